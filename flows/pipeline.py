"""Flow `pipeline`: the whole RubricEM run on one profile — the README's main job.

collect_sft_data → sft → rl → evaluate (held-out queries, graded independently of training rewards).
Each stage is a subflow, so the Prefect UI shows them nested under one pipeline run, and MLflow shows
one child run per stage under the run directory's parent run.
"""
from __future__ import annotations

from typing import Any

from prefect import flow

from flows.collect_sft_data import collect_sft_data
from flows.common import resolve_config, writes_run_dir
from flows.evaluate import evaluate
from flows.rl import rl
from flows.sft import sft
from rubricem_core.config import RunConfig
from tasks.rl import drop_sessions


@flow(name="pipeline")
@writes_run_dir
def pipeline(
    run_dir: str = "runs/tiny",
    profile: str | None = None,
    overrides: dict[str, Any] | None = None,
    config: RunConfig | None = None,
) -> dict[str, Any]:
    """Run every built stage in order on one run directory."""
    cfg = resolve_config(run_dir, profile, overrides, config, command="pipeline")
    collected = collect_sft_data(run_dir=run_dir, config=cfg)
    tuned = sft(run_dir=run_dir, config=cfg)
    trained = rl(run_dir=run_dir, config=cfg)
    drop_sessions()  # free the RL models before evaluation loads the final checkpoint
    evaluated = evaluate(run_dir=run_dir, config=cfg)
    return {"collect_sft_data": collected, "sft": tuned, "rl": trained, "evaluate": evaluated}
