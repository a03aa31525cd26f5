"""Learning curves: held-out score against RL step, `ss_grpo` and `full` from one SFT checkpoint.

Trains every recipe from one SFT checkpoint in its own sub run (``<work-dir>/ablation/<recipe>``) with the
same seed, query schedule and budget; only ``rl.recipe`` differs. The SFT checkpoint is the source run's
(``--run-dir``, never modified; its inputs and policy are copied), or, with ``--profile`` and no SFT
checkpoint there, made first: ``collect_sft_data`` and ``sft`` into ``--run-dir`` (default
``<work-dir>/base``). Training goes in chunks of ``--eval-every`` steps, the recipes taking turns, so both
curves grow together and a partial run still compares them step for step. After each chunk the chunk's
last step checkpoint is evaluated on the held-out synthetic queries, and the SFT policy once as the
curve's origin, by two graders: the built-in grader (the queries' persistent rubrics, checked with the
judge's own criteria) and the answer-match grader (eval/answer_match.py: the gold final answer and facts
matched by plain code that shares nothing with the training judge). Gains are paired by query.

Printed: progress with an ETA after every chunk; per recipe one row per step (phase, training reward R
per stage, valid scaffolds, reflection validity and bank size, tokens generated and in all, the seconds of
its rollouts, judge, update and reflection) and one per evaluation (both graders' scores and paired gains
over SFT ± standard error); then `full − ss_grpo`, the PNG's path and a `figure:` line. Written to the work
directory: ``learning_curve.png`` and ``learning_curve.json`` (per-query scores of both graders for the SFT
checkpoint and every evaluated RL checkpoint, plus every figure). A rerun with the same arguments resumes
(finished flows, RL steps and evaluations are read back), so run it with nohup and rerun it if killed.

    make learn                                        # the `learn` profile, ~2 h on 2 cores (docs/learning.md)
    .venv/bin/python bench/learning_curve.py --profile learn --work-dir runs/learn --steps 24 --eval-every 12
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

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import add_set_argument, has_sft_checkpoint, parse_overrides  # noqa: E402
from bench.compare_checkpoints import (  # noqa: E402
    evaluate_checkpoints,
    payload,
    print_kind_table,
    print_table,
    query_kinds,
)
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


GRADERS = ("independent", "builtin")  # answer match (eval/answer_match.py), the persistent-rubric grader


def step_rows(run_dir: str, upto: int) -> list[dict[str, Any]]:
    """One row per finished RL step of a recipe's run: training reward per stage, valid scaffolds,
    reflection validity, bank size, tokens and seconds, from the step's tables and saved task metrics."""
    from rubricem_core.eval.answer_match import match_query
    from rubricem_core.rl.progress import completed_step
    from rubricem_core.scaffold.extract import extract_answer
    from rubricem_core.schemas import Query
    from rubricem_core.store import RunStore
    from tasks.rl import step_metrics

    store = RunStore(run_dir)
    queries = {row["query_id"]: Query.from_row(row) for row in store.read_rows("queries")}
    rows = []
    for step in range(min(upto, completed_step(store) + 1)):
        m = step_metrics(store, step)
        rollouts = store.read_rows("rollouts", {"step": step})
        # the training rollouts' answers on the held-out grader's terms (answer match), and how many were
        # sampled with retrieved guidance in their prompt: what the update trained on, not what evaluation sees
        matched = [match_query(queries[r["query_id"]], extract_answer(r["text"]) or "")["score"] for r in rollouts]
        rows.append(
            {
                "step": step,
                "phase": rollouts[0]["phase"] if rollouts else "",
                **{f"R_{s}": m.get(f"reward/R/{s}_mean", math.nan) for s in STAGE_NAMES},
                "train_answer_match": sum(matched) / len(matched) if matched else math.nan,
                "guided": sum(bool(r["guidance"]) for r in rollouts) / max(1, len(rollouts)),
                "valid_scaffold": sum(r["valid_scaffold"] for r in rollouts) / max(1, len(rollouts)),
                "reflection_valid": m.get("reflection/valid_fraction", math.nan),
                "bank_size": m.get("bank/size", math.nan),
                "kl": m.get("rl/kl", math.nan),
                "advantaged": m.get("rl/advantaged_token_share", math.nan),  # trained tokens with A != 0
                "tokens": sum(r["n_tokens"] for r in rollouts),
                "tokens_generated": sum(r["n_policy_tokens"] for r in rollouts),
                # the parts that do not overlap: the judge streams during the rollouts (judge/wait_seconds is
                # what it adds after them); the reflection tasks run beside the rollouts and the update
                "rollout_s": m.get("rollout/seconds", math.nan),
                "judge_wait_s": m.get("judge/wait_seconds", math.nan),
                "update_s": m.get("rl/update_seconds", m.get("update_seconds", math.nan)),
                "reflection_gen_s": m.get("reflection/generate_seconds", math.nan),
                "reflection_update_s": m.get("reflection_update/seconds", math.nan),
                "push_s": m.get("rollout/push_seconds", math.nan),
            }
        )
    return rows


def evaluation(run_dir: str, checkpoint: str) -> dict[str, Any]:
    """The checkpoint's held-out evaluation (run now, or read back when a rerun finds it done)."""
    from flows.evaluate import evaluate

    result = evaluate(run_dir=run_dir, checkpoint=checkpoint, benchmarks=["synthetic"], retrieval="none")
    return read_evaluation(run_dir, result["tag"], result["benchmarks"]["synthetic"].get("reflection_valid_rate"))


def read_evaluation(run_dir: str, tag: str, reflection_valid: float | None = None) -> dict[str, Any]:
    """A finished evaluation's figures from `eval_results` (n == 0: not evaluated yet)."""
    parts = breakdown(run_dir, tag)
    per_query = {"builtin": parts.pop("per_query"), "independent": parts.pop("per_query_independent")}
    return {
        "checkpoint": tag,
        "score": _mean(per_query["builtin"]),
        # one unforced reflection per evaluated trajectory, checked by the meta-policy's validator
        "reflection_valid": math.nan if reflection_valid is None else float(reflection_valid),
        **parts,
        "per_query": per_query,
    }


def graded(ev: dict[str, Any], sft: dict[str, Any]) -> dict[str, Any]:
    """Both graders' means and paired gains over SFT (± standard error of the paired gain)."""
    out: dict[str, Any] = {}
    for grader in GRADERS:
        per_query = ev["per_query"][grader]
        gain, se = paired_gain(per_query, sft["per_query"][grader])
        out[grader] = {"mean": _mean(per_query), "gain": gain, "se": se}
    return out


def _mean(per_query: dict[str, float]) -> float:
    return sum(per_query.values()) / len(per_query) if per_query else math.nan


def plot_curves(curves: dict[str, list[dict[str, Any]]], sft: dict[str, Any], title: str, path: Path) -> None:
    """Held-out score against RL step per recipe and grader, ± the standard error of the paired gain."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10.5, 4.0), dpi=120)
    labels = {"independent": "answer match (independent)", "builtin": "persistent rubrics (built-in)"}
    for ax, grader in zip(axes, GRADERS):
        origin = _mean(sft["per_query"][grader])
        ax.axhline(origin, color="grey", lw=1, ls="--", label=f"SFT {origin:.3f}")
        for recipe, points in curves.items():
            xs = [0] + [p["step"] for p in points]
            ys = [origin] + [p["graded"][grader]["mean"] for p in points]
            errs = [0.0] + [_nan_to_zero(p["graded"][grader]["se"]) for p in points]
            ax.errorbar(xs, ys, yerr=errs, marker="o", capsize=3, label=recipe)
        ax.set_xlabel("RL steps")
        ax.set_ylabel(f"held-out score: {labels[grader]}")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def _nan_to_zero(x: float) -> float:
    return 0.0 if math.isnan(x) else x


def _fmt(x: float, spec: str = ".2f") -> str:
    return "   -" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)


class Progress:
    """Steps and evaluations done against the plan, with an ETA from the measured cost of each (work read
    back from an earlier run is counted as done but not timed)."""

    def __init__(self, steps: int, evaluations: int):
        self.total_steps, self.total_evals = steps, evaluations
        self.steps = self.evals = 0
        self.step_seconds: list[float] = []
        self.eval_seconds: list[float] = []
        self.t0 = time.perf_counter()

    def ran(self, what: str, count: int, seconds: float) -> None:
        timed = seconds > 5.0 * count  # anything faster was read back, not run
        if what == "steps":
            self.steps += count
            self.step_seconds += [seconds / count] * count if timed else []
        else:
            self.evals += count
            self.eval_seconds += [seconds] if timed else []

    def line(self) -> str:
        left_steps, left_evals = self.total_steps - self.steps, self.total_evals - self.evals
        elapsed = (time.perf_counter() - self.t0) / 60
        if (left_steps and not self.step_seconds) or (left_evals and not self.eval_seconds):
            eta = "ETA after the first timed step and evaluation"
        else:
            per_step = sum(self.step_seconds) / max(1, len(self.step_seconds))
            per_eval = sum(self.eval_seconds) / max(1, len(self.eval_seconds))
            eta = f"ETA {(left_steps * per_step + left_evals * per_eval) / 60:.0f} min"
            eta += f" ({per_step:.0f} s a step, {per_eval:.0f} s an evaluation)"
        return (
            f"[progress] {self.steps}/{self.total_steps} RL steps, {self.evals}/{self.total_evals} evaluations, "
            f"{elapsed:.1f} min elapsed, {eta}"
        )


# Sections only the RL runs and their evaluations read: a curve's --set of these stays out of the source
# run's config.yaml, which is the default config of every later curve started from that source (a
# `--set rl.queries_per_step=4` given while the source was made would silently become every later curve's).
RL_ONLY_SECTIONS = ("rl.", "rollout.", "judge.", "eval.")


def source_overrides(overrides: dict[str, Any]) -> dict[str, Any]:
    """The overrides that the source run (collection and SFT) records: all but RL_ONLY_SECTIONS'."""
    return {k: v for k, v in overrides.items() if not k.startswith(RL_ONLY_SECTIONS)}


def prepare_source(src: Path, profile: str, overrides: dict[str, Any]) -> None:
    """Teacher data and the SFT checkpoint in ``src`` (each flow resumes what an earlier run finished)."""
    from flows.collect_sft_data import collect_sft_data
    from flows.sft import sft

    for name, flow in (("collect_sft_data", collect_sft_data), ("sft", sft)):
        t0 = time.perf_counter()
        if name == "collect_sft_data":
            flow(run_dir=str(src), profile=profile, overrides=source_overrides(overrides) or None)
        else:
            flow(run_dir=str(src))
        print(f"[progress] {name} done in {(time.perf_counter() - t0) / 60:.1f} min ({src})", flush=True)


def rl_settings_line(cfg: Any, source: str) -> str:
    """What decides a step's cost and signal, in one line, and where the settings came from."""
    rl = cfg.rl
    return (
        f"RL settings ({source}): {rl.queries_per_step} queries × {cfg.rollout.group_size} rollouts a step, "
        f"async_steps {rl.async_steps}, lr {rl.lr:g}, kl_coef {rl.kl_coef:g}, window {rl.window}, "
        f"scaffold_violations {rl.scaffold_violations}, unscored_stage_return {rl.unscored_stage_return}, "
        f"seed {cfg.seed}"
    )


def curve_json(sft: dict[str, Any], points: dict[str, list[dict[str, Any]]], steps: dict[str, Any]) -> dict[str, Any]:
    """Per-query scores of both graders for SFT and every evaluated RL checkpoint (anyone can recompute the
    paired gains), with each evaluation's summary and each recipe's step rows beside them."""

    def entry(ev: dict[str, Any]) -> dict[str, Any]:
        summary = {k: v for k, v in ev.items() if k not in ("per_query", "graded")}
        return {**{g: ev["per_query"][g] for g in GRADERS}, "summary": summary, "graded": ev.get("graded")}

    return {
        "graders": {
            "independent": "answer match: gold final answer and facts by plain string code (eval/answer_match.py)",
            "builtin": "persistent rubrics checked with the judge's criteria (sim/world_grader.py)",
        },
        "sft": entry(sft),
        "recipes": {r: [{"step": p["step"], **entry(p)} for p in pts] for r, pts in points.items()},
        "steps": steps,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--run-dir",
        default=None,
        help="the run whose SFT policy the curves start from (not modified); default <work-dir>/base, made "
        "with --profile when it has no SFT checkpoint (runs/tiny without --work-dir)",
    )
    parser.add_argument("--work-dir", default=None, help="where the recipes train (default: a temporary directory)")
    parser.add_argument(
        "--profile",
        default=None,
        help="profile name or YAML: collection and SFT when --run-dir has no SFT checkpoint, and the RL runs "
        "(default: the source run's config.yaml); its data.* must be the source run's",
    )
    parser.add_argument("--recipes", default="ss_grpo,full", help="comma-separated; the last is the figure's")
    parser.add_argument("--steps", type=int, default=24, help="RL steps per recipe")
    parser.add_argument("--eval-every", type=int, default=6, help="evaluate every N steps (a multiple of 2·window)")
    parser.add_argument("--quick", action="store_true", help="tiny sizes: 4 steps, evaluations every 2")
    parser.add_argument(
        "--final-samples",
        type=int,
        default=0,
        help="then evaluate SFT and each recipe's last checkpoint again with N samples per query, in one "
        "evaluation directory (<work-dir>/compare), paired by query: one sample a query is a noisy measure",
    )
    parser.add_argument("--png", default=None, help="also copy the plot here (e.g. docs/learning_curve.png)")
    parser.add_argument("--json", default=None, help="also copy the JSON here (e.g. docs/learning_curve.json)")
    add_set_argument(parser)
    parser.add_argument(
        "--report",
        action="store_true",
        help="no training: print the curve so far from --work-dir's tables and write its PNG and JSON",
    )
    args = parser.parse_args()
    if args.run_dir is None:
        args.run_dir = str(Path(args.work_dir) / "base") if args.work_dir else "runs/tiny"
    src = Path(args.run_dir)
    goal = "> 0 by more than 2 standard errors"
    recipes = [r.strip() for r in args.recipes.split(",") if r.strip()]
    overrides: dict[str, Any] = {"tracking.enabled": False}
    if args.quick:
        args.steps, args.eval_every = 4, 2
        overrides.update({"rl.window": 1, "rollout.max_new_tokens": 256, "eval.max_queries": 6})
    overrides.update(parse_overrides(args.overrides))
    if args.report:
        return report_only(args, recipes, overrides)
    if args.profile and not RunLayout(src).has_sft_policy():
        prepare_source(src, args.profile, overrides)
    if not has_sft_checkpoint(src, figure_line(f"{recipes[-1]}_minus_sft", math.nan, "score", goal, None)):
        return 0

    from flows.ablation import prepare_recipe_run
    from flows.common import resolve_config
    from flows.rl import rl
    from rubricem_core.rl.progress import completed_step, step_checkpoint
    from rubricem_core.runlock import run_dir_lock
    from rubricem_core.store import RunStore

    with tempfile.TemporaryDirectory() as tmp:
        work = Path(args.work_dir) if args.work_dir else Path(tmp) / "run"
        work.mkdir(parents=True, exist_ok=True)
        run_dir = copy_inputs(src, work)
        cfg = resolve_config(
            run_dir, args.profile or str(RunLayout(src).config_file), overrides, command="learning_curve"
        )
        # the settings the curve trains with, before the first step: a source run recorded by an older version
        # may carry RL settings of its own (they are the default without --profile)
        print(rl_settings_line(cfg, args.profile or f"{RunLayout(src).config_file} (the source run's)"), flush=True)
        per_window = 2 * cfg.rl.window
        ends = chunk_ends(args.steps, args.eval_every, per_window)
        # a final evaluation with N samples a query costs about N one-sample evaluations
        finals = (len(recipes) + 1) * args.final_samples
        progress = Progress(len(recipes) * args.steps, 1 + len(recipes) * len(ends) + finals)
        t0 = time.perf_counter()
        sft = evaluation(run_dir, str(RunLayout(work).sft_final))
        progress.ran("evals", 1, time.perf_counter() - t0)
        need = power(sft["per_query"]["independent"])
        print(
            f"SFT: built-in {sft['score']:.3f}, answer match {sft['independent']:.3f} on {sft['n']} graded "
            f"trajectories; per-query sd {need['sd']:.3f}: {need['n_needed']} held-out queries let 2 standard "
            f"errors resolve a gain of {need['gain']}\n{progress.line()}",
            flush=True,
        )
        subs = {r: prepare_recipe_run(run_dir, r) for r in recipes}
        points: dict[str, list[dict[str, Any]]] = {r: [] for r in recipes}
        wall: dict[str, float] = {r: 0.0 for r in recipes}
        done = 0
        for end in ends:
            for recipe in recipes:
                sub = subs[recipe]
                rl_cfg = cfg.rl.model_copy(update={"recipe": recipe, "n_windows": end // per_window})
                t0 = time.perf_counter()
                with run_dir_lock(sub, command="learning_curve"):
                    # a recipe already trained past this chunk (a longer curve, or one the defaults have moved
                    # on from since) is only evaluated: its recorded config is the later chunk's
                    if completed_step(RunStore(sub)) < end - 1:
                        resolve_config(sub, config=cfg.model_copy(update={"rl": rl_cfg}), command="learning_curve")
                        rl(run_dir=sub)
                    t1 = time.perf_counter()
                    progress.ran("steps", end - done, t1 - t0)
                    ev = evaluation(sub, str(step_checkpoint(RunStore(sub), end - 1)))
                    progress.ran("evals", 1, time.perf_counter() - t1)
                wall[recipe] += time.perf_counter() - t0
                ev["graded"] = graded(ev, sft)
                points[recipe].append({"step": end, **ev})
                ind, bi = ev["graded"]["independent"], ev["graded"]["builtin"]
                print(
                    f"{recipe} after {end} steps: answer match {ind['mean']:.3f} ({ind['gain']:+.3f} ± {ind['se']:.3f} "
                    f"vs SFT), built-in {bi['mean']:.3f} ({bi['gain']:+.3f} ± {bi['se']:.3f}); answered "
                    f"{ev['answered']:.2f}, valid {ev['valid']:.2f}, finals {_fmt(ev['independent_finals'])}\n"
                    f"{progress.line()}",
                    flush=True,
                )
            done = end

        final = None
        if args.final_samples and all(points[r] and points[r][-1]["step"] == ends[-1] for r in recipes):
            t0 = time.perf_counter()
            checkpoints = {f"{r} step {ends[-1]}": step_checkpoint(RunStore(subs[r]), ends[-1] - 1) for r in recipes}
            sampled = {**overrides, "eval.samples_per_query": args.final_samples}
            results = evaluate_checkpoints(work, work / "compare", ["sft", *map(str, checkpoints.values())], sampled)
            for result, name in zip(results[1:], checkpoints):
                result["name"] = name
            final = payload(results, args.final_samples, query_kinds(work / "compare"))
            (work / "compare" / "comparison.json").write_text(json.dumps(final, indent=1))
            progress.ran("evals", finals, time.perf_counter() - t0)
            print(progress.line(), flush=True)
        report(work, f"{cfg.profile} profile", recipes, subs, sft, points, args, overrides, wall, final)
    return 0


def report(
    work: Path,
    title_name: str,
    recipes: list[str],
    subs: dict[str, str],
    sft: dict[str, Any],
    points: dict[str, list[dict[str, Any]]],
    args: argparse.Namespace,
    overrides: dict[str, Any],
    wall: dict[str, float] | None = None,
    final: dict[str, Any] | None = None,
) -> None:
    """Print every recipe's step rows and evaluations, then write the PNG and the JSON (a partial curve too:
    whatever steps and evaluations are done); with ``final`` (comparison.json of --final-samples) its table,
    gains and figure line."""
    sft["graded"] = graded(sft, sft)
    summary: dict[str, Any] = {"steps": args.steps, "eval_every": args.eval_every, "overrides": overrides}
    summary["power"] = power(sft["per_query"]["independent"])
    rows_of: dict[str, Any] = {}
    for recipe in recipes:
        steps = step_rows(subs[recipe], args.steps)
        rows_of[recipe] = steps
        spent = f", {wall[recipe] / 60:.1f} min in all (evaluations included)" if wall else ""
        print(f"\n== {recipe}: {len(steps)} steps{spent}")
        print(
            "step phase   R_plan R_res  R_rev  R_ans  match guided valid  refl_valid bank  kl      adv   tokens gen   "
            "roll_s judge_s upd_s"
        )
        for row in steps:
            print(
                f"{row['step']:>4} {row['phase']:<7} "
                + " ".join(f"{_fmt(row[f'R_{s}']):>6}" for s in STAGE_NAMES)
                + f" {_fmt(row['train_answer_match']):>5} {row['guided']:>6.2f}"
                + f" {row['valid_scaffold']:>6.2f} {_fmt(row['reflection_valid']):>10} "
                f"{_fmt(row['bank_size'], '.0f'):>4} {_fmt(row['kl'], '.4f'):>7} {_fmt(row['advantaged']):>5} "
                f"{row['tokens']:>6} "
                f"{row['tokens_generated']:>5} {_fmt(row['rollout_s'], '.0f'):>6} "
                f"{_fmt(row['judge_wait_s'], '.0f'):>7} {_fmt(row['update_s'], '.0f'):>5}"
            )
        if steps:
            parts = {k: sum(r[k] for r in steps) / len(steps) for k in ("rollout_s", "judge_wait_s", "update_s")}
            print(
                f"mean step {sum(parts.values()):.0f} s: rollouts {parts['rollout_s']:.0f} s + judge after "
                f"them {parts['judge_wait_s']:.0f} s + update {parts['update_s']:.0f} s"
            )
            print("training rollouts' answer match: " + training_match_line(steps))
            by_phase = phase_means(steps)
            summary.setdefault("by_phase", {})[recipe] = by_phase
            for line in phase_table(by_phase):
                print(line)
        print("eval  answer-match  vs SFT ± se      built-in  vs SFT ± se      answered valid finals refl_valid")
        for step, ev in [(0, sft)] + [(p["step"], p) for p in points[recipe]]:
            ind, bi = ev["graded"]["independent"], ev["graded"]["builtin"]
            print(
                f"{step:>4} {ind['mean']:>12.3f}  {ind['gain']:>+6.3f} ± {_fmt(ind['se'], '.3f'):>5} "
                f"{bi['mean']:>9.3f}  {bi['gain']:>+6.3f} ± {_fmt(bi['se'], '.3f'):>5}  {ev['answered']:>8.2f} "
                f"{ev['valid']:>5.2f} {_fmt(ev['independent_finals']):>6} {_fmt(ev['reflection_valid']):>10}"
            )
    if len(recipes) >= 2 and all(points[r] for r in recipes[-2:]):
        a, b = recipes[-2], recipes[-1]
        step = min(points[a][-1]["step"], points[b][-1]["step"])
        at = {r: next(p for p in points[r] if p["step"] == step) for r in (a, b)}
        for grader in GRADERS:
            diff, diff_se = paired_gain(at[b]["per_query"][grader], at[a]["per_query"][grader])
            summary[f"{b}_minus_{a}_{grader}"] = {"step": step, "gain": diff, "se": diff_se}
            print(f"{b} − {a} after {step} steps ({grader}): {diff:+.3f} ± {diff_se:.3f} (paired by query)")
    if final is not None:
        summary["final_comparison"] = final_gains(final)
    png = work / "learning_curve.png"
    plot_curves(points, sft, f"{title_name}: {', '.join(recipes)} from one SFT checkpoint", png)
    document = {**curve_json(sft, points, rows_of), "summary": summary}
    if final is not None:
        document["final_comparison"] = final
    (work / "learning_curve.json").write_text(json.dumps(document, indent=1, default=float))
    for wanted, made in ((args.png, png), (args.json, work / "learning_curve.json")):
        if wanted:
            Path(wanted).write_bytes(made.read_bytes())
    print(f"plot: {args.png or png}\njson: {args.json or work / 'learning_curve.json'}")
    goal = "> 0 by more than 2 standard errors"
    last = points[recipes[-1]][-1]["graded"]["independent"] if points[recipes[-1]] else {"gain": math.nan}
    met = None if math.isnan(last["gain"]) else bool(last["gain"] > 0 and last["gain"] > 2 * last["se"])
    print(figure_line(f"{recipes[-1]}_minus_sft", last["gain"], "score", goal, met))
    if final is not None:
        ind = summary["final_comparison"]["vs_first"][final["checkpoints"][-1]["name"]]["independent"]
        met = bool(ind["gain"] > 0 and ind["gain"] > 2 * ind["se"])
        name = f"{recipes[-1]}_minus_sft.{final['samples_per_query']}_samples"
        print(figure_line(name, ind["gain"], "score", goal, met))


def final_gains(final: dict[str, Any]) -> dict[str, Any]:
    """From a comparison.json: every later checkpoint's gain over the first (SFT) and the last one's over the
    one before it (`full` − `ss_grpo`), on both graders, paired by query; printed as a table."""
    cps = final["checkpoints"]
    print_table(final)
    print_kind_table(final)

    def gains(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
        out = {}
        for grader in GRADERS:
            gain, se = paired_gain(a[grader], b[grader])
            out[grader] = {"gain": gain, "se": se}
        return out

    out: dict[str, Any] = {"samples_per_query": final["samples_per_query"]}
    out["vs_first"] = {c["name"]: gains(c, cps[0]) for c in cps[1:]}
    if len(cps) >= 3:
        key = f"{cps[-1]['name']} − {cps[-2]['name']}"
        out[key] = gains(cps[-1], cps[-2])
        print(f"{key}: " + ", ".join(f"{g} {v['gain']:+.3f} ± {v['se']:.3f}" for g, v in out[key].items()))
    return out


def training_match_line(steps: list[dict[str, Any]]) -> str:
    """The training rollouts' answer match by phase (replay steps see their queries a second time) and by
    whether retrieval put guidance in the prompt, averaged over steps."""

    def mean_of(rows: list[dict[str, Any]]) -> str:
        values = [r["train_answer_match"] for r in rows if not math.isnan(r["train_answer_match"])]
        return f"{sum(values) / len(values):.3f} ({len(values)} steps)" if values else "n/a"

    parts = [f"{phase} {mean_of([r for r in steps if r['phase'] == phase])}" for phase in ("new", "repeat")]
    guided = [r for r in steps if r["guided"] > 0.5]
    parts.append(f"guided steps {mean_of(guided)}, unguided {mean_of([r for r in steps if r['guided'] <= 0.5])}")
    return "; ".join(parts)


PHASE_COLUMNS = (
    ("valid_scaffold", "valid scaffolds"),
    ("train_answer_match", "answer match"),
    ("kl", "KL"),
    ("advantaged", "trained tokens with an advantage"),
)


def phase_means(steps: list[dict[str, Any]]) -> dict[str, dict[str, dict[str, float]]]:
    """The training rollouts' means by phase (new queries; repeat: the same queries again, guided by their
    own reflections in `full`) in the first and second half of the steps: {column: {phase: {half: mean}}}.
    A fall on the repeat steps alone is what session 28's collapse looked like (docs/learning.md)."""
    if not steps:
        return {}
    middle = (steps[0]["step"] + steps[-1]["step"] + 1) / 2
    halves = {
        f"steps {steps[0]['step']}–{math.ceil(middle) - 1}": [r for r in steps if r["step"] < middle],
        f"steps {math.ceil(middle)}–{steps[-1]['step']}": [r for r in steps if r["step"] >= middle],
    }
    out: dict[str, dict[str, dict[str, float]]] = {}
    for column, _ in PHASE_COLUMNS:
        out[column] = {}
        for phase in ("new", "repeat"):
            out[column][phase] = {}
            for half, rows in halves.items():
                # a run from before a column's metric existed has none (NaN)
                found = [r.get(column, math.nan) for r in rows if r["phase"] == phase]
                values = [v for v in found if not math.isnan(v)]
                out[column][phase][half] = sum(values) / len(values) if values else math.nan
    return out


def phase_table(by_phase: dict[str, dict[str, dict[str, float]]]) -> list[str]:
    """``phase_means`` as printed lines, one per column and phase."""
    lines = []
    for column, label in PHASE_COLUMNS:
        for phase, halves in by_phase.get(column, {}).items():
            spec = ".4f" if column == "kl" else ".2f"
            values = ", ".join(f"{half} {_fmt(v, spec)}" for half, v in halves.items())
            lines.append(f"{label}, {phase}-query steps: {values}")
    return lines


def power(per_query: dict[str, float], gain: float = 0.1) -> dict[str, float]:
    """How many held-out queries let 2 standard errors of a paired gain resolve ``gain``, from the SFT
    evaluation's per-query spread: the paired difference of two policies whose per-query scores vary as
    SFT's does and are independent has sd √2·sd (an upper bound: scores correlated across policies by
    query difficulty shrink it); n = (2·√2·sd / gain)²."""
    values = list(per_query.values())
    if len(values) < 2:
        return {"sd": math.nan, "n_needed": math.nan, "gain": gain, "n": float(len(values))}
    mean = sum(values) / len(values)
    sd = math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1))
    return {"sd": sd, "n_needed": math.ceil((2 * math.sqrt(2) * sd / gain) ** 2), "gain": gain, "n": float(len(values))}


def report_only(args: argparse.Namespace, recipes: list[str], overrides: dict[str, Any]) -> int:
    """The curve so far from the work directory's tables: no training, no sampling."""
    from rubricem_core.config import load_config

    work = Path(args.work_dir)
    layout = RunLayout(work)
    if not layout.config_file.exists():
        raise SystemExit(f"--report: {work} has no config.yaml (no curve started there)")
    cfg = load_config(str(layout.config_file))
    ends = chunk_ends(args.steps, args.eval_every, 2 * cfg.rl.window)
    sft = read_evaluation(str(work), "sft")
    if not sft["n"]:
        raise SystemExit(f"--report: the SFT checkpoint in {work} has not been evaluated yet")
    subs = {r: str(layout.ablation_run_dir(r)) for r in recipes}
    points: dict[str, list[dict[str, Any]]] = {r: [] for r in recipes}
    for recipe in recipes:
        for end in ends:
            ev = read_evaluation(subs[recipe], f"rl-step-{end - 1:06d}")
            if not ev["n"]:
                break
            ev["graded"] = graded(ev, sft)
            points[recipe].append({"step": end, **ev})
    comparison = work / "compare" / "comparison.json"
    final = json.loads(comparison.read_text()) if comparison.exists() else None
    report(work, f"{cfg.profile} profile", recipes, subs, sft, points, args, overrides, final=final)
    return 0


if __name__ == "__main__":
    from flows.prefect_server import owned_ephemeral_server

    with owned_ephemeral_server():  # dies with this script, also when it is killed (flows/prefect_server.py)
        sys.exit(main())
