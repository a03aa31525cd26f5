"""Learning curves: held-out score against RL step, `ss_grpo` and `full` from one SFT checkpoint.

Copies a finished run's inputs and SFT policy into a work directory (the source run is never
modified), then trains every recipe in its own sub run (``<work-dir>/ablation/<recipe>``) with the same
seed, query schedule and budget; only ``rl.recipe`` differs. Training goes in chunks of ``--eval-every``
steps, the recipes taking turns, so both curves grow together and a partial run still compares them
step for step. After each chunk the chunk's last step checkpoint is evaluated on the held-out
synthetic queries with the built-in grader (the queries' persistent, checkable answer rubrics; never
the training judge's evolving ones), and the SFT policy once as the curve's origin.

Printed per recipe: one row per step (phase, training reward R per stage, valid scaffolds among the
rollouts, reflection validity and bank size, the seconds of its rollouts, judge and update) and one per
evaluation (score, its paired gain over SFT with the standard error of that gain, the parts of the
score, reflection validity); then the final
paired gains, `full − ss_grpo`, and a PNG of the curves (``<work-dir>/learning_curve.png``) with a JSON
of every figure beside it. It is a long job: a rerun with the same arguments resumes (finished RL steps
and evaluations are read back from the work directory), so run it with nohup and rerun it if killed.

    .venv/bin/python bench/learning_curve.py --run-dir runs/small --work-dir runs/small-curve \
        --steps 24 --eval-every 6                    # docs/learning.md
    .venv/bin/python bench/learning_curve.py --run-dir runs/tiny --quick   # tiny, a few minutes
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import has_sft_checkpoint  # noqa: E402
from bench.rl_improvement import breakdown, copy_inputs, paired_gain  # noqa: E402
from bench.run_all import figure_line  # noqa: E402
from rubricem_core.layout import RunLayout  # noqa: E402
from rubricem_core.offline import apply_offline_defaults  # noqa: E402

apply_offline_defaults()

STAGE_NAMES = ("plan", "research", "review", "answer")


def chunk_ends(steps: int, eval_every: int, steps_per_window: int) -> list[int]:
    """The step counts after which the recipes are evaluated: every ``eval_every`` steps up to ``steps``.
    A chunk must end on a window's end (the curriculum is built whole windows at a time)."""
    if eval_every % steps_per_window or steps % eval_every:
        raise SystemExit(
            f"--eval-every {eval_every} must be a multiple of 2 × rl.window = {steps_per_window}, and --steps "
            f"{steps} a multiple of --eval-every"
        )
    return list(range(eval_every, steps + 1, eval_every))


def step_rows(run_dir: str, upto: int) -> list[dict[str, Any]]:
    """One row per finished RL step of a recipe's run: training reward per stage, valid scaffolds,
    reflection validity, bank size and seconds, from the step's tables and saved task metrics."""
    from rubricem_core.rl.session import completed_step
    from rubricem_core.store import RunStore
    from tasks.rl import step_metrics

    store = RunStore(run_dir)
    rows = []
    for step in range(min(upto, completed_step(store) + 1)):
        m = step_metrics(store, step)
        rollouts = store.read_rows("rollouts", {"step": step})
        rows.append(
            {
                "step": step,
                "phase": rollouts[0]["phase"] if rollouts else "",
                **{f"R_{s}": m.get(f"reward/R/{s}_mean", math.nan) for s in STAGE_NAMES},
                "valid_scaffold": sum(r["valid_scaffold"] for r in rollouts) / max(1, len(rollouts)),
                "reflection_valid": m.get("reflection/valid_fraction", math.nan),
                "bank_size": m.get("bank/size", math.nan),
                "kl": m.get("rl/kl", math.nan),
                # the parts that do not overlap: the judge streams during the rollouts (judge/wait_seconds is
                # what it adds after them); the reflection tasks run beside the rollouts and the update
                "rollout_s": m.get("rollout/seconds", math.nan),
                "judge_wait_s": m.get("judge/wait_seconds", math.nan),
                "update_s": m.get("rl/update_seconds", math.nan),
            }
        )
    return rows


def evaluation(run_dir: str, checkpoint: str) -> dict[str, Any]:
    """The checkpoint's held-out evaluation (run now, or read back when a rerun finds it done)."""
    from flows.evaluate import evaluate

    result = evaluate(run_dir=run_dir, checkpoint=checkpoint, benchmarks=["synthetic"], retrieval="none")
    summary = result["benchmarks"]["synthetic"]
    score, reflection = summary["score_mean"], summary.get("reflection_valid_rate")
    return {
        "checkpoint": result["tag"],
        "score": math.nan if score is None else score,
        # one unforced reflection per evaluated trajectory, checked by the meta-policy's validator
        "reflection_valid": math.nan if reflection is None else float(reflection),
        **breakdown(run_dir, result["tag"]),
    }


def plot_curves(curves: dict[str, list[dict[str, Any]]], sft: dict[str, Any], title: str, path: Path) -> None:
    """Held-out score against RL step per recipe, ± the standard error of the paired gain over SFT."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.0), dpi=120)
    ax.axhline(sft["score"], color="grey", lw=1, ls="--", label=f"SFT {sft['score']:.3f}")
    for recipe, points in curves.items():
        xs = [0] + [p["step"] for p in points]
        ys = [sft["score"]] + [p["score"] for p in points]
        errs = [0.0] + [0.0 if math.isnan(p["se"]) else p["se"] for p in points]
        ax.errorbar(xs, ys, yerr=errs, marker="o", capsize=3, label=recipe)
    ax.set_xlabel("RL steps")
    ax.set_ylabel("held-out answer score (built-in grader)")
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def _fmt(x: float, spec: str = ".2f") -> str:
    return "   -" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run-dir", default="runs/tiny", help="a run with checkpoints/sft/final (not modified)")
    parser.add_argument("--work-dir", default=None, help="where the recipes train (default: a temporary directory)")
    parser.add_argument(
        "--profile",
        default=None,
        help="profile name or YAML for the RL runs (default: the source run's config.yaml); its data.* must be "
        "the source run's, whose queries and SFT policy are used",
    )
    parser.add_argument("--recipes", default="ss_grpo,full", help="comma-separated; the last is the figure's")
    parser.add_argument("--steps", type=int, default=24, help="RL steps per recipe")
    parser.add_argument("--eval-every", type=int, default=6, help="evaluate every N steps (a multiple of 2·window)")
    parser.add_argument("--quick", action="store_true", help="tiny sizes: 4 steps, evaluations every 2")
    parser.add_argument("--png", default=None, help="also copy the plot here (e.g. docs/learning_curve.png)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="config override (YAML value)")
    args = parser.parse_args()
    src = Path(args.run_dir)
    goal = "> 0 by more than 2 standard errors"
    recipes = [r.strip() for r in args.recipes.split(",") if r.strip()]
    if not has_sft_checkpoint(src, figure_line(f"{recipes[-1]}_minus_sft", math.nan, "score", goal, None)):
        return 0
    overrides: dict[str, Any] = {"tracking.enabled": False}
    if args.quick:
        args.steps, args.eval_every = 4, 2
        overrides.update({"rl.window": 1, "rollout.max_new_tokens": 256, "eval.max_queries": 6})
    for item in args.set:
        key, _, value = item.partition("=")
        overrides[key] = yaml.safe_load(value)

    from flows.ablation import prepare_recipe_run
    from flows.common import resolve_config
    from flows.rl import rl
    from rubricem_core.rl.session import step_checkpoint
    from rubricem_core.runlock import run_dir_lock
    from rubricem_core.store import RunStore

    with tempfile.TemporaryDirectory() as tmp:
        work = Path(args.work_dir) if args.work_dir else Path(tmp) / "run"
        work.mkdir(parents=True, exist_ok=True)
        run_dir = copy_inputs(src, work)
        cfg = resolve_config(
            run_dir, args.profile or str(RunLayout(src).config_file), overrides, command="learning_curve"
        )
        per_window = 2 * cfg.rl.window
        ends = chunk_ends(args.steps, args.eval_every, per_window)
        sft = evaluation(run_dir, str(RunLayout(work).sft_final))
        print(f"SFT: score {sft['score']:.3f} on {sft['n']} graded trajectories", flush=True)
        subs = {r: prepare_recipe_run(run_dir, r) for r in recipes}
        points: dict[str, list[dict[str, Any]]] = {r: [] for r in recipes}
        wall: dict[str, float] = {r: 0.0 for r in recipes}
        for end in ends:
            for recipe in recipes:
                sub = subs[recipe]
                rl_cfg = cfg.rl.model_copy(update={"recipe": recipe, "n_windows": end // per_window})
                t0 = time.perf_counter()
                with run_dir_lock(sub, command="learning_curve"):
                    resolve_config(sub, config=cfg.model_copy(update={"rl": rl_cfg}), command="learning_curve")
                    rl(run_dir=sub)
                    ev = evaluation(sub, str(step_checkpoint(RunStore(sub), end - 1)))
                wall[recipe] += time.perf_counter() - t0
                gain, se = paired_gain(ev["per_query"], sft["per_query"])
                points[recipe].append({"step": end, "score": ev["score"], "gain": gain, "se": se, **ev})
                print(
                    f"{recipe} after {end} steps: score {ev['score']:.3f}, vs SFT {gain:+.3f} ± {se:.3f} "
                    f"(answered {ev['answered']:.2f}, valid {ev['valid']:.2f}, facts {_fmt(ev['facts'])}, "
                    f"finals {_fmt(ev['finals'])})",
                    flush=True,
                )

        summary: dict[str, Any] = {"steps": args.steps, "eval_every": args.eval_every, "overrides": overrides}
        summary["sft"] = {k: v for k, v in sft.items() if k != "per_query"}
        summary["recipes"] = {}
        for recipe in recipes:
            steps = step_rows(subs[recipe], args.steps)
            summary["recipes"][recipe] = {
                "steps": steps,
                "evaluations": [{k: v for k, v in p.items() if k != "per_query"} for p in points[recipe]],
            }
            print(f"\n== {recipe}: {len(steps)} steps, {wall[recipe] / 60:.1f} min in all (evaluations included)")
            print("step phase   R_plan R_res  R_rev  R_ans  valid  refl_valid bank  kl      roll_s judge_s upd_s")
            for row in steps:
                print(
                    f"{row['step']:>4} {row['phase']:<7} "
                    + " ".join(f"{_fmt(row[f'R_{s}']):>6}" for s in STAGE_NAMES)
                    + f" {row['valid_scaffold']:>6.2f} {_fmt(row['reflection_valid']):>10} "
                    f"{_fmt(row['bank_size'], '.0f'):>4} {_fmt(row['kl'], '.4f'):>7} {_fmt(row['rollout_s'], '.0f'):>6} "
                    f"{_fmt(row['judge_wait_s'], '.0f'):>7} {_fmt(row['update_s'], '.0f'):>5}"
                )
            if steps:
                parts = {k: sum(r[k] for r in steps) / len(steps) for k in ("rollout_s", "judge_wait_s", "update_s")}
                print(
                    f"mean step {sum(parts.values()):.0f} s: rollouts {parts['rollout_s']:.0f} s + judge after "
                    f"them {parts['judge_wait_s']:.0f} s + update {parts['update_s']:.0f} s"
                )
            print("eval  score  vs SFT  ± se   answered valid facts finals refl_valid")
            print(
                f"   0 {sft['score']:>6.3f}  {0:>+6.3f} {0:>5.3f}  {sft['answered']:>8.2f} {sft['valid']:>5.2f} "
                f"{_fmt(sft['facts']):>5} {_fmt(sft['finals']):>6} {_fmt(sft['reflection_valid']):>10}"
            )
            for p in points[recipe]:
                print(
                    f"{p['step']:>4} {p['score']:>6.3f}  {p['gain']:>+6.3f} {p['se']:>5.3f}  {p['answered']:>8.2f} "
                    f"{p['valid']:>5.2f} {_fmt(p['facts']):>5} {_fmt(p['finals']):>6} {_fmt(p['reflection_valid']):>10}"
                )
        if len(recipes) >= 2:
            a, b = recipes[-2], recipes[-1]
            diff, diff_se = paired_gain(points[b][-1]["per_query"], points[a][-1]["per_query"])
            summary[f"{b}_minus_{a}"] = {"gain": diff, "se": diff_se}
            print(f"\n{b} − {a} after {args.steps} steps: {diff:+.3f} ± {diff_se:.3f} (paired by query)")
        png = work / "learning_curve.png"
        title = f"{src.name}: {', '.join(recipes)} from one SFT checkpoint"
        plot_curves(points, sft, title, png)
        (work / "learning_curve.json").write_text(json.dumps(summary, indent=2, default=float))
        if args.png:
            Path(args.png).write_bytes(png.read_bytes())
        print(f"plot: {args.png or png}")

    last = points[recipes[-1]][-1]
    met = None if math.isnan(last["gain"]) else bool(last["gain"] > 0 and last["gain"] > 2 * last["se"])
    print(figure_line(f"{recipes[-1]}_minus_sft", last["gain"], "score", goal, met))
    return 0


if __name__ == "__main__":
    sys.exit(main())
