"""Does RL improve on SFT? Held-out answer score before and after RL, `baseline` and `full` side by side.

Copies a finished run's inputs and SFT policy (never modifies it), runs the `ablation` flow for the
two recipes with the same budget and seed, and evaluates the SFT policy and each final RL checkpoint on
the held-out synthetic queries with the built-in grader — the persistent, checkable answer rubrics,
independent of the training judge's evolving rubrics. Prints the mean answer score of each, its
difference to SFT paired by query (with its standard error), and what the score is made of: the share
of trajectories that answer at all, valid scaffolds, fact rubrics met in full, and right final answers.
The goal counts as met when the last recipe's paired gain exceeds twice its standard error.

    .venv/bin/python bench/rl_improvement.py --run-dir runs/tiny [--quick] [--set rl.n_windows=2 ...]
    .venv/bin/python bench/rl_improvement.py --run-dir runs/small --work-dir runs/small-rl   # kept; rerun resumes
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import add_set_argument, has_sft_checkpoint, parse_overrides  # noqa: E402
from bench.pooled_gain import pooled_gain  # noqa: E402
from bench.run_all import figure_line  # noqa: E402
from rubricem_core.layout import RunLayout  # noqa: E402
from rubricem_core.offline import apply_offline_defaults  # noqa: E402

apply_offline_defaults()


def copy_inputs(src: Path, dst: Path) -> str:
    """The run's inputs and SFT policy into ``dst`` (and the teacher's reflections, which warm the
    reflection bank); parts already there (a resumed benchmark) are kept."""
    a, b = RunLayout(src), RunLayout(dst)
    parts = [(a.table_dir(t), b.table_dir(t)) for t in ("queries", "corpus", "teacher_reflections")]
    for source, target in [*parts, (a.sft_final, b.sft_final)]:
        if source.exists() and not target.exists():
            shutil.copytree(source, target)
    return str(dst)


def graded_rows(run_dir: str | Path, checkpoint: str) -> list[dict[str, Any]]:
    """One checkpoint's graded trajectories of the synthetic benchmark (`eval_results` rows)."""
    from rubricem_core.store import RunStore

    store = RunStore(run_dir)
    return [
        r
        for r in (store.read_rows("eval_results") if "eval_results" in store.tables() else [])
        if r["checkpoint"] == checkpoint and r["benchmark"] == "synthetic" and not r["grade_failed"]
    ]


def breakdown(run_dir: str, checkpoint: str) -> dict[str, Any]:
    """Per-query mean scores and the parts of the score for one checkpoint's synthetic evaluation."""
    rows = graded_rows(run_dir, checkpoint)
    per_query: dict[str, list[float]] = {}
    matched: dict[str, list[float]] = {}  # the answer-match grader's (eval/answer_match.py)
    answered = facts = facts_full = finals = finals_right = matched_finals = 0
    for row in rows:
        per_query.setdefault(row["query_id"], []).append(float(row["score"]))
        details = json.loads(row["details"])
        answered += bool(details.get("answered"))
        if isinstance(details.get("answer_match"), dict):
            matched.setdefault(row["query_id"], []).append(float(details["answer_match"]["score"]))
            matched_finals += bool(details["answer_match"]["final_correct"])
        for item in details.get("rubrics", []):
            if item.get("check") == "fact":
                facts, facts_full = facts + 1, facts_full + (item["score"] == 2)
            elif item.get("check") == "final":
                finals, finals_right = finals + 1, finals_right + (item["score"] == 2)
    n = max(1, len(rows))
    return {
        "per_query": {q: sum(v) / len(v) for q, v in per_query.items()},
        "n": len(rows),
        "answered": answered / n,
        "valid": sum(bool(r["valid_scaffold"]) for r in rows) / n,
        "facts": facts_full / facts if facts else math.nan,
        "finals": finals_right / finals if finals else math.nan,
        "per_query_independent": {q: sum(v) / len(v) for q, v in matched.items()},
        "independent": sum(map(sum, matched.values())) / n if matched else math.nan,
        "independent_finals": matched_finals / n if matched else math.nan,
    }


def paired_gain(policy: dict[str, float], reference: dict[str, float]) -> tuple[float, float]:
    """Mean and standard error of the per-query score difference over the queries both were graded on."""
    gain, se, _ = pooled_gain([(policy, reference)])
    return gain, se


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run-dir", default="runs/tiny", help="a run with checkpoints/sft/final (not modified)")
    parser.add_argument("--recipes", default="baseline,full")
    parser.add_argument("--quick", action="store_true", help="one window of one step, 4 eval queries, 256 tokens/turn")
    parser.add_argument(
        "--work-dir",
        default=None,
        help="keep the RL runs here (default: a temporary directory); a rerun resumes after the last finished step",
    )
    add_set_argument(parser)
    args = parser.parse_args()
    src = Path(args.run_dir)
    if not has_sft_checkpoint(src, "figure: full_minus_sft=nan score  goal: > 0  met: n/a"):
        return
    overrides = {"tracking.enabled": False}
    if args.quick:
        overrides.update({"rl.window": 1, "rl.n_windows": 1, "eval.max_queries": 4, "rollout.max_new_tokens": 256})
    overrides.update(parse_overrides(args.overrides))
    recipes = [r.strip() for r in args.recipes.split(",") if r.strip()]

    from flows.ablation import ablation

    with tempfile.TemporaryDirectory() as tmp:
        run_dir = copy_inputs(src, Path(args.work_dir) if args.work_dir else Path(tmp) / "run")
        result = ablation(
            run_dir=run_dir,
            profile=str(RunLayout(src).config_file),
            overrides=overrides,
            recipes=recipes,
            benchmarks=["synthetic"],
            retrieval="none",
        )
        parts = {
            r["recipe"]: {"score": r["score_mean"], **breakdown(r["run_dir"], r["checkpoint"])}
            for r in result["rows"]
            if r["benchmark"] == "synthetic"
        }
    print(f"budget per recipe: {result['budget']}")
    print(
        f"{'policy':<10} {'score':>6} {'vs SFT':>7} {'± se':>6} {'graded':>6} {'answered':>8} {'valid':>6} "
        f"{'facts':>6} {'finals':>6}"
    )
    sft = parts.get("sft")
    gains: dict[str, tuple[float, float]] = {}
    for name in ["sft", *recipes]:
        p = parts.get(name)
        if p is None:
            print(f"{name:<10} (no evaluation)")
            continue
        gain, se = (0.0, 0.0) if name == "sft" or sft is None else paired_gain(p["per_query"], sft["per_query"])
        gains[name] = (gain, se)
        score = p["score"] if p["score"] is not None else math.nan
        print(
            f"{name:<10} {score:>6.3f} {gain:>+7.3f} {se:>6.3f} {p['n']:>6d} {p['answered']:>8.2f} {p['valid']:>6.2f} "
            f"{p['facts']:>6.2f} {p['finals']:>6.2f}"
        )
    print(
        "score: mean answer score (persistent rubrics); vs SFT: mean per-query difference, ± its standard error;\n"
        "answered / valid: shares of trajectories; facts / finals: shares of fact rubrics met in full / right finals"
    )
    if len(recipes) >= 2 and all(parts.get(r) for r in recipes[-2:]):
        a, b = recipes[-2], recipes[-1]
        diff, diff_se = paired_gain(parts[b]["per_query"], parts[a]["per_query"])
        print(f"{b} − {a}: {diff:+.3f} ± {diff_se:.3f} (paired by query)")
    last = recipes[-1]
    gain, se = gains.get(last, (math.nan, math.nan))
    met = None if math.isnan(gain) else bool(gain > 0 and not math.isnan(se) and gain > 2 * se)
    print(figure_line(f"rl_improvement.{last}_minus_sft", gain, "score", "> 0 by more than 2 standard errors", met))


if __name__ == "__main__":
    main()
