"""rl.eval_every: which RL checkpoints make the learning curve, that they are written and never pruned,
that `eval_results` names their step, and the plots that draw the curve (the report's and the ablation's)."""

from __future__ import annotations

import io
from pathlib import Path

import pytest
from matplotlib.image import imread

from rubricem_core.config import load_config
from rubricem_core.eval.ablation import ablation_curve_plot, ablation_plot, curve_points, final_rows
from rubricem_core.eval.checkpoints import checkpoint_step, checkpoint_updates
from rubricem_core.eval.grading import result_rows, ungraded_row
from rubricem_core.report.data import RunData
from rubricem_core.report.plots import plot_eval_curve
from rubricem_core.rl.progress import (
    checkpoint_due,
    curve_checkpoints,
    curve_steps,
    last_step,
    prune_checkpoints,
    step_checkpoint,
)
from rubricem_core.store import RunStore


def tiny(**overrides: object):
    # 2 · window · n_windows steps: 8 with window 2 and 2 windows
    return load_config("tiny", {"rl.window": 2, "rl.n_windows": 2, **overrides})


@pytest.mark.parametrize(
    "every, expected", [(None, []), (1, list(range(8))), (2, [1, 3, 5, 7]), (3, [2, 5, 7]), (20, [7])]
)
def test_curve_steps_are_every_nth_step_and_the_last(every, expected):
    cfg = tiny(**{"rl.eval_every": every})
    assert last_step(cfg) == 7
    assert curve_steps(cfg) == expected


def test_curve_steps_write_a_checkpoint_whatever_checkpoint_every_says():
    cfg = tiny(**{"rl.eval_every": 3, "rl.checkpoint_every": 4})
    assert [s for s in range(8) if checkpoint_due(cfg, s)] == [2, 3, 5, 7]
    assert [s for s in range(8) if checkpoint_due(tiny(**{"rl.checkpoint_every": 4}), s)] == [3, 7]


def test_pruning_keeps_the_newest_and_every_curve_checkpoint(tmp_path: Path):
    run_dir = str(tmp_path / "run")
    for step in range(8):
        step_checkpoint(RunStore(run_dir), step).mkdir(parents=True)
        (step_checkpoint(RunStore(run_dir), step) / "checkpoint.json").write_text("{}")
    cfg = tiny(**{"rl.eval_every": 2})
    prune_checkpoints(RunStore(run_dir), keep=2, curve=curve_steps(cfg))
    left = sorted(int(p.name.removeprefix("step-")) for p in step_checkpoint(RunStore(run_dir), 0).parent.iterdir())
    assert left == [1, 3, 5, 6, 7]
    assert curve_checkpoints(RunStore(run_dir), cfg) == [step_checkpoint(RunStore(run_dir), s) for s in (1, 3, 5, 7)]
    prune_checkpoints(RunStore(run_dir), keep=2)  # without a curve: the newest two only
    assert sorted(p.name for p in step_checkpoint(RunStore(run_dir), 0).parent.iterdir()) == [
        "step-000006",
        "step-000007",
    ]


@pytest.mark.parametrize("tag, step, updates", [("sft", None, 0), ("rl-step-000003", 3, 4), ("other-1a2b", None, 0)])
def test_eval_rows_name_the_checkpoint_step(tag, step, updates):
    assert checkpoint_step(tag) == step and checkpoint_updates(tag) == updates
    assert ungraded_row(tag, "synthetic", "none", "q1", ("no_reference", "x"), "g")["step"] == step
    assert result_rows(tag, "synthetic", "none", [], [], "g", []) == []


def _rows(scores: dict[tuple[str, str], float]) -> list[dict]:
    return [
        {"recipe": recipe, "benchmark": "synthetic", "checkpoint": tag, "score_mean": score}
        for (recipe, tag), score in scores.items()
    ]


def test_ablation_curves_start_at_sft_and_the_bars_take_the_final_checkpoint():
    rows = _rows(
        {
            ("sft", "sft"): 0.2,
            ("full", "rl-step-000001"): 0.3,
            ("full", "rl-step-000003"): 0.5,
            ("ss_grpo", "rl-step-000001"): 0.25,
            ("ss_grpo", "rl-step-000003"): 0.4,
        }
    )
    assert curve_points(rows, "full", "synthetic") == [(0, 0.2), (2, 0.3), (4, 0.5)]
    final = {(r["recipe"], r["checkpoint"]) for r in final_rows(rows)}
    assert final == {("sft", "sft"), ("full", "rl-step-000003"), ("ss_grpo", "rl-step-000003")}
    for png in (ablation_curve_plot(rows), ablation_plot(rows)):
        assert imread(io.BytesIO(png), format="png").shape[0] > 100
    with pytest.raises(ValueError, match="no recipe rows"):
        ablation_curve_plot(_rows({("sft", "sft"): 0.2}))


def _eval_rows(tag: str, scores: list[float]) -> list[dict]:
    return [
        {
            "checkpoint": tag,
            "step": checkpoint_step(tag),
            "benchmark": "synthetic",
            "query_id": f"q{i}",
            "retrieval": "none",
            "details": "{}",
            "score": s,
            "grade_failed": False,
        }
        for i, s in enumerate(scores)
    ]


def test_the_report_draws_the_curve_from_two_checkpoints_on(tmp_path: Path):
    run_dir = tmp_path / "run"
    store = RunStore(run_dir)
    store.write_table("eval_results", _eval_rows("rl-step-000003", [0.5, 0.7]), part="final")
    with RunData(run_dir) as data:
        assert plot_eval_curve(data, tmp_path / "one.png") is None  # one checkpoint: no curve
    store.write_table("eval_results", _eval_rows("sft", [0.1, 0.3]), part="sft")
    store.write_table("eval_results", _eval_rows("rl-step-000001", [0.3, 0.5]), part="s1")
    with RunData(run_dir) as data:
        png = plot_eval_curve(data, tmp_path / "curve.png")
        points = data.rows("SELECT step, avg(score) AS mean FROM eval_results GROUP BY step ORDER BY step NULLS FIRST")
    assert png is not None and imread(png).shape[0] > 100
    assert [(r["step"], round(r["mean"], 3)) for r in points] == [(None, 0.2), (1, 0.4), (3, 0.6)]


def test_an_evaluate_flow_run_is_named_by_its_checkpoint(tmp_path: Path, monkeypatch):
    import prefect.runtime.flow_run as flow_run

    from flows.evaluate import evaluate_run_name

    run_dir = str(tmp_path / "run")
    monkeypatch.setattr(flow_run, "parameters", {"run_dir": run_dir, "checkpoint": None}, raising=False)
    assert evaluate_run_name() == f"evaluate · {run_dir}"
    checkpoint = str(step_checkpoint(RunStore(run_dir), 3))
    monkeypatch.setattr(flow_run, "parameters", {"run_dir": run_dir, "checkpoint": checkpoint}, raising=False)
    assert evaluate_run_name() == f"evaluate · {run_dir} · rl-step-000003"
