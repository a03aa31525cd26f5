"""Logging the report's files to MLflow, under the run directory's parent run.

Only a run that was tracked (its parent-run state exists, with its ``mlflow/mlflow.db`` or on the
tracking server of ``tracking.uri``, and its config has ``tracking.enabled``) gets the artifacts; the
report never creates an MLflow store or parent run of its own. The page
is always logged as ``report/report.html``, whatever file ``--out`` wrote, so a reader of the parent run
(``mlflow ui``, a script) finds the latest report at one path.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path
from typing import Any

from rubricem_core.layout import REPORT_FILE, RunLayout
from rubricem_core.tracking import LOCAL_STORE, Tracker, TrackingError, is_local_store

ARTIFACT_PATH = "report"


def mlflow_target(run_dir: Path, config: dict[str, Any] | None) -> tuple[Tracker | None, str]:
    """The tracker to log the report with, or None and the reason it is not logged."""
    if config is None:
        return None, "the run has no readable config.yaml to say whether it is tracked"
    tracking = config.get("tracking") or {}
    if not tracking.get("enabled", False):
        return None, "tracking is disabled in config.yaml (tracking.enabled)"
    uri = str(tracking.get("uri") or "").strip()
    layout = RunLayout(run_dir)
    db = layout.mlflow_db
    state_path = layout.tracking_state_file
    if is_local_store(uri) and not db.is_file():
        return None, f"the run has no MLflow store ({db} and {state_path} are needed)"
    if not state_path.is_file():
        return None, f"the run has no MLflow parent run ({state_path} is needed)"
    try:
        state = json.loads(state_path.read_text())
        store = state.get("store", LOCAL_STORE)
    except (OSError, json.JSONDecodeError, AttributeError) as exc:
        raise TrackingError(f"cannot read MLflow state file {state_path}: {exc}") from exc
    tracker = Tracker(run_dir, experiment=str(tracking.get("experiment") or "rubricem"), uri=uri)
    if store != tracker.store_key:
        where = "the run directory's own store" if store == LOCAL_STORE else store
        return None, f"the run's MLflow runs are in {where}, not where tracking.uri points ({uri or 'its own store'})"
    client = tracker.client  # applies the offline defaults (and relocates a copied local store) first
    run_id = tracker.recorded_parent_id()
    if run_id is None:
        return None, f"{state_path} names no parent run of this run directory on {tracker.tracking_uri}"
    from mlflow.exceptions import MlflowException

    try:
        artifact_uri = client.get_run(run_id).info.artifact_uri
    except MlflowException as exc:
        return None, f"the parent run {run_id} is not in {tracker.tracking_uri}: {exc.message}"
    # Opening the Tracker relocates a copied or moved run directory's store to its own artifacts
    # (rubricem_core.tracking); a store that still points elsewhere must not be written to. On a
    # tracking server the artifacts are where the server keeps them.
    own = layout.mlflow_artifacts_dir.as_uri() + "/"
    if tracker.is_local and not artifact_uri.startswith(own):
        return None, (
            f"the parent run stores artifacts at {artifact_uri}, outside this run directory "
            "(was it copied or moved?); not writing there"
        )
    where = "" if tracker.is_local else f" on {tracker.tracking_uri}"
    return tracker, f"parent run {run_id}{where}, artifact path {ARTIFACT_PATH}/"


def log_files(tracker: Tracker, page: Path, plots: list[Path]) -> str:
    """Log the page as ``report/report.html`` and each plot under ``report/`` of the parent run; returns
    the run id. A page written elsewhere (``--out FILE``) is logged under the standard name, not its own."""
    with tempfile.TemporaryDirectory(prefix="rubricem-report-") as tmp:
        logged = page
        if page.name != REPORT_FILE:
            logged = Path(tmp) / REPORT_FILE
            shutil.copyfile(page, logged)
        run_id = tracker.log_parent_artifact(logged, ARTIFACT_PATH)
    for path in plots:
        tracker.log_parent_artifact(path, ARTIFACT_PATH)
    return run_id
