"""Gains over SFT pooled over seeds, from learning-curve JSONs (bench/learning_curve.py --json).

Each seed is its own run: the same SFT checkpoint and held-out queries, its own sampling seed for the RL
rollouts and for the evaluations (the SFT point included). Per query, the pooled gain is the mean over
seeds of (RL score − that seed's SFT score); its standard error is over queries, as for one seed, so it
shrinks only by the sampling noise the seeds average out, not by counting a query twice.

    .venv/bin/python bench/pooled_gain.py docs/learning_curve_own.json docs/learning_curve_own_s1.json
    .venv/bin/python bench/pooled_gain.py A.json B.json --recipe full --step 24 --against ss_grpo

``--against RECIPE``: the same pairing between two recipes' checkpoints at that step (each seed's own),
instead of against SFT (the paper's ordering: full ≥ ss_grpo).

It also reads the comparisons of ``bench/compare_checkpoints.py`` (``comparison.json``, several samples a
query): each checkpoint there is one run, paired with that file's own SFT evaluation; a checkpoint read
back into several files (the same tag) counts once. ``--recipe``, ``--step`` and ``--against`` do not apply
to them.

    .venv/bin/python bench/pooled_gain.py docs/learning_compare4.json docs/learning_compare30.json \
        docs/learning_compare34.json

Beside the pooled gain it prints the runs' own gains' mean ± their spread over √runs ("between runs"):
that spread counts how differently training went from run to run, which the per-query standard error
does not, but not the noise of an SFT evaluation that several runs share.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.run_all import figure_line  # noqa: E402

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
    return (*mean_and_se(gains), len(gains))


def mean_and_se(values: list[float]) -> tuple[float, float]:
    """The mean and its standard error from the sample spread (NaN where there are too few values)."""
    if not values:
        return math.nan, math.nan
    mean = sum(values) / len(values)
    if len(values) < 2:
        return mean, math.nan
    var = sum((v - mean) ** 2 for v in values) / (len(values) - 1)
    return mean, math.sqrt(var / len(values))


Scores = dict[str, dict[str, float]]  # grader → query → score


def comparison_runs(path: str, comparison: dict[str, Any]) -> list[tuple[str, str, Scores, Scores]]:
    """(tag, name, checkpoint's scores, the file's SFT scores) for each non-SFT checkpoint of a
    ``compare_checkpoints.py`` comparison."""
    by_tag = {c["tag"]: c for c in comparison["checkpoints"]}
    if "sft" not in by_tag:
        raise SystemExit(f"{path}: a comparison without its SFT evaluation (checkpoints tagged {sorted(by_tag)})")
    scores = lambda c: {g: c[g] for g in GRADERS}  # noqa: E731
    return [(tag, c["name"], scores(c), scores(by_tag["sft"])) for tag, c in by_tag.items() if tag != "sft"]


def runs_of(paths: list[str], recipe: str, step: int | None, against: str) -> list[tuple[str, Scores, Scores]]:
    """(name, policy scores, reference scores) per run: one per learning curve, one per checkpoint of a
    comparison (each tag once, from the first file that has it)."""
    runs: list[tuple[str, Scores, Scores]] = []
    seen: set[str] = set()
    for path in paths:
        data = json.loads(Path(path).read_text())
        if "checkpoints" in data:
            for tag, name, policy, reference in comparison_runs(path, data):
                if tag not in seen:
                    seen.add(tag)
                    runs.append((f"{path}: {name}", policy, reference))
        else:
            runs.append((path, checkpoint_scores(data, recipe, step), checkpoint_scores(data, against, step)))
    return runs


def between_runs(gains: list[float]) -> tuple[float, float]:
    """The mean of the runs' gains and its standard error from their spread (NaN for one run)."""
    return mean_and_se(gains)


def in_se(value: float, se: float) -> str:
    """``value`` in standard errors, for the printout (n/a where the error is 0 or unknown)."""
    return f"{value / se:.1f} se" if se > 0 else "n/a se"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("curves", nargs="+", help="learning-curve JSONs (one per seed) or comparison JSONs")
    parser.add_argument("--recipe", default="full")
    parser.add_argument("--step", type=int, default=None, help="the RL checkpoint's step (default: the last evaluated)")
    parser.add_argument("--against", default="sft", help="the reference: sft (default) or another recipe")
    args = parser.parse_args()
    runs = runs_of(args.curves, args.recipe, args.step, args.against)
    what = f"{args.recipe}" + (f" after {args.step} steps" if args.step is not None else "") + f" − {args.against}"
    print(f"{what}, {len(runs)} run(s)")
    pooled: dict[str, tuple[float, float]] = {}
    for grader in GRADERS:
        gains = []
        for name, p, r in runs:
            gain, se, n = pooled_gain([(p[grader], r[grader])])
            gains.append(gain)
            print(f"  {grader:<12} {name}: {gain:+.3f} ± {se:.3f} ({n} queries, {in_se(gain, se)})")
        gain, se, n = pooled_gain([(p[grader], r[grader]) for _, p, r in runs])
        print(f"  {grader:<12} pooled: {gain:+.3f} ± {se:.3f} ({n} queries, {in_se(gain, se)})")
        pooled[grader] = (gain, se)
        mean, spread = between_runs(gains)
        print(f"  {grader:<12} between runs: {mean:+.3f} ± {spread:.3f} ({len(gains)} runs, {in_se(mean, spread)})")
    gain, se = pooled["independent"]
    goal = f"> 2 se (se {se:.3f}, {len(runs)} runs)"
    print(figure_line(f"pooled_gain_over_{args.against}_independent", gain, "answer match", goal, gain > 2 * se))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
