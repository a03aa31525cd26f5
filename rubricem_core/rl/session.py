"""The RL session of one run directory: who trains, who samples, and which weights each holds.

    with open_session(store, cfg) as sessions:            # the `rl` flow run owns it; its tasks get it
        session = sessions.at(after_step)                 # weights include the updates of steps ≤ after_step
        ensure_engine_weights(session, step, cfg)         # the engine samples with the weights after `step`
        session.policy.update(trajectories, token_advs, settings)
        if checkpoint_due(cfg, step): session.policy.save(step_checkpoint(store, step), extra)

``session.policy`` is where the trainer and the frozen reference live:

- ``LocalPolicy``: in this process (one device; ``distributed.nproc_per_node: 1``);
- ``RayPolicy`` (rubricem_core.rl.ray_policy): in Ray actors that live as long as the session (the
  whole ``rl`` flow run), driven by remote calls.

The rollout engine always lives in this process. With a rank policy, or with the reflection loop
(whose deferred update trains while the engine samples), the engine holds its own copy of the weights,
taken from the trainer every step by transfer (``policy.weights()``: the module's tensors here, a gloo
broadcast from trainer rank 0 otherwise; a vLLM server gets them pushed), never from a file written for
it. Resumable checkpoints are written every ``rl.checkpoint_every`` steps and at the last step. The
session lives as long as the flow run that opened it; in a new run (a restart) it is rebuilt from the newest checkpoint at or before the step
asked for, then the later steps' updates are replayed from their cached tables (``replay_updates``),
which gives the weights, optimizer, schedule and RNG an uninterrupted run had there.
"""

from __future__ import annotations

import logging
import shutil
import threading
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch

from rubricem_core.config import RunConfig
from rubricem_core.embedders import Embedder, HashingEmbedder, make_embedder
from rubricem_core.faults import fault_point
from rubricem_core.judge.buffer import RubricBuffer
from rubricem_core.policy.loading import load_policy
from rubricem_core.recipes import Recipe, get_recipe
from rubricem_core.reflection.bank import BankEntry, ReflectionBank
from rubricem_core.reflection.meta import rebuild_bank
from rubricem_core.rl.learner import WeightsVersion, update_inputs, updates_between
from rubricem_core.rl.policy import LocalPolicy, Policy, reflection_on
from rubricem_core.rl.progress import (
    completed_step,
    has_checkpoint,
    newest_checkpoint,
    replay_gaps,
    start_policy,
    step_checkpoint,
)
from rubricem_core.rollout.factory import make_engine
from rubricem_core.rollout.types import StreamingRolloutEngine
from rubricem_core.ssgrpo import as_lambda
from rubricem_core.store import RunStore

if TYPE_CHECKING:
    from rubricem_core.rollout.vllm_server_engine import VLLMServerEngine

log = logging.getLogger(__name__)


# ---- recipe ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class RecipeSettings:
    """What the run's recipe fixes for the judge and the advantages, with `rl.lambda_spec` applied."""

    recipe: Recipe
    lam: torch.Tensor  # K×K credit matrix Λ
    judged_stages: tuple[str, ...]


def recipe_settings(cfg: RunConfig) -> RecipeSettings:
    recipe = get_recipe(cfg.rl.recipe)
    lam = as_lambda(cfg.rl.lambda_spec) if cfg.rl.lambda_spec is not None else recipe.lam()
    return RecipeSettings(recipe=recipe, lam=lam, judged_stages=tuple(recipe.judged_stages))


# ---- the trainer side --------------------------------------------------------------------------


def shares_engine_module(cfg: RunConfig) -> bool:
    """The engine can sample with the trainer's own module only in one process, without ZeRO-3's
    partitioned parameters, and without the reflection loop's or one-step async's overlap."""
    return (
        cfg.distributed.world_size == 1
        and cfg.rollout.engine == "hf"
        and not reflection_on(cfg)
        and not cfg.rl.async_steps
        and not (cfg.rl.backend == "deepspeed" and cfg.rl.zero_stage == 3)
    )


def make_policy(store: RunStore, cfg: RunConfig, base: Path) -> Policy:
    """Where the trainer lives: this process, or trainer ranks of their own (distributed.world_size > 1)."""
    if cfg.distributed.world_size > 1:
        from rubricem_core.rl.ray_policy import RayPolicy

        return RayPolicy(str(store.run_dir), cfg, base)
    return LocalPolicy(base, cfg)


# ---- the session -------------------------------------------------------------------------------
@dataclass
class RLSession:
    store: RunStore
    weights: WeightsVersion  # the updates the trainer's weights hold (rl.learner's order)
    policy: Policy
    tokenizer: Any
    engine: StreamingRolloutEngine  # transformers, vLLM in process, or a vLLM server fleet (rollout.factory)
    buffers: StepBuffers = field(default_factory=lambda: StepBuffers(-1, {}))
    # The weights the engine samples with: always those after a whole step (-1: SFT).
    engine_weights: WeightsVersion = WeightsVersion(-1)
    separate_engine: bool = False
    bank: StepBank | None = None
    lock: threading.RLock = field(default_factory=threading.RLock)
    # The StreamingJudge (rubricem_core.judge.stream) the rollout task started on its step's groups, over
    # copies of ``buffers``; the judge task of that step collects it (judge.stream), else judges from the
    # tables. A running resource (its own thread and event loop) handed from one task to the next: with
    # one-step async the rollouts of step N+1 are sampled in step N's subflow and judged in N+1's.
    pending_judge: Any = None

    def close(self) -> None:
        """Stop what the session started: a streamed judgment nobody will collect, the trainer (ranks),
        an engine with processes of its own."""
        if self.pending_judge is not None:
            self.pending_judge.close()
            self.pending_judge = None
        self.policy.close()
        close = getattr(self.engine, "close", None)
        if close is not None:
            close()


class SessionManager:
    """The RL session of one ``rl`` flow run (``open_session``): the flow hands it to every step's tasks,
    which ask it for the live ``RLSession`` at the weights they need; it rebuilds that session from the
    newest checkpoint and the replay of the later updates when the live one cannot get there (a new
    flow run, a resumed run, a reflection task sampling at an older step).

    ``__slots__`` (no ``__dict__``, not iterable): Prefect records a subflow's parameters with FastAPI's
    ``jsonable_encoder``, which then gives up at once and stores the placeholder ``<SessionManager>``
    instead of walking the models; tasks use no cache key (``tasks.readback``), so it is never hashed."""

    __slots__ = ("store", "cfg", "_live", "_lock")

    def __init__(self, store: RunStore, cfg: RunConfig) -> None:
        self.store = store
        self.cfg = cfg
        self._live: RLSession | None = None
        self._lock = threading.Lock()

    def at(self, after_step: int) -> RLSession:
        """A session whose weights include the updates of steps ≤ ``after_step``: the live one (advanced
        by replaying the updates it lacks when it is behind), else a new one from the newest checkpoint at
        or before ``after_step`` and the replay of the later steps."""
        with self._lock:
            session = self._live
            # the live session also serves when it has applied the next step's reflection update already
            if session is not None and session.weights.step == after_step:
                return session
            if session is not None and session.weights.step < after_step:
                advance(session, self.cfg, after_step)
                return session
            self._close_live()
            start = newest_checkpoint(self.store, after_step)
            missing = replay_gaps(self.store, start, after_step, self.cfg)
            if missing:
                raise FileNotFoundError(
                    f"RL step {after_step} has no checkpoint and the newest one before it (step {start}; -1: SFT) "
                    f"cannot be brought to it: {', '.join(missing[:4])} missing; rerun from that step"
                )
            session = _new_session(self.store, self.cfg, start)
            try:
                advance(session, self.cfg, after_step)
            except BaseException:
                session.close()
                raise
            self._live = session
            return session

    def current(self) -> RLSession:
        """The live session whatever its step (background reflection work must not force a reload while
        the update of the same step advances it); a fresh one from the newest checkpoint otherwise."""
        with self._lock:
            session = self._live
        return session if session is not None else self.at(completed_step(self.store))

    def sampling(self, step: int) -> RLSession:
        """A session that can sample with the weights after ``step``: the live one when its engine has
        them, its trainer holds them, or their checkpoint exists (whatever the live session's own step:
        background reflection work must not force a reload while the update of the same step advances it);
        else one replayed to ``step`` from the tables (a resumed run writing a finished step's missing
        reflections, whose weights no checkpoint kept)."""
        with self._lock:
            session = self._live
        if session is not None and (
            session.engine_weights == WeightsVersion(step)
            or trainer_holds(session, step)
            or step < 0
            or has_checkpoint(self.store, step)
        ):
            return session
        return self.at(step)

    def close(self) -> None:
        """Free the live session's models (and stop its trainer ranks and engine processes)."""
        with self._lock:
            self._close_live()

    def _close_live(self) -> None:
        if self._live is not None:
            session, self._live = self._live, None
            session.close()


@contextmanager
def open_session(store: RunStore, cfg: RunConfig) -> Iterator[SessionManager]:
    """The RL session of one flow run: started lazily by the first task that needs it, stopped (trainer
    ranks, engine, fleet) when the block ends, however it ends.

        with open_session(store, cfg) as session:
            rollout_task(session, plan)       # session.at(plan.step - 1).engine samples
    """
    manager = SessionManager(store, cfg)
    try:
        yield manager
    finally:
        manager.close()


def _engine_device(policy: Policy) -> torch.device:
    if isinstance(policy, LocalPolicy):
        return policy.device
    from rubricem_core.policy.loading import auto_device

    return auto_device()


def _new_session(store: RunStore, cfg: RunConfig, at_checkpoint: int) -> RLSession:
    """A session with the trainer at checkpoint ``at_checkpoint`` (-1: SFT) and its engine."""
    base = start_policy(store)
    policy = make_policy(store, cfg, base)
    try:
        if at_checkpoint >= 0:
            policy.load(step_checkpoint(store, at_checkpoint))
        # from the tables, not the checkpoint's copy: they are what the judge wrote, whichever
        # task a resumed run skipped
        buffers = rebuild_buffers(store, at_checkpoint, cfg.judge.cap_per_stage)
        tokenizer = policy.tokenizer
        log.info(
            "RL session at step %d: trainer %s (%d rank%s)",
            at_checkpoint,
            cfg.rl.backend,
            cfg.distributed.world_size,
            "s" if cfg.distributed.world_size > 1 else "",
        )
        # vllm / vllm_server hold their own copy of the weights, from the SFT directory, synced (pushed, or
        # reloaded from a step's checkpoint) before each step's rollouts (ensure_engine_weights); so does
        # a transformers engine beside trainer ranks, ZeRO-3 or the reflection loop's overlap
        shared = shares_engine_module(cfg)
        engine = make_engine(
            cfg,
            base,
            tokenizer,
            log_path=store.state_dir / "vllm-server.log",
            push=True,
            # shares_engine_module: a LocalPolicy, whose trainer's module the engine samples from
            model=cast(LocalPolicy, policy).trainer.model if shared else None,
            device=_engine_device(policy) if cfg.rollout.engine == "hf" and not shared else "cpu",
        )
        start = WeightsVersion(at_checkpoint)
        separate, engine_weights = (False, start) if shared else (True, WeightsVersion(-1))
    except BaseException:
        policy.close()
        raise
    session = RLSession(
        store,
        start,
        policy,
        tokenizer,
        engine,
        buffers,
        engine_weights=engine_weights,
        separate_engine=separate,
    )
    if reflection_on(cfg):
        reset_bank(session, cfg, at_checkpoint)
    return session


def advance(session: RLSession, cfg: RunConfig, to_step: int) -> None:
    """Bring the session's trainer from its step to ``to_step`` by replaying those steps' updates from
    their tables (replay_updates), with the bank holding the reflections of steps ≤ ``to_step`` (the
    rubric buffers follow on demand: buffers_at rebuilds them from `judge_rubrics`)."""
    if to_step > session.weights.step:
        log.info("RL session: replaying the updates from %s to step %d from their tables", session.weights, to_step)
        replay_updates(session, cfg, to_step)
    if session.bank is not None:
        session.bank.load_through(to_step)


def replay_updates(session: RLSession, cfg: RunConfig, to_step: int) -> None:
    """Apply the updates from the session's weights to those after ``to_step`` as the run applied them
    (rl.learner's order: in each step the deferred reflection update, unless this session applied it
    already, then SS-GRPO), from their tables, as the tasks apply them. Same inputs, same calls, same
    order: the trainer ends with the weights, optimizer state, LR schedule, step counter and RNG of the
    uninterrupted run. Nothing is sampled or judged, no table, metric or checkpoint is written; the engine
    keeps the weights it has."""
    for update, version in updates_between(cfg, session.weights, WeightsVersion(to_step)):
        batch, settings = update_inputs(session.store, cfg, update, session.tokenizer.decode)
        session.policy.update(batch.trajectories, batch.token_advantages, settings)
        applied(session, version)
        if update.kind == "task":
            fault_point("rl.update_replayed")


def applied(session: RLSession, version: WeightsVersion) -> None:
    """Record that the trainer's weights are now at ``version`` (an engine sharing its module with it too)."""
    session.weights = version
    if not session.separate_engine:
        session.engine_weights = version


@dataclass(frozen=True)
class StepBuffers:
    """Every query's rubric buffer after the judge of ``step`` (-1: before RL). Never changed in place: a
    step's judge changes copies of its queries' buffers (``for_step``), which become the session's once
    its tables are written, so a judge that fails half-way leaves these as they were."""

    step: int
    by_query: dict[str, RubricBuffer]

    def for_step(
        self, step: int, queries: dict[str, dict[str, Any]], query_ids: Sequence[str], cap: int
    ) -> dict[str, RubricBuffer]:
        """The buffers the judge of ``step`` changes: these, with a copy of each of the step's queries'
        (a new one, its persistent rubrics, for a query judged the first time)."""
        if step != self.step + 1:
            raise RuntimeError(f"the judge of RL step {step} needs the buffers after step {step - 1}, not {self.step}")
        out = dict(self.by_query)
        for qid in query_ids:
            held = self.by_query.get(qid)
            out[qid] = (
                held.copy()
                if held is not None
                else RubricBuffer.from_query(qid, queries[qid]["rubrics"], cap, step=step)
            )
        return out


def rebuild_buffers(store: RunStore, through_step: int, cap_per_stage: int) -> StepBuffers:
    """Every query's rubric buffer after the judge of step ``through_step`` (-1: none yet), from the
    `judge_rubrics` partitions of steps ≤ it."""
    by_query: dict[str, list[dict[str, Any]]] = {}
    for step in store.partitions("judge_rubrics", "step"):
        if step > through_step:
            break
        for row in store.read_rows("judge_rubrics", {"step": step}):
            by_query.setdefault(row["query_id"], []).append(row)
    buffers = {qid: RubricBuffer.from_rows(qid, rows, cap_per_stage) for qid, rows in by_query.items()}
    return StepBuffers(through_step, buffers)


def buffers_at(session: RLSession, step: int, cfg: RunConfig) -> StepBuffers:
    """The buffers after the judge of ``step``: the session's, or rebuilt from the tables when the session
    holds another step's (a resumed run whose judge task was skipped as done)."""
    if session.buffers.step != step:
        session.buffers = rebuild_buffers(session.store, step, cfg.judge.cap_per_stage)
    return session.buffers


@contextmanager
def engine_asleep(session: RLSession, cfg: RunConfig) -> Iterator[None]:
    """With ``rollout.colocate``: the vLLM server sleeps while the trainer updates on the GPUs it shares,
    and wakes before it next samples (ensure_engine_weights), not here: a step's rollouts may need newer
    weights first, pushed or reloaded into the woken server."""
    server = getattr(session.engine, "server", None)
    if cfg.rollout.colocate and server is not None:
        with session.lock:
            server.sleep()
    yield


def trainer_holds(session: RLSession, step: int) -> bool:
    """The trainer's weights are those after step ``step``: its update is the last one applied, and the
    reflection update that the next step applies before its own update is not (yet)."""
    return session.weights == WeightsVersion(step)


def _checkpoint_source(session: RLSession, step: int) -> Path:
    """The directory holding the weights after ``step`` when the trainer no longer does."""
    if step < 0:
        return start_policy(session.store)
    if not has_checkpoint(session.store, step):
        raise RuntimeError(
            f"the engine needs the weights after RL step {step}; the trainer has moved on ({session.weights}) and "
            f"rl.checkpoint_every kept no checkpoint of that step: sample from SessionManager.sampling({step}), "
            "which replays the updates to it"
        )
    return step_checkpoint(session.store, step)


def ensure_engine_weights(session: RLSession, step: int, cfg: RunConfig) -> None:
    """Make the engine sample with the weights after step ``step`` (-1: SFT). While the trainer holds
    them they come from it by transfer: its tensors in this process, a gloo broadcast from trainer
    rank 0 through Ray (RayPolicy), or a push into the vLLM server's workers. Only for weights the trainer no
    longer holds (a resumed run sampling at an older step) is a checkpoint directory read.

    Callers that change the weights next call this first (the deferred reflection update of step N+1
    before its update): the engine's copy is taken under ``session.lock`` before the trainer moves,
    so step N+1's rollouts sample with the weights after update N whichever task gets here first."""
    with session.lock:
        server = getattr(session.engine, "server", None)
        if server is not None and server.asleep:  # colocated: the trainer's update is over
            server.wake_up()
        if session.engine_weights == WeightsVersion(step):
            return
        if not session.separate_engine:  # it samples from the trainer's module: whatever the trainer holds
            if session.weights != WeightsVersion(step):
                raise RuntimeError(
                    f"the engine shares the trainer's weights ({session.weights}); cannot sample at step {step}"
                )
            session.engine_weights = session.weights
            return
        holds = trainer_holds(session, step)
        if hasattr(session.engine, "load_weights_from_dir"):  # a server process of its own
            served = cast("VLLMServerEngine", session.engine)
            if cfg.rollout.weight_transfer == "adapter":  # LoRA: the step's adapter, loaded at run time
                served.load_adapter(_adapter_source(session, step, holds))
            elif cfg.rollout.weight_transfer != "checkpoint" and holds:
                served.push_weights(session.policy)  # straight from the trainer, tensor by tensor
            else:  # the server reads the checkpoint itself
                served.load_weights_from_dir(_checkpoint_source(session, step))
            session.engine_weights = WeightsVersion(step)
            return
        weights = session.policy.weights() if holds else None
        if weights is not None:
            session.engine.update_weights(weights)
        else:
            model, _ = load_policy(str(_checkpoint_source(session, step)), dtype=cfg.policy.dtype)
            session.engine.update_weights(model.state_dict())
        session.engine_weights = WeightsVersion(step)


def _adapter_source(session: RLSession, step: int, holds: bool) -> Path:
    """The LoRA adapter the servers load for ``step``: written by the trainer now (state/adapter-push/, the
    previous one removed), or, when the trainer does not hold that step's weights, the step's adapter checkpoint
    itself (peft's files, over the base the servers serve)."""
    if not holds:
        return _checkpoint_source(session, step)
    root = session.store.state_dir / "adapter-push"
    out = root / f"step-{step:06d}"
    shutil.rmtree(out, ignore_errors=True)
    session.policy.save_adapter(out)
    for old in root.iterdir():
        if old != out:
            shutil.rmtree(old, ignore_errors=True)
    return out


# ---- reflection bank ---------------------------------------------------------------------------
def new_bank(cfg: RunConfig) -> ReflectionBank:
    """An empty bank as ``reflection`` configures it (the session's is a StepBank)."""
    return ReflectionBank(_bank_embedder(cfg), within_source=cfg.reflection.within_source)


def _bank_embedder(cfg: RunConfig) -> Embedder:
    return make_embedder(cfg.reflection.embedder) or HashingEmbedder()


class StepBank(ReflectionBank):
    """The session's reflection bank: the warm start (the teacher's valid reflections, with
    ``reflection.warm_bank``) and the accepted reflections of ``steps``, the RL steps replayed into it."""

    def __init__(self, cfg: RunConfig, store: RunStore) -> None:
        super().__init__(_bank_embedder(cfg), within_source=cfg.reflection.within_source)
        self.store = store
        self.steps: set[int] = set()
        if cfg.reflection.warm_bank:
            self.add_many(warm_bank_entries(store, cfg.reflection.min_score))

    def load_steps(self, steps: Iterable[int], rows: dict[int, list[dict[str, Any]]] | None = None) -> None:
        """Replay the accepted reflections of ``steps`` not loaded yet, from ``rows[step]`` when given (a
        step whose `reflections` partition is not written yet), else from the table."""
        todo = sorted(s for s in steps if s not in self.steps)
        if not todo:
            return
        questions = {q["query_id"]: q["question"] for q in self.store.read_rows("queries")}
        given = rows or {}
        replay = [
            r for s in todo for r in (given[s] if s in given else self.store.read_rows("reflections", {"step": s}))
        ]
        rebuild_bank(self, replay, questions)
        self.steps.update(todo)

    def load_through(self, step: int) -> None:
        """Load every step ≤ ``step`` whose `reflections` partition is written."""
        self.load_steps(s for s in self.store.partitions("reflections", "step") if s <= step)


def reset_bank(session: RLSession, cfg: RunConfig, through_step: int) -> None:
    """A new bank in the session: the warm start and the accepted reflections of steps ≤ ``through_step``.
    ``within_source: window``: its within retrieval returns the reflection written at the new-query step
    that the step being sampled replays (the paper's within-episode guidance; the rollout task passes
    ``replay_source_step``), not the query's best-ever one."""
    session.bank = StepBank(cfg, session.store)
    session.bank.load_through(through_step)


WARM_STEP = -1  # the step of the teacher's reflections in the bank: before RL


def warm_bank_entries(store: RunStore, score: float) -> list[BankEntry]:
    """One entry per query from its first valid teacher reflection, at ``score`` (reflection.min_score:
    any accepted reflection of the policy scores above it and replaces it)."""
    if not store.files("teacher_reflections"):
        return []
    questions = {q["query_id"]: q["question"] for q in store.read_rows("queries")}
    first: dict[str, str] = {}
    for row in store.read_rows("teacher_reflections"):
        whole = row["request_id"].endswith("-reflection")  # not one of the prefix variants
        if whole and row["valid"] and row["query_id"] not in first:
            first[row["query_id"]] = row["text"]
    return [
        BankEntry(qid, questions.get(qid, ""), text, float(score), WARM_STEP) for qid, text in sorted(first.items())
    ]
