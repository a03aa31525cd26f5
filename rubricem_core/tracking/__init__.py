"""MLflow tracking for one pipeline run directory: a parent run per run dir, a child run per stage attempt.

By default everything lives inside the run dir (``mlflow/mlflow.db`` SQLite store,
``mlflow/artifacts``), so a run directory is self-contained and can be inspected with ``mlflow ui``;
``tracking.uri`` sends it to any MLflow tracking server instead (runs of many run dirs compared in
one UI; artifacts go where the server keeps them). Rules:

* **Run ids** are persisted in ``state/mlflow_parent.json`` (parent id, the current child id per flow,
  the store they live in and the absolute run-dir path the store was written for).
* **One run per attempt, one history per stage.** Every run of a flow (a first run, a retry, a rerun
  with nothing left to do) is a new child run ``"<flow>"``, ``"<flow> · attempt N"`` under the same
  parent, tagged ``rubricem.flow``, ``rubricem.attempt``, ``rubricem.retry_of`` and
  ``rubricem.current`` (``true`` on the newest attempt only). So each attempt's params, Prefect link,
  status and duration are its own. Steps keep their numbers across attempts, and an attempt carries
  the earlier attempts' points forward (from the ``metrics`` table, with their original timestamps):
  before its first point of a metric, those at lower steps; when it ends, every step it did not log
  itself. The current attempt's chart is thus the stage's whole series (RL steps 0–7 over a crash
  after step 4), equal to the ``metrics`` table; an older attempt keeps what it logged. A previous
  attempt still RUNNING is marked FAILED (its process crashed), unless this process runs it.
* **Parent run.** Named after the run dir, tagged ``rubricem.run_dir``; it follows its stages'
  status, holds the headline settings of ``config.yaml`` as params (:data:`HEADLINE_KEYS`; MLflow
  params cannot change, so a later change is listed in the ``rubricem.params_changed`` tag) and the
  evaluation scores as metrics (:meth:`Tracker.log_parent_metrics`, step = checkpoint updates).
* **Moved or copied run dirs.** MLflow stores absolute artifact locations. When the local store is
  opened from another path than the one recorded, the stored locations under the old
  ``<run_dir>/mlflow/artifacts`` are rewritten to this directory's (one SQLite transaction, under
  the state-file lock, before any MLflow call), so a copy reads and writes its own artifacts. On a
  tracking server a copy (the recorded directory still exists) gets a parent run of its own; a moved
  directory keeps its runs.
* **UI view.** The experiment is tagged ``mlflow.experimentKind=custom_model_development`` (the tag
  MLflow 3's kind selector writes); MLflow 3.17's UI picks the view from its ``workflowType``
  switch instead, so every link (:func:`mlflow_ui_url`) ends in ``?workflowType=machine_learning``.
* **Threads.** All calls go through ``MlflowClient`` with explicit run ids: the global active-run
  stack of ``mlflow.start_run`` is per-thread state that concurrent Prefect tasks would trample.
* **Metrics** are mirrored into the ``metrics`` Parquet table for SQL, one file per (flow, step,
  metric names): a step logged again by a retry replaces its rows, ``run_id`` names the attempt.
"""

from __future__ import annotations

from rubricem_core.schemas import METRICS_SCHEMA
from rubricem_core.tracking.links import (
    HEADLINE_KEYS,
    LOCAL_STORE,
    TrackingError,
    configured_uri,
    flatten_params,
    is_local_store,
    mlflow_ui_command,
    mlflow_ui_url,
    ui_base,
    ui_instructions,
)
from rubricem_core.tracking.relocate import relocate_store
from rubricem_core.tracking.runs import ChildRun, Tracker
from rubricem_core.tracking.values import _retry

__all__ = [
    "HEADLINE_KEYS",
    "LOCAL_STORE",
    "METRICS_SCHEMA",
    "ChildRun",
    "Tracker",
    "TrackingError",
    "_retry",
    "configured_uri",
    "flatten_params",
    "is_local_store",
    "mlflow_ui_command",
    "mlflow_ui_url",
    "relocate_store",
    "ui_base",
    "ui_instructions",
]
