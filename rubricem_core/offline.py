"""Environment defaults for offline, telemetry-free runs.

Applied by the project itself (CLI, flows, tests) so users never have to export them.
Values already set by the user win (``setdefault``), so a GPU node can still opt in to a hub.
"""

from __future__ import annotations

import os

OFFLINE_DEFAULTS: dict[str, str] = {
    "LITELLM_LOCAL_MODEL_COST_MAP": "True",  # litellm fetches its price map from GitHub otherwise
    "MLFLOW_DISABLE_TELEMETRY": "true",
    "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
    "DO_NOT_TRACK": "1",
    "HF_HUB_OFFLINE": "1",  # nothing may load weights from a hub at run time
    "TRANSFORMERS_OFFLINE": "1",
    "HF_DATASETS_OFFLINE": "1",
    "TOKENIZERS_PARALLELISM": "false",
    # transformers' "Loading weights" bars (and the hub's): 18 of them per pipeline run in a flow's output
    "HF_HUB_DISABLE_PROGRESS_BARS": "1",
    "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "90",
    "PREFECT_LOGGING_TO_API_BATCH_INTERVAL": "0.5",
    # rubricem_core's records reach a flow run's log (flows/common.route_core_logs); outside a run they
    # only go to the console, without a warning per record
    "PREFECT_LOGGING_TO_API_WHEN_MISSING_FLOW": "ignore",
}


def apply_offline_defaults() -> None:
    for key, value in OFFLINE_DEFAULTS.items():
        os.environ.setdefault(key, value)
    if not os.path.exists("/dev/nvidiactl"):
        # without it DeepSpeed (imported by accelerate on every save_pretrained) probes for GPUs and warns
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
