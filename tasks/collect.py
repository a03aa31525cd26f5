"""Prefect tasks of SFT data collection: thin wrappers that call rubricem_core and own the Parquet I/O.

Caching is by Parquet: a task whose output partition exists returns without recomputing, so a
retried flow run (CLI or the Prefect UI's retry) resumes from the last completed round.
"""

from __future__ import annotations

from typing import Any

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE
from prefect.states import State

from rubricem_core.config import RunConfig
from rubricem_core.faults import fault_point
from rubricem_core.llm.endpoints import endpoint_for
from rubricem_core.store import RunStore, save_task_metrics
from rubricem_core.teacher.collection import (
    ROUND_METRICS_TASK,
    TeacherRoundError,
    ask_teacher_reflections,
    cached_round_figures,
    filter_states,
    load_states,
    round_key,
    run_teacher_round,
)
from tasks.inputs import search_env
from tasks.readback import parquet_task, read_back
from tasks.secrets import resolve_api_key

__all__ = ["TeacherRoundError", "filter_trajectories", "load_states", "teacher_reflections", "teacher_round"]


@parquet_task(name="teacher-round", task_run_name="teacher-round-{round_index}", retries=1, retry_delay_seconds=2)
def teacher_round(run_dir: str, cfg: RunConfig, round_index: int) -> dict[str, Any] | State:
    """One teacher round over all unfinished trajectories (rubricem_core.teacher.collection).

    Writes requests, responses, then state: the state partition is written last and marks the round
    complete, so a crash anywhere before it reruns the whole round (re-attaching to its batch).
    """
    log = get_run_logger()
    store, key = RunStore(run_dir), round_key(round_index)
    if store.has("teacher_state", key):
        figures = cached_round_figures(store, cfg, round_index)
        log.info("round %d already complete (cached Parquet); %d unfinished", round_index, figures["unfinished"])
        return read_back(figures, store.partition_path("teacher_state", key).parent, run_dir)
    settings = endpoint_for(cfg.teacher, api_key=resolve_api_key(cfg.teacher), max_tool_calls=cfg.tools.max_tool_calls)
    done = run_teacher_round(store, cfg, round_index, settings, lambda: search_env(run_dir, cfg), log.info)
    if done is None:
        return {"round": round_index, "cached": False, "unfinished": 0, "requests": 0}
    store.write_table("teacher_requests", done.request_rows, key)
    store.write_table("teacher_responses", done.response_rows, key)
    if done.failure is not None:  # not done: no state for this round; the rerun sends only the failed requests
        done.marker.unlink(missing_ok=True)  # that batch is over; re-attaching would only return the same failures
        raise done.failure
    # before the state, which marks the round done: a rerun that skips the round still reports them
    save_task_metrics(store, ROUND_METRICS_TASK, round_index, done.retry_stats.retry_metrics(""))
    store.write_table("teacher_state", done.state_rows, key)
    fault_point("collect.round_written")
    done.marker.unlink(missing_ok=True)
    figures, stats = done.figures(), done.retry_stats
    log.info(
        "round %d done: %d requests, %d failed, %d trajectories still unfinished; %d retries, %d rate-limited "
        "answers, %.1fs waited",
        *(round_index, figures["requests"], figures["failed"], figures["unfinished"]),
        *(stats.retries, stats.rate_limited, stats.wait_s),
    )
    return figures


@task(name="filter-trajectories", task_run_name="filter-trajectories", cache_policy=NO_CACHE)
def filter_trajectories(run_dir: str, cfg: RunConfig, last_round: int) -> dict[str, Any]:
    """Rejection filtering of every trajectory → `sft_trajectories` (accepted and rejected rows)."""
    log = get_run_logger()
    store = RunStore(run_dir)
    filtered = filter_states(load_states(store, cfg, last_round), cfg)
    store.write_table("sft_trajectories", filtered.rows)
    s = filtered.summary
    log.info(
        "filtered %d trajectories: %d accepted, %d rejected %s",
        *(s["trajectories"], s["accepted"], s["trajectories"] - s["accepted"], s["reject_reasons"]),
    )
    if filtered.failure is not None:
        raise filtered.failure
    return {**s, "path": str(store.table_dir("sft_trajectories"))}


def _policy_tokenizer(run_dir: str, cfg: RunConfig, log: Any) -> Any:
    """The policy's tokenizer when the reflection prompt is bounded in its tokens (reflection.max_trajectory_tokens),
    else None: the teacher is asked exactly what RL asks the policy, and SFT trains the policy on that prompt."""
    if cfg.reflection.max_trajectory_tokens is None:
        return None
    from rubricem_core.policy.loading import load_policy_tokenizer  # pulls in torch and transformers
    from tasks.sft import base_policy

    return load_policy_tokenizer(base_policy(run_dir, cfg, log))


@parquet_task(name="teacher-reflections", task_run_name="teacher-reflections", retries=1, retry_delay_seconds=2)
def teacher_reflections(run_dir: str, cfg: RunConfig) -> dict[str, Any] | State:
    """The teacher's reflection on every accepted trajectory → `teacher_reflections` (one round through
    the same Batch API / concurrent path). A rerun asks again only for the rows whose call failed."""
    log = get_run_logger()
    store = RunStore(run_dir)
    if not cfg.teacher.write_reflections:
        return {}
    tcfg = cfg.teacher
    asked = ask_teacher_reflections(
        store,
        cfg,
        _policy_tokenizer(run_dir, cfg, log),
        lambda: endpoint_for(tcfg, api_key=resolve_api_key(tcfg), max_tool_calls=cfg.tools.max_tool_calls),
        log.info,
    )
    stats = asked.stats
    if asked.rows is None:
        log.info(
            "teacher reflections already written (cached Parquet): %d valid of %d",
            *(stats["reflections_valid"], stats["reflections"]),
        )
        return read_back({**stats, "cached": True}, store.table_dir("teacher_reflections"), run_dir)
    store.write_table("teacher_reflections", asked.rows)
    if asked.marker is not None:
        asked.marker.unlink(missing_ok=True)
    log.info(
        "reflections: %d valid of %d, %d failed calls, rejected %s",
        *(stats["reflections_valid"], stats["reflections"], stats["reflections_failed"]),
        stats["reflection_reject_codes"],
    )
    return {**stats, "cached": False}
