"""``write_report``: one self-contained HTML page summarizing a run directory.

The PNG plots are embedded as base64 data URIs, so the single file can be mailed or attached to a
ticket; they are also written beside it (``<name>_plots/``) and, for a tracked run, logged to MLflow
under the parent run. Every piece of text that comes from the run (config values, reject codes,
benchmark names, paths) goes through ``html.escape``.
"""

from __future__ import annotations

import base64
import html
import logging
import os
import shlex
from collections.abc import Callable, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from rubricem_core.layout import RunLayout
from rubricem_core.report import sections
from rubricem_core.report.data import STAGES, RunData
from rubricem_core.report.plots import PLOTS, STAGE_COLORS, make_plots
from rubricem_core.report.publish import log_files, mlflow_target
from rubricem_core.store import atomic_write_text
from rubricem_core.tracking import (
    TrackingError,
    configured_uri,
    is_local_store,
    mlflow_ui_command,
    mlflow_ui_url,
    ui_base,
)

log = logging.getLogger(__name__)


class ReportError(ValueError):
    """The directory cannot be reported on (it is not a run directory)."""


# ---- formatting --------------------------------------------------------------------------------
def _esc(value: Any) -> str:
    return html.escape(str(value), quote=True)


def fmt_int(value: Any) -> str:
    return "–" if sections.is_missing(value) else f"{int(round(float(value))):,}"


def fmt_fixed(digits: int) -> Callable[[Any], str]:
    def fmt(value: Any) -> str:
        return "–" if sections.is_missing(value) else f"{float(value):.{digits}f}"

    return fmt


def fmt_general(value: Any) -> str:
    """Small magnitudes (KL, clip fractions near 0) keep their significant digits."""
    if sections.is_missing(value):
        return "–"
    number = float(value)
    if number == 0:
        return "0"
    return f"{number:.2e}" if abs(number) < 1e-3 else f"{number:.4g}"


def fmt_usd(value: Any) -> str:
    return "–" if sections.is_missing(value) else f"${float(value):,.4f}"


def fmt_pct(value: Any) -> str:
    return "–" if sections.is_missing(value) else f"{100 * float(value):.1f}%"


def fmt_text(value: Any) -> str:
    return "–" if value is None else str(value)


def _table(headers: Sequence[str], rows: Sequence[Sequence[str]], numeric: Sequence[bool] | None = None) -> str:
    numeric = numeric or [False] * len(headers)
    head = "".join(f"<th{' class=num' if n else ''}>{_esc(h)}</th>" for h, n in zip(headers, numeric))
    body = "".join(
        "<tr>" + "".join(f"<td{' class=num' if n else ''}>{_esc(c)}</td>" for c, n in zip(row, numeric)) + "</tr>"
        for row in rows
    )
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def _kv(items: Sequence[tuple[str, Any]]) -> str:
    rows = "".join(f"<tr><th>{_esc(k)}</th><td>{_esc(v)}</td></tr>" for k, v in items)
    return f"<table class=kv>{rows}</table>"


def _no_data(what: str) -> str:
    return f"<p class=nodata>no data ({_esc(what)})</p>"


# ---- sections -----------------------------------------------------------------------------------
def _config_section(summary: dict[str, Any], inventory: list[tuple[str, int]]) -> str:
    parts = ["<h2>Run configuration</h2>"]
    if summary["error"]:
        parts.append(_no_data(summary["error"]))
    else:
        parts.append(_kv(summary["items"]))
    if summary["lambda"] is not None:
        header = ["Λ (row: stage k, column: reward of stage j)", *STAGES]
        rows = [[stage, *(fmt_general(v) for v in row)] for stage, row in zip(STAGES, summary["lambda"])]
        parts.append(_table(header, rows, [False] + [True] * len(STAGES)))
    if inventory:
        parts.append("<h3>Tables</h3>")
        parts.append(_table(["table", "rows"], [[name, fmt_int(n)] for name, n in inventory], [False, True]))
    return "\n".join(parts)


def _sft_section(summary: dict[str, Any] | None) -> str:
    parts = ["<h2>SFT</h2>"]
    if not summary:
        return parts[0] + _no_data("tables sft_trajectories, teacher_responses and sft/* metrics are absent")
    if "trajectories" in summary:
        total = summary["trajectories"]
        rate = summary["accepted"] / total if total else None
        parts.append("<h3>Teacher trajectories</h3>")
        items = [
            ("trajectories", fmt_int(total)),
            ("accepted", f"{fmt_int(summary['accepted'])} ({fmt_pct(rate)})"),
            ("rejected", fmt_int(summary["rejected"])),
        ]
        teacher = summary.get("teacher")
        if teacher:
            items += [
                ("teacher requests", fmt_int(teacher["requests"])),
                (
                    "teacher tokens (prompt / completion)",
                    f"{fmt_int(teacher['prompt_tokens'])} / {fmt_int(teacher['completion_tokens'])}",
                ),
                ("teacher cost", fmt_usd(teacher["cost_usd"])),
            ]
        parts.append(_kv(items))
        if summary.get("reject_codes"):
            parts.append(
                _table(
                    ["reject code", "rejected trajectories"],
                    [[c, fmt_int(n)] for c, n in summary["reject_codes"]],
                    [False, True],
                )
            )
    training = summary.get("training")
    parts.append("<h3>Training</h3>")
    if not training:
        parts.append(_no_data("no sft/loss metrics from the sft flow"))
    else:
        items = [
            ("optimizer steps", fmt_int(training["steps"])),
            ("first logged loss", fmt_fixed(4)(training["first_loss"])),
            ("final loss", fmt_fixed(4)(training["final_loss"])),
            ("tokens/s", fmt_int(training["tokens_per_s"])),
            ("padding fraction", fmt_fixed(3)(training["padding_fraction"])),
        ]
        items += [(f"final NLL, {stage}", fmt_fixed(4)(v)) for stage, v in training["final_nll"].items()]
        parts.append(_kv(items))
    return "\n".join(parts)


# a table column: the record's key, its header, how a value is written, whether it is numeric (right-aligned)
Column = tuple[str, str, Callable[[Any], str], bool]


def _records_section(
    head: str, records: list[dict[str, Any]], missing: str, columns: Sequence[Column], note: str = ""
) -> str:
    """A section's heading and one table, a row per record, then ``note`` (``missing``: what is absent when
    there is no record)."""
    if not records:
        return head + _no_data(missing)
    rows = [[fmt(record.get(key)) for key, _, fmt, _ in columns] for record in records]
    return head + _table([h for _, h, _, _ in columns], rows, [n for *_, n in columns]) + note


RL_COLUMNS: tuple[Column, ...] = (
    ("step", "step", fmt_int, True),
    ("phase", "phase", fmt_text, False),
    ("retrieval", "retrieval", fmt_text, False),
    ("rollouts", "rollouts", fmt_int, True),
    ("valid_scaffold", "valid scaffold", fmt_pct, True),
    *((f"R_{s}", f"R {s}", fmt_fixed(3), True) for s in STAGES),
    ("loss", "loss", fmt_general, True),
    ("kl", "KL", fmt_general, True),
    ("clip_fraction", "clip frac.", fmt_general, True),
    ("judge_calls", "judge calls", fmt_int, True),
    ("judge_failed", "failed judgments", fmt_int, True),
    ("judge_cost", "judge cost", fmt_usd, True),
    ("step_time", "step time (s)", fmt_fixed(1), True),
)


def _rl_section(steps: list[dict[str, Any]]) -> str:
    missing = "tables stage_rewards, rollouts and rl/* metrics are absent"
    note = "<p class=note>R: mean stage reward over the step's rollouts (– : the stage had no rubrics).</p>"
    return _records_section("<h2>RL per step</h2>", steps, missing, RL_COLUMNS, note)


def _samples_section(samples: list[dict[str, Any]]) -> str:
    head = "<h2>One trajectory per step</h2>"
    if not samples:
        return head + _no_data("table rollouts is absent or empty")
    parts = [
        head,
        "<p class=note>Each step's first rollout by id (a sample, not the best), laid out by stage with the stage "
        "rewards the judge gave it; long stage texts and tool outputs are cut (the rollouts table holds all).</p>",
    ]
    for i, sample in enumerate(samples):
        rewards = (
            " · ".join(f"R {stage} {sample['R'][stage]:.2f}" for stage in STAGES if stage in sample["R"])
            or "no stage rewards"
        )
        valid = "valid scaffold" if sample.get("valid_scaffold") else "invalid scaffold"
        summary = (
            f"step {fmt_int(sample['step'])} · {_esc(rewards)} · {valid} · {fmt_int(sample.get('n_tool_calls'))} "
            f"tool calls · {_esc(sample.get('finish_reason') or '')}"
        )
        body = [f"<p><b>Query</b> {_esc(sample.get('question') or sample['query_id'])}</p>"]
        stage = None
        for part_stage, is_tool, text in sample["parts"]:
            if part_stage != stage:
                if stage is not None:
                    body.append("</div>")
                stage = part_stage
                color = STAGE_COLORS.get(stage, "#999999")
                body.append(f'<div class=stage style="border-left:4px solid {color}"><h4>{_esc(stage)}</h4>')
            css = "tool" if is_tool else "traj"
            body.append(f"<pre class={css}>{_esc(text.strip())}</pre>")
        if stage is not None:
            body.append("</div>")
        opened = " open" if i == len(samples) - 1 else ""
        parts.append(f"<details{opened}><summary>{summary}</summary>{''.join(body)}</details>")
    return "\n".join(parts)


REFLECTION_COLUMNS: tuple[Column, ...] = (
    ("step", "step", fmt_int, True),
    ("candidates", "candidates", fmt_int, True),
    ("valid", "valid", fmt_int, True),
    ("accepted", "accepted", fmt_int, True),
    ("mean_score", "mean score (valid)", fmt_fixed(3), True),
    ("best_score", "best score", fmt_fixed(3), True),
)


def _reflection_section(steps: list[dict[str, Any]]) -> str:
    return _records_section("<h2>Reflections</h2>", steps, "table reflections is absent or empty", REFLECTION_COLUMNS)


EVAL_COLUMNS: tuple[Column, ...] = (
    ("checkpoint", "checkpoint", fmt_text, False),
    ("benchmark", "benchmark", fmt_text, False),
    ("retrieval", "retrieval", fmt_text, False),
    ("queries", "queries", fmt_int, True),
    ("samples", "samples", fmt_int, True),
    ("failed", "failed grades", fmt_int, True),
    ("mean_score", "mean score", fmt_fixed(3), True),
    ("sd", "std", fmt_fixed(3), True),
)


def _eval_section(results: list[dict[str, Any]]) -> str:
    missing = "table eval_results is absent or empty"
    note = "<p class=note>Means and std over graded samples; failed grades are excluded and counted.</p>"
    return _records_section("<h2>Evaluation</h2>", results, missing, EVAL_COLUMNS, note)


def _plots_section(plots: dict[str, Path | None]) -> str:
    parts = ["<h2>Plots</h2>"]
    missing = []
    for spec in PLOTS:
        path = plots.get(spec.name)
        if path is None:
            missing.append(f"<li>{_esc(spec.title)}: no data ({_esc(spec.source)})</li>")
            continue
        data = base64.b64encode(path.read_bytes()).decode("ascii")
        parts.append(
            f'<figure><img alt="{_esc(spec.title)}" src="data:image/png;base64,{data}">'
            f"<figcaption>{_esc(spec.title)}</figcaption></figure>"
        )
    if missing:
        parts.append("<h3>Not plotted</h3><ul class=nodata>" + "".join(missing) + "</ul>")
    return "\n".join(parts)


# SQL to dig further: (title, query, tables it needs).
SQL_RECIPES: tuple[tuple[str, str, tuple[str, ...]], ...] = (
    ("tables and their columns", "SHOW TABLES", ()),
    (
        "why teacher traces were rejected",
        "SELECT code, count(*) AS n FROM (SELECT unnest(reject_reasons) AS code FROM sft_trajectories) GROUP BY ALL ORDER BY n DESC",
        ("sft_trajectories",),
    ),
    (
        "stage rewards, returns, advantages",
        "SELECT step, stage, avg(R) AS R, avg(G) AS G, avg(A) AS A FROM stage_rewards GROUP BY ALL ORDER BY step, stage",
        ("stage_rewards",),
    ),
    (
        "mean judge score per stage and step",
        "SELECT step, stage, avg(score) AS mean_score, count(*) AS n FROM judge_scores GROUP BY ALL ORDER BY step, stage",
        ("judge_scores",),
    ),
    (
        "most discriminative rubrics",
        "SELECT step, rubric_id, any_value(stage) AS stage, stddev_samp(score) AS spread FROM judge_scores GROUP BY step, rubric_id ORDER BY spread DESC LIMIT 10",
        ("judge_scores",),
    ),
    (
        "rubrics pruned at each step",
        "SELECT step, query_id, stage, title FROM judge_rubrics WHERE status = 'pruned' AND pruned_step = step",
        ("judge_rubrics",),
    ),
    ("every metric name", "SELECT DISTINCT flow, name FROM metrics ORDER BY flow, name", ("metrics",)),
    ("one metric over steps", "SELECT step, value FROM metrics WHERE name = 'rl/loss' ORDER BY step", ("metrics",)),
    (
        "accepted reflections",
        "SELECT step, query_id, score, text FROM reflections WHERE accepted ORDER BY step, score DESC",
        ("reflections",),
    ),
    (
        "evaluation by benchmark",
        "SELECT checkpoint, benchmark, retrieval, avg(score) AS score, count(*) AS n FROM eval_results GROUP BY ALL ORDER BY ALL",
        ("eval_results",),
    ),
)


def _registered(tracker: Any, run_dir: Path, raw_config: dict[str, Any] | None) -> list[str]:
    """One HTML line per registered version of the run's policy (empty when untracked or none)."""
    if tracker is None:
        return []
    from rubricem_core.registry import model_name, versions_of

    configured = str(((raw_config or {}).get("tracking") or {}).get("model_name") or "")
    lines = []
    for version, tags in versions_of(tracker, model_name(run_dir, configured)):
        what = tags.get("stage", "")
        if tags.get("step"):
            what += f" step {tags['step']}"
        scores = [f"{k.removeprefix('eval.')} {v}" for k, v in sorted(tags.items()) if k.endswith(".score_mean")]
        lines.append(
            f'<li><a href="{_esc(version.url)}">{_esc(version.name)} version {_esc(version.version)}</a> '
            f"({_esc(what)}{'; ' + _esc(', '.join(scores)) if scores else ''})</li>"
        )
    return lines


def _sql_section(run_dir: Path, tables: set[str], mlflow_note: str, registered: Sequence[str] = ()) -> str:
    target = shlex.quote(str(run_dir))
    items = []
    for title, query, needs in SQL_RECIPES:
        if all(t in tables for t in needs):
            command = f'rubricem sql --run-dir {target} "{query}"'
            items.append(f"<li>{_esc(title)}<pre>{_esc(command)}</pre></li>")
    uri = configured_uri(run_dir)
    link = mlflow_ui_url(ui_base(uri))
    if is_local_store(uri):
        start = f"<code>{_esc(mlflow_ui_command(f'sqlite:///{RunLayout(run_dir).mlflow_db}'))}</code>, then "
    else:
        start = f"tracking server <code>{_esc(uri)}</code>: "
    return (
        "<h2>Dig further</h2><ul class=sql>" + "".join(items) + "</ul>"
        f'<p>MLflow: {start}<a href="{_esc(link)}">{_esc(link)}</a></p>'
        + (f"<p>The policy in MLflow's Model Registry:</p><ul>{''.join(registered)}</ul>" if registered else "")
        + f"<p class=note>Report artifacts in MLflow: {_esc(mlflow_note)}</p>"
    )


STYLE = """
body{font-family:system-ui,-apple-system,'Segoe UI',Roboto,sans-serif;max-width:1180px;margin:24px auto;padding:0 16px;color:#222}
h1{font-size:1.5em;margin-bottom:0}h2{border-bottom:1px solid #ddd;padding-bottom:3px;margin-top:1.6em}h3{font-size:1.02em;margin-bottom:.3em}
table{border-collapse:collapse;font-size:.88em;margin:.4em 0 .8em}th,td{border:1px solid #ddd;padding:3px 8px;text-align:left}
thead th{background:#f3f3f3}tbody tr:nth-child(even){background:#fafafa}.num{text-align:right;font-variant-numeric:tabular-nums}
table.kv th{background:#f7f7f7;font-weight:600}.nodata{color:#888;font-style:italic}.note{color:#666;font-size:.85em}
figure{margin:1em 0}figure img{max-width:100%;border:1px solid #eee}figcaption{color:#666;font-size:.85em}
pre{background:#f6f8fa;padding:6px 8px;overflow-x:auto;font-size:.82em;margin:.2em 0 .6em}.meta{color:#666;margin-top:.2em}
details{border:1px solid #e3e3e3;border-radius:4px;padding:4px 10px;margin:.4em 0}summary{cursor:pointer;font-size:.9em}
.stage{padding-left:8px;margin:.5em 0}.stage h4{margin:.2em 0;font-size:.9em;text-transform:capitalize}
pre.traj{white-space:pre-wrap;background:#fff;border:none;padding:2px 0}pre.tool{white-space:pre-wrap;color:#555;background:#f3f3f3}
"""


def render_page(run_dir: Path, body: Sequence[str]) -> str:
    generated = datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")
    return (
        "<!DOCTYPE html>\n<html lang=en><head><meta charset=utf-8>"
        f"<title>RubricEM report: {_esc(run_dir.name)}</title><style>{STYLE}</style></head><body>\n"
        f"<h1>RubricEM run report: {_esc(run_dir.name)}</h1><p class=meta>{_esc(run_dir)} · generated {generated}</p>\n"
        + "\n".join(body)
        + "\n</body></html>\n"
    )


def write_report(
    run_dir: str | os.PathLike[str],
    out_path: str | os.PathLike[str] | None = None,
    log_to_mlflow: bool | None = None,
) -> Path:
    """Write the run's one-page HTML report and return its path.

    Args:
        run_dir: the run directory.
        out_path: the HTML file (default ``<run_dir>/report/report.html``); PNGs go to ``<stem>_plots/`` beside it.
        log_to_mlflow: None logs the HTML (as ``report/report.html``, whatever ``out_path`` names it) and PNGs
            under the parent MLflow run when the run was tracked (and says why not otherwise); True requires it
            (TrackingError when impossible); False skips it.
    """
    root = Path(run_dir).expanduser().resolve()
    if not root.is_dir():
        raise ReportError(f"run directory {root} does not exist")
    layout = RunLayout(root)
    if not layout.looks_like_run_dir():
        raise ReportError(f"{root} is not a run directory: it has neither tables/ nor config.yaml")
    out = Path(out_path).expanduser().resolve() if out_path is not None else layout.report_html
    plots_dir = out.parent / f"{out.stem}_plots"

    raw_config, config_error = sections.read_config(root)
    tracker, mlflow_note = None, "not requested (--no-mlflow)"
    if log_to_mlflow is not False:
        tracker, mlflow_note = mlflow_target(root, raw_config)
        if tracker is None and log_to_mlflow:
            raise TrackingError(f"cannot log the report to MLflow: {mlflow_note}")
        if tracker is None:
            mlflow_note = f"not logged: {mlflow_note}"

    with RunData(root) as data:
        plots = make_plots(data, plots_dir)
        # what the model did first (plots, then its trajectories), the numbers behind them, then the settings
        body = [
            _plots_section(plots),
            _eval_section(sections.eval_summary(data)),
            _rl_section(sections.rl_steps(data)),
            _samples_section(sections.step_samples(data)),
            _sft_section(sections.sft_summary(data)),
            _reflection_section(sections.reflection_steps(data)),
            _config_section(sections.config_summary(raw_config, config_error), sections.table_inventory(data)),
            _sql_section(root, data.tables, mlflow_note, _registered(tracker, root, raw_config)),
        ]
    atomic_write_text(out, render_page(root, body))
    if tracker is not None:
        run_id = log_files(tracker, out, [p for p in plots.values() if p is not None])
        log.info("report logged to MLflow run %s", run_id)
    return out
