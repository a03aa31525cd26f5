"""The reflection loop left alone (no forced candidates): the teacher's reflections warm the bank before
RL, so step 0's cross-episode retrieval finds guidance; the policy's own candidates go through the
judge and the reflections table unforced."""

from __future__ import annotations

import json
import shutil

import pytest

from rubricem_core.sql import run_sql
from rubricem_core.store import RunStore
from rubricem_core.testing import MICRO_PROFILE
from tests.rl_runs import RL_RUN, sft_run  # noqa: F401  (module fixture)

pytestmark = pytest.mark.slow  # runs flows end to end; `make test-fast` leaves it out

UNFORCED = {**RL_RUN, "rl.recipe": "full", "reflection.n_candidates": 2, "reflection.max_new_tokens": 64}


def _rl(sft_run, dst, **extra) -> str:
    from flows.rl import rl

    shutil.copytree(sft_run, dst)
    rl(run_dir=str(dst), profile=MICRO_PROFILE, overrides={**UNFORCED, **extra})
    return str(dst)


@pytest.mark.parametrize("warm", [True, False])
def test_teacher_reflections_warm_the_bank_and_step_0_retrieves_them(sft_run, tmp_path, warm):
    run = _rl(sft_run, tmp_path / "run", **{"reflection.warm_bank": warm})
    store = RunStore(run)
    valid = {r["query_id"] for r in store.read_rows("teacher_reflections") if r["valid"]}
    assert valid, "the collection wrote teacher reflections"
    bank = store.read_rows("bank")
    warm_rows = [r for r in bank if r["step"] == -1]
    step0 = [r for r in store.read_rows("rollouts", {"step": 0})]
    hits = json.loads(
        run_sql(run, "SELECT value FROM metrics WHERE name = 'retrieval/cross_hits' AND step = 0", fmt="json")
    )
    if warm:
        # every train query with a valid teacher reflection, unless the policy's own replaced it
        assert {r["query_id"] for r in warm_rows} | {r["query_id"] for r in bank if r["step"] >= 0} >= valid
        assert warm_rows and hits[0]["value"] > 0 and any(r["guidance"] for r in step0)
    else:
        assert not warm_rows and hits[0]["value"] == 0 and not any(r["guidance"] for r in step0)
    # the unforced candidates were judged and recorded (valid or not) with their codes
    cands = store.read_rows("reflections", {"step": 0})
    assert cands and all(r["valid"] == (not r["codes"]) for r in cands)
