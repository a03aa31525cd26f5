"""Flow `ablation`: the paper's recipes from one SFT checkpoint with matched budgets, then evaluation.

Each recipe trains in its own sub run directory ``<run_dir>/ablation/<recipe>`` that starts from a copy
of the run's `queries`, `corpus`, `teacher_reflections` (when collected: the warm reflection bank) and
SFT policy; every recipe gets the same RL budget (steps, queries per
step, group size, seed — so the same query schedule), only ``rl.recipe`` differs. Each final checkpoint
(with rl.eval_every also each learning-curve checkpoint), and the SFT policy as the reference, is evaluated
with the `evaluate` flow; the summary lands in the `ablation` table of the parent run, a bar plot in
``<run_dir>/ablation/ablation.png`` and the learning curves in ``ablation_curve.png`` (and MLflow).
A rerun resumes: RL continues after its last finished step, finished evaluations are read back.
"""

from __future__ import annotations

import shutil
import uuid
from pathlib import Path
from typing import Any

from prefect import flow, get_run_logger

from flows.common import RUN_HOOKS, Profile, resolve_config, writes_run_dir
from flows.evaluate import evaluate
from flows.rl import rl
from rubricem_core.eval.ablation import ablation_curve_plot, ablation_plot, ablation_rows, final_rows
from rubricem_core.eval.checkpoints import checkpoint_updates
from rubricem_core.layout import RunLayout
from rubricem_core.recipes import RECIPES
from rubricem_core.rl.curriculum import schedule_length
from rubricem_core.rl.progress import curve_checkpoints, start_policy
from rubricem_core.runlock import run_dir_lock
from rubricem_core.schemas import ABLATION_SCHEMA
from rubricem_core.store import RunStore, atomic_write_bytes
from rubricem_core.tracking import Tracker

DEFAULT_RECIPES = ("baseline", "ss_grpo", "meta_policy", "full")


def _copy_once(src: Path, dst: Path) -> None:
    """Copy a directory unless it is already there; a copy appears whole or not at all."""
    if dst.exists():
        return
    staging = dst.parent / f".{dst.name}.{uuid.uuid4().hex[:8]}.tmp"
    shutil.copytree(src, staging)
    staging.rename(dst)


def prepare_recipe_run(run_dir: str, recipe: str) -> str:
    """``<run_dir>/ablation/<recipe>`` with the parent's inputs and SFT policy (copied once): the queries,
    the corpus and, when collected, the teacher's reflections (they warm the reflection bank of the
    recipes that reflect, ``reflection.warm_bank``; without them a sub run's bank starts empty)."""
    parent_store = RunStore(run_dir)
    parent = parent_store.layout
    sub = RunLayout(parent.ablation_run_dir(recipe))
    for table in ("queries", "corpus"):
        _copy_once(parent.table_dir(table), sub.table_dir(table))
    if parent.table_dir("teacher_reflections").exists():
        _copy_once(parent.table_dir("teacher_reflections"), sub.table_dir("teacher_reflections"))
    _copy_once(start_policy(parent_store), sub.sft_final)
    return str(sub.root)


@flow(name="ablation", flow_run_name="ablation · {run_dir}", **RUN_HOOKS)
@writes_run_dir
def ablation(
    run_dir: str = "runs/tiny",
    profile: Profile = None,
    overrides: dict[str, Any] | None = None,
    recipes: list[str] | None = None,
    benchmarks: list[str] | None = None,
    retrieval: str | None = None,
) -> dict[str, Any]:
    """Train each recipe from the run's SFT policy with the same budget and evaluate it.

    Args:
        run_dir: a run directory with `queries`, `corpus` and checkpoints/sft/final.
        profile: profile name under data/profiles or a YAML path; None: the run directory's own config.yaml
            (the tiny profile for a new run directory).
        overrides: dotted-key overrides shared by every recipe (budgets: rl.*, rollout.*).
        recipes: recipes to compare (default: baseline, ss_grpo, meta_policy, full).
        benchmarks: benchmarks to evaluate on (default: eval.benchmarks).
        retrieval: test-time reflection guidance none | cross | within (default: eval.retrieval).
    """
    log = get_run_logger()
    names = list(recipes or DEFAULT_RECIPES)
    unknown = [r for r in names if r not in RECIPES]
    if unknown or not names:
        raise ValueError(f"ablation recipes {unknown or names} unknown or empty; choose from {sorted(RECIPES)}")
    cfg = resolve_config(run_dir, profile, overrides, command="ablation")
    store = RunStore(run_dir)
    sft_policy = start_policy(store)  # fail before any training when there is no SFT policy
    budget = {
        "rl_steps": schedule_length(cfg.rl.window, cfg.rl.n_windows),
        "queries_per_step": cfg.rl.queries_per_step,
        "group_size": cfg.rollout.group_size,
    }
    rows = []
    reference = evaluate(run_dir=run_dir, checkpoint=str(sft_policy), benchmarks=benchmarks, retrieval=retrieval)
    rows += ablation_rows("sft", reference, {**budget, "rl_steps": 0}, run_dir)
    for recipe in names:
        sub = prepare_recipe_run(run_dir, recipe)
        sub_cfg = cfg.model_copy(update={"rl": cfg.rl.model_copy(update={"recipe": recipe})})
        with run_dir_lock(sub, command="ablation"):
            resolve_config(sub, config=sub_cfg, command="ablation")  # the recipe's run reads it from its directory
            trained = rl(run_dir=sub)
            for checkpoint in curve_checkpoints(RunStore(sub), sub_cfg, before_last=True):
                evaluation = evaluate(
                    run_dir=sub, checkpoint=str(checkpoint), benchmarks=benchmarks, retrieval=retrieval
                )
                rows += ablation_rows(recipe, evaluation, budget, sub)
            evaluation = evaluate(
                run_dir=sub, checkpoint=trained["final_checkpoint"], benchmarks=benchmarks, retrieval=retrieval
            )
        rows += ablation_rows(recipe, evaluation, budget, sub)
        log.info("ablation %s: %s", recipe, {r["benchmark"]: r["score_mean"] for r in rows if r["recipe"] == recipe})
    store.write_table("ablation", rows, schema=ABLATION_SCHEMA)
    plot = store.layout.ablation_plot
    atomic_write_bytes(plot, ablation_plot(rows, f"Recipe ablation ({budget['rl_steps']} RL steps each)"))
    curve = store.layout.ablation_curve_plot if cfg.rl.eval_every is not None else None
    if curve is not None:
        atomic_write_bytes(
            curve, ablation_curve_plot(rows, f"Learning curves (evaluated every {cfg.rl.eval_every} steps)")
        )
    if cfg.tracking.enabled:
        tracker = Tracker(run_dir, experiment=cfg.tracking.experiment, uri=cfg.tracking.uri)
        with tracker.child_run("ablation", params={"ablation.recipes": ",".join(names), **budget}) as child:
            # one series per recipe and benchmark, by policy updates (SFT 0): the final score is its last point
            by_step: dict[int, dict[str, float]] = {}
            for r in rows:
                if r["score_mean"] is not None:
                    name = f"ablation/{r['recipe']}/{r['benchmark']}/score_mean"
                    by_step.setdefault(checkpoint_updates(r["checkpoint"]), {})[name] = r["score_mean"]
            for step, metrics in sorted(by_step.items()):
                child.log_metrics(metrics, step=step)
            child.log_artifact(plot, "ablation")
            if curve is not None:
                child.log_artifact(curve, "ablation")
    return {
        "recipes": names,
        "budget": budget,
        "rows": rows,
        "final": final_rows(rows),
        "plot": str(plot),
        "curve_plot": str(curve) if curve is not None else None,
    }
