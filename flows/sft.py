"""Flow `sft`: fine-tune the policy on accepted `sft_trajectories` (tool outputs masked)."""

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
    require_tables,
    resolve_config,
    writes_run_dir,
)
from rubricem_core.config import flatten
from rubricem_core.registry import register_stage_policy, version_link
from rubricem_core.report.markdown import sft_markdown
from rubricem_core.tracking import Tracker
from tasks.sft import ARTIFACT_MAX_BYTES, checkpoint_size, prepare_policy_task, train_sft_task


@flow(name="sft", flow_run_name="sft · {run_dir}", **RUN_HOOKS)
@writes_run_dir
def sft(
    run_dir: str = "runs/tiny",
    profile: Profile = None,
    overrides: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Supervised fine-tuning of the policy on the run's accepted teacher trajectories.

    Args:
        run_dir: a run directory that holds `sft_trajectories` (from collect_sft_data).
        profile: profile name under data/profiles or a YAML path; None: the run directory's own config.yaml
            (the tiny profile for a new run directory).
        overrides: dotted-key overrides, e.g. {"sft.epochs": 4}.
    """
    log = get_run_logger()
    cfg = resolve_config(run_dir, profile, overrides, command="sft")
    require_tables(run_dir, ["corpus", "sft_trajectories"], "collect-sft-data")
    tracker = Tracker.from_config(run_dir, cfg.tracking)
    params = flatten(
        {"policy": cfg.policy.model_dump(mode="json"), "sft": cfg.sft.model_dump(mode="json"), "seed": cfg.seed}
    )
    with tracker.child_run("sft", params=params, tags=prefect_links()) if tracker else nullcontext() as child:
        policy_dir = prepare_policy_task(run_dir, cfg)
        result = train_sft_task(run_dir, cfg, policy_dir, log_metrics=child.log_metrics if child else None)
        if child is not None and not result.get("cached"):
            child.log_dict({k: v for k, v in result.items()}, "sft_summary.json")
            child.set_tags({"checkpoint.final": result["final_dir"], "policy.base": policy_dir})
            if not cfg.tracking.register_model and checkpoint_size(result["final_dir"]) <= ARTIFACT_MAX_BYTES:
                child.log_artifact(result["final_dir"], artifact_path="checkpoints/sft_final")
        # the registered version's artifact is the checkpoint's serving files; the same weights register once
        version = register_stage_policy(tracker, child, cfg.tracking, run_dir, result["final_dir"], stage="sft")
        if version is not None:
            log.info("SFT policy registered: %s version %s (%s)", version.name, version.version, version.url)
        publish_markdown(
            "sft",
            run_dir,
            sft_markdown(result, run_dir, **mlflow_links(tracker, child), model_link=version_link(version)),
            f"SFT of {run_dir}",
        )
    log.info("SFT policy: %s", result["final_dir"])
    return result
