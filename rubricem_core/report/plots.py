"""The report's plots: one function per plot, each reading the run's tables through DuckDB.

Every function takes a :class:`RunData` and an output path, writes one PNG and returns its path,
or returns ``None`` without writing anything when its table is absent or empty (the report then
lists the plot as "no data"). Figures are built on ``matplotlib.figure.Figure`` directly, which
renders with Agg and never touches pyplot's global state or the process-wide backend.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from rubricem_core.eval.checkpoints import checkpoint_updates
from rubricem_core.report.data import STAGES, RunData
from rubricem_core.report.sections import eval_graded
from rubricem_core.store import atomic_write_bytes

STAGE_COLORS = {"plan": "#4C72B0", "research": "#55A868", "review": "#8172B2", "answer": "#DD8452"}
STAGE_MARKERS = {"plan": "o", "research": "s", "review": "^", "answer": "D"}  # tells apart lines that coincide
PALETTE = ("#4C72B0", "#DD8452", "#55A868", "#C44E52", "#8172B2", "#937860", "#DA8BC3", "#8C8C8C")
DPI = 110


# ---- figure plumbing -------------------------------------------------------------------------
def _figure(ncols: int, title: str) -> tuple[Figure, list[Axes]]:
    fig = Figure(figsize=(4.2 * ncols + 0.6, 3.6), dpi=DPI, layout="constrained")
    axes = fig.subplots(1, ncols, squeeze=False)[0].tolist()
    fig.suptitle(title, fontsize=12, fontweight="bold")
    for ax in axes:
        ax.grid(True, alpha=0.3, linewidth=0.6)
        ax.spines[["top", "right"]].set_visible(False)
        ax.tick_params(labelsize=8.5)
    return fig, axes


def _steps_axis(ax: Axes, steps: list[int], label: str = "RL step") -> None:
    ax.set_xlabel(label, fontsize=9)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    if steps:  # fixed margins: room for bars at the ends, and a lone point gets a readable axis
        low, high = min(steps), max(steps)
        pad = 1.0 if low == high else max(0.5, 0.03 * (high - low))
        ax.set_xlim(low - pad, high + pad)


def _label(text: object) -> str:
    """Text from the run as a literal label: a '$' pair would otherwise start matplotlib's math mode."""
    return str(text).replace("$", r"\$")


def _legend(ax: Axes, **kwargs: object) -> None:
    """A legend only when something was drawn with a label (an empty legend warns and shows a box)."""
    if ax.get_legend_handles_labels()[1]:
        ax.legend(fontsize=7.5, frameon=False, **kwargs)


def _save(fig: Figure, path: Path) -> Path:
    import io

    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=DPI)
    atomic_write_bytes(path, buffer.getvalue())
    return path


# ---- plots ------------------------------------------------------------------------------------
def plot_stage_rewards(data: RunData, path: Path) -> Path | None:
    """Mean stage reward R per RL step (band: ± one standard deviation over rollouts)."""
    if not data.has("stage_rewards", "step", "stage", "R"):
        return None
    rows = data.rows(
        "SELECT step, stage, avg(R) AS mean, stddev_pop(R) AS sd, count(R) AS n FROM stage_rewards "
        "WHERE R IS NOT NULL AND NOT isnan(R) GROUP BY step, stage ORDER BY step"
    )
    if not rows:
        return None
    fig, (ax,) = _figure(1, "Stage rewards per step")
    all_steps = sorted({int(r["step"]) for r in rows})
    for stage in STAGES:
        points = [r for r in rows if r["stage"] == stage]
        if not points:
            continue
        steps = [int(r["step"]) for r in points]
        mean = [float(r["mean"]) for r in points]
        sd = [float(r["sd"] or 0.0) for r in points]
        color = STAGE_COLORS[stage]
        ax.plot(steps, mean, marker=STAGE_MARKERS[stage], markersize=4.5, color=color, label=stage, linewidth=1.6)
        ax.fill_between(
            steps,
            [m - s for m, s in zip(mean, sd)],
            [m + s for m, s in zip(mean, sd)],
            color=color,
            alpha=0.12,
            linewidth=0,
        )
    ax.set_ylim(-0.03, 1.03)
    ax.set_ylabel("mean R (0–1)", fontsize=9)
    _steps_axis(ax, all_steps)
    ax.legend(
        fontsize=8.5, loc="center left", bbox_to_anchor=(1.01, 0.5), frameon=False
    )  # outside: R near 1 stays visible
    missing = [s for s in STAGES if not any(r["stage"] == s for r in rows)]
    if missing:
        ax.set_title("no rubrics (R is null): " + ", ".join(missing), fontsize=8.5, color="#666666")
    return _save(fig, path)


def plot_buffer_size(data: RunData, path: Path) -> Path | None:
    """Rubric buffer per step: active rubrics per query and stage, and rubrics pruned at the step."""
    if not data.has("judge_rubrics", "step", "query_id", "stage", "status"):
        return None
    active = data.rows(
        "SELECT step, stage, count(*) FILTER (WHERE status = 'active') / count(DISTINCT query_id) AS per_query "
        "FROM judge_rubrics GROUP BY step, stage ORDER BY step"
    )
    if not active:
        return None
    pruned_at = "pruned_step = step" if "pruned_step" in data.columns("judge_rubrics") else "TRUE"
    pruned = data.rows(
        f"SELECT step, stage, count(*) AS n FROM judge_rubrics WHERE status = 'pruned' AND {pruned_at} "
        "GROUP BY step, stage ORDER BY step"
    )
    steps = sorted({int(r["step"]) for r in active})
    fig, (left, right) = _figure(2, "Rubric buffer")
    for stage in STAGES:
        points = [r for r in active if r["stage"] == stage]
        if points:
            left.plot(
                [int(r["step"]) for r in points],
                [float(r["per_query"]) for r in points],
                marker=STAGE_MARKERS[stage],
                markersize=4.5,
                color=STAGE_COLORS[stage],
                label=stage,
                linewidth=1.6,
            )
    left.set_title("active rubrics per query", fontsize=10)
    left.set_ylim(bottom=0)
    left.yaxis.set_major_locator(MaxNLocator(integer=True))
    left.legend(fontsize=8, frameon=False)
    _steps_axis(left, steps)
    bottom = {s: 0.0 for s in steps}
    for stage in STAGES:
        counts = {int(r["step"]): float(r["n"]) for r in pruned if r["stage"] == stage}
        if not counts:
            continue
        heights = [counts.get(s, 0.0) for s in steps]
        right.bar(steps, heights, bottom=[bottom[s] for s in steps], color=STAGE_COLORS[stage], label=stage, width=0.6)
        for s, h in zip(steps, heights):
            bottom[s] += h
    right.set_title("rubrics pruned at the step (all queries)", fontsize=10)
    right.yaxis.set_major_locator(MaxNLocator(integer=True))
    right.set_ylim(0, max(1.0, max(bottom.values())) * 1.4)  # headroom for the legend
    if pruned:
        right.legend(fontsize=8, frameon=False)
    else:
        right.text(0.5, 0.5, "nothing pruned", transform=right.transAxes, ha="center", va="center", color="#777777")
    _steps_axis(right, steps)
    return _save(fig, path)


def plot_judge_cost(data: RunData, path: Path) -> Path | None:
    """Judge traffic per RL step: calls, tokens and cost (rubric judge, plus the reflection judge if any)."""
    judge = data.metric_series("judge/", flow="rl")
    reflection = data.metric_series("reflection_judge/", flow="rl")
    if not judge and not reflection:
        return None
    steps = sorted({s for series in (*judge.values(), *reflection.values()) for s in series})

    def values(series: dict[str, dict[int, float]], name: str) -> list[float]:
        points = series.get(name, {})
        return [points.get(s, 0.0) for s in steps]

    fig, (calls_ax, tokens_ax, cost_ax) = _figure(3, "Judge calls, tokens and cost")
    stacks = [
        ("rubric generation", values(judge, "judge/generate_calls"), PALETTE[0]),
        ("trajectory scoring", values(judge, "judge/score_calls"), PALETTE[1]),
        ("reflection judge", values(reflection, "reflection_judge/calls"), PALETTE[4]),
    ]
    _stacked_bars(calls_ax, steps, stacks)
    failed = values(judge, "judge/failed_trajectories")
    totals = [sum(stack[1][i] for stack in stacks) for i in range(len(steps))]
    for step, n, top in zip(steps, failed, totals):
        if n:  # failed judgments are excluded from the update: flag them above the step's bar
            calls_ax.annotate(
                f"{n:g} failed",
                (step, top),
                xytext=(0, 3),
                textcoords="offset points",
                ha="center",
                fontsize=7.5,
                color=PALETTE[3],
                fontweight="bold",
            )
    calls_ax.set_title("calls", fontsize=10)
    _legend(calls_ax)

    prompt = [
        a + b
        for a, b in zip(values(judge, "judge/prompt_tokens"), values(reflection, "reflection_judge/prompt_tokens"))
    ]
    completion = [
        a + b
        for a, b in zip(
            values(judge, "judge/completion_tokens"), values(reflection, "reflection_judge/completion_tokens")
        )
    ]
    _stacked_bars(tokens_ax, steps, [("prompt", prompt, PALETTE[2]), ("completion", completion, PALETTE[5])])
    tokens_ax.set_title("tokens", fontsize=10)
    _legend(tokens_ax)

    cost = [a + b for a, b in zip(values(judge, "judge/cost_usd"), values(reflection, "reflection_judge/cost_usd"))]
    cost_ax.bar(steps, cost, color=PALETTE[3], width=0.6, label="per step")
    running, cumulative = 0.0, []
    for c in cost:
        running += c
        cumulative.append(running)
    cost_ax.plot(steps, cumulative, marker="o", markersize=4, color="#333333", linewidth=1.4, label="cumulative")
    cost_ax.set_title(f"cost (USD), total ${running:,.4f}", fontsize=10)
    cost_ax.set_ylim(0, max(cumulative) * 1.3 if running > 0 else 1.0)
    _legend(cost_ax)
    if running == 0:
        cost_ax.text(
            0.5,
            0.5,
            "$0: no priced judge calls",
            transform=cost_ax.transAxes,
            ha="center",
            va="center",
            color="#777777",
        )
    for ax in (calls_ax, tokens_ax, cost_ax):
        _steps_axis(ax, steps)
    return _save(fig, path)


def _stacked_bars(ax: Axes, steps: list[int], stacks: list[tuple[str, list[float], str]]) -> None:
    bottom = [0.0] * len(steps)
    for label, heights, color in stacks:
        if not any(heights):
            continue
        ax.bar(steps, heights, bottom=bottom, color=color, label=label, width=0.6)
        bottom = [b + h for b, h in zip(bottom, heights)]
    ax.set_ylim(0, max(1.0, max(bottom, default=0.0)) * 1.4)  # headroom for the legend


def plot_reflection_acceptance(data: RunData, path: Path) -> Path | None:
    """Reflection candidates per step: valid fraction, acceptance rate, mean judge score."""
    if not data.has("reflections", "step", "query_id", "valid", "score", "accepted"):
        return None
    # acceptance is per source trajectory (the best candidate of each); older rows name only the query
    source = "source_rollout_id" if "source_rollout_id" in data.columns("reflections") else "query_id"
    rows = data.rows(
        "SELECT step, count(*) AS candidates, avg(valid::DOUBLE) AS valid_rate, "
        f"count(DISTINCT {source}) AS sources, count(*) FILTER (WHERE accepted) AS accepted, "
        "avg(score) FILTER (WHERE valid) AS mean_score, avg(score) FILTER (WHERE accepted) AS accepted_score "
        "FROM reflections GROUP BY step ORDER BY step"
    )
    if not rows:
        return None
    steps = [int(r["step"]) for r in rows]
    fig, (rates, scores) = _figure(2, "Reflection candidates")
    rates.plot(
        steps,
        [float(r["valid_rate"]) for r in rows],
        marker="o",
        markersize=4,
        color=PALETTE[0],
        label="valid candidates",
    )
    rates.plot(
        steps,
        [r["accepted"] / r["sources"] for r in rows],
        marker="s",
        markersize=4,
        color=PALETTE[2],
        label="sources with an accepted reflection",
    )
    rates.set_ylim(-0.03, 1.03)
    rates.set_title("fractions", fontsize=10)
    _legend(rates)
    for key, label, color, marker in (
        ("mean_score", "valid candidates", PALETTE[1], "o"),
        ("accepted_score", "accepted", PALETTE[3], "s"),
    ):
        points = [(s, float(r[key])) for s, r in zip(steps, rows) if r[key] is not None and not math.isnan(r[key])]
        if points:
            scores.plot(
                [p[0] for p in points], [p[1] for p in points], marker=marker, markersize=4, color=color, label=label
            )
    scores.set_title("mean judge score", fontsize=10)
    _legend(scores)
    for ax in (rates, scores):
        _steps_axis(ax, steps)
    return _save(fig, path)


def plot_eval_scores(data: RunData, path: Path) -> Path | None:
    """Mean evaluation score per benchmark, one bar per (checkpoint, retrieval); error bar: standard error."""
    if not data.has("eval_results", "benchmark", "score"):
        return None
    cols = data.columns("eval_results")
    checkpoint = "coalesce(CAST(checkpoint AS VARCHAR), '')" if "checkpoint" in cols else "''"
    retrieval = "coalesce(CAST(retrieval AS VARCHAR), '')" if "retrieval" in cols else "''"
    rows = data.rows(
        f"SELECT benchmark, {checkpoint} AS checkpoint, {retrieval} AS retrieval, avg(score) AS mean, "
        f"stddev_samp(score) AS sd, count(score) AS n FROM eval_results WHERE score IS NOT NULL AND {eval_graded(data)} "
        "GROUP BY ALL ORDER BY benchmark, checkpoint, retrieval"
    )
    if not rows:
        return None
    benchmarks = list(dict.fromkeys(r["benchmark"] for r in rows))
    series = list(dict.fromkeys((r["checkpoint"], r["retrieval"]) for r in rows))
    fig = Figure(
        figsize=(max(5.0, 1.2 + 1.1 * len(benchmarks) * max(1, len(series)) ** 0.6), 3.8), dpi=DPI, layout="constrained"
    )
    ax = fig.subplots()
    fig.suptitle("Evaluation scores", fontsize=12, fontweight="bold")
    ax.grid(True, axis="y", alpha=0.3, linewidth=0.6)
    ax.spines[["top", "right"]].set_visible(False)
    width = 0.8 / len(series)
    top = 0.0
    for i, key in enumerate(series):
        xs, means, errors = [], [], []
        for j, bench in enumerate(benchmarks):
            match = [r for r in rows if r["benchmark"] == bench and (r["checkpoint"], r["retrieval"]) == key]
            if not match:
                continue
            r = match[0]
            se = float(r["sd"]) / math.sqrt(r["n"]) if r["sd"] is not None and r["n"] > 1 else 0.0
            xs.append(j - 0.4 + width * (i + 0.5))
            means.append(float(r["mean"]))
            errors.append(se)
        label = _label(" · ".join(part for part in key if part) or "score")
        bars = ax.bar(
            xs,
            means,
            width=width * 0.92,
            yerr=errors,
            capsize=3,
            color=PALETTE[i % len(PALETTE)],
            label=label,
            error_kw={"linewidth": 0.8},
        )
        # inside the bar: above it the error bar would cross the number
        ax.bar_label(
            bars,
            labels=[f"{m:.2f}" for m in means],
            fontsize=7.5,
            label_type="center",
            color="white",
            fontweight="bold",
        )
        top = max(top, max(m + e for m, e in zip(means, errors)))
    long_names = any(len(str(b)) > 14 for b in benchmarks)
    ax.set_xticks(
        range(len(benchmarks)),
        [_label(b) for b in benchmarks],
        fontsize=8.5,
        rotation=20 if long_names else 0,
        ha="right" if long_names else "center",
    )
    ax.set_ylabel("mean score", fontsize=9)
    ax.set_ylim(min(0.0, min(float(r["mean"]) for r in rows)), max(1.0, top) * 1.12)
    if len(series) > 1 or series[0] != ("", ""):
        ax.legend(fontsize=7.5, frameon=False, ncols=min(3, len(series)), loc="upper left")
    return _save(fig, path)


def plot_eval_curve(data: RunData, path: Path) -> Path | None:
    """The learning curve (rl.eval_every): mean evaluation score against policy updates (SFT 0, RL step N
    → N + 1), a line per (benchmark, retrieval), error bars the standard error; None with fewer than two
    evaluated checkpoints of this run."""
    if not data.has("eval_results", "benchmark", "score", "checkpoint"):
        return None
    retrieval = "coalesce(CAST(retrieval AS VARCHAR), '')" if "retrieval" in data.columns("eval_results") else "''"
    rows = data.rows(
        f"SELECT benchmark, {retrieval} AS retrieval, CAST(checkpoint AS VARCHAR) AS checkpoint, avg(score) AS mean, "
        f"stddev_samp(score) AS sd, count(score) AS n FROM eval_results WHERE score IS NOT NULL AND {eval_graded(data)} "
        "AND (checkpoint = 'sft' OR regexp_matches(checkpoint, '^rl-step-[0-9]+$')) GROUP BY ALL"
    )
    for r in rows:
        r["updates"] = checkpoint_updates(r["checkpoint"])
    if len({r["updates"] for r in rows}) < 2:
        return None
    fig, (ax,) = _figure(1, "Learning curve")
    for i, key in enumerate(dict.fromkeys((r["benchmark"], r["retrieval"]) for r in rows)):
        points = sorted((r["updates"], r) for r in rows if (r["benchmark"], r["retrieval"]) == key)
        xs = [x for x, _ in points]
        means = [float(r["mean"]) for _, r in points]
        errors = [float(r["sd"]) / math.sqrt(r["n"]) if r["sd"] is not None and r["n"] > 1 else 0.0 for _, r in points]
        ax.errorbar(
            xs,
            means,
            yerr=errors,
            color=PALETTE[i % len(PALETTE)],
            marker="o",
            markersize=3,
            linewidth=1.4,
            capsize=3,
            label=_label(" · ".join(part for part in key if part)),
        )
    ax.set_ylabel("mean score", fontsize=9)
    ax.set_ylim(min(0.0, *(float(r["mean"]) for r in rows)), max(1.0, *(float(r["mean"]) for r in rows)) * 1.05)
    _steps_axis(ax, sorted({r["updates"] for r in rows}), "RL steps (policy updates; SFT = 0)")
    _legend(ax)
    return _save(fig, path)


def plot_sft_loss(data: RunData, path: Path) -> Path | None:
    """SFT training loss per optimizer step, and the per-stage NLL."""
    series = data.metric_series("sft/", flow="sft")
    loss = series.get("sft/loss")
    if not loss:
        return None
    fig, (total, stages) = _figure(2, "SFT loss")
    steps = sorted(loss)
    total.plot(steps, [loss[s] for s in steps], color=PALETTE[0], linewidth=1.6, marker="o", markersize=2.5)
    total.set_title("token-mean loss", fontsize=10)
    _steps_axis(total, steps, "optimizer step")
    drawn = False
    for stage in STAGES:
        nll = series.get(f"sft/nll/{stage}")
        if nll:
            xs = sorted(nll)
            stages.plot(xs, [nll[s] for s in xs], color=STAGE_COLORS[stage], linewidth=1.4, label=stage)
            drawn = True
    stages.set_title("NLL per stage", fontsize=10)
    if drawn:
        stages.legend(fontsize=8, frameon=False)
    else:
        stages.text(
            0.5, 0.5, "no per-stage NLL logged", transform=stages.transAxes, ha="center", va="center", color="#777777"
        )
    _steps_axis(stages, steps, "optimizer step")
    return _save(fig, path)


def plot_rl_update(data: RunData, path: Path) -> Path | None:
    """The policy update per RL step: its loss, the KL to the reference policy and the clipped share."""
    series = data.metric_series("rl/", flow="rl")
    panels = [
        (n, t)
        for n, t in (("rl/loss", "loss"), ("rl/kl", "KL to the reference"), ("rl/clip_fraction", "clip fraction"))
        if series.get(n)
    ]
    if not panels:
        return None
    fig, axes = _figure(len(panels), "RL update")
    for i, (ax, (name, title)) in enumerate(zip(axes, panels, strict=True)):
        points = series[name]
        steps = sorted(points)
        ax.plot(steps, [points[s] for s in steps], color=PALETTE[i], linewidth=1.6, marker="o", markersize=3)
        ax.set_title(title, fontsize=10)
        _steps_axis(ax, steps)
    return _save(fig, path)


class PlotSpec(NamedTuple):
    name: str  # file stem and MLflow artifact name
    title: str
    source: str  # what the plot reads, shown next to "no data"
    fn: Callable[[RunData, Path], Path | None]


PLOTS: tuple[PlotSpec, ...] = (
    PlotSpec("eval_curve", "Learning curve", "table eval_results (SFT and rl.eval_every checkpoints)", plot_eval_curve),
    PlotSpec("stage_rewards", "Stage rewards per step", "table stage_rewards", plot_stage_rewards),
    PlotSpec(
        "rl_update",
        "RL update: loss, KL, clipping",
        "metrics rl/loss, rl/kl, rl/clip_fraction (flow rl)",
        plot_rl_update,
    ),
    PlotSpec("buffer_size", "Rubric buffer", "table judge_rubrics", plot_buffer_size),
    PlotSpec(
        "judge_cost", "Judge calls, tokens and cost", "metrics judge/*, reflection_judge/* (flow rl)", plot_judge_cost
    ),
    PlotSpec("reflection_acceptance", "Reflection acceptance", "table reflections", plot_reflection_acceptance),
    PlotSpec("eval_scores", "Evaluation scores", "table eval_results", plot_eval_scores),
    PlotSpec("sft_loss", "SFT loss", "metrics sft/loss, sft/nll/* (flow sft)", plot_sft_loss),
)


def make_plots(data: RunData, out_dir: Path) -> dict[str, Path | None]:
    """Write every plot into ``out_dir``; ``None`` marks a plot without data."""
    out_dir = Path(out_dir)
    out: dict[str, Path | None] = {}
    for spec in PLOTS:
        target = out_dir / f"{spec.name}.png"
        target.unlink(missing_ok=True)  # a stale PNG from an earlier report must not pass for this run's
        out[spec.name] = spec.fn(data, target)
    return out
