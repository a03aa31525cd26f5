"""SFT data collection without Prefect (rubricem_core.teacher.collection): a teacher round over a run's
tables, its cached figures, a rerun that sends only the unanswered requests, the round's failure rule,
rejection filtering, and the teacher's reflections."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest

from rubricem_core.config import RunConfig, load_config
from rubricem_core.environment import local_tool_env
from rubricem_core.llm.endpoints import endpoint_for
from rubricem_core.llm.types import EndpointSettings
from rubricem_core.rollout.types import ANSWERED
from rubricem_core.sim.world import generate_world
from rubricem_core.store import RunStore
from rubricem_core.teacher.collection import (
    TeacherRound,
    answered_before,
    ask_teacher_reflections,
    cached_round_figures,
    filter_states,
    load_states,
    round_failure,
    round_key,
    run_teacher_round,
)
from rubricem_core.teacher.rounds import TEACHER_ERROR

SMALL = {
    "data.world.n_documents": 80,
    "data.world.n_queries": 6,
    "data.world.eval_fraction": 0.0,
    "teacher.trajectories_per_query": 2,
    "teacher.max_rounds": 3,
}
LOG = logging.getLogger(__name__)
# a teacher that answers nothing: a request sent to it comes back failed
DEAD = {"teacher.model": "openai/unreachable", "teacher.api_base": "http://127.0.0.1:9", "teacher.max_retries": 0}


def _run(tmp_path: Path, **overrides: Any) -> tuple[RunStore, RunConfig]:
    cfg = load_config("tiny", {**SMALL, **overrides})
    world = generate_world(cfg.data.world)
    store = RunStore(tmp_path / "run")
    store.write_table("queries", world.queries_table())
    store.write_table("corpus", world.corpus_table())
    return store, cfg


def _round(store: RunStore, cfg: RunConfig, r: int) -> TeacherRound | None:
    settings = endpoint_for(cfg.teacher, api_key="k", max_tool_calls=cfg.tools.max_tool_calls)
    env = lambda: local_tool_env(store.read_table("corpus"), cfg.tools)  # noqa: E731
    return run_teacher_round(store, cfg, r, settings, env, LOG.info)


def _teacher(overrides: dict[str, Any]) -> dict[str, Any]:
    return {k.removeprefix("teacher."): v for k, v in overrides.items()}


def _write(store: RunStore, done: TeacherRound, with_state: bool = True) -> None:
    key = round_key(done.round_index)
    store.write_table("teacher_requests", done.request_rows, key)
    store.write_table("teacher_responses", done.response_rows, key)
    if with_state:
        store.write_table("teacher_state", done.state_rows, key)


def test_rounds_run_until_every_trajectory_ends_and_cached_figures_match(tmp_path: Path) -> None:
    store, cfg = _run(tmp_path)
    n = len(load_states(store, cfg, -1))
    assert n == 12  # 6 queries × 2 trajectories, all in the sft split of tiny's collection
    r, asked = 0, []
    while (done := _round(store, cfg, r)) is not None:
        assert done.failure is None and len(done.request_rows) == len(done.response_rows) == len(done.state_rows)
        assert {row["round"] for row in done.state_rows} == {r}
        _write(store, done)
        fresh = done.figures()
        cached = cached_round_figures(store, cfg, r)
        for k in ("requests", "failed", "unfinished", "prompt_tokens", "completion_tokens"):
            assert cached[k] == fresh[k], k
        assert cached["cost_usd"] == pytest.approx(fresh["cost_usd"]) and cached["cached"] and not fresh["cached"]
        asked.append(fresh["requests"])
        r += 1
    assert asked[0] == n and asked == sorted(asked, reverse=True) and r <= cfg.teacher.max_rounds
    states = load_states(store, cfg, r - 1)
    assert all(s.finished for s in states) and done is None


def test_a_rerun_of_a_written_round_sends_only_what_was_not_answered(tmp_path: Path) -> None:
    store, cfg = _run(tmp_path)
    first = _round(store, cfg, 0)
    assert first is not None
    _write(store, first, with_state=False)  # the attempt died before its state: the round is not done
    assert set(answered_before(store, 0)) == {row["request_id"] for row in first.response_rows}
    dead = cfg.model_copy(update={"teacher": cfg.teacher.model_copy(update=_teacher(DEAD))})
    again = _round(store, dead, 0)  # anything sent now would come back failed
    assert again is not None and again.failure is None
    keep = ("request_id", "status", "response", "prompt_tokens", "completion_tokens")
    assert [{k: row[k] for k in keep} for row in again.response_rows] == [
        {k: row[k] for k in keep} for row in first.response_rows
    ]
    assert again.state_rows == first.state_rows and again.retry_stats.retries == 0


@pytest.mark.parametrize(
    ("statuses", "min_ok", "fails"),
    [(["ok", "ok", "error"], 0.5, False), (["ok", "error", "error"], 0.5, True), (["ok", "error"], 1.0, True)],
)
def test_a_round_fails_below_the_ok_fraction(statuses: list[str], min_ok: float, fails: bool) -> None:
    rows = [
        {"request_id": f"t{i}:r00", "status": s, "error": None if s == "ok" else "503"} for i, s in enumerate(statuses)
    ]
    failure = round_failure(rows, 0, min_ok, "m")
    assert (failure is not None) == fails
    if failure is not None:
        bad = statuses.count("error")
        assert f"round 0: {bad} of {len(statuses)} teacher requests failed" in str(failure) and "t1:r00: 503" in str(
            failure
        )
    assert round_failure([{"request_id": "a", "status": "ok", "error": None}], 0, 1.0, "m") is None


def test_a_round_against_a_dead_endpoint_fails_and_filtering_says_why(tmp_path: Path) -> None:
    store, cfg = _run(tmp_path, **DEAD)
    done = _round(store, cfg, 0)
    assert done is not None and done.failure is not None
    assert "12 of 12 teacher requests failed" in str(done.failure)
    states = load_states(store, cfg, -1)
    for state, row in zip(states, done.state_rows):
        state.finished, state.finish_reason, state.error = row["finished"], row["finish_reason"], row["error"]
    filtered = filter_states(states, cfg)
    assert filtered.summary["accepted"] == 0 and {r["finish_reason"] for r in filtered.rows} == {TEACHER_ERROR}
    assert filtered.failure is not None and "no trajectory was accepted: 12 of 12" in str(filtered.failure)


def test_filtering_accepts_answered_traces_and_ends_the_unfinished_at_max_rounds(tmp_path: Path) -> None:
    store, cfg = _run(tmp_path, **{"teacher.max_rounds": 12})
    r = 0
    while (done := _round(store, cfg, r)) is not None:
        _write(store, done)
        r += 1
    filtered = filter_states(load_states(store, cfg, r - 1), cfg)
    s = filtered.summary
    assert s["trajectories"] == 12 and s["accepted"] == sum(row["accepted"] for row in filtered.rows) > 0
    assert s["acceptance_rate"] == s["accepted"] / 12 and filtered.failure is None
    assert all(row["finish_reason"] == ANSWERED for row in filtered.rows if row["accepted"])
    assert sum(s["reject_reasons"].values()) >= 12 - s["accepted"]
    # a trace the flow ran out of rounds on is rejected as max_rounds
    unfinished = load_states(store, cfg, -1)  # nothing answered yet
    cut = filter_states(unfinished[:2], cfg)
    assert [row["finish_reason"] for row in cut.rows] == ["max_rounds"] * 2 and cut.summary["accepted"] == 0
    assert cut.failure is None  # rejected, but not because the teacher failed


def test_teacher_reflections_are_asked_once_and_reasked_only_when_failed(tmp_path: Path) -> None:
    store, cfg = _run(tmp_path, **{"teacher.max_rounds": 12, "teacher.reflection_prefixes": 1})
    r = 0
    while (done := _round(store, cfg, r)) is not None:
        _write(store, done)
        r += 1
    filtered = filter_states(load_states(store, cfg, r - 1), cfg)
    store.write_table("sft_trajectories", filtered.rows)
    resolved: list[int] = []

    def settings() -> EndpointSettings:
        resolved.append(1)
        return endpoint_for(cfg.teacher, max_tool_calls=cfg.tools.max_tool_calls)

    asked = ask_teacher_reflections(store, cfg, None, settings, LOG.info)
    assert asked.rows is not None and len(asked.rows) == 2 * filtered.summary["accepted"]  # whole + one prefix
    assert asked.stats["reflections"] == len(asked.rows) and asked.stats["reflections_failed"] == 0
    assert asked.stats["reflections_valid"] > 0 and resolved == [1] and asked.marker is not None
    store.write_table("teacher_reflections", asked.rows)
    again = ask_teacher_reflections(store, cfg, None, settings, LOG.info)
    assert again.rows is None and again.stats == asked.stats and resolved == [1]  # no endpoint needed
    # a row whose call failed is asked again, the others are kept as they are
    failed = [dict(asked.rows[0], status="error", error="503"), *asked.rows[1:]]
    store.write_table("teacher_reflections", failed)
    third = ask_teacher_reflections(store, cfg, None, settings, LOG.info)
    assert third.rows == asked.rows and resolved == [1, 1]
