"""The numbers of the report, gathered from a run directory into plain dicts (no HTML here).

Each function returns ``None`` (or an empty list) when the tables it reads are absent or empty, so
the page can say "no data" for that section.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import yaml

from rubricem_core.layout import RunLayout
from rubricem_core.report.data import STAGES, RunData

# Tables in the order a run writes them (the contract's names), for the table inventory.
TABLE_ORDER = (
    "queries",
    "corpus",
    "teacher_requests",
    "teacher_responses",
    "sft_trajectories",
    "rollouts",
    "judge_rubrics",
    "judge_scores",
    "stage_rewards",
    "reflections",
    "bank",
    "metrics",
    "eval_results",
)


def _dig(raw: dict[str, Any], dotted: str) -> Any:
    node: Any = raw
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    return node


def read_config(run_dir: Path) -> tuple[dict[str, Any] | None, str | None]:
    """``config.yaml`` of the run as plain YAML (not validated, so a run written by an older config
    schema still reports), or None and the reason it is unusable."""
    path = RunLayout(run_dir).config_file
    if not path.is_file():
        return None, f"no config.yaml in {run_dir}"
    try:
        raw = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    except (yaml.YAMLError, UnicodeDecodeError) as exc:
        return None, f"cannot parse {path}: {exc}"
    if not isinstance(raw, dict):
        return None, f"{path} is not a YAML mapping"
    return raw, None


def config_summary(raw: dict[str, Any] | None, error: str | None = None) -> dict[str, Any]:
    """Key settings: ``{"items": [(label, value)], "lambda": K×K or None, "lambda_source", "error"}``."""
    if raw is None:
        return {"items": [], "lambda": None, "lambda_source": None, "error": error or "no config"}
    recipe_name = _dig(raw, "rl.recipe")
    lam, lam_source, judged, reflection = _recipe_details(recipe_name, _dig(raw, "rl.lambda_spec"))
    policy = _dig(raw, "policy.name_or_path")
    if policy == "tiny":
        policy = (
            f"tiny Qwen3 (random init; hidden {_dig(raw, 'policy.hidden_size')}, "
            f"{_dig(raw, 'policy.n_layers')} layers, vocab {_dig(raw, 'policy.vocab_size')})"
        )
    items = [
        ("profile", raw.get("profile")),
        ("seed", raw.get("seed")),
        ("recipe", recipe_name),
        ("Λ", lam_source),
        ("judged stages", ", ".join(judged) if judged else None),
        ("reflection meta-policy", None if reflection is None else ("on" if reflection else "off")),
        ("policy model", policy),
        ("teacher", _dig(raw, "teacher.model")),
        ("judge", _dig(raw, "judge.model")),
        ("rollout engine", _dig(raw, "rollout.engine")),
        ("group size", _dig(raw, "rollout.group_size")),
        ("window × windows", _pair(_dig(raw, "rl.window"), _dig(raw, "rl.n_windows"))),
        ("queries per step", _dig(raw, "rl.queries_per_step")),
        ("RL learning rate", _dig(raw, "rl.lr")),
        ("data source", _dig(raw, "data.source")),
    ]
    return {
        "items": [(k, v) for k, v in items if v is not None],
        "lambda": lam,
        "lambda_source": lam_source,
        "error": None,
    }


def _pair(a: Any, b: Any) -> str | None:
    return None if a is None or b is None else f"{a} × {b}"


def _recipe_details(
    recipe_name: Any, override: Any
) -> tuple[list[list[float]] | None, str | None, list[str], bool | None]:
    """Λ as a matrix, how it was chosen, judged stages and reflection flag of a recipe."""
    from rubricem_core.recipes import RECIPES  # imports torch: only when a report is built
    from rubricem_core.ssgrpo import LambdaSpecError, as_lambda

    recipe = RECIPES.get(recipe_name) if isinstance(recipe_name, str) else None
    spec = override if override is not None else (recipe.lambda_spec if recipe else None)
    judged = list(recipe.judged_stages) if recipe else []
    reflection = recipe.reflection if recipe else None
    if spec is None:
        return None, None, judged, reflection
    source = spec if isinstance(spec, str) else "explicit matrix"
    source = f"{source} (rl.lambda_spec)" if override is not None else f"{source} (recipe preset)"
    try:
        matrix = as_lambda(spec, len(STAGES)).tolist()
    except LambdaSpecError as exc:
        return None, f"{spec!r}: {exc}", judged, reflection
    return matrix, source, judged, reflection


def table_inventory(data: RunData) -> list[tuple[str, int]]:
    """(table, row count) for every table of the run, contract tables first."""
    names = [t for t in TABLE_ORDER if t in data.tables] + sorted(t for t in data.tables if t not in TABLE_ORDER)
    return [(name, data.count(name)) for name in names]


def _last(series: dict[int, float] | None) -> float | None:
    if not series:
        return None
    return series[max(series)]


def sft_summary(data: RunData) -> dict[str, Any] | None:
    """Collection (accepted/rejected, reject codes, teacher traffic) and training (loss, speed, padding)."""
    out: dict[str, Any] = {}
    if data.has("sft_trajectories", "accepted"):
        counts = data.rows(
            "SELECT count(*) AS total, count(*) FILTER (WHERE accepted) AS accepted FROM sft_trajectories"
        )[0]
        out["trajectories"] = int(counts["total"])
        out["accepted"] = int(counts["accepted"])
        out["rejected"] = int(counts["total"]) - int(counts["accepted"])
        out["reject_codes"] = []
        if data.has("sft_trajectories", "reject_reasons"):
            out["reject_codes"] = [
                (r["code"], int(r["n"]))
                for r in data.rows(
                    "SELECT code, count(*) AS n FROM (SELECT unnest(reject_reasons) AS code FROM sft_trajectories "
                    "WHERE NOT accepted) GROUP BY code ORDER BY n DESC, code"
                )
            ]
    if data.has("teacher_responses", "prompt_tokens", "completion_tokens", "cost_usd"):
        row = data.rows(
            "SELECT count(*) AS requests, sum(prompt_tokens) AS prompt_tokens, sum(completion_tokens) AS completion_tokens, "
            "sum(cost_usd) AS cost_usd FROM teacher_responses"
        )[0]
        out["teacher"] = {k: (0 if v is None else v) for k, v in row.items()}
    series = data.metric_series("sft/", flow="sft")
    loss = series.get("sft/loss")
    if loss:
        # padding_fraction and tokens_per_s are cumulative over the run, so the last logged value is the run's
        out["training"] = {
            "steps": max(loss),
            "first_loss": loss[min(loss)],
            "final_loss": loss[max(loss)],
            "tokens_per_s": _last(series.get("sft/tokens_per_s")),
            "padding_fraction": _last(series.get("sft/padding_fraction")),
            "final_nll": {s: _last(series.get(f"sft/nll/{s}")) for s in STAGES if series.get(f"sft/nll/{s}")},
        }
    return out or None


# Columns of the RL table: (key, header, metric name or None when computed here).
RL_METRICS = (
    ("loss", "loss", "rl/loss"),
    ("kl", "KL", "rl/kl"),
    ("clip_fraction", "clip frac.", "rl/clip_fraction"),
    ("judge_failed", "failed judgments", "judge/failed_trajectories"),
    ("judge_cost", "judge cost (USD)", "judge/cost_usd"),
    ("step_time", "step time (s)", "rl/step_time_s"),
)


def rl_steps(data: RunData) -> list[dict[str, Any]]:
    """One row per RL step: phase, rollouts, mean R per stage, update and judge metrics."""
    rewards: dict[int, dict[str, float]] = {}
    if data.has("stage_rewards", "step", "stage", "R"):
        for r in data.rows(
            "SELECT step, stage, avg(R) FILTER (WHERE NOT isnan(R)) AS mean_R FROM stage_rewards GROUP BY step, stage"
        ):
            if r["mean_R"] is not None:
                rewards.setdefault(int(r["step"]), {})[r["stage"]] = float(r["mean_R"])
    rollouts: dict[int, dict[str, Any]] = {}
    if data.has("rollouts", "step", "phase", "retrieval"):
        valid = "avg(valid_scaffold::DOUBLE)" if "valid_scaffold" in data.columns("rollouts") else "NULL"
        for r in data.rows(
            f"SELECT step, string_agg(DISTINCT phase, ',') AS phase, string_agg(DISTINCT retrieval, ',') AS retrieval, "
            f"count(*) AS n, {valid} AS valid FROM rollouts GROUP BY step"
        ):
            rollouts[int(r["step"])] = r
    metrics = {**data.metric_series("rl/", flow="rl"), **data.metric_series("judge/", flow="rl")}
    steps = sorted(set(rewards) | set(rollouts) | {s for series in metrics.values() for s in series})
    out = []
    for step in steps:
        row: dict[str, Any] = {"step": step}
        roll = rollouts.get(step, {})
        row["phase"] = roll.get("phase")
        row["retrieval"] = roll.get("retrieval")
        row["rollouts"] = roll.get("n")
        row["valid_scaffold"] = roll.get("valid")
        for stage in STAGES:
            row[f"R_{stage}"] = rewards.get(step, {}).get(stage)
        for key, _, name in RL_METRICS:
            row[key] = metrics.get(name, {}).get(step)
        calls = [metrics.get(n, {}).get(step) for n in ("judge/generate_calls", "judge/score_calls")]
        row["judge_calls"] = None if all(c is None for c in calls) else sum(c or 0.0 for c in calls)
        out.append(row)
    return out


SAMPLE_STEPS = 24  # trajectories shown at most: evenly spaced steps, the first and the last included
SAMPLE_STAGE_CHARS = 2400  # a stage's text beyond this is cut (the table holds all of it)
SAMPLE_TOOL_CHARS = 300  # a tool output beyond this is cut


def step_samples(data: RunData) -> list[dict[str, Any]]:
    """One trajectory per RL step (the step's first rollout by id: a sample, not the best) with its query, stage
    rewards and text as ``parts``: (stage, is_tool_output, text) in order, long texts cut."""
    if not data.has("rollouts", "step", "rollout_id", "text"):
        return []
    question = "q.question" if data.has("queries", "query_id", "question") else "NULL"
    join = "LEFT JOIN queries q USING (query_id)" if question != "NULL" else ""
    rows = data.rows(
        f"SELECT r.step, r.query_id, r.rollout_id, r.text, r.valid_scaffold, r.finish_reason, r.n_tool_calls, "
        f"{question} AS question FROM rollouts r {join} "
        "QUALIFY row_number() OVER (PARTITION BY r.step ORDER BY r.rollout_id) = 1 ORDER BY r.step"
    )
    if len(rows) > SAMPLE_STEPS:
        picks = sorted({round(i * (len(rows) - 1) / (SAMPLE_STEPS - 1)) for i in range(SAMPLE_STEPS)})
        rows = [rows[i] for i in picks]
    rewards: dict[str, dict[str, float]] = {}
    if rows and data.has("stage_rewards", "rollout_id", "stage", "R"):
        ids = [r["rollout_id"] for r in rows]
        for r in data.rows("SELECT rollout_id, stage, R FROM stage_rewards WHERE list_contains(?, rollout_id)", [ids]):
            if r["R"] is not None and not math.isnan(r["R"]):
                rewards.setdefault(r["rollout_id"], {})[r["stage"]] = float(r["R"])
    from rubricem_core.scaffold.segments import parse_segments

    out = []
    for row in rows:
        parts: list[tuple[str, bool, str]] = []
        used: dict[str, int] = {}
        for seg in parse_segments(row["text"] or ""):
            limit = SAMPLE_TOOL_CHARS if seg.is_tool_output else SAMPLE_STAGE_CHARS - used.get(seg.stage, 0)
            text = seg.text if len(seg.text) <= max(limit, 0) else seg.text[: max(limit, 0)] + " […]"
            if not seg.is_tool_output:
                used[seg.stage] = used.get(seg.stage, 0) + len(seg.text)
            if text.strip():
                parts.append((seg.stage, seg.is_tool_output, text))
        out.append({**{k: row[k] for k in row if k != "text"}, "R": rewards.get(row["rollout_id"], {}), "parts": parts})
    return out


def reflection_steps(data: RunData) -> list[dict[str, Any]]:
    if not data.has("reflections", "step", "valid", "score", "accepted"):
        return []
    return data.rows(
        "SELECT step, count(*) AS candidates, count(*) FILTER (WHERE valid) AS valid, "
        "count(*) FILTER (WHERE accepted) AS accepted, avg(score) FILTER (WHERE valid) AS mean_score, "
        "max(score) AS best_score FROM reflections GROUP BY step ORDER BY step"
    )


def eval_graded(data: RunData) -> str:
    """SQL condition for an eval row that was graded (failed grades are excluded from means, and counted)."""
    return "NOT coalesce(grade_failed, false)" if "grade_failed" in data.columns("eval_results") else "TRUE"


def eval_summary(data: RunData) -> list[dict[str, Any]]:
    if not data.has("eval_results", "benchmark", "score"):
        return []
    cols = data.columns("eval_results")
    checkpoint = "CAST(checkpoint AS VARCHAR)" if "checkpoint" in cols else "NULL"
    retrieval = "CAST(retrieval AS VARCHAR)" if "retrieval" in cols else "NULL"
    queries = "count(DISTINCT query_id)" if "query_id" in cols else "NULL"
    ok = eval_graded(data)
    return data.rows(
        f"SELECT {checkpoint} AS checkpoint, benchmark, {retrieval} AS retrieval, {queries} AS queries, "
        f"count(*) AS samples, count(*) FILTER (WHERE NOT ({ok})) AS failed, "
        f"avg(score) FILTER (WHERE {ok}) AS mean_score, stddev_samp(score) FILTER (WHERE {ok}) AS sd "
        "FROM eval_results GROUP BY ALL ORDER BY checkpoint, benchmark, retrieval"
    )


def is_missing(value: Any) -> bool:
    return value is None or (isinstance(value, float) and math.isnan(value))
