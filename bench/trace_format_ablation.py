"""Scaffold vs ReAct (the paper's Fig. 6a/6b): the same pipeline twice from nothing — teacher traces, SFT,
answer-only RL (`rl.recipe: baseline`), evaluation of the SFT and the RL policy — once with the four-stage
scaffold and once with the unstructured ReAct format (`policy.prompt_style: react`: tool calls with free
text between them, one cited answer). Prints one table (format × checkpoint: held-out score, answer match,
valid traces of that format, answered, tool calls; the teacher traces accepted) and the RL score's
difference, ReAct minus scaffold.

    .venv/bin/python bench/trace_format_ablation.py --quick              # the suite's micro run (~2 min)
    .venv/bin/python bench/trace_format_ablation.py --profile small --work-dir runs/format-ablation

On `tiny`/`--quick` the policy is a random-init toy and the built-in stand-ins are scripted, so the table
shows the comparison runs end to end, not how the formats compare on a real model.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.run_all import figure_line  # noqa: E402
from rubricem_core.config import load_config  # noqa: E402
from rubricem_core.offline import apply_offline_defaults  # noqa: E402

apply_offline_defaults()

FORMATS = ("scaffold", "react")


def format_overrides(profile: str, trace_format: str) -> dict[str, Any]:
    """The run's overrides: answer-only RL for both; the profile's own scaffold prompt, or react."""
    style = load_config(profile).policy.prompt_style if trace_format == "scaffold" else "react"
    if style == "react" and trace_format == "scaffold":
        raise ValueError(f"profile {profile!r} already uses the react prompt; give a scaffold profile")
    steps = load_config(profile).rl.window * load_config(profile).rl.n_windows * 2
    return {"policy.prompt_style": style, "rl.recipe": "baseline", "rl.eval_every": steps, "tracking.enabled": False}


def table_rows(run_dir: Path, trace_format: str) -> list[dict[str, Any]]:
    """One row per evaluated checkpoint of a run (SFT first), from its `eval_results` and `sft_trajectories`."""
    from rubricem_core.sql import run_sql

    accepted = json.loads(
        run_sql(
            run_dir, "SELECT count(*) FILTER (WHERE accepted) AS a, count(*) AS n FROM sft_trajectories", fmt="json"
        )
    )[0]
    rows = json.loads(
        run_sql(
            run_dir,
            "SELECT checkpoint, step, count(*) AS n, avg(score) AS score, "
            "avg(json_extract(details, '$.answer_match.score')::DOUBLE) AS answer_match, "
            "avg(valid_scaffold::INT) AS valid, avg((finish_reason = 'answered')::INT) AS answered, "
            "avg(n_tool_calls) AS calls FROM eval_results WHERE NOT grade_failed GROUP BY ALL "
            "ORDER BY step NULLS FIRST, checkpoint",
            fmt="json",
        )
    )
    return [{"format": trace_format, "teacher_accepted": f"{accepted['a']}/{accepted['n']}", **r} for r in rows]


def run(profile: str, work_dir: Path) -> list[dict[str, Any]]:
    from flows.pipeline import pipeline

    out = []
    for trace_format in FORMATS:
        run_dir = work_dir / trace_format
        pipeline(run_dir=str(run_dir), profile=profile, overrides=format_overrides(profile, trace_format))
        out += table_rows(run_dir, trace_format)
    return out


def print_table(rows: list[dict[str, Any]]) -> None:
    head = ("format", "checkpoint", "n", "score", "answer_match", "valid", "answered", "calls", "teacher_accepted")
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for r in rows:
        cells = [f"{r[k]:.3f}" if isinstance(r[k], float) else str(r[k]) for k in head]
        print("| " + " | ".join(cells) + " |")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--profile", default="tiny", help="a scaffold profile (the react run overrides its prompt)")
    parser.add_argument("--work-dir", type=Path, default=None, help="where the two runs go (default: a temp dir)")
    parser.add_argument("--quick", action="store_true", help="the test suite's micro profile")
    args = parser.parse_args(argv)
    profile = args.profile
    if args.quick:
        from rubricem_core.testing import MICRO_PROFILE

        profile = MICRO_PROFILE
    with tempfile.TemporaryDirectory(prefix="format-ablation-") as tmp:
        rows = run(profile, args.work_dir or Path(tmp))
    print_table(rows)
    final = {r["format"]: r["score"] for r in rows if r["checkpoint"] != "sft"}
    delta = final.get("react", float("nan")) - final.get("scaffold", float("nan"))
    print(figure_line("react_minus_scaffold_rl_score", delta, "held-out score", "report", None))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
