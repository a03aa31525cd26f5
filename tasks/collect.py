"""Prefect tasks of SFT data collection: thin wrappers that call rubricem_core and own the Parquet I/O.

Caching is by Parquet: a task whose output partition exists returns without recomputing, so a
retried flow run (CLI or the Prefect UI's retry) resumes from the last completed round.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pyarrow as pa
from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE
from prefect.states import State

from rubricem_core.config import RunConfig
from rubricem_core.environment import policy_system_prompt
from rubricem_core.faults import fault_point
from rubricem_core.filtering import filter_trace
from rubricem_core.llm.endpoints import endpoint_for
from rubricem_core.llm.types import ChatResult, RetryStats
from rubricem_core.progress import Progress
from rubricem_core.schemas import (
    SFT_TRAJECTORIES_SCHEMA,
    TEACHER_REFLECTIONS_SCHEMA,
    TEACHER_REQUESTS_SCHEMA,
    TEACHER_RESPONSES_SCHEMA,
)
from rubricem_core.splits import sft_queries
from rubricem_core.store import RunStore, atomic_write_text, cached_task_metrics, save_task_metrics
from rubricem_core.teacher.endpoint import run_round
from rubricem_core.teacher.reflections import reflection_requests, reflection_row, reflection_sources, reflection_stats
from rubricem_core.teacher.rounds import (
    TEACHER_ERROR,
    TrajectoryState,
    apply_result,
    build_requests,
    initial_states,
    tool_outputs,
)
from tasks.inputs import search_env
from tasks.readback import parquet_task, read_back
from tasks.secrets import resolve_api_key


def _round_key(round_index: int) -> dict[str, int]:
    return {"round": round_index}


def load_states(store: RunStore, cfg: RunConfig, upto_round: int) -> list[TrajectoryState]:
    """Initial states (rebuilt from `queries`) overlaid with each completed round's updates."""
    queries = sft_queries(store.read_rows("queries"), cfg.data.sft_split)
    system = policy_system_prompt(cfg.policy.prompt_style)
    states = {s.trajectory_id: s for s in initial_states(queries, cfg.teacher.trajectories_per_query, cfg.seed, system)}
    for r in range(upto_round + 1):
        if not store.has("teacher_state", _round_key(r)):
            break
        for row in store.read_rows("teacher_state", _round_key(r)):
            states[row["trajectory_id"]] = TrajectoryState.from_row(row)
    return list(states.values())


def batch_marker(store: RunStore, name: str, what: str, n_requests: int) -> tuple[Path, str | None, Any]:
    """A crash after submitting a batch must re-attach to it, not pay for it twice: the marker file
    ``state/<name>.json``, the batch id it holds (None: nothing submitted yet) and the callback that writes it."""
    marker = store.layout.batch_marker(name)
    resume_batch_id = json.loads(marker.read_text())["batch_id"] if marker.exists() else None

    def on_submitted(batch_id: str) -> None:
        atomic_write_text(marker, json.dumps({"batch_id": batch_id, "submitted_at": time.time()}))
        get_run_logger().info("%s: batch %s submitted with %d requests", what, batch_id, n_requests)

    return marker, resume_batch_id, on_submitted


ROUND_METRICS_TASK = "teacher-round"  # state/…/teacher-round-NNNN.json: a round's llm_* metrics


class TeacherRoundError(RuntimeError):
    """Too many of a round's teacher requests failed to go on with it."""


def _answered(store: RunStore, round_index: int) -> dict[str, ChatResult]:
    """The ok responses of a round a previous attempt wrote but did not finish."""
    if not store.has("teacher_responses", _round_key(round_index)):
        return {}
    return {
        r["request_id"]: ChatResult(
            custom_id=r["request_id"],
            status="ok",
            text=r["response"],
            finish_reason=r["finish_reason"],
            prompt_tokens=r["prompt_tokens"] or 0,
            completion_tokens=r["completion_tokens"] or 0,
            cost_usd=r["cost_usd"] or 0.0,
            attempts=r["attempts"] or 0,
            latency_s=r["latency_s"] or 0.0,
            batch_id=r["batch_id"],
        )
        for r in store.read_rows("teacher_responses", _round_key(round_index))
        if r["status"] == "ok"
    }


@parquet_task(name="teacher-round", task_run_name="teacher-round-{round_index}", retries=1, retry_delay_seconds=2)
def teacher_round(run_dir: str, cfg: RunConfig, round_index: int) -> dict[str, Any] | State:
    """One teacher round over all unfinished trajectories.

    Writes requests, responses, then state: the state partition is written last and marks the round
    complete, so a crash anywhere before it reruns the whole round (re-attaching to its batch).
    """
    log = get_run_logger()
    store = RunStore(run_dir)
    if store.has("teacher_state", _round_key(round_index)):
        states = load_states(store, cfg, round_index)
        unfinished = sum(not s.finished for s in states)
        log.info("round %d already complete (cached Parquet); %d unfinished", round_index, unfinished)
        # the round's figures come from its Parquet, so a resumed run reports the same totals
        resp = (
            store.read_rows("teacher_responses", _round_key(round_index))
            if store.has("teacher_responses", _round_key(round_index))
            else []
        )
        figures = {
            "round": round_index,
            "cached": True,
            "unfinished": unfinished,
            "requests": len(resp),
            "failed": sum(r["status"] != "ok" for r in resp),
            "prompt_tokens": sum(r["prompt_tokens"] or 0 for r in resp),
            "completion_tokens": sum(r["completion_tokens"] or 0 for r in resp),
            "cost_usd": sum(r["cost_usd"] or 0.0 for r in resp),
            **cached_task_metrics(store, ROUND_METRICS_TASK, round_index),  # retries, 429s, waits
        }
        return read_back(figures, store.partition_path("teacher_state", _round_key(round_index)).parent, run_dir)

    states = load_states(store, cfg, round_index - 1)
    active = [s for s in states if not s.finished]
    tcfg = cfg.teacher
    settings = endpoint_for(tcfg, api_key=resolve_api_key(tcfg), max_tool_calls=cfg.tools.max_tool_calls)
    requests = build_requests(active, round_index, tcfg.model, tcfg.max_tokens, tcfg.temperature)
    if not requests:
        return {"round": round_index, "cached": False, "unfinished": 0, "requests": 0}

    marker, resume_batch_id, on_submitted = batch_marker(
        store, f"teacher_round_{round_index:04d}", f"round {round_index}", len(requests)
    )

    submitted_at = pa.scalar(time.time_ns() // 1000, type=pa.timestamp("us", tz="UTC")).as_py()
    # A rerun of a round that failed: its answered requests are in `teacher_responses` (paid for once)
    answered = _answered(store, round_index)
    to_send = [r for r in requests if r.custom_id not in answered]
    on_result = Progress(f"round {round_index}: teacher responses", len(to_send), log.info).tick
    log.info(
        "round %d: %d requests (%s mode, model %s)%s",
        round_index,
        len(to_send),
        tcfg.mode,
        tcfg.model,
        f", {len(answered)} answered before" if answered else "",
    )
    retry_stats = RetryStats()  # how hard the endpoint pushed back: metrics teacher/llm_*
    results = (
        run_round(to_send, tcfg, settings, resume_batch_id, on_submitted, on_result, retry_stats) if to_send else []
    )
    results += [answered[r.custom_id] for r in requests if r.custom_id in answered]
    by_id = {r.custom_id: r for r in results}
    missing = [r.custom_id for r in requests if r.custom_id not in by_id]
    if missing:
        raise RuntimeError(f"round {round_index}: provider returned no result for {missing[:5]} ({len(missing)} total)")

    env = search_env(run_dir, cfg)
    for state in active:  # a round resumed in another process: web search ids of earlier rounds stay browsable
        for output in tool_outputs(state):
            env.observe(output)
    by_traj = {s.trajectory_id: s for s in active}
    for req in requests:
        state = by_traj[req.metadata["trajectory_id"]]
        apply_result(
            state,
            by_id[req.custom_id],
            lambda call: env.execute(call).text,
            round_index,
            tcfg.max_rounds,
            cfg.tools.max_tool_calls,
        )

    req_rows, resp_rows = [], []
    for req in requests:
        res = by_id[req.custom_id]
        tid = req.metadata["trajectory_id"]
        req_rows.append(
            dict(
                request_id=req.custom_id,
                trajectory_id=tid,
                query_id=by_traj[tid].query_id,
                round=round_index,
                model=req.model,
                mode=tcfg.mode,
                batch_id=res.batch_id,
                status=res.status,
                n_messages=len(req.messages),
                last_message=req.messages[-1]["content"],
                submitted_at=submitted_at,
            )
        )
        resp_rows.append(
            dict(
                request_id=req.custom_id,
                trajectory_id=tid,
                query_id=by_traj[tid].query_id,
                round=round_index,
                model=req.model,
                status=res.status,
                response=res.text,
                error=res.error,
                finish_reason=res.finish_reason,
                prompt_tokens=res.prompt_tokens,
                completion_tokens=res.completion_tokens,
                cost_usd=res.cost_usd,
                attempts=res.attempts,
                latency_s=res.latency_s,
                batch_id=res.batch_id,
            )
        )
    store.write_table("teacher_requests", req_rows, _round_key(round_index), schema=TEACHER_REQUESTS_SCHEMA)
    store.write_table("teacher_responses", resp_rows, _round_key(round_index), schema=TEACHER_RESPONSES_SCHEMA)
    failed_rows = [r for r in resp_rows if r["status"] != "ok"]
    if failed_rows and len(resp_rows) - len(failed_rows) < tcfg.min_ok_fraction * len(resp_rows):
        # Not done: no state for this round. The rerun sends only these requests again.
        marker.unlink(missing_ok=True)  # that batch is over; re-attaching would only return the same failures
        first = "; ".join(f"{r['request_id']}: {r['error']}" for r in failed_rows[:3])
        raise TeacherRoundError(
            f"round {round_index}: {len(failed_rows)} of {len(resp_rows)} teacher requests failed "
            f"(teacher.min_ok_fraction={tcfg.min_ok_fraction}); fix the endpoint ({tcfg.model}) and rerun: only the "
            f"failed requests are sent again. First errors: {first}"
        )
    # before the state, which marks the round done: a rerun that skips the round still reports them
    save_task_metrics(store, ROUND_METRICS_TASK, round_index, retry_stats.retry_metrics(""))
    state_rows = [dict(s.to_row(), round=round_index) for s in active]
    store.write_table("teacher_state", state_rows, _round_key(round_index))
    fault_point("collect.round_written")
    marker.unlink(missing_ok=True)

    failed = sum(r.status != "ok" for r in results)
    unfinished = sum(not s.finished for s in load_states(store, cfg, round_index))
    log.info(
        "round %d done: %d requests, %d failed, %d trajectories still unfinished; %d retries, %d rate-limited "
        "answers, %.1fs waited",
        round_index,
        len(requests),
        failed,
        unfinished,
        retry_stats.retries,
        retry_stats.rate_limited,
        retry_stats.wait_s,
    )
    return {
        "round": round_index,
        "cached": False,
        "requests": len(requests),
        "failed": failed,
        "unfinished": unfinished,
        "prompt_tokens": sum(r.prompt_tokens or 0 for r in results),
        "completion_tokens": sum(r.completion_tokens or 0 for r in results),
        "cost_usd": sum(r.cost_usd or 0.0 for r in results),
        **retry_stats.retry_metrics(""),
    }


@task(name="filter-trajectories", task_run_name="filter-trajectories", cache_policy=NO_CACHE)
def filter_trajectories(run_dir: str, cfg: RunConfig, last_round: int) -> dict[str, Any]:
    """Rejection filtering of every trajectory → `sft_trajectories` (accepted and rejected rows)."""
    log = get_run_logger()
    store = RunStore(run_dir)
    states = load_states(store, cfg, last_round)
    rows = []
    for s in states:
        if not s.finished:  # rounds ran out in the flow: the trace never reached an answer
            s.finish_reason = "max_rounds"
        decision = filter_trace(
            s.text,
            s.n_tool_calls,
            s.finish_reason,
            min_tool_calls=cfg.filter.min_tool_calls,
            require_grounding=cfg.filter.require_grounding,
            allowed_violations=cfg.filter.allowed_violations,
            max_tool_calls=cfg.tools.max_tool_calls,
        )
        rows.append(
            dict(
                trajectory_id=s.trajectory_id,
                query_id=s.query_id,
                accepted=decision.accepted,
                reject_reasons=decision.reject_reasons,
                reject_details=decision.details,
                n_tool_calls=s.n_tool_calls,
                n_rounds=s.n_rounds,
                finish_reason=s.finish_reason,
                text=s.text,
                messages=json.dumps(s.messages, ensure_ascii=False),
                model=cfg.teacher.model,
                prompt_tokens=s.prompt_tokens,
                completion_tokens=s.completion_tokens,
                cost_usd=s.cost_usd,
            )
        )
    store.write_table("sft_trajectories", rows, schema=SFT_TRAJECTORIES_SCHEMA)
    accepted = sum(r["accepted"] for r in rows)
    reasons: dict[str, int] = {}
    for r in rows:
        for code in r["reject_reasons"]:
            reasons[code] = reasons.get(code, 0) + 1
    log.info(
        "filtered %d trajectories: %d accepted, %d rejected %s", len(rows), accepted, len(rows) - accepted, reasons
    )
    errors = [s for s in states if s.finish_reason == TEACHER_ERROR]
    if not accepted and errors:
        raise TeacherRoundError(
            f"no trajectory was accepted: {len(errors)} of {len(rows)} ended in a teacher error (first: "
            f"{errors[0].trajectory_id}: {errors[0].error}); see teacher_responses.error"
        )
    return {
        "trajectories": len(rows),
        "accepted": accepted,
        "acceptance_rate": accepted / len(rows) if rows else 0.0,
        "reject_reasons": reasons,
        "mean_tool_calls": sum(r["n_tool_calls"] for r in rows) / len(rows) if rows else 0.0,
        "cost_usd": sum(r["cost_usd"] for r in rows),
        "path": str(Path(store.table_dir("sft_trajectories"))),
    }


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
    old = (
        {r["request_id"]: r for r in store.read_rows("teacher_reflections")}
        if store.files("teacher_reflections")
        else {}
    )
    accepted = [r for r in store.read_rows("sft_trajectories") if r["accepted"]]
    questions = {q["query_id"]: q["question"] for q in store.read_rows("queries")}
    tcfg = cfg.teacher
    every = reflection_requests(
        reflection_sources(accepted, tcfg.reflection_prefixes, cfg.seed),
        questions,
        tcfg.model,
        tcfg.max_tokens,
        tcfg.temperature,
        cfg.reflection.max_trajectory_chars,
        cfg.reflection.max_trajectory_tokens,
        _policy_tokenizer(run_dir, cfg, log),
    )
    requests = [req for req in every if req.custom_id not in old or old[req.custom_id]["status"] != "ok"]
    if not requests:
        stats = reflection_stats([old[r.custom_id] for r in every])
        log.info(
            "teacher reflections already written (cached Parquet): %d valid of %d",
            stats["reflections_valid"],
            stats["reflections"],
        )
        return read_back({**stats, "cached": True}, store.table_dir("teacher_reflections"), run_dir)
    settings = endpoint_for(tcfg, api_key=resolve_api_key(tcfg), max_tool_calls=cfg.tools.max_tool_calls)
    marker, resume_batch_id, on_submitted = batch_marker(store, "teacher_reflections", "reflections", len(requests))

    log.info("reflections: %d requests (%s mode, model %s)", len(requests), tcfg.mode, tcfg.model)
    on_result = Progress("reflections: teacher responses", len(requests), log.info).tick
    results = {r.custom_id: r for r in run_round(requests, tcfg, settings, resume_batch_id, on_submitted, on_result)}
    missing = [r.custom_id for r in requests if r.custom_id not in results]
    if missing:
        raise RuntimeError(f"reflections: provider returned no result for {missing[:5]} ({len(missing)} total)")
    for req in requests:
        old[req.custom_id] = reflection_row(
            req, results[req.custom_id], questions[req.metadata["query_id"]], cfg.reflection.validity
        )
    rows = [old[req.custom_id] for req in every]  # one order: the sources'
    store.write_table("teacher_reflections", rows, schema=TEACHER_REFLECTIONS_SCHEMA)
    marker.unlink(missing_ok=True)
    stats = reflection_stats(rows)
    log.info(
        "reflections: %d valid of %d, %d failed calls, rejected %s",
        stats["reflections_valid"],
        stats["reflections"],
        stats["reflections_failed"],
        stats["reflection_reject_codes"],
    )
    return {**stats, "cached": False}
