"""Markdown summaries of a flow run (the Prefect Artifacts tab shows them; the flows publish them).

Pure functions of the figures a flow already returns, so they are tested without Prefect: SFT data
collection (acceptance and reject codes), SFT, one row per RL step, evaluation per benchmark.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from rubricem_core.tracking import mlflow_ui_command


def cell(value: Any) -> str:
    """A table cell: floats with 4 significant digits, NaN/None as "–", pipes escaped."""
    if value is None:
        return "–"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        if not math.isfinite(value):
            return "–"
        return f"{value:.4g}"
    return str(value).replace("|", "\\|").replace("\n", " ")


def table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def links(
    run_dir: str,
    mlflow_url: str | None,
    mlflow_db: str | None = None,
    label: str = "MLflow run",
    model_link: str | None = None,
) -> str:
    parts = [f'- run directory: `{run_dir}` (tables: `rubricem sql --run-dir {run_dir} "SHOW TABLES"`)']
    if mlflow_url:
        where = f" (start it with `{mlflow_ui_command(mlflow_db)}`)" if mlflow_db else ""
        parts.append(f"- {label}: [{mlflow_url}]({mlflow_url}){where}")
    if model_link:
        parts.append(model_link)
    return "\n".join(parts)


def collection_markdown(
    stats: Mapping[str, Any],
    rounds: int,
    totals: Mapping[str, Any],
    run_dir: str,
    mlflow_url: str | None = None,
    mlflow_db: str | None = None,
) -> str:
    rejected = dict(sorted(stats.get("reject_reasons", {}).items(), key=lambda kv: -kv[1]))
    out = [
        f"# SFT data collection: {stats['accepted']} of {stats['trajectories']} trajectories accepted",
        table(
            ["figure", "value"],
            [
                ["teacher rounds", rounds],
                ["teacher requests", totals.get("requests", 0)],
                ["failed requests", totals.get("failed", 0)],
                ["acceptance rate", float(stats.get("acceptance_rate", float("nan")))],
                ["mean tool calls (accepted)", float(stats.get("mean_tool_calls", float("nan")))],
                ["teacher cost (USD)", float(stats.get("cost_usd", 0.0))],
                *(
                    [["teacher reflections valid", f"{stats['reflections_valid']} of {stats['reflections']}"]]
                    if "reflections" in stats
                    else []
                ),
            ],
        ),
        "## Reject codes",
        table(["code", "trajectories"], list(rejected.items())) if rejected else "none",
    ]
    if stats.get("reflection_reject_codes"):
        out += [
            "## Teacher reflection reject codes",
            table(["code", "reflections"], list(stats["reflection_reject_codes"].items())),
        ]
    out += ["## Links", links(run_dir, mlflow_url, mlflow_db)]
    return "\n\n".join(out) + "\n"


def sft_markdown(
    result: Mapping[str, Any],
    run_dir: str,
    mlflow_url: str | None = None,
    mlflow_db: str | None = None,
    model_link: str | None = None,
) -> str:
    if result.get("cached"):
        body = f"SFT had already finished: `{result['final_dir']}` (nothing trained in this flow run)."
    else:
        body = table(
            ["figure", "value"],
            [
                [k, result[k]]
                for k in (
                    "steps",
                    "trajectories",
                    "reflection_examples",
                    "guided_trajectories",
                    "skipped_too_long",
                    "rejected_rows",
                    "train_tokens",
                    "policy_tokens",
                    "padding_fraction",
                    "final_loss",
                )
                if k in result
            ]
            + [["policy", result["final_dir"]]],
        )
    return (
        "\n\n".join(
            [
                f"# SFT policy: `{result['final_dir']}`",
                body,
                "## Links",
                links(run_dir, mlflow_url, mlflow_db, model_link=model_link),
            ]
        )
        + "\n"
    )


RL_COLUMNS = (  # metric → column header of the RL step table
    ("reward/R/answer_mean", "R answer"),
    ("reward/R/plan_mean", "R plan"),
    ("rl/loss", "loss"),
    ("rl/kl", "KL"),
    ("rl/clip_fraction", "clip"),
    ("reflection/valid_fraction", "valid reflections"),
    ("retrieval/cross_hits", "cross hits"),
    ("retrieval/within_hits", "within hits"),
    ("rollout/seconds", "rollout s"),
)


def rl_markdown(
    steps: Sequence[Mapping[str, Any]],
    recipe: str,
    total_steps: int,
    run_dir: str,
    mlflow_url: str | None = None,
    mlflow_db: str | None = None,
    model_link: str | None = None,
) -> str:
    """``steps``: one mapping per finished step with ``step``, ``phase``, ``retrieval`` and its metrics."""
    shown = [(k, h) for k, h in RL_COLUMNS if any(k in s for s in steps)]
    rows = [[s["step"], s["phase"], s["retrieval"], *[s.get(k) for k, _ in shown]] for s in steps]
    return (
        "\n\n".join(
            [
                f"# RL ({recipe}): {len(steps)} of {total_steps} steps done",
                table(["step", "phase", "retrieval", *[h for _, h in shown]], rows) if rows else "no step finished",
                f'Per-stage scores: `rubricem sql --run-dir {run_dir} "SELECT step, stage, avg(score) FROM judge_scores GROUP BY ALL ORDER BY ALL"`',
                "## Links",
                links(run_dir, mlflow_url, mlflow_db, model_link=model_link),
            ]
        )
        + "\n"
    )


def eval_markdown(
    tag: str,
    checkpoint: str,
    retrieval: str,
    results: Mapping[str, Mapping[str, Any]],
    run_dir: str,
    mlflow_url: str | None = None,
    mlflow_db: str | None = None,
) -> str:
    keys = ("score_mean", "n_samples", "grade_failed", "n_ungraded", "valid_scaffold_rate", "reflection_valid_rate")
    shown = [k for k in keys if any(k in r for r in results.values())]
    rows = [[name, *[r.get(k) for k in shown], "yes" if r.get("cached") else "no"] for name, r in results.items()]
    return (
        "\n\n".join(
            [
                f"# Evaluation of {tag} (retrieval {retrieval})",
                f"checkpoint: `{checkpoint}`",
                table(["benchmark", *shown, "cached"], rows),
                "## Links",
                links(run_dir, mlflow_url, mlflow_db),
            ]
        )
        + "\n"
    )


def pipeline_markdown(
    result: Mapping[str, Any],
    profile: str,
    run_dir: str,
    mlflow_url: str | None = None,
    mlflow_db: str | None = None,
) -> str:
    """The pipeline run's own summary: one row per stage (what it produced, whether it was read back)
    and the links to MLflow and the HTML report. ``result`` is the pipeline flow's return value."""
    collected, tuned, trained, evaluated = (result[k] for k in ("collect_sft_data", "sft", "rl", "evaluate"))
    scores = ", ".join(f"{name} {cell(s.get('score_mean'))}" for name, s in evaluated["benchmarks"].items())
    rows = [
        ["collect_sft_data", f"{collected['accepted']} of {collected['trajectories']} trajectories accepted"],
        ["sft", f"`{tuned['final_dir']}`" + (" (read back)" if tuned.get("cached") else f", {tuned['steps']} steps")],
        ["rl", f"{trained['steps']} steps of {trained['recipe']}; `{trained['final_checkpoint']}`"],
        ["evaluate", f"{evaluated['tag']} (retrieval {evaluated['retrieval']}): {scores}"],
    ]
    extra = [f"- report: `{result['report']}` (`rubricem report --run-dir {run_dir}` writes it again)"]
    return (
        "\n\n".join(
            [
                f"# Pipeline of `{run_dir}` ({profile} profile)",
                table(["stage", "result"], rows),
                "## Links",
                links(run_dir, mlflow_url, mlflow_db, label="MLflow experiment") + "\n" + "\n".join(extra),
            ]
        )
        + "\n"
    )
