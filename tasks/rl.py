"""Prefect tasks of one RL step: rollout → judge (rubric generation, scoring, buffer update) → SS-GRPO
update (a resumable checkpoint every rl.checkpoint_every steps and at the last). Each task's output is a
Parquet partition `step=NNNN`; a retried run skips what exists. Models live in the `rl` flow run's
session (rubricem_core.rl.session.open_session: the trainer and reference in this process or in trainer
ranks, the rollout engine, rubric buffers), which the flow hands to every task; it is rebuilt after a
restart from the newest checkpoint and the replay of the later steps' updates from their tables. Each
task reads its inputs, calls one function of rubricem_core.rl.steps and writes what it returns.
"""

from __future__ import annotations

from typing import Any

from prefect import get_run_logger
from prefect.states import State

from rubricem_core.faults import fault_point
from rubricem_core.judge.step import check_enough_judged
from rubricem_core.rl.curriculum import StepPlan, sampling_step
from rubricem_core.rl.progress import completed_step, curve_steps, mark_step_done, prune_checkpoints
from rubricem_core.rl.session import SessionManager
from rubricem_core.rl.steps import judge_rl_step, sample_step, update_step
from rubricem_core.schemas import JUDGE_RUBRICS_SCHEMA, JUDGE_SCORES_SCHEMA, ROLLOUTS_SCHEMA, STAGE_REWARDS_SCHEMA
from rubricem_core.store import RunStore, cached_task_metrics, save_task_metrics
from tasks.inputs import search_env
from tasks.readback import parquet_task, read_back_step
from tasks.secrets import resolve_api_key


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
def rollout_task(session: SessionManager, plan: StepPlan) -> dict[str, Any] | State:
    """Sample a group per query with the current weights (one-step async: those before the update now
    running) and the real tools → `rollouts` (with `judge.stream`, each group is judged as it ends;
    rubricem_core.rl.steps.sample_step)."""
    log, store, cfg = get_run_logger(), session.store, session.cfg
    if store.has("rollouts", _key(plan.step)):
        return read_back_step(store, "rollout", plan.step, store.partition_path("rollouts", _key(plan.step)))
    queries = {q["query_id"]: q for q in store.read_rows("queries")}
    api_key = resolve_api_key(cfg.judge) if cfg.judge.stream else None
    tools = search_env(str(store.run_dir), cfg)
    # on-policy: the trainer at step−1; one-step async: the live session while its update of step−1 runs
    rl_session = (
        session.sampling(sampling_step(plan.step, cfg.rl.async_steps))
        if cfg.rl.async_steps
        else session.at(plan.step - 1)
    )
    sampled = sample_step(rl_session, cfg, plan, queries, tools, api_key, log.info)
    save_task_metrics(store, "rollout", plan.step, sampled.metrics)  # before the table: it marks the task done
    store.write_table("rollouts", sampled.rows, _key(plan.step), schema=ROLLOUTS_SCHEMA)
    fault_point("rl.rollouts_written")
    log.info(*sampled.summary(plan.step))
    return {"cached": False, "metrics": sampled.metrics}


@parquet_task(name="judge", task_run_name="judge-step-{plan.step}")
def judge_task(session: SessionManager, plan: StepPlan) -> dict[str, Any] | State:
    """The stagewise judge of the step's rollouts (rubricem_core.rl.steps.judge_rl_step) → `judge_rubrics`,
    `judge_scores`, and `stage_rewards` (R, G = RΛᵀ, A); failed judgments are marked in `rollouts` and
    get no G or A."""
    log, store, cfg = get_run_logger(), session.store, session.cfg
    if store.has("stage_rewards", _key(plan.step)):
        return read_back_step(store, "judge", plan.step, store.partition_path("stage_rewards", _key(plan.step)))
    queries = {q["query_id"]: q for q in store.read_rows("queries")}
    rollouts = store.read_rows("rollouts", _key(plan.step))
    rl_session = session.at(plan.step - 1)
    judged = judge_rl_step(rl_session, cfg, plan, queries, rollouts, resolve_api_key(cfg.judge))
    if judged.rollouts_changed:  # the verdicts are kept even when the step cannot train
        store.write_table("rollouts", judged.rollouts, _key(plan.step), schema=ROLLOUTS_SCHEMA)
    fault_point("rl.judge_failures_written")
    check_enough_judged(plan.step, len(rollouts), judged.errors, cfg.judge)
    store.write_table("judge_rubrics", judged.rubric_rows, _key(plan.step), schema=JUDGE_RUBRICS_SCHEMA)
    fault_point("rl.judge_rubrics_written")
    store.write_table("judge_scores", judged.score_rows, _key(plan.step), schema=JUDGE_SCORES_SCHEMA)
    save_task_metrics(store, "judge", plan.step, judged.metrics)  # before stage_rewards, which marks it done
    store.write_table("stage_rewards", judged.reward_rows, _key(plan.step), schema=STAGE_REWARDS_SCHEMA)
    if judged.buffers is not None:
        rl_session.buffers = judged.buffers  # those of the tables just written
    fault_point("rl.judge_done")
    msg = "step %d: judged %d rollouts of %d queries in %.1fs, %d failed"
    log.info(msg, plan.step, len(rollouts), judged.n_groups, judged.seconds, len(judged.errors))
    return {"cached": False, "metrics": judged.metrics}


@parquet_task(name="ss-grpo-update", task_run_name="ss-grpo-update-step-{plan.step}")
def update_task(session: SessionManager, plan: StepPlan) -> dict[str, Any] | State:
    """One clipped policy-gradient step on the judged rollouts with the judge task's advantages and a
    checkpoint when due (rubricem_core.rl.steps.update_step); then the step is marked done."""
    log, store, cfg = get_run_logger(), session.store, session.cfg
    if completed_step(store) >= plan.step:  # in a checkpoint, or replayed from the step's tables
        return read_back_step(store, "update", plan.step, store.layout.rl_progress_file)
    updated = update_step(session.at(plan.step - 1), cfg, plan, log.info)
    save_task_metrics(store, "update", plan.step, updated.metrics)  # before the progress file: it marks the step done
    mark_step_done(store, plan.step)
    fault_point("rl.step_done")
    if updated.saved:
        prune_checkpoints(store, keep=cfg.rl.keep_checkpoints, curve=curve_steps(cfg))
    log.info(*updated.summary(plan.step))
    return {"cached": False, "metrics": updated.metrics}
