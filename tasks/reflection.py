"""Prefect tasks of the reflection meta-policy (recipes meta_policy and full).

`reflection-candidates` (step N, new-query phase): the policy writes reflection candidates on the step's
rollouts (they need no judge score, so this runs while the task judge scores the step; `reflect` writes
them again when the judge's failure marks change which rollouts are the sources).
`reflect` (step N): those candidates → reflection judge → `reflections` partition step=N, best valid
candidate per query into the bank (`bank` table + the FAISS bank saved at `bank_dir(run_dir)`, where
evaluation reads it).
`reflection-update` (run in step N+1): one GRPO step on the reflection tokens of step N's candidates.
The flow overlaps them with the task work (see flows/rl.py); both skip what their Parquet or the
newest checkpoint already holds, so a retried run redoes only what is missing.
"""

from __future__ import annotations

from typing import Any

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE
from prefect.states import State

from rubricem_core.config import RunConfig
from rubricem_core.faults import fault_point
from rubricem_core.reflection.bank import ReflectionBank, bank_dir
from rubricem_core.rl.curriculum import StepPlan
from rubricem_core.rl.learner import WeightsVersion
from rubricem_core.rl.progress import completed_step
from rubricem_core.rl.session import RLSession, SessionManager
from rubricem_core.rl.steps import (
    ReflectionCandidates,
    reflect_step,
    reflection_update_step,
    reload_bank_step,
    step_sources,
    write_candidates,
)
from rubricem_core.schemas import BANK_SCHEMA, REFLECTIONS_SCHEMA
from rubricem_core.store import RunStore, save_task_metrics
from tasks.inputs import search_env
from tasks.readback import parquet_task, read_back_step
from tasks.secrets import resolve_api_key


def _key(step: int) -> dict[str, int]:
    return {"step": step}


@task(name="reflection-candidates", task_run_name="reflection-candidates-step-{plan.step}", cache_policy=NO_CACHE)
def reflection_candidates_task(session: SessionManager, plan: StepPlan) -> ReflectionCandidates | None:
    """The policy's reflection candidates on a new-query step's rollouts (weights: those after step−1;
    rubricem_core.rl.steps.write_candidates), handed to `reflect` as a value; None when the step's
    `reflections` are written already (`reflect` reads them back)."""
    store, cfg = session.store, session.cfg
    if store.has("reflections", _key(plan.step)):
        return None
    # the live session, unless a resumed run lost the weights of step−1 (no checkpoint kept them):
    # then one replayed to step−1 from the tables
    candidates = _write_candidates(session.sampling(plan.step - 1), cfg, plan)
    n = sum(len(g) for g in candidates.groups)
    get_run_logger().info("step %d: %d reflection candidates written in %.1fs", plan.step, n, candidates.seconds)
    return candidates


def _write_candidates(rl_session: RLSession, cfg: RunConfig, plan: StepPlan) -> ReflectionCandidates:
    queries = {q["query_id"]: q for q in rl_session.store.read_rows("queries")}
    return write_candidates(rl_session, cfg, plan, queries, search_env(str(rl_session.store.run_dir), cfg))


@parquet_task(name="reflect", task_run_name="reflect-step-{plan.step}")
def reflect_task(
    session: SessionManager, plan: StepPlan, candidates: ReflectionCandidates | None = None
) -> dict[str, Any] | State:
    """Judge and bank the reflections of a new-query step (rubricem_core.rl.steps.reflect_step) →
    `reflections`, `bank` and the saved FAISS bank. ``candidates``: reflection-candidates' value; None
    (a rerun, one-step async's engine work) writes them here first."""
    log, store, cfg = get_run_logger(), session.store, session.cfg
    if store.has("reflections", _key(plan.step)):
        where = store.partition_path("reflections", _key(plan.step))
        return read_back_step(store, "reflect", plan.step, where, reload_bank_step(session.current(), plan.step))
    rl_session = session.sampling(plan.step - 1)  # as reflection-candidates' (the bank is the live one's)
    if candidates is not None and not candidates.written_on(step_sources(store, cfg, plan)):
        # written while the judge was still marking failed judgments (a rerun after a judge outage reads
        # the stale marks): written again on the sources the judged rollouts give
        log.info("step %d: reflection sources changed with the judge's verdicts; writing candidates again", plan.step)
        candidates = None
    if candidates is None:
        candidates = _write_candidates(rl_session, cfg, plan)
    queries = {q["query_id"]: q for q in store.read_rows("queries")}
    reflected = reflect_step(rl_session, cfg, plan, queries, candidates, resolve_api_key(cfg.reflection.judge))
    # The bank first, then the metrics, then `reflections`, which marks the task done: a rerun after a
    # kill before it redoes the step's reflections and rebuilds the bank from the earlier partitions.
    if rl_session.bank is not None:
        _write_bank(store, rl_session.bank)
    save_task_metrics(store, "reflect", plan.step, reflected.metrics)
    store.write_table("reflections", reflected.rows, _key(plan.step), schema=REFLECTIONS_SCHEMA)
    fault_point("rl.reflections_written")
    log.info(*reflected.summary(plan.step, rl_session.bank))
    return {"cached": False, "metrics": reflected.metrics}


def _write_bank(store: RunStore, bank: ReflectionBank) -> None:
    """The `bank` table and the saved FAISS index, both from the session's bank (the replay of
    every `reflections` partition so far)."""
    store.write_table("bank", bank.rows(), schema=BANK_SCHEMA)
    fault_point("rl.bank_table_written")
    bank.save(bank_dir(store.run_dir))  # with its embedder's name: evaluation rebuilds the same one


@parquet_task(name="reflection-update", task_run_name="reflection-update-of-step-{source.step}")
def reflection_update_task(session: SessionManager, source: StepPlan, at_step: int) -> dict[str, Any] | State:
    """GRPO on the reflection tokens of step ``source.step``'s candidates, applied during ``at_step``
    (before that step's task update; rubricem_core.rl.steps.reflection_update_step)."""
    log, store = get_run_logger(), session.store
    if completed_step(store) >= at_step:
        return read_back_step(store, "reflection-update", at_step, store.layout.rl_progress_file)
    rl_session = session.at(at_step - 1)
    # applied already: replayed from the tables when the session was rebuilt
    if rl_session.weights > WeightsVersion(at_step - 1):
        where = store.partition_path("reflections", _key(source.step))
        return read_back_step(store, "reflection-update", at_step, where)
    update = reflection_update_step(rl_session, session.cfg, source.step, at_step, log.info)
    # the weights keep this update only in memory until the step's checkpoint; a rerun redoes both
    save_task_metrics(store, "reflection-update", at_step, update.metrics)
    fault_point("rl.reflection_update_done")
    msg = "step %d: reflection update on %d candidates of step %d (%d with signal)"
    log.info(msg, at_step, update.n_candidates, source.step, update.nonzero)
    return {"cached": False, "metrics": update.metrics}
