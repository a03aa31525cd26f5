"""Flow `pipeline`: the whole RubricEM run on one profile — the README's main job.

collect_sft_data → sft → rl → evaluate (held-out queries, graded independently of training rewards; with
rl.eval_every also the SFT policy and every learning-curve checkpoint, oldest first, the final one last).
Each stage is a subflow, so the Prefect UI shows them nested under one pipeline run, and MLflow shows
one child run per stage under the run directory's parent run. The pipeline run's own log has a progress
line per stage and the end summary with its links; its Markdown artifact has the same.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from prefect import flow, get_run_logger

from flows.collect_sft_data import collect_sft_data
from flows.common import RUN_HOOKS, Profile, experiment_links, publish_markdown, resolve_config, writes_run_dir
from flows.evaluate import evaluate
from flows.rl import rl
from flows.sft import sft
from rubricem_core.config import RunConfig
from rubricem_core.progress import Progress, format_seconds
from rubricem_core.report.markdown import pipeline_markdown
from rubricem_core.report.summary import pipeline_summary
from rubricem_core.rl.progress import curve_checkpoints, start_policy
from rubricem_core.stage_costs import expected_costs, record_stage_seconds
from rubricem_core.store import RunStore
from rubricem_core.tracking import mlflow_ui_command

STAGES = ("collect_sft_data", "sft", "rl", "evaluate", "report")


def learning_curve_checkpoints(store: RunStore, cfg: RunConfig) -> list[Path]:
    """What rl.eval_every evaluates before the final checkpoint: the SFT policy, then the curve's RL
    checkpoints, oldest first ([] without rl.eval_every)."""
    if cfg.rl.eval_every is None:
        return []
    return [start_policy(store), *curve_checkpoints(store, cfg, before_last=True)]


@flow(name="pipeline", flow_run_name="pipeline · {run_dir}", **RUN_HOOKS)
@writes_run_dir
def pipeline(
    run_dir: str = "runs/tiny",
    profile: Profile = None,
    overrides: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Run every built stage in order on one run directory.

    Args:
        run_dir: the run directory (Parquet tables, checkpoints, MLflow, state).
        profile: profile name under data/profiles or a YAML path; None: the run directory's own config.yaml
            (the tiny profile for a new run directory).
        overrides: dotted-key overrides of the profile, e.g. {"rl.recipe": "baseline"}.
    """
    log = get_run_logger()
    cfg = resolve_config(run_dir, profile, overrides, command="pipeline")  # recorded: every stage reads it
    store = RunStore(run_dir)
    costs, source = expected_costs(store.layout.state_dir, cfg.profile, STAGES)
    stages = Progress("pipeline stage", len(STAGES), log.info, every_s=0.0, costs=costs)
    if costs is not None:
        log.info("pipeline: %d stages, ETA %s (from %s)", len(STAGES), format_seconds(sum(costs)), source)
    seconds: dict[str, float] = {}
    clock = time.monotonic()

    def done(stage: str, detail: str) -> None:
        nonlocal clock
        now = time.monotonic()
        seconds[stage], clock = now - clock, now
        stages.update(len(seconds), f"{stage}: {detail}")

    collected = collect_sft_data(run_dir=run_dir)
    done("collect_sft_data", f"{collected['accepted']} of {collected['trajectories']} trajectories accepted")
    tuned = sft(run_dir=run_dir)
    done("sft", f"{tuned['final_dir']}" + (" (read back)" if tuned.get("cached") else ""))
    trained = rl(run_dir=run_dir)
    done("rl", f"{trained['steps']} steps of {trained['recipe']}")
    for checkpoint in learning_curve_checkpoints(store, cfg):
        evaluate(run_dir=run_dir, checkpoint=str(checkpoint))
    evaluated = evaluate(run_dir=run_dir, checkpoint=trained["final_checkpoint"])
    done("evaluate", f"{evaluated['tag']} on {', '.join(evaluated['benchmarks'])}")
    from rubricem_core.report import write_report  # DuckDB: only where the HTML summary is written

    report = write_report(run_dir)  # the one-page HTML summary, also logged to the run's MLflow
    done("report", f"{report}")
    record_stage_seconds(store.layout.state_dir, seconds)  # the next run of this directory estimates from these
    result = {"collect_sft_data": collected, "sft": tuned, "rl": trained, "evaluate": evaluated, "report": str(report)}
    links = experiment_links(cfg, run_dir)
    summary = pipeline_summary(result, cfg.profile, run_dir)
    if links["mlflow_url"]:
        start = f" ({mlflow_ui_command(links['mlflow_db'])})" if links["mlflow_db"] else ""
        summary += f"\n  MLflow:     {links['mlflow_url']}{start}"
    log.info("%s", summary)
    publish_markdown(
        "pipeline", run_dir, pipeline_markdown(result, cfg.profile, run_dir, **links), f"pipeline of {run_dir}"
    )
    return result
