"""Prefect tasks of one RL step: rollout → judge (rubric generation, scoring, buffer update) → SS-GRPO
update (a resumable checkpoint every rl.checkpoint_every steps and at the last). Each task's output is a
Parquet partition `step=NNNN`; a retried run skips what exists. Models live in the per-process
`RLSession` of rubricem_core.rl.session (the trainer and reference in this process or in long-lived
trainer ranks, the rollout engine, rubric buffers), rebuilt after a restart from the newest checkpoint
and the replay of the later steps' updates from their tables.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from typing import Any

from prefect import get_run_logger
from prefect.states import State

from rubricem_core.config import RunConfig
from rubricem_core.encoding import encode_prompt
from rubricem_core.environment import prompt_messages
from rubricem_core.faults import fault_point
from rubricem_core.judge.buffer import RubricBuffer
from rubricem_core.judge.llm_judge import GroupJudgment, JudgeOptions, LLMJudge, judge_step
from rubricem_core.judge.stream import StreamingJudge
from rubricem_core.judge.types import JudgeQuery, JudgeRollout
from rubricem_core.llm.endpoints import builtin_provider, endpoint_for
from rubricem_core.progress import Progress
from rubricem_core.reflection.meta import retrieve_guidance
from rubricem_core.rl.curriculum import StepPlan
from rubricem_core.rl.records import rollout_row, rollout_text
from rubricem_core.rl.session import (  # noqa: F401  (re-exported for the flows, reflection tasks and tests)
    RLSession,
    buffers_at,
    checkpoint_due,
    completed_step,
    current_session,
    curve_checkpoints,
    curve_steps,
    drop_sessions,
    engine_asleep,
    ensure_engine_weights,
    get_session,
    load_bank_steps,
    newest_checkpoint,
    recipe_settings,
    reflection_on,
    replay_source_step,
    reset_bank,
    rl_dir,
    sampling_session,
    start_policy,
    step_checkpoint,
    update_settings,
)
from rubricem_core.rl.update import group_advantages, training_batch
from rubricem_core.rl.update import reward_rows as reward_rows_of
from rubricem_core.rollout import RolloutRequest, SamplingParams
from rubricem_core.scaffold import STAGES
from rubricem_core.schemas import JUDGE_RUBRICS_SCHEMA, JUDGE_SCORES_SCHEMA, ROLLOUTS_SCHEMA, STAGE_REWARDS_SCHEMA  # noqa: F401
from rubricem_core.seeds import ROLLOUT, derive_seed
from rubricem_core.store import RunStore, atomic_write_text, cached_task_metrics, save_task_metrics
from rubricem_core.trajectory import TokenTrajectory
from tasks.inputs import search_env
from tasks.readback import parquet_task, read_back
from tasks.secrets import resolve_api_key


class JudgeStepError(RuntimeError):
    """Too few of a step's rollouts could be judged to train on them."""


def _key(step: int) -> dict[str, int]:
    return {"step": step}


STEP_TASKS = ("rollout", "judge", "update", "reflection-update", "reflect")  # rl_step's merge order


def step_metrics(store: RunStore, step: int) -> dict[str, float]:
    """A step's metrics as rl_step returns them, from its tasks' saved metrics."""
    out: dict[str, float] = {}
    for name in STEP_TASKS:
        out.update(cached_task_metrics(store, name, step))
    return out


def step_metrics_logged(store: RunStore, flow: str, step: int) -> bool:
    if step not in store.partitions("metrics", "step"):
        return False
    return any(r["flow"] == flow for r in store.read_rows("metrics", {"step": step}))


# ---- tasks --------------------------------------------------------------------------------------
@parquet_task(name="rollout", task_run_name="rollout-step-{plan.step}")
def rollout_task(run_dir: str, cfg: RunConfig, plan: StepPlan) -> dict[str, Any] | State:
    """Sample a group per query with the current weights and the real tools → `rollouts`. With
    `judge.stream` each query's group is handed to the step's StreamingJudge the moment it ends (kept on
    the session for the judge task), so judging overlaps the groups still sampling."""
    log = get_run_logger()
    store = RunStore(run_dir)
    if store.has("rollouts", _key(plan.step)):
        metrics = cached_task_metrics(store, "rollout", plan.step)
        return read_back(
            {"cached": True, "metrics": metrics}, store.partition_path("rollouts", _key(plan.step)), run_dir
        )
    session = get_session(run_dir, cfg, plan.step - 1)
    ensure_engine_weights(session, plan.step - 1, cfg)
    queries = {q["query_id"]: q for q in store.read_rows("queries")}
    guidance: list[str | None] = [None] * len(plan.query_ids)
    metrics: dict[str, float] = {}
    if session.bank is not None and plan.retrieval != "none":
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
    sampling = SamplingParams(
        temperature=cfg.rollout.temperature,
        top_p=cfg.rollout.top_p,
        max_new_tokens=cfg.rollout.max_new_tokens,
        max_total_tokens=cfg.rollout.max_total_tokens,
        seed=derive_seed(cfg.seed, ROLLOUT, plan.step),
    )
    requests = [
        RolloutRequest(
            request_id=qid,
            prompt_ids=encode_prompt(
                session.tokenizer, prompt_messages(queries[qid], guidance=text, style=cfg.policy.prompt_style)
            ),
            n=cfg.rollout.group_size,
            sampling=sampling,
            max_tool_calls=cfg.tools.max_tool_calls,
        )
        for qid, text in zip(plan.query_ids, guidance)
    ]
    progress = Progress(
        f"step {plan.step}: trajectories finished", len(requests) * cfg.rollout.group_size, log.info, every_s=30.0
    )
    session.engine.on_progress = lambda done, _total: progress.update(done)
    stream = _start_streaming_judge(session, cfg, plan, queries) if cfg.judge.stream else None
    t0 = time.perf_counter()
    try:
        groups = session.engine.generate(requests, search_env(run_dir, cfg))
    except BaseException:
        if stream is not None:
            stream.close()  # the buffers it changed are rebuilt from the tables (buffers_step is None)
        raise
    finally:
        session.engine.on_progress = None
        session.engine.on_group_done = None
    seconds = time.perf_counter() - t0
    session.pending_judge = stream  # the judge task collects it
    rows = []
    for qid, text, group in zip(plan.query_ids, guidance, groups):
        for i, traj in enumerate(group):
            rows.append(rollout_row(plan, qid, rollout_id(plan, qid, i), traj, cfg.tools.max_tool_calls, text))
    generated = sum(r["n_policy_tokens"] for r in rows)
    metrics["rollout/seconds"] = seconds
    metrics["rollout/tokens_per_s"] = generated / max(seconds, 1e-9)
    save_task_metrics(store, "rollout", plan.step, metrics)  # before the table: the table marks the task done
    store.write_table("rollouts", rows, _key(plan.step), schema=ROLLOUTS_SCHEMA)
    fault_point("rl.rollouts_written")
    log.info(
        "step %d: %d rollouts, %d generated tokens in %.1fs (%.0f tok/s), %d valid scaffolds",
        plan.step,
        len(rows),
        generated,
        seconds,
        generated / max(seconds, 1e-9),
        sum(r["valid_scaffold"] for r in rows),
    )
    return {"cached": False, "metrics": metrics}


def rollout_id(plan: StepPlan, query_id: str, index: int) -> str:
    return f"{query_id}-s{plan.step:04d}-r{index}"


def judge_query(q: dict[str, Any]) -> JudgeQuery:
    """What the judge is told of a `queries` row."""
    spec = json.loads(q["spec"]) if q.get("spec") else None
    return JudgeQuery(q["query_id"], q["question"], spec=spec, reference_answer=q.get("reference_answer"))


def step_judge(
    session: RLSession, cfg: RunConfig, plan: StepPlan, queries: dict[str, dict[str, Any]]
) -> tuple[LLMJudge, dict[str, RubricBuffer]]:
    """The judge of a step and the buffers it changes: those after the step before, plus a new buffer
    (its persistent rubrics) for each query judged the first time. ``session.buffers_step`` becomes None:
    the buffers are changed in place from here on, unknown until the step's judge tables are written
    (a failed or killed judge leaves them to be rebuilt from `judge_rubrics`)."""
    buffers = buffers_at(session, plan.step - 1, cfg)
    session.buffers_step = None
    for qid in plan.query_ids:
        if qid not in buffers:
            buffers[qid] = RubricBuffer.from_query(
                qid, queries[qid]["rubrics"], cfg.judge.cap_per_stage, step=plan.step
            )
    builtin = builtin_provider(cfg.judge.model) == "rubricem-judge"
    settings = endpoint_for(cfg.judge, api_key=resolve_api_key(cfg.judge))
    return LLMJudge(settings, judge_options(cfg, recipe_settings(cfg).judged_stages, builtin)), buffers


def _start_streaming_judge(
    session: RLSession, cfg: RunConfig, plan: StepPlan, queries: dict[str, dict[str, Any]]
) -> StreamingJudge:
    """A StreamingJudge over the step's buffers, fed by the engine as each query's group ends: each
    trajectory as the judge task would read its `rollouts` row (same id, same text)."""
    if session.pending_judge is not None:  # a stale one (a failed step before): nobody will collect it
        session.pending_judge.close()
        session.pending_judge = None
    judge, buffers = step_judge(session, cfg, plan, queries)
    stream = StreamingJudge(judge, buffers, plan.step)
    targets = [judge_query(queries[qid]) for qid in plan.query_ids]

    def on_group_done(index: int, group: list[TokenTrajectory]) -> None:
        query = targets[index]
        rollouts = [JudgeRollout(rollout_id(plan, query.query_id, i), rollout_text(t)) for i, t in enumerate(group)]
        # every group has group_size rollouts: the offset is the batch judge's, whichever group ends first
        stream.submit(query, rollouts, index=index, offset=index * cfg.rollout.group_size)

    session.engine.on_group_done = on_group_done
    return stream


def _take_streamed(session: RLSession, plan: StepPlan) -> StreamingJudge | None:
    """The rollout task's StreamingJudge when it judged this step over the session's buffers as they
    still are; None (closing a stale one) otherwise: the judge task then judges from the tables."""
    stream, session.pending_judge = session.pending_judge, None
    if stream is None:
        return None
    if stream.step == plan.step and stream.buffers is session.buffers and session.buffers_step is None:
        return stream
    stream.close()
    return None


def judge_options(cfg: RunConfig, judged_stages: tuple[str, ...], builtin: bool) -> JudgeOptions:
    """The stagewise judge's options for this run's recipe and judge."""
    # A recipe that judges the answer alone (baseline: DR Tulu's evolving-answer objective; meta_policy:
    # the same plus reflections) has its judge read the question and the final answer only. The built-in
    # judge keeps the whole trajectory: its answer checks verify citations against the snippets the
    # research retrieved (without them every citation reads as invented).
    answer_only = tuple(judged_stages) == ("answer",) and not builtin
    return JudgeOptions.from_config(
        cfg.judge,
        seed=cfg.seed,
        rubric_stages=judged_stages,
        view="answer" if answer_only else "trajectory",
    )


@parquet_task(name="judge", task_run_name="judge-step-{plan.step}")
def judge_task(run_dir: str, cfg: RunConfig, plan: StepPlan) -> dict[str, Any] | State:
    """Rubric generation (one call per query) and scoring (one call per rollout), buffer update and
    pruning → `judge_rubrics`, `judge_scores`, and `stage_rewards` (R, and from it G = RΛᵀ and the
    per-stage advantages A); failed judgments are marked in `rollouts` and get no G or A. The judgments
    are the rollout task's streamed ones when it judged this step in this process, else made here from
    the `rollouts` table; both give the same tables."""
    log = get_run_logger()
    store = RunStore(run_dir)
    if store.has("stage_rewards", _key(plan.step)):
        metrics = cached_task_metrics(store, "judge", plan.step)
        where = store.partition_path("stage_rewards", _key(plan.step))
        return read_back({"cached": True, "metrics": metrics}, where, run_dir)
    session = get_session(run_dir, cfg, plan.step - 1)
    rs = recipe_settings(cfg)
    queries = {q["query_id"]: q for q in store.read_rows("queries")}
    rollouts = store.read_rows("rollouts", _key(plan.step))
    t0 = time.perf_counter()
    stream = _take_streamed(session, plan)
    results: list[GroupJudgment]
    if stream is not None:  # judged while the rollouts sampled (judge.stream): wait for the last groups
        judge, buffers = stream.judge, stream.buffers
        results = stream.collect(plan.query_ids)
        _check_streamed(results, rollouts)
        seconds = stream.seconds
    else:
        judge, buffers = step_judge(session, cfg, plan, queries)
        groups = [
            (
                judge_query(queries[qid]),
                [JudgeRollout(r["rollout_id"], r["text"]) for r in rollouts if r["query_id"] == qid],
            )
            for qid in plan.query_ids
        ]
        results = judge_step(judge, groups, buffers, plan.step)
        seconds = time.perf_counter() - t0
    wait_seconds = time.perf_counter() - t0  # how long this task held the step up

    rubric_rows, score_rows, reward_rows, errors = judge_tables(plan.step, results, buffers, rs.lam)
    # The judge's verdict on each rollout, kept even when the step cannot train. Rewritten only when it
    # differs from what the rollout task (or a failed attempt's judge) wrote: with every judgment in,
    # the rollouts partition stays as sampled.
    if any(
        r["judge_failed"] != (r["rollout_id"] in errors) or r["judge_error"] != errors.get(r["rollout_id"])
        for r in rollouts
    ):
        for r in rollouts:
            r["judge_failed"] = r["rollout_id"] in errors
            r["judge_error"] = errors.get(r["rollout_id"])
        store.write_table("rollouts", rollouts, _key(plan.step), schema=ROLLOUTS_SCHEMA)
    fault_point("rl.judge_failures_written")
    judged = len(rollouts) - len(errors)
    if judged == 0 or judged < cfg.judge.min_judged_fraction * len(rollouts):
        # Nothing is marked done: no rubrics, scores or rewards of this step; the rerun re-judges it
        # from the buffers of the step before (rebuilt from the tables).
        first = "; ".join(f"{rid}: {err}" for rid, err in list(errors.items())[:3])
        raise JudgeStepError(
            f"step {plan.step}: {len(errors)} of {len(rollouts)} judgments failed (judge.min_judged_fraction="
            f"{cfg.judge.min_judged_fraction}); nothing was trained or checkpointed; fix the judge endpoint "
            f"({cfg.judge.model}) and rerun to re-judge this step. First errors: {first}"
        )
    store.write_table("judge_rubrics", rubric_rows, _key(plan.step), schema=JUDGE_RUBRICS_SCHEMA)
    fault_point("rl.judge_rubrics_written")
    store.write_table("judge_scores", score_rows, _key(plan.step), schema=JUDGE_SCORES_SCHEMA)
    metrics = judge.usage.metrics()
    metrics["judge/failed_trajectories"] = float(len(errors))
    metrics["judge/seconds"] = seconds  # from the first call to the last (streamed: from the first group)
    metrics["judge/wait_seconds"] = wait_seconds
    for stage in STAGES:
        metrics[f"buffer/{stage}_active"] = float(sum(len(buffers[q].active(stage)) for q in plan.query_ids))
    save_task_metrics(store, "judge", plan.step, metrics)  # before stage_rewards, which marks the task done
    # R, G and A, final: the update trains on these advantages and writes nothing here
    store.write_table("stage_rewards", reward_rows, _key(plan.step), schema=STAGE_REWARDS_SCHEMA)
    session.buffers_step = plan.step
    fault_point("rl.judge_done")
    log.info(
        "step %d: judged %d rollouts of %d queries in %.1fs, %d failed",
        plan.step,
        len(rollouts),
        len(results),
        seconds,
        len(errors),
    )
    return {"cached": False, "metrics": metrics}


def judge_tables(
    step: int, results: list[GroupJudgment], buffers: dict[str, RubricBuffer], lam: Any
) -> tuple[list[dict[str, Any]], list[dict[str, Any]], list[dict[str, Any]], dict[str, str]]:
    """A step's `judge_rubrics`, `judge_scores` and `stage_rewards` rows (groups in ``results`` order)
    and the error of each failed judgment by rollout id."""
    rubric_rows, score_rows, reward_rows, errors = [], [], [], {}
    for g in results:
        rubric_rows.extend(buffers[g.query_id].rows(step))
        for j in g.judgments:
            if j.failed:
                errors[j.rollout_id] = j.error or "judgment failed"
            else:
                score_rows.extend(j.rows(step, g.query_id))
        failed = [rid in errors for rid in g.rollout_ids]
        reward_rows.extend(reward_rows_of(step, g.query_id, g.rollout_ids, group_advantages(g.R, lam, failed)))
    return rubric_rows, score_rows, reward_rows, errors


def _check_streamed(results: list[GroupJudgment], rollouts: list[dict[str, Any]]) -> None:
    """The streamed groups judged exactly the rollouts the table holds (ids and texts were made by one path)."""
    judged = [rid for g in results for rid in g.rollout_ids]
    if judged != [r["rollout_id"] for r in rollouts]:
        raise RuntimeError(f"the streamed judge judged rollouts {judged[:4]}..., the table holds others")


@parquet_task(name="ss-grpo-update", task_run_name="ss-grpo-update-step-{plan.step}")
def update_task(run_dir: str, cfg: RunConfig, plan: StepPlan) -> dict[str, Any] | State:
    """One clipped policy-gradient step on the judged rollouts with the judge task's advantages; a
    resumable checkpoint (with the rubric buffers) when rl.checkpoint_every says so and at the last step."""
    log = get_run_logger()
    store = RunStore(run_dir)
    if completed_step(run_dir) >= plan.step:  # in a checkpoint, or replayed from the step's tables
        metrics = cached_task_metrics(store, "update", plan.step)
        return read_back({"cached": True, "metrics": metrics}, store.layout.rl_progress_file, run_dir)
    session = get_session(run_dir, cfg, plan.step - 1)
    batch = training_batch(
        store.read_rows("rollouts", _key(plan.step)), store.read_rows("stage_rewards", _key(plan.step))
    )
    t0 = time.perf_counter()
    session.policy.log_to(log.info)  # trainer ranks' output goes to this task's log
    with engine_asleep(session, cfg):
        metrics = session.policy.update(
            batch.trajectories, batch.token_advantages, update_settings(cfg, cfg.rollout.temperature)
        )
    metrics["update_seconds"] = time.perf_counter() - t0
    session.step = plan.step
    # The engine picks up these weights by transfer before the next step's rollouts
    # (ensure_engine_weights): this step's reflections may still be sampling with the old ones.
    fault_point("rl.update_applied")
    saved = checkpoint_due(cfg, plan.step)
    if saved:
        # A copy of the buffers for inspection; a resumed session rebuilds them from `judge_rubrics`.
        buffers = json.dumps({qid: b.to_dict() for qid, b in buffers_at(session, plan.step, cfg).items()})
        session.policy.save(step_checkpoint(run_dir, plan.step), extra={"buffers": buffers, "step": plan.step})
        fault_point("rl.checkpoint_saved")
    out = {f"rl/{k}": v for k, v in metrics.items()} | batch.stage_means
    save_task_metrics(store, "update", plan.step, out)  # before the progress file, which marks the step done
    # Done: the update is applied and every table it needs is written. Without a checkpoint of this
    # step, a resume replays its update from those tables (rl.session.replay_updates).
    atomic_write_text(store.layout.rl_progress_file, json.dumps({"completed_step": plan.step}))
    fault_point("rl.step_done")
    if saved:
        _prune_checkpoints(run_dir, keep=cfg.rl.keep_checkpoints, curve=curve_steps(cfg))
    log.info(
        "step %d: update on %d trajectories: loss %.4f kl %.4f clip %.3f gap %.4f%s",
        plan.step,
        len(batch.trajectories),
        metrics.get("loss", float("nan")),
        metrics.get("kl", float("nan")),
        metrics.get("clip_fraction", float("nan")),
        metrics.get("logprob_gap_mean", float("nan")),
        "; checkpoint written" if saved else "",
    )
    return {"cached": False, "metrics": out}


def _prune_checkpoints(run_dir: str, keep: int, curve: Sequence[int] = ()) -> None:
    """Keep the newest ``keep`` step checkpoints (a resume needs only the newest; the rest are for
    inspection and evaluation) and those of the learning-curve steps ``curve``."""
    import shutil

    kept = {step_checkpoint(run_dir, step) for step in curve}
    ckpts = sorted(p for p in rl_dir(run_dir).glob("step-*") if p.is_dir())
    for old in ckpts[:-keep]:
        if old not in kept:
            shutil.rmtree(old, ignore_errors=True)
