"""The recipe ablation's table, bar plot and learning curves (pure functions; the `ablation` flow does
the runs).

A row per (recipe, benchmark, evaluated checkpoint): the evaluation summary of a recipe's RL checkpoint,
with the RL budget it had (steps, queries per step, group size), so a table whose budgets differ is
visible as such. Without rl.eval_every only the final checkpoint is evaluated; with it, every curve
checkpoint too (the final one last). The SFT policy the recipes start from is the ``sft`` reference row.
"""

from __future__ import annotations

import io
from collections.abc import Sequence
from typing import Any

from matplotlib.figure import Figure

from rubricem_core import schemas
from rubricem_core.eval.checkpoints import checkpoint_updates
from rubricem_core.schemas import nan_to_none

ABLATION_SCHEMA = schemas.ABLATION_SCHEMA  # defined in schemas; the ablation flow imports it from here


def ablation_rows(
    recipe: str, evaluation: dict[str, Any], budget: dict[str, int], run_dir: str
) -> list[dict[str, Any]]:
    """Table rows from one `evaluate` flow result (its ``benchmarks`` summaries)."""
    rows = []
    for benchmark, summary in evaluation["benchmarks"].items():
        rows.append(
            {
                "recipe": recipe,
                "benchmark": benchmark,
                "retrieval": evaluation["retrieval"],
                "checkpoint": evaluation["tag"],
                "score_mean": _num(summary["score_mean"]),
                "n_samples": int(summary["n_samples"]),
                "grade_failed": int(summary["grade_failed"]),
                "valid_scaffold_rate": _num(summary["valid_scaffold_rate"]),
                "rl_steps": budget["rl_steps"],
                "queries_per_step": budget["queries_per_step"],
                "group_size": budget["group_size"],
                "run_dir": run_dir,
            }
        )
    return rows


def _num(value: float | None) -> float | None:
    """A summary figure for the table: NaN (nothing to average) → NULL."""
    value = nan_to_none(value)
    return None if value is None else float(value)


def final_rows(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each (recipe, benchmark)'s row of its most trained checkpoint (the final one of a recipe)."""
    final: dict[tuple[str, str], dict[str, Any]] = {}
    for row in rows:
        key = (row["recipe"], row["benchmark"])
        if key not in final or checkpoint_updates(row["checkpoint"]) >= checkpoint_updates(final[key]["checkpoint"]):
            final[key] = row
    return list(final.values())


def ablation_plot(rows: Sequence[dict[str, Any]], title: str = "Recipe ablation") -> bytes:
    """PNG bytes: grouped bars, one group per benchmark, one bar per recipe at its final checkpoint
    (missing scores drawn as 0)."""
    rows = final_rows(rows)
    benchmarks = list(dict.fromkeys(r["benchmark"] for r in rows))
    recipes = list(dict.fromkeys(r["recipe"] for r in rows))
    if not benchmarks:
        raise ValueError("ablation_plot: no rows to plot")
    score = {(r["recipe"], r["benchmark"]): r["score_mean"] for r in rows}
    fig = Figure(figsize=(max(4.0, 1.6 * len(benchmarks) * max(1, len(recipes)) / 2), 3.6), dpi=100)
    ax = fig.add_subplot(1, 1, 1)
    width = 0.8 / len(recipes)
    for i, recipe in enumerate(recipes):
        xs = [b + (i - (len(recipes) - 1) / 2) * width for b in range(len(benchmarks))]
        ys = [score.get((recipe, bench)) or 0.0 for bench in benchmarks]
        ax.bar(xs, ys, width=width, label=recipe.replace("$", r"\$"))
    ax.set_xticks(range(len(benchmarks)), [b.replace("$", r"\$") for b in benchmarks])
    ax.set_ylim(0, 1)
    ax.set_ylabel("mean score")
    ax.set_title(title)
    ax.legend(fontsize="small")
    fig.tight_layout()
    out = io.BytesIO()
    fig.savefig(out, format="png")
    return out.getvalue()


def curve_points(rows: Sequence[dict[str, Any]], recipe: str, benchmark: str) -> list[tuple[int, float]]:
    """(policy updates, score) of one recipe's curve on one benchmark, starting from the SFT reference."""
    points = {
        checkpoint_updates(r["checkpoint"]): r["score_mean"]
        for r in rows
        if r["benchmark"] == benchmark and r["recipe"] in (recipe, "sft") and r["score_mean"] is not None
    }
    return sorted(points.items())


def ablation_curve_plot(rows: Sequence[dict[str, Any]], title: str = "Learning curves") -> bytes:
    """PNG bytes: one panel per benchmark, score against RL steps (policy updates; SFT at 0), a line per
    recipe (every recipe's line starts at the SFT reference)."""
    benchmarks = list(dict.fromkeys(r["benchmark"] for r in rows))
    recipes = [r for r in dict.fromkeys(row["recipe"] for row in rows) if r != "sft"]
    if not benchmarks or not recipes:
        raise ValueError("ablation_curve_plot: no recipe rows to plot")
    fig = Figure(figsize=(max(4.0, 3.6 * len(benchmarks)), 3.4), dpi=100)
    for index, benchmark in enumerate(benchmarks, 1):
        ax = fig.add_subplot(1, len(benchmarks), index)
        for recipe in recipes:
            points = curve_points(rows, recipe, benchmark)
            if points:
                ax.plot(*zip(*points), marker="o", markersize=3, label=recipe.replace("$", r"\$"))
        ax.set_title(benchmark.replace("$", r"\$"), fontsize=10)
        ax.set_xlabel("RL steps (policy updates)")
        ax.set_ylabel("mean score")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize="small")
    fig.suptitle(title)
    fig.tight_layout()
    out = io.BytesIO()
    fig.savefig(out, format="png")
    return out.getvalue()
