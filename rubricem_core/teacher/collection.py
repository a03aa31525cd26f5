"""SFT data collection over a run's tables: one teacher round, rejection filtering, and the teacher's
reflections, as plain functions of a `RunStore` and the `RunConfig`.

The Prefect tasks (tasks/collect.py) resolve the endpoint, the tool environment and the logger, call
one of these, and write the rows it returns. Caching is by Parquet: the `teacher_state` partition of
a round is written last and marks the round complete, so a crash anywhere before it reruns the whole
round — re-attaching to its submitted batch (``batch_marker``) and sending only the requests that
were not answered yet (``answered_before``).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa

from rubricem_core.config import RunConfig
from rubricem_core.environment import policy_system_prompt, trace_format
from rubricem_core.filtering import filter_trace
from rubricem_core.llm.concurrent import run_concurrent
from rubricem_core.llm.types import ChatRequest, ChatResult, EndpointSettings, RetryStats
from rubricem_core.progress import Progress
from rubricem_core.splits import sft_queries
from rubricem_core.store import RunStore, atomic_write_text, cached_task_metrics
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
from rubricem_core.tools.base import ToolEnv

ROUND_METRICS_TASK = "teacher-round"  # state/…/teacher-round-NNNN.json: a round's llm_* metrics

Info = Callable[..., None]  # a logger's ``info``: ``info(msg, *args)``


class TeacherRoundError(RuntimeError):
    """Too many of a round's teacher requests failed to go on with it."""


def round_key(round_index: int) -> dict[str, int]:
    """The partition of a round in the teacher tables."""
    return {"round": round_index}


def load_states(store: RunStore, cfg: RunConfig, upto_round: int) -> list[TrajectoryState]:
    """Initial states (rebuilt from `queries`) overlaid with each completed round's updates."""
    queries = sft_queries(store.read_rows("queries"), cfg.data.sft_split)
    system = policy_system_prompt(cfg.policy.prompt_style)
    states = {s.trajectory_id: s for s in initial_states(queries, cfg.teacher.trajectories_per_query, cfg.seed, system)}
    for r in range(upto_round + 1):
        if not store.has("teacher_state", round_key(r)):
            break
        for row in store.read_rows("teacher_state", round_key(r)):
            states[row["trajectory_id"]] = TrajectoryState.from_row(row)
    return list(states.values())


def batch_marker(
    store: RunStore, name: str, what: str, n_requests: int, info: Info
) -> tuple[Path, str | None, Callable[[str], None]]:
    """A crash after submitting a batch must re-attach to it, not pay for it twice: the marker file
    ``state/<name>.json``, the batch id it holds (None: nothing submitted yet) and the callback that writes it."""
    marker = store.layout.batch_marker(name)
    resume_batch_id = json.loads(marker.read_text())["batch_id"] if marker.exists() else None

    def on_submitted(batch_id: str) -> None:
        atomic_write_text(marker, json.dumps({"batch_id": batch_id, "submitted_at": time.time()}))
        info("%s: batch %s submitted with %d requests", what, batch_id, n_requests)

    return marker, resume_batch_id, on_submitted


def answered_before(store: RunStore, round_index: int) -> dict[str, ChatResult]:
    """The ok responses of a round a previous attempt wrote but did not finish."""
    if not store.has("teacher_responses", round_key(round_index)):
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
        for r in store.read_rows("teacher_responses", round_key(round_index))
        if r["status"] == "ok"
    }


def cached_round_figures(store: RunStore, cfg: RunConfig, round_index: int) -> dict[str, Any]:
    """The figures of a completed round, from its Parquet, so a resumed run reports the same totals."""
    unfinished = sum(not s.finished for s in load_states(store, cfg, round_index))
    key = round_key(round_index)
    resp = store.read_rows("teacher_responses", key) if store.has("teacher_responses", key) else []
    return {
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


@dataclass
class TeacherRound:
    """What one teacher round produced: the rows of its three tables, in the order they are written
    (`teacher_requests`, `teacher_responses`, then `teacher_state`, which marks the round done)."""

    round_index: int
    results: list[ChatResult]
    request_rows: list[dict[str, Any]]
    response_rows: list[dict[str, Any]]
    state_rows: list[dict[str, Any]]
    unfinished: int  # trajectories of the whole collection still without an end after this round
    retry_stats: RetryStats  # how hard the endpoint pushed back: metrics teacher/llm_*
    marker: Path  # the round's batch marker, removed once the round is written (or its batch is over)
    failure: TeacherRoundError | None  # too many requests failed: write requests and responses, not the state

    def figures(self) -> dict[str, Any]:
        return {
            "round": self.round_index,
            "cached": False,
            "requests": len(self.request_rows),
            "failed": sum(r.status != "ok" for r in self.results),
            "unfinished": self.unfinished,
            "prompt_tokens": sum(r.prompt_tokens or 0 for r in self.results),
            "completion_tokens": sum(r.completion_tokens or 0 for r in self.results),
            "cost_usd": sum(r.cost_usd or 0.0 for r in self.results),
            **self.retry_stats.retry_metrics(""),
        }


def run_teacher_round(
    store: RunStore,
    cfg: RunConfig,
    round_index: int,
    settings: EndpointSettings,
    make_env: Callable[[], ToolEnv],
    info: Info,
) -> TeacherRound | None:
    """One teacher round over all unfinished trajectories (None: none is left to ask). ``make_env``
    builds the tool environment once the answers are in; ``info`` logs the round's progress."""
    states = load_states(store, cfg, round_index - 1)
    active = [s for s in states if not s.finished]
    tcfg = cfg.teacher
    requests = build_requests(active, round_index, tcfg.model, tcfg.max_tokens, tcfg.temperature)
    if not requests:
        return None
    marker, resume_batch_id, on_submitted = batch_marker(
        store, f"teacher_round_{round_index:04d}", f"round {round_index}", len(requests), info
    )
    submitted_at = pa.scalar(time.time_ns() // 1000, type=pa.timestamp("us", tz="UTC")).as_py()
    # A rerun of a round that failed: its answered requests are in `teacher_responses` (paid for once)
    answered = answered_before(store, round_index)
    to_send = [r for r in requests if r.custom_id not in answered]
    on_result = Progress(f"round {round_index}: teacher responses", len(to_send), info).tick
    info(
        "round %d: %d requests (%s mode, model %s)%s",
        round_index,
        len(to_send),
        tcfg.mode,
        tcfg.model,
        f", {len(answered)} answered before" if answered else "",
    )
    retry_stats = RetryStats()
    results = (
        run_round(to_send, tcfg, settings, resume_batch_id, on_submitted, on_result, retry_stats) if to_send else []
    )
    results += [answered[r.custom_id] for r in requests if r.custom_id in answered]
    by_id = {r.custom_id: r for r in results}
    missing = [r.custom_id for r in requests if r.custom_id not in by_id]
    if missing:
        raise RuntimeError(f"round {round_index}: provider returned no result for {missing[:5]} ({len(missing)} total)")

    by_traj = {s.trajectory_id: s for s in active}
    apply_answers(requests, by_id, by_traj, make_env(), round_index, tcfg.max_rounds, cfg.tools.max_tool_calls)
    req_rows, resp_rows = round_rows(requests, by_id, by_traj, round_index, tcfg.mode, submitted_at)
    return TeacherRound(
        round_index=round_index,
        results=results,
        request_rows=req_rows,
        response_rows=resp_rows,
        state_rows=[dict(s.to_row(), round=round_index) for s in active],
        unfinished=sum(not s.finished for s in states),  # `active` are the same objects, updated in place
        retry_stats=retry_stats,
        marker=marker,
        failure=round_failure(resp_rows, round_index, tcfg.min_ok_fraction, tcfg.model),
    )


def apply_answers(
    requests: Sequence[ChatRequest],
    by_id: dict[str, ChatResult],
    by_traj: dict[str, TrajectoryState],
    env: ToolEnv,
    round_index: int,
    max_rounds: int,
    max_tool_calls: int,
) -> None:
    """Append each answer to its trajectory and run the tool call it ends in (``apply_result``)."""
    # a round resumed in another process: web search ids of earlier rounds stay browsable
    for state in by_traj.values():
        for output in tool_outputs(state):
            env.observe(output)
    for req in requests:
        apply_result(
            by_traj[req.metadata["trajectory_id"]],
            by_id[req.custom_id],
            lambda call: env.execute(call).text,
            round_index,
            max_rounds,
            max_tool_calls,
        )


def run_rounds_in_memory(
    states: Sequence[TrajectoryState],
    settings: EndpointSettings,
    env: ToolEnv,
    max_rounds: int,
    max_tool_calls: int,
) -> None:
    """Every round of ``states`` with concurrent chat calls to ``settings``' endpoint, nothing written:
    the loop of teacher_round without its tables (tests and benches that only need the traces)."""
    for r in range(max_rounds):
        requests = build_requests(list(states), r, settings.model, 2048, 0.7)
        if not requests:
            break
        results = {x.custom_id: x for x in run_concurrent(requests, settings)}
        apply_answers(requests, results, {s.trajectory_id: s for s in states}, env, r, max_rounds, max_tool_calls)


def round_rows(
    requests: Sequence[ChatRequest],
    by_id: dict[str, ChatResult],
    by_traj: dict[str, TrajectoryState],
    round_index: int,
    mode: str,
    submitted_at: Any,
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The `teacher_requests` and `teacher_responses` rows of a round, one of each per request."""
    req_rows: list[dict[str, Any]] = []
    resp_rows: list[dict[str, Any]] = []
    for req in requests:
        res = by_id[req.custom_id]
        tid = req.metadata["trajectory_id"]
        common = dict(
            request_id=req.custom_id,
            trajectory_id=tid,
            query_id=by_traj[tid].query_id,
            round=round_index,
            model=req.model,
        )
        req_rows.append(
            dict(
                common,
                mode=mode,
                batch_id=res.batch_id,
                status=res.status,
                n_messages=len(req.messages),
                last_message=req.messages[-1]["content"],
                submitted_at=submitted_at,
            )
        )
        resp_rows.append(
            dict(
                common,
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
    return req_rows, resp_rows


def round_failure(
    resp_rows: Sequence[dict[str, Any]], round_index: int, min_ok_fraction: float, model: str
) -> TeacherRoundError | None:
    """The error that stops a round when fewer than ``min_ok_fraction`` of its requests were answered;
    the rerun sends only the failed requests again."""
    failed_rows = [r for r in resp_rows if r["status"] != "ok"]
    if not failed_rows or len(resp_rows) - len(failed_rows) >= min_ok_fraction * len(resp_rows):
        return None
    first = "; ".join(f"{r['request_id']}: {r['error']}" for r in failed_rows[:3])
    return TeacherRoundError(
        f"round {round_index}: {len(failed_rows)} of {len(resp_rows)} teacher requests failed "
        f"(teacher.min_ok_fraction={min_ok_fraction}); fix the endpoint ({model}) and rerun: only the "
        f"failed requests are sent again. First errors: {first}"
    )


# ---- rejection filtering ---------------------------------------------------------------------------
@dataclass
class FilteredTrajectories:
    """Every trajectory with its filter decision (the `sft_trajectories` rows) and their summary."""

    rows: list[dict[str, Any]]
    summary: dict[str, Any]
    failure: TeacherRoundError | None  # nothing accepted because the teacher failed: the collection fails


def filter_states(states: Sequence[TrajectoryState], cfg: RunConfig) -> FilteredTrajectories:
    """Rejection filtering of every trajectory (a trace the rounds ran out on ends as ``max_rounds``)."""
    rows: list[dict[str, Any]] = []
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
            trace_format=trace_format(cfg.policy.prompt_style),
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
    accepted = sum(r["accepted"] for r in rows)
    reasons: dict[str, int] = {}
    for r in rows:
        for code in r["reject_reasons"]:
            reasons[code] = reasons.get(code, 0) + 1
    summary = {
        "trajectories": len(rows),
        "accepted": accepted,
        "acceptance_rate": accepted / len(rows) if rows else 0.0,
        "reject_reasons": reasons,
        "mean_tool_calls": sum(r["n_tool_calls"] for r in rows) / len(rows) if rows else 0.0,
        "cost_usd": sum(r["cost_usd"] for r in rows),
    }
    errors = [s for s in states if s.finish_reason == TEACHER_ERROR]
    failure = None
    if not accepted and errors:
        failure = TeacherRoundError(
            f"no trajectory was accepted: {len(errors)} of {len(rows)} ended in a teacher error (first: "
            f"{errors[0].trajectory_id}: {errors[0].error}); see teacher_responses.error"
        )
    return FilteredTrajectories(rows, summary, failure)


# ---- the teacher's reflections ---------------------------------------------------------------------
@dataclass
class TeacherReflections:
    """The `teacher_reflections` rows (None: all were written before, nothing was asked) and their stats."""

    rows: list[dict[str, Any]] | None
    stats: dict[str, Any]
    marker: Path | None  # the batch marker to remove once the rows are written


def ask_teacher_reflections(
    store: RunStore,
    cfg: RunConfig,
    tokenizer: Any,
    settings: Callable[[], EndpointSettings],
    info: Info,
) -> TeacherReflections:
    """The teacher's reflection on every accepted trajectory (one round through the same Batch API /
    concurrent path); asks again only for the rows whose call failed before. ``tokenizer`` is the
    policy's when the prompt is bounded in tokens; ``settings`` resolves the endpoint when a call is due."""
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
        tokenizer,
    )
    requests = [req for req in every if req.custom_id not in old or old[req.custom_id]["status"] != "ok"]
    if not requests:
        return TeacherReflections(None, reflection_stats([old[r.custom_id] for r in every]), None)
    endpoint = settings()
    marker, resume_batch_id, on_submitted = batch_marker(
        store, "teacher_reflections", "reflections", len(requests), info
    )
    info("reflections: %d requests (%s mode, model %s)", len(requests), tcfg.mode, tcfg.model)
    on_result = Progress("reflections: teacher responses", len(requests), info).tick
    results = {r.custom_id: r for r in run_round(requests, tcfg, endpoint, resume_batch_id, on_submitted, on_result)}
    missing = [r.custom_id for r in requests if r.custom_id not in results]
    if missing:
        raise RuntimeError(f"reflections: provider returned no result for {missing[:5]} ({len(missing)} total)")
    for req in requests:
        old[req.custom_id] = reflection_row(
            req, results[req.custom_id], questions[req.metadata["query_id"]], cfg.reflection.validity
        )
    rows = [old[req.custom_id] for req in every]  # one order: the sources'
    return TeacherReflections(rows, reflection_stats(rows), marker)
