"""Flow `rl`: the windowed RL loop; every step is the subflow `rl_step`.

Window K (rl.window): K steps of fresh query batches, then the same K batches replayed. Each rl_step
runs the tasks rollout → judge (rubric generation, scoring, buffer update) → ss-grpo-update (with a
resumable checkpoint every rl.checkpoint_every steps and at the last step); a retried run skips every
step and task whose Parquet exists and whose update the progress file marks done, and replays the
updates after the newest checkpoint from their tables (docs/checkpointing.md).

With the reflection meta-policy (recipes meta_policy, full) a step N also runs
  reflection-update (on step N−1's candidates)  alongside  rollout      (submitted together),
  reflection-candidates (the policy's; new-query steps)  alongside  judge, and
  reflect (reflection judge, bank)                    alongside  ss-grpo-update,
so the Prefect timeline shows the overlap. `reflection.schedule: sync` runs the same tasks one after
another in the same order of weight changes, so both schedules give the same numbers.

With one-step asynchronous RL (rl.async_steps: 1, the paper's) a step N runs
  judge (of the rollouts sampled during step N−1)  →  reflection-update, ss-grpo-update
                                          alongside  rollout of step N+1, reflect of step N
with the engine sampling the weights after step N−1 while the trainer moves to N (policy lag one;
rl.importance_correction: tis corrects it). `reflection.schedule: sync` runs that work one task after
another: again the same numbers.
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import Any

from prefect import flow, get_run_logger
from prefect.utilities.annotations import quote

from flows.common import (
    RUN_HOOKS,
    Profile,
    mlflow_links,
    prefect_links,
    publish_markdown,
    require_tables,
    resolve_config,
    writes_run_dir,
)
from rubricem_core.config import RunConfig, flatten
from rubricem_core.progress import Progress
from rubricem_core.recipes import get_recipe
from rubricem_core.registry import register_stage_policy, version_link
from rubricem_core.report.markdown import rl_markdown
from rubricem_core.rl.curriculum import StepPlan, reflect_before_next_rollouts, windowed_schedule
from rubricem_core.rl.learner import step_updates
from rubricem_core.rl.progress import completed_step, start_policy, step_checkpoint
from rubricem_core.rl.session import SessionManager, open_session, recipe_settings, reflection_on
from rubricem_core.splits import rl_queries
from rubricem_core.store import RunStore
from rubricem_core.tracking import Tracker
from tasks.reflection import reflect_task, reflection_candidates_task, reflection_update_task
from tasks.rl import judge_task, rollout_task, step_metrics, step_metrics_logged, update_task
from tasks.secrets import check_endpoint_keys


@flow(name="rl_step", flow_run_name="step-{plan.step}-{plan.phase}", **RUN_HOOKS)
def rl_step(
    run_dir: str,
    cfg: RunConfig,
    plan: StepPlan,
    session: SessionManager,
    previous: StepPlan | None = None,
    next_plan: StepPlan | None = None,
) -> None:
    """One RL step: rollouts with the current weights, the stagewise judge, the SS-GRPO update, and with
    the reflection loop the deferred reflection update of ``previous`` and this step's reflections.
    With rl.async_steps: 1 the step's rollouts were sampled during ``previous``'s update, and
    ``next_plan``'s, with this step's reflections, are sampled during this one (_engine_work).
    ``session``: the `rl` flow run's (open_session), handed to every task; ``run_dir`` and ``cfg`` are
    its own, kept as parameters for the Prefect UI and the crashed-run cleanup (flows.common).

    Returns nothing: the step's metrics are its tasks' saved ones (``step_metrics``). Prefect links
    whatever a subflow returns to the parent flow run (``FlowRunContext.run_results``, one entry per
    value) for the parent's whole life, so a returned metrics dict grew the `rl` flow by ~16 KiB a step."""
    overlap = cfg.reflection.schedule == "deferred"
    if cfg.rl.async_steps:  # the step's rollouts: sampled during the previous update, or now if a kill lost them
        catch_up = _engine_work(session, previous, plan) if previous is not None else [(rollout_task, session, plan)]
        _alongside(False, _not_written(session, catch_up), [])
    pending = _reflections_to_train(session, plan, previous)
    reflection_update = [(reflection_update_task, session, pending, plan.step)] if pending else []
    if cfg.rl.async_steps:  # the trainer's updates beside the engine's next rollouts and this step's reflections
        judge_task(session, plan)
        _alongside(overlap, [*reflection_update, (update_task, session, plan)], _engine_work(session, plan, next_plan))
        return
    _alongside(overlap, [(rollout_task, session, plan)], reflection_update)
    if not plan.reflects:
        judge_task(session, plan)
        update_task(session, plan)
        return
    # the policy writes the step's reflection candidates (from the rollouts alone) while the judge scores
    # them; the reflection judge and the bank then run beside the update
    (candidates,) = _alongside(overlap, [(judge_task, session, plan)], [(reflection_candidates_task, session, plan)])
    _alongside(overlap, [(update_task, session, plan)], [(reflect_task, session, plan, quote(candidates))])


def _engine_work(session: SessionManager, plan: StepPlan, next_plan: StepPlan | None) -> list[tuple]:
    """What the engine samples during ``plan``'s update with one-step async, in its fixed order
    (curriculum.reflect_before_next_rollouts): ``next_plan``'s rollouts and ``plan``'s reflections."""
    work = [(rollout_task, session, next_plan)] if next_plan is not None else []
    if plan.reflects:
        reflect = (reflect_task, session, plan)
        first = reflect_before_next_rollouts(plan, next_plan, session.cfg.rl.window)
        work = [reflect, *work] if first else [*work, reflect]
    return work


def _not_written(session: SessionManager, work: list[tuple]) -> list[tuple]:
    """The engine tasks of ``work`` whose table a killed run did not write (rollouts, reflections)."""
    table = {rollout_task: "rollouts", reflect_task: "reflections"}
    return [call for call in work if not session.store.has(table[call[0]], {"step": call[2].step})]


def _reflections_to_train(session: SessionManager, plan: StepPlan, previous: StepPlan | None) -> StepPlan | None:
    """The step whose reflection candidates this step trains on (its reflection update in
    rl.learner.step_updates; its reflections written now if a killed run left them out)."""
    sources = [u.source_step for u in step_updates(session.cfg, plan.step) if u.kind == "reflection"]
    if previous is None or sources != [previous.step]:
        return None
    if not session.store.has("reflections", {"step": previous.step}):
        reflect_task(session, previous)  # the previous step's reflections (its metrics are that step's)
    return previous


def _alongside(overlap: bool, main: list[tuple], side: list[tuple]) -> list[Any]:
    """Run the ``main`` tasks (each a task and its arguments) one after another, and the ``side`` tasks
    one after another beside them: submitted to run concurrently when ``overlap``
    (reflection.schedule: deferred), else after ``main`` — the same order of weight changes either
    way, so both schedules give the same numbers. The ``side`` tasks' results, in order."""
    if not overlap:
        for task, *args in main:
            task(*args)
        return [task(*args) for task, *args in side]
    futures: list[Any] = []
    for task, *args in side:  # each waits for the one before it
        futures.append(task.submit(*args, wait_for=futures[-1:]))
    try:
        for task, *args in main:
            task(*args)
    finally:
        for future in futures:
            future.wait()  # a failure of one must not leave the other still changing the weights
    return [future.result() for future in futures]


def _finish_done_step(session: SessionManager, plan: StepPlan, next_plan: StepPlan | None, child: Any) -> None:
    """A step a killed run marked done but did not finish: its reflections (written alongside the
    update; sampled with the weights after the step before, replayed from the tables when no checkpoint
    kept them), with one-step async the next step's rollouts too, in the engine's order, and its
    metrics, from the tasks' saved metrics."""
    store = session.store
    if session.cfg.rl.async_steps:
        for task, *args in _not_written(session, _engine_work(session, plan, next_plan)):
            task(*args)
    elif plan.reflects and not store.has("reflections", {"step": plan.step}):
        reflect_task(session, plan)
    if child is not None and not step_metrics_logged(store, "rl", plan.step):
        child.log_metrics(step_metrics(store, plan.step), step=plan.step)


def step_table(store: RunStore, plans: list[StepPlan]) -> list[dict[str, Any]]:
    """One row per finished step for the flow run's artifact (the tasks' saved metrics)."""
    done = completed_step(store)
    return [
        {"step": p.step, "phase": p.phase, "retrieval": p.retrieval, **step_metrics(store, p.step)}
        for p in plans
        if p.step <= done
    ]


def rl_plans(store: RunStore, cfg: RunConfig) -> list[StepPlan]:
    queries = [q["query_id"] for q in rl_queries(store.read_rows("queries"), cfg.data.rl_filter)]
    reflecting = get_recipe(cfg.rl.recipe).reflection
    return windowed_schedule(
        queries, cfg.rl.window, cfg.rl.n_windows, cfg.rl.queries_per_step, cfg.seed, reflection=reflecting
    )


@flow(name="rl", flow_run_name="rl · {run_dir}", **RUN_HOOKS)
@writes_run_dir
def rl(
    run_dir: str = "runs/tiny",
    profile: Profile = None,
    overrides: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Windowed RL from the run's SFT checkpoint.

    Args:
        run_dir: a run directory with `queries`, `corpus` and checkpoints/sft/final.
        profile: profile name under data/profiles or a YAML path; None: the run directory's own config.yaml
            (the tiny profile for a new run directory).
        overrides: dotted-key overrides, e.g. {"rl.recipe": "baseline"}.
    """
    log = get_run_logger()
    cfg = resolve_config(run_dir, profile, overrides, command="rl")
    check_endpoint_keys(cfg.judge, *([cfg.reflection.judge] if reflection_on(cfg) else []))
    require_tables(run_dir, ["queries", "corpus"], "collect-sft-data")
    store = RunStore(run_dir)
    start_policy(store)  # names `rubricem sft` when there is no SFT policy
    plans = rl_plans(store, cfg)
    rs = recipe_settings(cfg)
    tracker = Tracker.from_config(run_dir, cfg.tracking)
    params = flatten(
        {
            "rl": cfg.rl.model_dump(mode="json"),
            "rollout": cfg.rollout.model_dump(mode="json"),
            "judge": cfg.judge.model_dump(mode="json"),
        }
    )
    params["rl.lambda"] = str(rs.lam.tolist())
    last: dict[str, float] = {}
    with (
        tracker.child_run("rl", params=params, tags=prefect_links()) if tracker else nullcontext() as child,
        # trainer (ranks), engine and fleet live for this flow run: stopped when it ends, however it ends
        open_session(store, cfg) as session,
    ):
        done = completed_step(store)
        if done >= 0:
            log.info("resuming RL after step %d", done)
        progress = Progress("RL step", len(plans), log.info, every_s=0.0, start_done=sum(p.step <= done for p in plans))
        for i, plan in enumerate(plans):
            next_plan = plans[i + 1] if i + 1 < len(plans) else None
            if plan.step <= done:  # its update is in the newest checkpoint or replayed from its tables
                _finish_done_step(session, plan, next_plan, child)
                continue
            rl_step(run_dir, cfg, plan, session, plans[i - 1] if i > 0 else None, next_plan)
            metrics = step_metrics(store, plan.step)  # what the step's tasks returned
            if metrics and child is not None:
                child.log_metrics(metrics, step=plan.step)
            last = metrics or last
            progress.update(i + 1, f"step {plan.step} ({plan.phase}, retrieval {plan.retrieval}) done")
        final = step_checkpoint(store, plans[-1].step)
        version = register_stage_policy(
            tracker, child, cfg.tracking, run_dir, final, stage="rl", step=plans[-1].step, recipe=cfg.rl.recipe
        )
        if version is not None:
            log.info("RL policy registered: %s version %s (%s)", version.name, version.version, version.url)
        publish_markdown(
            "rl",
            run_dir,
            rl_markdown(
                step_table(store, plans),
                cfg.rl.recipe,
                len(plans),
                run_dir,
                **mlflow_links(tracker, child),
                model_link=version_link(version),
            ),
            f"RL of {run_dir}: one row per step",
        )
    return {
        "steps": len(plans),
        "final_checkpoint": str(final),
        "recipe": cfg.rl.recipe,
        "last_metrics": {k: v for k, v in last.items() if k.startswith(("reward/", "rl/loss", "rl/kl"))},
    }
