"""The work of each task of one RL step on the flow run's session, without orchestration: the Prefect
tasks (tasks/rl.py, tasks/reflection.py) read their inputs, call one of these, and write what it returns.

    sampled = sample_step(session, cfg, plan, queries, tools, judge_api_key, log_line)  # → `rollouts`
    judged = judge_rl_step(session, cfg, plan, queries, rollouts, api_key)                # → judge tables
    updated = update_step(session, cfg, plan, log_line)                                   # SS-GRPO (+ checkpoint)
    candidates = write_candidates(session, cfg, plan, queries, tools)                     # while the judge runs
    reflected = reflect_step(session, cfg, plan, queries, candidates, api_key)            # → `reflections`, bank
    refl = reflection_update_step(session, cfg, source_step, at_step, log_line)           # GRPO on reflections

Each changes the session (weights, engine, rubric buffers, bank) in memory only; the tables it returns
mark the task done once written, so the order of the writes stays with the task.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from rubricem_core.config import RunConfig
from rubricem_core.encoding import encode_prompt
from rubricem_core.environment import prompt_messages, trace_format
from rubricem_core.faults import fault_point
from rubricem_core.judge.buffer import RubricBuffer
from rubricem_core.judge.llm_judge import GroupJudgment, LLMJudge, judge_step
from rubricem_core.judge.step import check_streamed, judge_groups, judge_query, mark_failures, step_judge
from rubricem_core.judge.stream import StreamingJudge
from rubricem_core.judge.types import JudgeRollout
from rubricem_core.progress import Progress
from rubricem_core.reflection.bank import ReflectionBank
from rubricem_core.reflection.meta import candidate_requests, engine_stop_texts, pick_source_rollouts, retrieve_guidance
from rubricem_core.reflection.step import judge_candidates, reflection_judge
from rubricem_core.rl.curriculum import StepPlan, replay_source_step, sampling_step
from rubricem_core.rl.learner import WeightsVersion, step_updates, update_inputs
from rubricem_core.rl.progress import checkpoint_due, last_step, step_checkpoint
from rubricem_core.rl.records import broken_stages, rollout_row, rollout_text
from rubricem_core.rl.session import (
    RLSession,
    StepBuffers,
    applied,
    buffers_at,
    engine_asleep,
    ensure_engine_weights,
    rebuild_buffers,
    recipe_settings,
    reset_bank,
)
from rubricem_core.rl.update import gate_broken_stages, group_advantages
from rubricem_core.rl.update import reward_rows as reward_rows_of
from rubricem_core.rollout import RolloutRequest, SamplingParams
from rubricem_core.scaffold import STAGES
from rubricem_core.seeds import REFLECTION_SAMPLING, ROLLOUT, derive_seed
from rubricem_core.store import RunStore
from rubricem_core.tools.base import ToolEnv
from rubricem_core.trajectory import TokenTrajectory

LogLine = Callable[..., Any]  # a logger's info: log_line("fmt %s", arg)


def rollout_id(plan: StepPlan, query_id: str, index: int) -> str:
    return f"{query_id}-s{plan.step:04d}-r{index}"


# ---- rollout ------------------------------------------------------------------------------------
@dataclass
class SampledStep:
    """A step's `rollouts` rows and the rollout task's metrics."""

    rows: list[dict[str, Any]]
    metrics: dict[str, float]
    seconds: float

    def summary(self, step: int) -> tuple[Any, ...]:
        generated = sum(r["n_policy_tokens"] for r in self.rows)
        return (
            "step %d: %d rollouts, %d generated tokens in %.1fs (%.0f tok/s), %d valid scaffolds",
            step,
            len(self.rows),
            generated,
            self.seconds,
            generated / max(self.seconds, 1e-9),
            sum(r["valid_scaffold"] for r in self.rows),
        )


def sample_step(
    session: RLSession,
    cfg: RunConfig,
    plan: StepPlan,
    queries: dict[str, dict[str, Any]],
    tools: ToolEnv,
    judge_api_key: str | None,
    log_line: LogLine,
) -> SampledStep:
    """Sample a group per query with the weights after the step before (one-step async: the step before
    that; curriculum.sampling_step) and the real tools. With `judge.stream` each query's group is handed
    to the step's StreamingJudge the moment it ends (kept on the session for the judge task), so judging
    overlaps the groups still sampling."""
    weights_step = sampling_step(plan.step, cfg.rl.async_steps)
    pushed = time.perf_counter()
    ensure_engine_weights(session, weights_step, cfg)  # that update's weights into the engine (the push)
    push_seconds = time.perf_counter() - pushed
    guidance, metrics = bank_guidance(session, cfg, plan, queries)
    metrics["rollout/push_seconds"] = push_seconds
    metrics["rollout/policy_lag"] = float(plan.step - 1 - weights_step)  # updates the samples lag the trainer
    requests = rollout_requests(session.tokenizer, cfg, plan, queries, guidance)
    progress = Progress(
        f"step {plan.step}: trajectories finished", len(requests) * cfg.rollout.group_size, log_line, every_s=30.0
    )

    def on_progress(done: int, _total: int) -> None:
        progress.update(done)

    session.engine.on_progress = on_progress
    stream = start_streaming_judge(session, cfg, plan, queries, judge_api_key) if cfg.judge.stream else None
    t0 = time.perf_counter()
    try:
        groups = session.engine.generate(requests, tools)
    except BaseException:
        if stream is not None:
            stream.close()  # it changed copies: the session's buffers are as they were
        raise
    finally:
        session.engine.on_progress = None
        session.engine.on_group_done = None
    seconds = time.perf_counter() - t0
    session.pending_judge = stream  # the judge task collects it
    rows = []
    for qid, text, group in zip(plan.query_ids, guidance, groups):
        for i, traj in enumerate(group):
            row = rollout_row(
                *(plan, qid, rollout_id(plan, qid, i), traj, cfg.tools.max_tool_calls, text),
                trace_format=trace_format(cfg.policy.prompt_style),
            )
            rows.append(row)
    generated = sum(r["n_policy_tokens"] for r in rows)
    metrics["rollout/seconds"] = seconds
    metrics["rollout/tokens_per_s"] = generated / max(seconds, 1e-9)
    return SampledStep(rows, metrics, seconds)


def bank_guidance(
    session: RLSession, cfg: RunConfig, plan: StepPlan, queries: dict[str, dict[str, Any]]
) -> tuple[list[str | None], dict[str, float]]:
    """Each query's reflection guidance from the session's bank (plan.retrieval: cross or within; None
    without) and the retrieval metrics."""
    if session.bank is None or plan.retrieval == "none":
        return [None] * len(plan.query_ids), {}
    questions = {qid: q["question"] for qid, q in queries.items()}
    guidance, metrics = retrieve_guidance(
        session.bank,
        [(qid, questions[qid]) for qid in plan.query_ids],
        plan.retrieval,
        cfg.reflection.retrieval_k,
        cfg.reflection.min_similarity,
        questions,
        source_step=replay_source_step(plan.step, cfg.rl.window),
    )
    metrics["bank/size"] = float(len(session.bank))
    return guidance, metrics


def rollout_requests(
    tokenizer: Any,
    cfg: RunConfig,
    plan: StepPlan,
    queries: dict[str, dict[str, Any]],
    guidance: list[str | None],
) -> list[RolloutRequest]:
    """One request of rollout.group_size trajectories per query of the step, seeded by the step."""
    sampling = SamplingParams(
        temperature=cfg.rollout.temperature,
        top_p=cfg.rollout.top_p,
        max_new_tokens=cfg.rollout.max_new_tokens,
        max_total_tokens=cfg.rollout.max_total_tokens,
        seed=derive_seed(cfg.seed, ROLLOUT, plan.step),
    )
    return [
        RolloutRequest(
            request_id=qid,
            prompt_ids=encode_prompt(
                tokenizer, prompt_messages(queries[qid], guidance=text, style=cfg.policy.prompt_style)
            ),
            n=cfg.rollout.group_size,
            sampling=sampling,
            max_tool_calls=cfg.tools.max_tool_calls,
        )
        for qid, text in zip(plan.query_ids, guidance)
    ]


# ---- judge --------------------------------------------------------------------------------------
def session_judge(
    session: RLSession, cfg: RunConfig, plan: StepPlan, queries: dict[str, dict[str, Any]], api_key: str | None
) -> tuple[LLMJudge, dict[str, RubricBuffer]]:
    """The judge of a step and the buffers it changes: copies of those after the step before
    (StepBuffers.for_step), which the judge task puts in the session once the step's tables are written."""
    before = buffers_at(session, plan.step - 1, cfg)
    buffers = before.for_step(plan.step, queries, plan.query_ids, cfg.judge.cap_per_stage)
    return step_judge(cfg, recipe_settings(cfg).judged_stages, api_key), buffers


def start_streaming_judge(
    session: RLSession, cfg: RunConfig, plan: StepPlan, queries: dict[str, dict[str, Any]], api_key: str | None
) -> StreamingJudge:
    """A StreamingJudge over the step's buffers, fed by the engine as each query's group ends: each
    trajectory as the judge task would read its `rollouts` row (same id, same text)."""
    if session.pending_judge is not None:  # a stale one (a failed step before): nobody will collect it
        session.pending_judge.close()
        session.pending_judge = None
    judge, buffers = session_judge(session, cfg, plan, queries, api_key)
    stream = StreamingJudge(judge, buffers, plan.step)
    targets = [judge_query(queries[qid]) for qid in plan.query_ids]

    def on_group_done(index: int, group: list[TokenTrajectory]) -> None:
        query = targets[index]
        rollouts = [JudgeRollout(rollout_id(plan, query.query_id, i), rollout_text(t)) for i, t in enumerate(group)]
        # every group has group_size rollouts: the offset is the batch judge's, whichever group ends first
        stream.submit(query, rollouts, index=index, offset=index * cfg.rollout.group_size)

    session.engine.on_group_done = on_group_done
    return stream


def take_streamed(session: RLSession, plan: StepPlan) -> StreamingJudge | None:
    """The rollout task's StreamingJudge when it judged this step from the buffers the session still
    holds (those after the step before); None (closing a stale one) otherwise: the judge task then
    judges from the tables."""
    stream, session.pending_judge = session.pending_judge, None
    if stream is None:
        return None
    if stream.step == plan.step and session.buffers.step == plan.step - 1:
        return stream
    stream.close()
    return None


@dataclass
class JudgedStep:
    """A step's judge tables (`judge_rubrics`, `judge_scores`, `stage_rewards`: R, G = RΛᵀ and A), the
    error of each failed judgment by rollout id, the `rollouts` rows marked with the verdicts
    (``rollouts_changed``: rewrite them), and the judge task's metrics."""

    rubric_rows: list[dict[str, Any]] = field(default_factory=list)
    score_rows: list[dict[str, Any]] = field(default_factory=list)
    reward_rows: list[dict[str, Any]] = field(default_factory=list)
    errors: dict[str, str] = field(default_factory=dict)
    rollouts: list[dict[str, Any]] = field(default_factory=list)
    rollouts_changed: bool = False
    buffers: StepBuffers | None = None  # the buffers after this step's judge (the session's once written)
    metrics: dict[str, float] = field(default_factory=dict)
    n_groups: int = 0
    seconds: float = 0.0


def judge_tables(
    step: int,
    results: list[GroupJudgment],
    buffers: dict[str, RubricBuffer],
    lam: torch.Tensor,
    broken: Mapping[str, set[str]] | None = None,
    rule: str = "zero",
    unscored: str = "none",
) -> JudgedStep:
    """A step's `judge_rubrics`, `judge_scores` and `stage_rewards` rows (groups in ``results`` order)
    and the error of each failed judgment by rollout id. ``broken``: each rollout's stages with a scaffold
    violation, gated by ``rule`` (``rl.scaffold_violations``: zero or format); None: the judge's R as it is.
    ``unscored``: the return of a stage with no score (``rl.unscored_stage_return``)."""
    out = JudgedStep(n_groups=len(results))
    for g in results:
        out.rubric_rows.extend(buffers[g.query_id].rows(step))
        for j in g.judgments:
            if j.failed:
                out.errors[j.rollout_id] = j.error or "judgment failed"
            else:
                out.score_rows.extend(j.rows(step, g.query_id))
        failed = [rid in out.errors for rid in g.rollout_ids]
        R = g.R if broken is None else gate_broken_stages(g.R, [broken[rid] for rid in g.rollout_ids], rule, failed)
        out.reward_rows.extend(
            reward_rows_of(step, g.query_id, g.rollout_ids, group_advantages(R, lam, failed, unscored))
        )
    return out


def stages_to_gate(cfg: RunConfig, rollouts: list[dict[str, Any]]) -> dict[str, set[str]] | None:
    """Each rollout's stages with a scaffold violation when ``rl.scaffold_violations`` gates them (scaffold
    traces only), else None."""
    fmt = trace_format(cfg.policy.prompt_style)
    if cfg.rl.scaffold_violations == "judged" or fmt != "scaffold":
        return None
    return {row["rollout_id"]: broken_stages(row["text"], cfg.tools.max_tool_calls) for row in rollouts}


def judge_rl_step(
    session: RLSession,
    cfg: RunConfig,
    plan: StepPlan,
    queries: dict[str, dict[str, Any]],
    rollouts: list[dict[str, Any]],
    api_key: str | None,
) -> JudgedStep:
    """Rubric generation (one call per query) and scoring (one call per rollout), buffer update and
    pruning. The judgments are the rollout task's streamed ones when it judged this step in this
    session, else made here from the step's `rollouts` rows; both give the same tables."""
    t0 = time.perf_counter()
    stream = take_streamed(session, plan)
    if stream is not None:  # judged while the rollouts sampled (judge.stream): wait for the last groups
        judge, buffers = stream.judge, stream.buffers
        results = stream.collect(plan.query_ids)
        check_streamed(results, rollouts)
        seconds = stream.seconds
    else:
        judge, buffers = session_judge(session, cfg, plan, queries, api_key)
        results = judge_step(judge, judge_groups(rollouts, queries, plan.query_ids), buffers, plan.step)
        seconds = time.perf_counter() - t0
    wait_seconds = time.perf_counter() - t0  # how long this task held the step up
    lam, broken = recipe_settings(cfg).lam, stages_to_gate(cfg, rollouts)
    out = judge_tables(
        plan.step, results, buffers, lam, broken, cfg.rl.scaffold_violations, cfg.rl.unscored_stage_return
    )
    out.rollouts, out.seconds, out.buffers = rollouts, seconds, StepBuffers(plan.step, buffers)
    out.rollouts_changed = mark_failures(rollouts, out.errors)
    metrics = judge.usage.metrics()
    metrics["judge/failed_trajectories"] = float(len(out.errors))
    metrics["judge/seconds"] = seconds  # from the first call to the last (streamed: from the first group)
    metrics["judge/wait_seconds"] = wait_seconds
    for stage in STAGES:
        metrics[f"buffer/{stage}_active"] = float(sum(len(buffers[q].active(stage)) for q in plan.query_ids))
    out.metrics = metrics
    return out


# ---- SS-GRPO update -----------------------------------------------------------------------------
@dataclass
class UpdatedStep:
    """The update task's metrics (``rl/…`` and the step's reward means), the trainer's own, and
    whether the step's checkpoint was written."""

    metrics: dict[str, float]
    trainer_metrics: dict[str, float]
    n_trajectories: int
    saved: bool

    def summary(self, step: int) -> tuple[Any, ...]:
        m = self.trainer_metrics
        return (
            "step %d: update on %d trajectories: loss %.4f kl %.4f clip %.3f gap %.4f%s",
            step,
            self.n_trajectories,
            m.get("loss", float("nan")),
            m.get("kl", float("nan")),
            m.get("clip_fraction", float("nan")),
            m.get("logprob_gap_mean", float("nan")),
            "; checkpoint written" if self.saved else "",
        )


def _require_weights(session: RLSession, before: WeightsVersion, kind: str, step: int) -> None:
    """An update applies to the weights the run's order puts before it, or not at all."""
    if session.weights != before:
        raise RuntimeError(
            f"step {step}'s {kind} update needs the weights at {before}; the trainer holds {session.weights}"
        )


def update_step(session: RLSession, cfg: RunConfig, plan: StepPlan, log_line: LogLine) -> UpdatedStep:
    """One clipped policy-gradient step on the judged rollouts with the judge task's advantages; a
    resumable checkpoint (with the rubric buffers) when rl.checkpoint_every says so and at the last step."""
    store = session.store
    updates = step_updates(cfg, plan.step)
    (update,) = [u for u in updates if u.kind == "task"]
    _require_weights(session, WeightsVersion(plan.step - 1, len(updates) - 1), "SS-GRPO", plan.step)
    batch, settings = update_inputs(store, cfg, update, session.tokenizer.decode)
    engine_samples_beside = plan.step < last_step(cfg) or plan.reflects
    if cfg.rl.async_steps and engine_samples_beside:
        # the next step's rollouts (and this step's reflections) sample with the weights before this
        # update: the engine takes them now
        ensure_engine_weights(session, plan.step - 1, cfg)
    t0 = time.perf_counter()
    session.policy.log_to(log_line)  # trainer ranks' output goes to the calling task's log
    with engine_asleep(session, cfg):
        metrics = session.policy.update(batch.trajectories, batch.token_advantages, settings)
    metrics["update_seconds"] = time.perf_counter() - t0
    applied(session, WeightsVersion(plan.step))
    # The engine picks up these weights by transfer before the next step's rollouts
    # (ensure_engine_weights): this step's reflections may still be sampling with the old ones.
    fault_point("rl.update_applied")
    saved = checkpoint_due(cfg, plan.step)
    if saved:
        # A copy of the buffers for inspection; a resumed session rebuilds them from `judge_rubrics`.
        at_step = session.buffers
        if at_step.step != plan.step:
            at_step = rebuild_buffers(store, plan.step, cfg.judge.cap_per_stage)
        buffers = json.dumps({qid: b.to_dict() for qid, b in at_step.by_query.items()})
        session.policy.save(step_checkpoint(store, plan.step), extra={"buffers": buffers, "step": plan.step})
        fault_point("rl.checkpoint_saved")
    out = {f"rl/{k}": v for k, v in metrics.items()} | batch.stage_means
    if batch.trajectories:
        out["rl/advantaged_token_share"] = batch.advantaged_token_share()
    return UpdatedStep(out, metrics, len(batch.trajectories), saved)


# ---- reflections ----------------------------------------------------------------------------------
@dataclass
class ReflectedStep:
    """A new-query step's `reflections` rows, the reflect task's metrics, and how many trajectories
    they reflect on; the session's bank holds the accepted ones already."""

    rows: list[dict[str, Any]]
    metrics: dict[str, float]
    n_sources: int

    def summary(self, step: int, bank: ReflectionBank | None) -> tuple[Any, ...]:
        return (
            "step %d: %d reflection candidates for %d trajectories, %d valid, %d accepted; bank size %d",
            step,
            len(self.rows),
            self.n_sources,
            sum(r["valid"] for r in self.rows),
            sum(r["accepted"] for r in self.rows),
            len(bank) if bank is not None else 0,
        )


@dataclass
class ReflectionCandidates:
    """A new-query step's reflection candidates as the policy wrote them (weights after step−1), before
    the reflection judge: the source rollout per query, the candidates of each, the seconds it took.
    Written from the rollouts alone, so the engine writes them while the task judge scores the step."""

    sources: dict[str, dict[str, Any]]
    groups: list[list[TokenTrajectory]]
    seconds: float

    def written_on(self, sources: dict[str, dict[str, Any]]) -> bool:
        """Whether these candidates reflect on exactly ``sources`` (query → the same rollout)."""
        ids = lambda chosen: {qid: row["rollout_id"] for qid, row in chosen.items()}  # noqa: E731
        return ids(self.sources) == ids(sources)


def step_sources(store: RunStore, cfg: RunConfig, plan: StepPlan) -> dict[str, dict[str, Any]]:
    """The rollout each query of a new-query step reflects on, from the step's `rollouts` as they stand
    (a rollout whose judgment failed is never a source)."""
    return pick_source_rollouts(store.read_rows("rollouts", {"step": plan.step}), plan.query_ids, cfg.seed, plan.step)


def write_candidates(
    session: RLSession,
    cfg: RunConfig,
    plan: StepPlan,
    queries: dict[str, dict[str, Any]],
    tools: ToolEnv,
) -> ReflectionCandidates:
    """``reflection.n_candidates`` reflections per sampled rollout of a new-query step, with the weights
    after step−1."""
    sources = step_sources(session.store, cfg, plan)
    t0 = time.perf_counter()
    groups = sample_candidates(session, cfg, plan.step, sources, queries, tools)
    return ReflectionCandidates(sources, groups, time.perf_counter() - t0)


def reflect_step(
    session: RLSession,
    cfg: RunConfig,
    plan: StepPlan,
    queries: dict[str, dict[str, Any]],
    candidates: ReflectionCandidates,
    api_key: str | None,
) -> ReflectedStep:
    """Judge and bank a new-query step's reflection candidates: the reflection judge scores them (with
    the step's task-judge tables as its privileged view), the best valid one per query enters the
    session's bank."""
    store = session.store
    judged = judge_candidates(
        reflection_judge(cfg, api_key),
        cfg,
        plan.step,
        queries,
        candidates.sources,
        candidates.groups,
        engine_stop_texts(session.engine, session.tokenizer),
        store.read_rows("judge_rubrics", {"step": plan.step}),
        store.read_rows("judge_scores", {"step": plan.step}),
        candidates.seconds,
        session.tokenizer.decode,
    )
    # An earlier attempt in this session banked other rows: the bank is rebuilt from the earlier steps
    if session.bank is not None:
        if plan.step in session.bank.steps:
            reset_bank(session, cfg, plan.step - 1)
        session.bank.load_steps([plan.step], rows={plan.step: judged.rows})
        judged.metrics["bank/size"] = float(len(session.bank))
    return ReflectedStep(judged.rows, judged.metrics, judged.n_sources)


def sample_candidates(
    session: RLSession,
    cfg: RunConfig,
    step: int,
    sources: dict[str, dict[str, Any]],
    queries: dict[str, dict[str, Any]],
    tools: ToolEnv,
) -> list[list[TokenTrajectory]]:
    """``reflection.n_candidates`` reflections on each source rollout, written by the policy with the
    weights after step−1 (those the step's rollouts used)."""
    sampling = SamplingParams(
        temperature=cfg.reflection.temperature,
        top_p=cfg.rollout.top_p,
        max_new_tokens=cfg.reflection.max_new_tokens,
        max_total_tokens=cfg.rollout.max_total_tokens,
        seed=derive_seed(cfg.seed, REFLECTION_SAMPLING, step),
    )
    requests = candidate_requests(
        session.tokenizer,
        sources,
        {qid: q["question"] for qid, q in queries.items()},
        cfg.reflection.n_candidates,
        sampling,
        cfg.reflection.max_trajectory_chars,
        cfg.reflection.max_trajectory_tokens,
    )
    with session.lock:  # the engine is not re-entrant
        ensure_engine_weights(session, step - 1, cfg)
        return session.engine.generate(requests, tools) if requests else []


def reload_bank_step(session: RLSession, step: int) -> dict[str, float]:
    """Bank the accepted reflections of a step whose `reflections` partition exists (a rerun that reads
    it back); the bank's size as a metric."""
    if session.bank is None:
        return {}
    session.bank.load_steps([step])
    return {"bank/size": float(len(session.bank))}


@dataclass
class ReflectionUpdate:
    """The reflection-update task's metrics and what it trained on."""

    metrics: dict[str, float]
    n_candidates: int
    nonzero: int


def reflection_update_step(
    session: RLSession, cfg: RunConfig, source_step: int, at_step: int, log_line: LogLine
) -> ReflectionUpdate:
    """GRPO on the reflection tokens of step ``source_step``'s candidates, applied during ``at_step``
    (before that step's task update; the engine keeps sampling with the weights it was synced to)."""
    # The step's rollouts must see the weights from before this update.
    ensure_engine_weights(session, at_step - 1, cfg)
    (update,) = [u for u in step_updates(cfg, at_step) if u.kind == "reflection"]
    _require_weights(session, WeightsVersion(at_step - 1), "reflection", at_step)
    if update.source_step != source_step:
        raise RuntimeError(f"step {at_step} trains the reflections of step {update.source_step}, not {source_step}")
    batch, settings = update_inputs(session.store, cfg, update, session.tokenizer.decode)
    t0 = time.perf_counter()
    session.policy.log_to(log_line)  # trainer ranks' output goes to the calling task's log
    with engine_asleep(session, cfg):
        metrics = session.policy.update(batch.trajectories, batch.token_advantages, settings)
    applied(session, WeightsVersion(at_step - 1, 1))
    out = {f"reflection_update/{k}": v for k, v in metrics.items()}
    out["reflection_update/source_step"] = float(source_step)
    out["reflection_update/candidates"] = float(len(batch.trajectories))
    out["reflection_update/nonzero_advantages"] = float(batch.nonzero)
    out["reflection_update/seconds"] = time.perf_counter() - t0
    return ReflectionUpdate(out, len(batch.trajectories), batch.nonzero)
