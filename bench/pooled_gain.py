"""Gains over SFT pooled over seeds, from learning-curve JSONs (bench/learning_curve.py --json).

Each seed is its own run: the same SFT checkpoint and held-out queries, its own sampling seed for the RL
rollouts and for the evaluations (the SFT point included). Per query, the pooled gain is the mean over
seeds of (RL score − that seed's SFT score); its standard error is over queries, as for one seed, so it
shrinks only by the sampling noise the seeds average out, not by counting a query twice.

    .venv/bin/python bench/pooled_gain.py docs/learning_curve_own.json docs/learning_curve_own_s1.json
    .venv/bin/python bench/pooled_gain.py A.json B.json --recipe full --step 24 --against ss_grpo

``--against RECIPE``: the same pairing between two recipes' checkpoints at that step (each seed's own),
instead of against SFT (the paper's ordering: full ≥ ss_grpo).
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Any

GRADERS = ("independent", "builtin")


def checkpoint_scores(curve: dict[str, Any], recipe: str, step: int | None) -> dict[str, dict[str, float]]:
    """Per-query scores of both graders: the SFT point (``recipe`` "sft") or ``recipe``'s checkpoint
    after ``step`` (None: its last evaluated one)."""
    if recipe == "sft":
        return {g: curve["sft"][g] for g in GRADERS}
    points = curve["recipes"].get(recipe)
    if not points:
        raise SystemExit(f"no evaluated checkpoint of recipe {recipe!r} (has: {sorted(curve['recipes'])})")
    point = points[-1] if step is None else next((p for p in points if p["step"] == step), None)
    if point is None:
        raise SystemExit(f"recipe {recipe!r} has no evaluation after step {step} (has {[p['step'] for p in points]})")
    return {g: point[g] for g in GRADERS}


def pooled_gain(pairs: list[tuple[dict[str, float], dict[str, float]]]) -> tuple[float, float, int]:
    """Mean, standard error over queries and query count of the per-query gain averaged over seeds;
    ``pairs`` holds one (policy, reference) per seed, on the queries every seed graded."""
    common = set.intersection(*(set(p) & set(r) for p, r in pairs))
    gains = [sum(p[q] - r[q] for p, r in pairs) / len(pairs) for q in sorted(common)]
    if len(gains) < 2:
        return (gains[0] if gains else math.nan), math.nan, len(gains)
    mean = sum(gains) / len(gains)
    var = sum((g - mean) ** 2 for g in gains) / (len(gains) - 1)
    return mean, math.sqrt(var / len(gains)), len(gains)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("curves", nargs="+", help="learning-curve JSONs, one per seed")
    parser.add_argument("--recipe", default="full")
    parser.add_argument("--step", type=int, default=None, help="the RL checkpoint's step (default: the last evaluated)")
    parser.add_argument("--against", default="sft", help="the reference: sft (default) or another recipe")
    args = parser.parse_args()
    curves = [json.loads(Path(p).read_text()) for p in args.curves]
    policy = [checkpoint_scores(c, args.recipe, args.step) for c in curves]
    reference = [checkpoint_scores(c, args.against, args.step) for c in curves]
    what = f"{args.recipe}" + (f" after {args.step} steps" if args.step is not None else "") + f" − {args.against}"
    print(f"{what}, {len(curves)} seed(s)")
    for grader in GRADERS:
        for path, p, r in zip(args.curves, policy, reference):
            gain, se, n = pooled_gain([(p[grader], r[grader])])
            print(f"  {grader:<12} {path}: {gain:+.3f} ± {se:.3f} ({n} queries, {gain / se:.1f} se)")
        gain, se, n = pooled_gain([(p[grader], r[grader]) for p, r in zip(policy, reference)])
        print(f"  {grader:<12} pooled: {gain:+.3f} ± {se:.3f} ({n} queries, {gain / se:.1f} se)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
