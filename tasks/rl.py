"""Prefect tasks of one RL step: rollout → judge (rubric generation, scoring, buffer update) → SS-GRPO
update + checkpoint. Each task's output is a Parquet partition `step=NNNN`; a retried run skips what
exists. Models live in a per-process `RLSession` (trainer, rollout engine sharing its weights, frozen
reference policy, rubric buffers), rebuilt from the previous step's checkpoint after a restart.
"""
from __future__ import annotations

import json
import math
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE

from rubricem_core.config import RunConfig
from rubricem_core.encoding import encode_prompt
from rubricem_core.environment import prompt_messages
from rubricem_core.faults import fault_point
from rubricem_core.judge.aggregate import stage_reward_rows
from rubricem_core.judge.buffer import RubricBuffer
from rubricem_core.judge.builtin import register_builtin_judge
from rubricem_core.judge.llm_judge import JudgeOptions, LLMJudge, judge_step
from rubricem_core.judge.types import JudgeQuery, JudgeRollout
from rubricem_core.policy.loading import load_policy
from rubricem_core.recipes import get_recipe
from rubricem_core.rl.curriculum import StepPlan
from rubricem_core.rl.update import group_advantages, per_token_advantages, ss_grpo_update
from rubricem_core.rollout import HFRolloutEngine, RolloutRequest, SamplingParams
from rubricem_core.scaffold import STAGES, validate
from rubricem_core.ssgrpo import as_lambda
from rubricem_core.embedders import HashingEmbedder, make_embedder
from rubricem_core.reflection.bank import ReflectionBank
from rubricem_core.reflection.meta import rebuild_bank, retrieve_guidance
from rubricem_core.store import RunStore, atomic_write_text
from rubricem_core.teacher.endpoint import endpoint_settings
from rubricem_core.training import TrainerConfig, make_trainer
from rubricem_core.trajectory import TokenTrajectory
from tasks.inputs import search_env
from tasks.secrets import resolve_api_key

ROLLOUTS_SCHEMA = pa.schema([
    ("step", pa.int64()), ("query_id", pa.string()), ("rollout_id", pa.string()), ("phase", pa.string()),
    ("retrieval", pa.string()), ("token_ids", pa.list_(pa.int64())), ("loss_mask", pa.list_(pa.int8())),
    ("stage_ids", pa.list_(pa.int8())), ("logprobs", pa.list_(pa.float32())), ("n_tool_calls", pa.int64()),
    ("finish_reason", pa.string()), ("valid_scaffold", pa.bool_()), ("judge_failed", pa.bool_()),
    ("violations", pa.list_(pa.string())), ("n_tokens", pa.int64()), ("n_policy_tokens", pa.int64()),
    ("prompt_len", pa.int64()), ("text", pa.string()), ("segments", pa.string()), ("guidance", pa.string()),
])
JUDGE_RUBRICS_SCHEMA = pa.schema([
    ("step", pa.int64()), ("query_id", pa.string()), ("rubric_id", pa.string()), ("stage", pa.string()),
    ("polarity", pa.string()), ("origin", pa.string()), ("title", pa.string()), ("description", pa.string()),
    ("weight", pa.float64()), ("status", pa.string()), ("created_step", pa.int64()), ("pruned_step", pa.int64()),
    ("check", pa.string()),
])
JUDGE_SCORES_SCHEMA = pa.schema([
    ("step", pa.int64()), ("query_id", pa.string()), ("rollout_id", pa.string()), ("rubric_id", pa.string()),
    ("stage", pa.string()), ("polarity", pa.string()), ("weight", pa.float64()), ("score", pa.int64()),
    ("justification", pa.string()),
])
STAGE_REWARDS_SCHEMA = pa.schema([
    ("step", pa.int64()), ("query_id", pa.string()), ("rollout_id", pa.string()), ("stage", pa.string()),
    ("R", pa.float64()), ("G", pa.float64()), ("A", pa.float64()),
])


def rl_dir(run_dir: str) -> Path:
    return Path(run_dir) / "checkpoints" / "rl"


def step_checkpoint(run_dir: str, step: int) -> Path:
    return rl_dir(run_dir) / f"step-{step:06d}"


def _key(step: int) -> dict[str, int]:
    return {"step": step}


def recipe_settings(cfg: RunConfig) -> dict[str, Any]:
    recipe = get_recipe(cfg.rl.recipe)
    lam = as_lambda(cfg.rl.lambda_spec) if cfg.rl.lambda_spec is not None else recipe.lam()
    return {
        "recipe": recipe, "lam": lam,
        "kl_coef": recipe.kl_coef if cfg.rl.kl_coef is None else cfg.rl.kl_coef,
        "judged_stages": tuple(recipe.judged_stages),
    }


# ---- the per-process session --------------------------------------------------------------------
@dataclass
class RLSession:
    run_dir: str
    step: int  # the last step whose update is applied to the weights (-1: the SFT policy)
    trainer: Any
    tokenizer: Any
    ref_model: Any
    engine: Any  # HFRolloutEngine or VLLMRolloutEngine
    buffers: dict[str, RubricBuffer] = field(default_factory=dict)
    # The engine's weights are those of the checkpoint after this step (-1: SFT). With the reflection
    # loop the engine holds its own copy, so the trainer can update while the engine samples.
    engine_step: int = -1
    separate_engine: bool = False
    bank: ReflectionBank | None = None
    bank_steps: set[int] = field(default_factory=set)  # steps whose accepted reflections are in the bank
    reflection_updates: set[int] = field(default_factory=set)  # steps whose reflection update is applied
    lock: threading.RLock = field(default_factory=threading.RLock)


_SESSIONS: dict[str, RLSession] = {}
_SESSION_LOCK = threading.Lock()


def start_policy(run_dir: str) -> Path:
    final = Path(run_dir) / "checkpoints" / "sft" / "final"
    if not (final / "config.json").exists():
        raise FileNotFoundError(f"no SFT checkpoint at {final}: run `rubricem sft` (or the pipeline) first")
    return final


def reflection_on(cfg: RunConfig) -> bool:
    return bool(get_recipe(cfg.rl.recipe).reflection)


def _total_steps(cfg: RunConfig) -> int:
    task_updates = 2 * cfg.rl.window * cfg.rl.n_windows
    return task_updates + (cfg.rl.window * cfg.rl.n_windows if reflection_on(cfg) else 0)


def get_session(run_dir: str, cfg: RunConfig, after_step: int) -> RLSession:
    """A session whose weights include the updates of steps ≤ ``after_step``."""
    with _SESSION_LOCK:
        key = str(Path(run_dir).resolve())
        session = _SESSIONS.get(key)
        if session is not None and session.step == after_step:
            return session
        base = start_policy(run_dir)
        model, tokenizer = load_policy(str(base), dtype=cfg.policy.dtype)
        trainer = make_trainer(model, TrainerConfig(
            lr=cfg.rl.lr, weight_decay=0.0, warmup_steps=cfg.rl.warmup_steps, total_steps=max(1, _total_steps(cfg)),
            min_lr_ratio=1.0, max_grad_norm=cfg.rl.max_grad_norm, precision=cfg.rl.precision, seed=cfg.seed,
            backend=cfg.rl.backend, zero_stage=cfg.rl.zero_stage,
        ))
        # The reference and the engine's copy live where the trainer's model does (a GPU when there is one).
        ref_model, _ = load_policy(str(base), dtype=cfg.policy.dtype, device=trainer.device)
        ref_model.requires_grad_(False)
        buffers: dict[str, RubricBuffer] = {}
        if after_step >= 0:
            ckpt = step_checkpoint(run_dir, after_step)
            if not (ckpt / "checkpoint.json").exists():
                raise FileNotFoundError(f"RL step {after_step} has no checkpoint at {ckpt}; rerun that step")
            extra = trainer.load(ckpt)
            buffers = {qid: RubricBuffer.from_dict(d) for qid, d in json.loads(extra["buffers"]).items()}
        if cfg.rollout.engine == "vllm":
            from rubricem_core.rollout.vllm_engine import VLLMRolloutEngine

            # vLLM holds its own copy of the weights: it starts from the SFT directory and is synced
            # from the trainer before each step's rollouts (ensure_engine_weights).
            engine = VLLMRolloutEngine(str(base), tokenizer, llm_kwargs={
                "tensor_parallel_size": cfg.rollout.tensor_parallel_size,
                "gpu_memory_utilization": cfg.rollout.gpu_memory_utilization,
            }, max_model_len=cfg.rollout.max_total_tokens)
            separate, engine_step = True, -1
        elif reflection_on(cfg):
            # Own copy of the weights: the deferred reflection update trains while this engine samples.
            engine_model, _ = load_policy(str(base), dtype=cfg.policy.dtype, device=trainer.device)
            engine_model.requires_grad_(False)
            engine = HFRolloutEngine(engine_model, tokenizer, max_batch_rows=cfg.rollout.max_batch_rows)
            separate, engine_step = True, -1
        else:
            engine = HFRolloutEngine(trainer.model, tokenizer, max_batch_rows=cfg.rollout.max_batch_rows)
            separate, engine_step = False, after_step
        session = RLSession(run_dir, after_step, trainer, tokenizer, ref_model, engine, buffers,
                            engine_step=engine_step, separate_engine=separate)
        if reflection_on(cfg):
            session.bank = new_bank(cfg)
            store = RunStore(run_dir)
            load_bank_steps(session, store, [s for s in store.partitions("reflections", "step") if s <= after_step])
        _SESSIONS.clear()
        _SESSIONS[key] = session
        return session


def current_session(run_dir: str, cfg: RunConfig) -> RLSession:
    """The live session whatever its step (background reflection work must not force a reload while
    the update of the same step advances it); a fresh one from the newest checkpoint otherwise."""
    with _SESSION_LOCK:
        session = _SESSIONS.get(str(Path(run_dir).resolve()))
    return session if session is not None else get_session(run_dir, cfg, completed_step(run_dir))


def save_task_metrics(store: RunStore, task: str, step: int, metrics: dict[str, float]) -> None:
    """A task's metrics next to its Parquet, so a retried run that skips the task still logs them."""
    path = store.state_dir / "task_metrics" / f"{task}-{step:04d}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, json.dumps(metrics))


def cached_task_metrics(store: RunStore, task: str, step: int) -> dict[str, float]:
    path = store.state_dir / "task_metrics" / f"{task}-{step:04d}.json"
    return json.loads(path.read_text()) if path.exists() else {}


def drop_sessions() -> None:
    with _SESSION_LOCK:
        _SESSIONS.clear()


def ensure_engine_weights(session: RLSession, step: int, cfg: RunConfig) -> None:
    """Make the engine sample with the weights of checkpoint ``step`` (-1: SFT). The trainer holds them
    when ``step`` is the session's step; an older step (a resumed run regenerating reflections) is
    read from its checkpoint directory."""
    with session.lock:
        if session.engine_step == step:
            return
        if not session.separate_engine:
            if step != session.step:
                raise RuntimeError(f"the engine shares the trainer's weights (step {session.step}); cannot sample at step {step}")
            session.engine_step = step
            return
        if step == session.step:
            session.engine.sync_from(session.trainer.model)
        else:
            source = start_policy(session.run_dir) if step < 0 else step_checkpoint(session.run_dir, step)
            model, _ = load_policy(str(source), dtype=cfg.policy.dtype)
            session.engine.sync_from(model)
        session.engine_step = step


def new_bank(cfg: RunConfig) -> ReflectionBank:
    embedder = make_embedder(cfg.reflection.embedder) or HashingEmbedder()
    return ReflectionBank(embedder)


def load_bank_steps(session: RLSession, store: RunStore, steps: list[int]) -> None:
    """Replay the accepted reflections of ``steps`` (not yet loaded) into the session's bank."""
    todo = sorted(s for s in steps if s not in session.bank_steps)
    if not todo or session.bank is None:
        return
    questions = {q["query_id"]: q["question"] for q in store.read_rows("queries")}
    rows = [r for s in todo for r in store.read_rows("reflections", _key(s))]
    rebuild_bank(session.bank, rows, questions)
    session.bank_steps.update(todo)


# ---- tasks --------------------------------------------------------------------------------------
@task(name="rollout", cache_policy=NO_CACHE)
def rollout_task(run_dir: str, cfg: RunConfig, plan: StepPlan) -> dict[str, Any]:
    """Sample a group per query with the current weights and the real tools → `rollouts`."""
    log = get_run_logger()
    store = RunStore(run_dir)
    if store.has("rollouts", _key(plan.step)):
        return {"cached": True, "metrics": cached_task_metrics(store, "rollout", plan.step)}
    session = get_session(run_dir, cfg, plan.step - 1)
    ensure_engine_weights(session, plan.step - 1, cfg)
    queries = {q["query_id"]: q for q in store.read_rows("queries")}
    guidance: list[str | None] = [None] * len(plan.query_ids)
    metrics: dict[str, float] = {}
    if session.bank is not None and plan.retrieval != "none":
        questions = {qid: q["question"] for qid, q in queries.items()}
        guidance, metrics = retrieve_guidance(
            session.bank, [(qid, questions[qid]) for qid in plan.query_ids], plan.retrieval,
            cfg.reflection.retrieval_k, cfg.reflection.min_similarity, questions)
        metrics["bank/size"] = float(len(session.bank))
    sampling = SamplingParams(
        temperature=cfg.rollout.temperature, top_p=cfg.rollout.top_p, max_new_tokens=cfg.rollout.max_new_tokens,
        max_total_tokens=cfg.rollout.max_total_tokens, seed=cfg.seed * 100_003 + plan.step,
    )
    requests = [
        RolloutRequest(request_id=qid, prompt_ids=encode_prompt(session.tokenizer, prompt_messages(
                           queries[qid], guidance=text, style=cfg.policy.prompt_style)),
                       n=cfg.rollout.group_size, sampling=sampling, max_tool_calls=cfg.tools.max_tool_calls)
        for qid, text in zip(plan.query_ids, guidance)
    ]
    t0 = time.perf_counter()
    groups = session.engine.generate(requests, search_env(run_dir, cfg))
    seconds = time.perf_counter() - t0
    rows = []
    for qid, text, group in zip(plan.query_ids, guidance, groups):
        for i, traj in enumerate(group):
            rows.append(rollout_row(plan, qid, f"{qid}-s{plan.step:04d}-r{i}", traj, cfg.tools.max_tool_calls, text))
    generated = sum(r["n_policy_tokens"] for r in rows)
    metrics["rollout/seconds"] = seconds
    metrics["rollout/tokens_per_s"] = generated / max(seconds, 1e-9)
    save_task_metrics(store, "rollout", plan.step, metrics)  # before the table: the table marks the task done
    store.write_table("rollouts", rows, _key(plan.step), schema=ROLLOUTS_SCHEMA)
    fault_point("rl.rollouts_written")
    log.info("step %d: %d rollouts, %d generated tokens in %.1fs (%.0f tok/s), %d valid scaffolds",
             plan.step, len(rows), generated, seconds, generated / max(seconds, 1e-9), sum(r["valid_scaffold"] for r in rows))
    return {"cached": False, "metrics": metrics}


def rollout_row(plan: StepPlan, query_id: str, rollout_id: str, traj: TokenTrajectory, max_tool_calls: int,
                guidance: str | None) -> dict[str, Any]:
    text = "".join(s.text for s in traj.segments if s.kind != "prompt")
    violations = sorted({v.code for v in validate(text, max_tool_calls=max_tool_calls)})
    return {
        "step": plan.step, "query_id": query_id, "rollout_id": rollout_id, "phase": plan.phase,
        "retrieval": plan.retrieval, "token_ids": traj.token_ids, "loss_mask": traj.loss_mask,
        "stage_ids": traj.stage_ids, "logprobs": [None if math.isnan(x) else x for x in traj.logprobs],
        "n_tool_calls": traj.n_tool_calls, "finish_reason": traj.finish_reason,
        "valid_scaffold": not violations, "judge_failed": False, "violations": violations,
        "n_tokens": len(traj), "n_policy_tokens": traj.n_policy_tokens, "prompt_len": traj.prompt_len,
        "text": text, "segments": json.dumps([s.__dict__ for s in traj.segments], ensure_ascii=False),
        "guidance": guidance,
    }


@task(name="judge", cache_policy=NO_CACHE)
def judge_task(run_dir: str, cfg: RunConfig, plan: StepPlan) -> dict[str, Any]:
    """Rubric generation (one call per query) and scoring (one call per rollout), buffer update and
    pruning → `judge_rubrics`, `judge_scores`, `stage_rewards` (R); failed judgments are marked."""
    log = get_run_logger()
    store = RunStore(run_dir)
    if store.has("stage_rewards", _key(plan.step)):
        return {"cached": True, "metrics": cached_task_metrics(store, "judge", plan.step)}
    session = get_session(run_dir, cfg, plan.step - 1)
    rs = recipe_settings(cfg)
    queries = {q["query_id"]: q for q in store.read_rows("queries")}
    rollouts = store.read_rows("rollouts", _key(plan.step))
    for qid in plan.query_ids:
        if qid not in session.buffers:
            session.buffers[qid] = RubricBuffer.from_query(qid, queries[qid]["rubrics"], cfg.judge.cap_per_stage, step=plan.step)
    model = cfg.judge.model
    if model.startswith("rubricem-judge/"):
        model = register_builtin_judge()
    settings = endpoint_settings(cfg.judge.model_copy(update={"model": model}), api_key=resolve_api_key(cfg.judge))
    judge = LLMJudge(settings, JudgeOptions(
        temperature=cfg.judge.temperature, max_tokens=cfg.judge.max_tokens, seed=cfg.seed,
        max_new_rubrics_per_stage=cfg.judge.max_new_rubrics_per_stage, rubric_stages=rs["judged_stages"],
        structured_output=cfg.judge.structured_output,
    ))
    groups = []
    for qid in plan.query_ids:
        q = queries[qid]
        jq = JudgeQuery(qid, q["question"], spec=json.loads(q["spec"]) if q.get("spec") else None,
                        reference_answer=q.get("reference_answer"))
        groups.append((jq, [JudgeRollout(r["rollout_id"], r["text"]) for r in rollouts if r["query_id"] == qid]))
    t0 = time.perf_counter()
    results = judge_step(judge, groups, session.buffers, plan.step)
    seconds = time.perf_counter() - t0

    rubric_rows, score_rows, reward_rows, failed = [], [], [], set()
    for g in results:
        rubric_rows.extend(session.buffers[g.query_id].rows(plan.step))
        for j in g.judgments:
            if j.failed:
                failed.add(j.rollout_id)
            else:
                score_rows.extend(j.rows(plan.step, g.query_id))
        reward_rows.extend(stage_reward_rows(plan.step, g.query_id, g.rollout_ids, g.R))
    for r in rollouts:
        r["judge_failed"] = r["rollout_id"] in failed
    store.write_table("rollouts", rollouts, _key(plan.step), schema=ROLLOUTS_SCHEMA)
    store.write_table("judge_rubrics", rubric_rows, _key(plan.step), schema=JUDGE_RUBRICS_SCHEMA)
    store.write_table("judge_scores", score_rows, _key(plan.step), schema=JUDGE_SCORES_SCHEMA)
    for row in reward_rows:
        row.setdefault("G", None)
        row.setdefault("A", None)
    # R now; the update task rewrites this partition with G and A
    metrics = judge.usage.metrics()
    metrics["judge/failed_trajectories"] = float(len(failed))
    metrics["judge/seconds"] = seconds
    for stage in STAGES:
        metrics[f"buffer/{stage}_active"] = float(sum(len(session.buffers[q].active(stage)) for q in plan.query_ids))
    save_task_metrics(store, "judge", plan.step, metrics)  # before stage_rewards, which marks the task done
    store.write_table("stage_rewards", reward_rows, _key(plan.step), schema=STAGE_REWARDS_SCHEMA)
    log.info("step %d: judged %d rollouts of %d queries in %.1fs, %d failed", plan.step, len(rollouts), len(groups), seconds, len(failed))
    return {"cached": False, "metrics": metrics}


@task(name="ss-grpo-update", cache_policy=NO_CACHE)
def update_task(run_dir: str, cfg: RunConfig, plan: StepPlan) -> dict[str, Any]:
    """G = RΛᵀ, per-stage advantages, one clipped policy-gradient step; checkpoint with buffers."""
    log = get_run_logger()
    store = RunStore(run_dir)
    ckpt = step_checkpoint(run_dir, plan.step)
    if completed_step(run_dir) >= plan.step:
        return {"cached": True}
    session = get_session(run_dir, cfg, plan.step - 1)
    rs = recipe_settings(cfg)
    rollouts = store.read_rows("rollouts", _key(plan.step))
    rewards = store.read_rows("stage_rewards", _key(plan.step))
    R_of = {(r["rollout_id"], r["stage"]): (np.nan if r["R"] is None else r["R"]) for r in rewards}

    trajs, advs, reward_rows = [], [], []
    stage_stats: dict[str, list[float]] = {f"{m}/{s}": [] for m in ("R", "G", "A") for s in STAGES}
    for qid in plan.query_ids:
        group = [r for r in rollouts if r["query_id"] == qid]
        R = np.array([[R_of[(r["rollout_id"], s)] for s in STAGES] for r in group], dtype=np.float64)
        ga = group_advantages(R, rs["lam"])
        for i, r in enumerate(group):
            for k, s in enumerate(STAGES):
                reward_rows.append({"step": plan.step, "query_id": qid, "rollout_id": r["rollout_id"], "stage": s,
                                    "R": _num(ga.R[i, k]), "G": _num(ga.G[i, k]), "A": _num(ga.A[i, k])})
                for name, arr in (("R", ga.R), ("G", ga.G), ("A", ga.A)):
                    if not math.isnan(arr[i, k]):
                        stage_stats[f"{name}/{s}"].append(float(arr[i, k]))
            if r["judge_failed"]:
                continue  # excluded from the update, never scored 0
            traj = TokenTrajectory(token_ids=r["token_ids"], loss_mask=r["loss_mask"], stage_ids=r["stage_ids"],
                                   logprobs=[math.nan if x is None else x for x in r["logprobs"]])
            trajs.append(traj)
            advs.append(per_token_advantages(traj, ga.A[i]))
    t0 = time.perf_counter()
    metrics = ss_grpo_update(
        session.trainer, session.ref_model, trajs, advs, session.tokenizer.pad_token_id,
        cfg.rl.max_tokens_per_batch, cfg.rollout.temperature, rs["recipe"].clip_low, rs["recipe"].clip_high,
        rs["kl_coef"],
    )
    metrics["update_seconds"] = time.perf_counter() - t0
    # The engine picks up these weights before the next step's rollouts (ensure_engine_weights):
    # this step's reflections may still be sampling with the old ones.
    buffers = json.dumps({qid: b.to_dict() for qid, b in session.buffers.items()})
    session.trainer.save(ckpt, extra={"buffers": buffers, "step": plan.step}, tokenizer=session.tokenizer)
    session.step = plan.step
    store.write_table("stage_rewards", reward_rows, _key(plan.step), schema=STAGE_REWARDS_SCHEMA)
    atomic_write_text(store.state_dir / "rl_progress.json", json.dumps({"completed_step": plan.step}))
    _prune_checkpoints(run_dir, keep=2)
    out = {f"rl/{k}": v for k, v in metrics.items()}
    for name, values in stage_stats.items():
        if values:
            out[f"reward/{name}_mean"] = float(np.mean(values))
    log.info("step %d: update on %d trajectories: loss %.4f kl %.4f clip %.3f gap %.4f", plan.step, len(trajs),
             metrics.get("loss", float("nan")), metrics.get("kl", float("nan")),
             metrics.get("clip_fraction", float("nan")), metrics.get("logprob_gap_mean", float("nan")))
    return {"cached": False, "metrics": out}


def completed_step(run_dir: str) -> int:
    """The last RL step whose update, checkpoint and tables are all written (-1: none)."""
    path = RunStore(run_dir).state_dir / "rl_progress.json"
    if not path.exists():
        return -1
    step = int(json.loads(path.read_text())["completed_step"])
    if not (step_checkpoint(run_dir, step) / "checkpoint.json").exists():
        raise FileNotFoundError(f"{path} says step {step} is complete but its checkpoint is missing")
    return step


def _num(x: float) -> float | None:
    return None if math.isnan(x) else float(x)


def _prune_checkpoints(run_dir: str, keep: int) -> None:
    """Keep the newest ``keep`` step checkpoints (older ones are not needed to resume)."""
    import shutil

    ckpts = sorted(p for p in rl_dir(run_dir).glob("step-*") if p.is_dir())
    for old in ckpts[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
