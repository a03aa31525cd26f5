"""Names, tags and limits of the project's MLflow runs, and every MLflow address the project prints or
publishes."""

from __future__ import annotations

import logging
import os
import re
import shlex
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from rubricem_core.layout import TRACKING_STATE_FILE, RunLayout
from rubricem_core.offline import OFFLINE_DEFAULTS

if TYPE_CHECKING:
    pass

log = logging.getLogger(__name__)


# MLflow's documented limits (mlflow.utils.validation); kept here so importing this module stays cheap
MAX_PARAM_VALUE_CHARS = 6000
MAX_TAG_VALUE_CHARS = 8000
MAX_KEY_CHARS = 250
MAX_PARAMS_PER_BATCH = 100
MAX_METRICS_PER_BATCH = 1000

STATE_FILE = TRACKING_STATE_FILE  # state/<this>: the run directory's parent run and its children
# MLflow 3's UI reads this experiment tag to pick the experiment's view (its kind selector writes it)
EXPERIMENT_KIND_TAG = "mlflow.experimentKind"
MODEL_TRAINING_KIND = "custom_model_development"
FLOW_TAG = "rubricem.flow"
ATTEMPT_TAG = "rubricem.attempt"
RETRY_OF_TAG = "rubricem.retry_of"
CURRENT_TAG = "rubricem.current"  # "true" on a stage's newest attempt, "false" on the ones before
RUN_DIR_TAG = "rubricem.run_dir"
PARAMS_CHANGED_TAG = "rubricem.params_changed"
DEFAULT_UI = "http://127.0.0.1:5000"
UI_URL_ENV = "MLFLOW_UI_URL"  # where `mlflow ui` serves a run dir's store (a tracking server serves its own)
MODEL_TRAINING_VIEW = "workflowType=machine_learning"  # MLflow 3.17's UI view switch, as a URL parameter
LOCAL_STORE = "local"  # the state file's name for the run directory's own SQLite store
# config.yaml settings the parent run carries as params: enough to tell runs apart in one experiment
HEADLINE_KEYS = (
    "profile",
    "seed",
    "policy.name_or_path",
    "teacher.model",
    "judge.model",
    "sft.epochs",
    "rl.recipe",
    "rl.window",
    "rl.n_windows",
    "rl.queries_per_step",
    "rollout.engine",
    "eval.benchmarks",
    "eval.retrieval",
)
# (table, column, extra condition) holding absolute artifact locations in MLflow's SQLite schema
_LOCATION_COLUMNS = (
    ("experiments", "artifact_location", ""),
    ("runs", "artifact_uri", ""),
    ("logged_models", "artifact_location", ""),
    ("trace_tags", "value", "key = 'mlflow.artifactLocation' AND "),
)
_KEY_CHARS = re.compile(r"[^\w\-. /:]")  # MLflow accepts alphanumerics, _ - . space / :


class TrackingError(RuntimeError):
    """MLflow state of a run directory is unusable (corrupt state file, unreachable store)."""


# ---- links: every MLflow address the project prints or publishes is built here ------------------
def is_local_store(uri: str | None) -> bool:
    """True for the run directory's own store (``tracking.uri`` empty)."""
    return not (uri or "").strip()


def ui_base(tracking_uri: str | None = None) -> str:
    """The MLflow UI's address: a tracking server (http/https) serves its own; for the run dir's store
    it is where ``mlflow ui`` listens (``MLFLOW_UI_URL``, default http://127.0.0.1:5000)."""
    uri = (tracking_uri or "").strip()
    if os.environ.get(UI_URL_ENV):
        return os.environ[UI_URL_ENV].rstrip("/")
    if uri.startswith(("http://", "https://")):
        return uri.rstrip("/")
    return DEFAULT_UI


def mlflow_ui_url(base: str, experiment_id: str | None = None, run_id: str | None = None) -> str:
    """A page of the MLflow UI at ``base`` opened in the model-training view: the experiments list, an
    experiment's runs, or one run. MLflow 3.17 picks GenAI or model training by its ``workflowType``
    switch (this URL parameter, else the browser's last choice), not by the experiment's kind tag."""
    if run_id and not experiment_id:
        raise ValueError("a run's MLflow link needs its experiment id")
    page = "#/experiments"
    if experiment_id:
        page += f"/{experiment_id}/runs" + (f"/{run_id}" if run_id else "")
    return f"{base.rstrip('/')}/{page}?{MODEL_TRAINING_VIEW}"


def mlflow_ui_command(store_uri: str, mlflow: str = "mlflow") -> str:
    """The shell command that serves a run dir's store (``sqlite:///…/mlflow.db``) with ``mlflow ui``,
    offline: the UI imports litellm, which downloads its cost map unless told not to, and MLflow sends
    telemetry."""
    env = " ".join(f"{k}={OFFLINE_DEFAULTS[k]}" for k in ("LITELLM_LOCAL_MODEL_COST_MAP", "MLFLOW_DISABLE_TELEMETRY"))
    return f"{env} {mlflow} ui --backend-store-uri {shlex.quote(store_uri)}"


def configured_uri(run_dir: str | os.PathLike[str]) -> str:
    """``tracking.uri`` of the run directory's ``config.yaml`` ("" for its own store, or no config)."""
    path = RunLayout(run_dir).config_file
    try:
        raw = yaml.safe_load(path.read_text(encoding="utf-8")) if path.is_file() else None
    except (OSError, yaml.YAMLError, UnicodeDecodeError):
        return ""
    tracking = raw.get("tracking") if isinstance(raw, dict) else None
    uri = tracking.get("uri") if isinstance(tracking, dict) else None
    return uri.strip() if isinstance(uri, str) else ""


def ui_instructions(run_dir: str | os.PathLike[str], mlflow: str = "mlflow") -> str:
    """How to look at a run directory's MLflow runs: start ``mlflow ui`` on its store, then the link;
    on a tracking server, the link alone."""
    uri = configured_uri(run_dir)
    link = mlflow_ui_url(ui_base(uri))
    if not is_local_store(uri):
        return f"open {link} (tracking server {uri})"
    db = RunLayout(Path(run_dir).expanduser().resolve()).mlflow_db
    return f"{mlflow_ui_command(f'sqlite:///{db}', mlflow)}\n(then open {link})"


def flatten_params(params: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested dicts become dotted keys: ``{"rl": {"lr": 1e-6}}`` → ``{"rl.lr": 1e-6}``."""
    flat: dict[str, Any] = {}
    for key, value in params.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping) and value:
            flat.update(flatten_params(value, prefix=f"{name}."))
        else:
            flat[name] = value
    return flat
