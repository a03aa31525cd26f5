"""`evaluate --retrieval cross` after a real `rl` run with the reflection loop: evaluation finds the bank RL
saved and searches it with the embedder RL built it with (here hashing:64, not the 256-dim fallback).
The run uses reflection.within_source: window, so its replay step also checks that the session hands
the bank the right window step. About a minute (SFT + two RL steps of the tiny policy); the
loader-level checks are in tests/test_eval_bank.py, the window/best ones in test_reflection_bank_within.py."""

from __future__ import annotations

import json

import pytest

from rubricem_core.reflection.bank import bank_dir, saved_bank_info
from rubricem_core.sql import run_sql
from rubricem_core.store import RunStore
from tests.rl_runs import forced_reflections, rl_with_reflections, sft_run  # noqa: F401  (module fixtures)

pytestmark = pytest.mark.slow  # runs flows end to end; `make test-fast` leaves it out

# one new-query step and its replay
RL = {"rl.window": 1, "reflection.embedder": "hashing:64", "reflection.within_source": "window"}


def test_evaluate_cross_after_rl_uses_the_bank_rl_saved(sft_run, tmp_path, forced_reflections):
    from flows.evaluate import evaluate

    run_dir = rl_with_reflections(sft_run, tmp_path / "rl", forced_reflections, **RL)
    assert saved_bank_info(bank_dir(run_dir)).embedder == "hashing:64"
    store = RunStore(run_dir)
    banked = {r["query_id"] for r in store.read_rows("bank")}
    assert banked and {r["step"] for r in store.read_rows("bank")} == {0}  # step 0's accepted reflections
    # the replay (step 1) retrieves what window 0's new-query step (step 0) wrote for each query
    replay = [r for r in store.read_rows("rollouts") if r["step"] == 1]
    assert {r["query_id"] for r in replay} == banked and all(r["guidance"] for r in replay)
    hits = json.loads(
        run_sql(
            run_dir,
            "SELECT name, value FROM metrics WHERE flow = 'rl' AND step = 1 AND name LIKE 'retrieval/within_%'",
            fmt="json",
        )
    )
    assert {m["name"]: m["value"] for m in hits} == {"retrieval/within_hits": len(banked), "retrieval/within_misses": 0}

    result = evaluate(
        run_dir=run_dir,
        overrides={"tracking.enabled": False, "eval.max_queries": 2},
        benchmarks=["synthetic"],
        retrieval="cross",
    )
    assert result["tag"] == "rl-step-000001"
    assert result["benchmarks"]["synthetic"]["guided_rate"] == pytest.approx(
        1.0
    )  # held-out: other queries' reflections
    rows = store.read_rows("eval_results")
    assert rows and all(r["retrieval"] == "cross" and r["guidance"] for r in rows)

    # the paper's test-time reuse through the flow: trial 1 (cross), a reflection on it, trial 2 guided by it
    result = evaluate(
        run_dir=run_dir,
        overrides={"tracking.enabled": False, "eval.max_queries": 2},
        benchmarks=["synthetic"],
        retrieval="sequential",
    )
    summary = result["benchmarks"]["synthetic"]
    assert result["retrieval"] == "sequential" and "trial1/score_mean" in summary
    trials = {r["retrieval"] for r in store.read_rows("eval_results")}
    assert {"sequential-1", "sequential-2"} <= trials
