"""Does RL improve on SFT? Held-out answer score before and after RL, `baseline` and `full` side by side.

Copies a finished run's inputs and SFT policy (never modifies it), runs the `ablation` flow for the
two recipes with the same budget and seed, and evaluates the SFT policy and each final RL checkpoint on
the held-out synthetic queries with the built-in grader — the persistent, checkable answer rubrics,
independent of the training judge's evolving rubrics. Prints the mean answer score of each and the
difference to SFT.

    .venv/bin/python bench/rl_improvement.py --run-dir runs/tiny [--quick] [--set rl.n_windows=2 ...]
    .venv/bin/python bench/rl_improvement.py --run-dir runs/small --work-dir runs/small-rl   # kept; rerun resumes
"""
from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import has_sft_checkpoint  # noqa: E402
from rubricem_core.offline import apply_offline_defaults  # noqa: E402

apply_offline_defaults()


def copy_inputs(src: Path, dst: Path) -> str:
    """The run's inputs and SFT policy into ``dst``; parts already there (a resumed benchmark) are kept."""
    for part in ("tables/queries", "tables/corpus", "checkpoints/sft/final"):
        if not (dst / part).exists():
            shutil.copytree(src / part, dst / part)
    return str(dst)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run-dir", default="runs/tiny", help="a run with checkpoints/sft/final (not modified)")
    parser.add_argument("--recipes", default="baseline,full")
    parser.add_argument("--quick", action="store_true", help="one window of one step, 4 eval queries, 256 tokens/turn")
    parser.add_argument("--work-dir", default=None,
                        help="keep the RL runs here (default: a temporary directory); a rerun resumes after the last finished step")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="config override (YAML value)")
    args = parser.parse_args()
    src = Path(args.run_dir)
    if not has_sft_checkpoint(src, "figure: full_minus_sft=nan score  goal: > 0  met: n/a"):
        return
    overrides = {"tracking.enabled": False}
    if args.quick:
        overrides.update({"rl.window": 1, "rl.n_windows": 1, "eval.max_queries": 4, "rollout.max_new_tokens": 256})
    for item in args.set:
        key, _, value = item.partition("=")
        overrides[key] = yaml.safe_load(value)
    recipes = [r.strip() for r in args.recipes.split(",") if r.strip()]

    from flows.ablation import ablation

    with tempfile.TemporaryDirectory() as tmp:
        run_dir = copy_inputs(src, Path(args.work_dir) if args.work_dir else Path(tmp) / "run")
        result = ablation(run_dir=run_dir, profile=str(src / "config.yaml"), overrides=overrides,
                          recipes=recipes, benchmarks=["synthetic"], retrieval="none")
    scores = {r["recipe"]: r["score_mean"] for r in result["rows"] if r["benchmark"] == "synthetic"}
    print(f"budget per recipe: {result['budget']}")
    print(f"{'policy':<12} {'answer score':>12} {'vs SFT':>8}")
    sft = scores.get("sft")
    for name in ["sft", *recipes]:
        value = scores.get(name)
        delta = None if value is None or sft is None else value - sft
        print(f"{name:<12} {value if value is not None else float('nan'):>12.3f} "
              f"{delta if delta is not None else float('nan'):>+8.3f}")
    last = recipes[-1]
    gain = None if scores.get(last) is None or sft is None else scores[last] - sft
    print(f"figure: {last}_minus_sft={gain if gain is not None else float('nan'):.3f} score  goal: > 0  "
          f"met: {'yes' if gain is not None and gain > 0 else 'no'}")


if __name__ == "__main__":
    main()
