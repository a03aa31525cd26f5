"""The recipe ablation's table and bar plot (pure functions; the `ablation` flow does the runs).

A row per (recipe, benchmark): the evaluation summary of the recipe's final RL checkpoint, with the
RL budget it had (steps, queries per step, group size), so a table whose budgets differ is visible
as such. The SFT policy the recipes start from is the ``sft`` reference row.
"""

from __future__ import annotations

import io
from collections.abc import Sequence
from typing import Any

from matplotlib.figure import Figure

from rubricem_core import schemas
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


def ablation_plot(rows: Sequence[dict[str, Any]], title: str = "Recipe ablation") -> bytes:
    """PNG bytes: grouped bars, one group per benchmark, one bar per recipe (missing scores drawn as 0)."""
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
