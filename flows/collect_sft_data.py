"""Flow `collect_sft_data`: teacher traces over tool-using rounds → filtered `sft_trajectories`."""

from __future__ import annotations

from contextlib import nullcontext
from typing import Any

from prefect import flow, get_run_logger

from flows.common import (
    RUN_HOOKS,
    Profile,
    mlflow_links,
    prefect_links,
    publish_markdown,
    resolve_config,
    writes_run_dir,
)
from rubricem_core.config import flatten
from rubricem_core.report.markdown import collection_markdown
from rubricem_core.tracking import Tracker
from tasks.collect import filter_trajectories, teacher_reflections, teacher_round
from tasks.inputs import prepare_inputs
from tasks.secrets import check_endpoint_keys

# how hard the teacher's endpoint pushed back in a round (a cached round has only the retries)
RETRY_METRICS = ("llm_retries", "llm_rate_limited", "llm_wait_seconds")


@flow(name="collect_sft_data", flow_run_name="collect_sft_data · {run_dir}", **RUN_HOOKS)
@writes_run_dir
def collect_sft_data(
    run_dir: str = "runs/tiny",
    profile: Profile = None,
    overrides: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Collect stage-structured teacher trajectories and filter them for SFT.

    Args:
        run_dir: the run directory (Parquet tables, MLflow, state).
        profile: profile name under data/profiles or a YAML path; None: the run directory's own config.yaml
            (the tiny profile for a new run directory).
        overrides: dotted-key overrides of the profile, e.g. {"teacher.max_rounds": 6}.
    """
    log = get_run_logger()
    cfg = resolve_config(run_dir, profile, overrides, command="collect_sft_data")
    check_endpoint_keys(cfg.teacher)
    tracker = Tracker.from_config(run_dir, cfg.tracking)
    run = (
        tracker.child_run("collect_sft_data", params=flatten(cfg.model_dump(mode="json")), tags=prefect_links())
        if tracker
        else None
    )
    with run if run is not None else nullcontext() as child:
        inputs = prepare_inputs(run_dir, cfg)
        last_round = -1
        totals = {"requests": 0, "failed": 0, "prompt_tokens": 0, "completion_tokens": 0, "cost_usd": 0.0}
        for r in range(cfg.teacher.max_rounds):
            summary = teacher_round(run_dir, cfg, r)
            last_round = r
            for k in totals:
                totals[k] += summary.get(k, 0)
            if child is not None:  # cached rounds too: a killed run may not have mirrored them (same rows, replaced)
                logged = ("requests", "failed", "unfinished", "cost_usd", *RETRY_METRICS)
                child.log_metrics({f"teacher/{k}": float(summary[k]) for k in logged if k in summary}, step=r)
            if summary["unfinished"] == 0:
                break
        stats = filter_trajectories(run_dir, cfg, last_round)
        reflections = teacher_reflections(run_dir, cfg)
        stats.update({k: v for k, v in reflections.items() if k != "cached"})
        if child is not None:
            child.log_metrics(
                {
                    "sft/trajectories": stats["trajectories"],
                    "sft/accepted": stats["accepted"],
                    "sft/acceptance_rate": stats["acceptance_rate"],
                    "sft/mean_tool_calls": stats["mean_tool_calls"],
                    "teacher/total_cost_usd": stats["cost_usd"],
                    "teacher/total_requests": totals["requests"],
                    **{f"sft/rejected/{code}": n for code, n in stats["reject_reasons"].items()},
                    **(
                        {
                            "sft/reflections": reflections["reflections"],
                            "sft/reflections_valid": reflections["reflections_valid"],
                            **{
                                f"sft/reflection_rejected/{c}": n
                                for c, n in reflections["reflection_reject_codes"].items()
                            },
                        }
                        if reflections
                        else {}
                    ),
                },
                step=0,
            )
            child.log_dict(stats, "sft_collection_summary.json")
        publish_markdown(
            "collect-sft-data",
            run_dir,
            collection_markdown(stats, last_round + 1, totals, run_dir, **mlflow_links(tracker, child)),
            f"SFT data collection of {run_dir}: acceptance and reject codes",
        )
    log.info(
        "collected %d trajectories (%d accepted) from %d queries, %d valid teacher reflections; tables in %s/tables",
        stats["trajectories"],
        stats["accepted"],
        inputs["train_queries"],
        reflections.get("reflections_valid", 0),
        run_dir,
    )
    return {**stats, **inputs, "rounds": last_round + 1}
