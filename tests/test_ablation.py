"""The `ablation` flow: recipes from one SFT checkpoint with matched budgets, evaluation, table and plot.

Tested on `baseline` and `ss_grpo` (the reflection recipes are refused by the rl flow until the
reflection loop is wired in). The "SFT" policy is a random-init tiny model, as in test_evaluate_flow.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rubricem_core.config import load_config
from rubricem_core.sql import run_sql
from rubricem_core.store import RunStore
from tests.flow_overrides import FLOW_TINY

pytestmark = pytest.mark.slow  # runs flows end to end; `make test-fast` leaves it out

SMALL = {
    **FLOW_TINY,
    "data.world.n_queries": 10,
    "data.world.eval_fraction": 0.2,
    "rollout.group_size": 2,
    "rl.window": 1,
    "rl.n_windows": 1,
    "rl.queries_per_step": 1,
}


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory, prefect_harness):
    from tests.untrained_run import write_untrained_run

    run = tmp_path_factory.mktemp("ablation") / "run"
    write_untrained_run(load_config("tiny", SMALL), run)
    return str(run)


def test_ablation_trains_each_recipe_with_the_same_budget_and_tabulates(run_dir, monkeypatch):
    from flows.ablation import ablation

    overrides = {**SMALL, "rl.eval_every": 1}  # learning curves: every step's checkpoint evaluated
    result = ablation(
        run_dir=run_dir, profile="tiny", overrides=overrides, recipes=["baseline", "ss_grpo"], benchmarks=["synthetic"]
    )
    assert result["budget"] == {"rl_steps": 2, "queries_per_step": 1, "group_size": 2}
    rows = RunStore(run_dir).read_rows("ablation")
    assert [(r["recipe"], r["checkpoint"]) for r in rows] == [
        ("sft", "sft"),
        ("baseline", "rl-step-000000"),
        ("baseline", "rl-step-000001"),
        ("ss_grpo", "rl-step-000000"),
        ("ss_grpo", "rl-step-000001"),
    ]
    assert [r["rl_steps"] for r in rows] == [0, 2, 2, 2, 2]
    assert all(r["benchmark"] == "synthetic" and 0.0 <= r["score_mean"] <= 1.0 and r["n_samples"] == 2 for r in rows)
    assert [r["checkpoint"] for r in result["final"]] == ["sft", "rl-step-000001", "rl-step-000001"]
    assert Path(result["curve_plot"]).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    subs = {recipe: RunStore(Path(run_dir) / "ablation" / recipe) for recipe in ("baseline", "ss_grpo")}
    schedules = {}
    for recipe, store in subs.items():
        assert store.partitions("rollouts", "step") == [0, 1]
        rollouts = store.read_rows("rollouts")
        schedules[recipe] = sorted({(r["step"], r["query_id"]) for r in rollouts})
        assert len(rollouts) == 2 * 1 * 2  # steps × queries × group
        assert (store.run_dir / "checkpoints" / "rl" / "step-000001" / "checkpoint.json").exists()
        assert store.has("eval_results", {}, "rl-step-000001--synthetic--none")
    assert schedules["baseline"] == schedules["ss_grpo"]  # matched budgets: the same queries at every step
    # the recipes differ where they should: the baseline judges the answer stage only
    stages = {
        recipe: {r["stage"] for r in store.read_rows("judge_rubrics") if r["origin"] == "adaptive"}
        for recipe, store in subs.items()
    }
    assert stages["baseline"] <= {"answer"}
    assert RunStore(run_dir).has("eval_results", {}, "sft--synthetic--none")

    plot = Path(result["plot"])
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    logged = json.loads(run_sql(run_dir, "SELECT name, step FROM metrics WHERE flow = 'ablation'", fmt="json"))
    assert sorted((m["name"], m["step"]) for m in logged) == [  # one series per recipe, by policy updates
        ("ablation/baseline/synthetic/score_mean", 1),
        ("ablation/baseline/synthetic/score_mean", 2),
        ("ablation/sft/synthetic/score_mean", 0),
        ("ablation/ss_grpo/synthetic/score_mean", 1),
        ("ablation/ss_grpo/synthetic/score_mean", 2),
    ]

    # a rerun trains and samples nothing: RL resumes after its last step, evaluations are read back
    import flows.rl
    import rubricem_core.eval.benchmark

    def refuse(*args, **kwargs):
        raise AssertionError("finished work was redone")

    monkeypatch.setattr(flows.rl, "rl_step", refuse)
    monkeypatch.setattr(rubricem_core.eval.benchmark, "run_eval", refuse)
    again = ablation(
        run_dir=run_dir, profile="tiny", overrides=overrides, recipes=["baseline", "ss_grpo"], benchmarks=["synthetic"]
    )
    assert [r["score_mean"] for r in again["rows"]] == [r["score_mean"] for r in rows]


def test_unknown_recipes_are_refused_before_any_training(run_dir):
    from flows.ablation import ablation

    with pytest.raises(ValueError, match="grpo_plus"):
        ablation(run_dir=run_dir, profile="tiny", overrides=SMALL, recipes=["baseline", "grpo_plus"])
    assert not (Path(run_dir) / "ablation" / "grpo_plus").exists()
