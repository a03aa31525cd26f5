"""The run directory's MLflow runs: the `Tracker` (its parent run, one child run per stage attempt, the model
registry) and a stage attempt's `ChildRun` (params, metrics mirrored to the `metrics` table, artifacts, status)."""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import threading
import time
import uuid
from collections.abc import Iterator, Mapping
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from rubricem_core.layout import RunLayout
from rubricem_core.offline import apply_offline_defaults
from rubricem_core.schemas import METRICS_SCHEMA
from rubricem_core.store import RunStore, StoreError, atomic_write_text, read_parquet_file

if TYPE_CHECKING:
    from mlflow import MlflowClient
    from mlflow.entities import Run

from rubricem_core.tracking.links import (
    ATTEMPT_TAG,
    CURRENT_TAG,
    EXPERIMENT_KIND_TAG,
    FLOW_TAG,
    HEADLINE_KEYS,
    LOCAL_STORE,
    MAX_METRICS_PER_BATCH,
    MAX_PARAM_VALUE_CHARS,
    MAX_PARAMS_PER_BATCH,
    MAX_TAG_VALUE_CHARS,
    MODEL_TRAINING_KIND,
    PARAMS_CHANGED_TAG,
    RETRY_OF_TAG,
    RUN_DIR_TAG,
    STATE_FILE,
    TrackingError,
    flatten_params,
    is_local_store,
    mlflow_ui_url,
    ui_base,
)
from rubricem_core.tracking.relocate import _artifact_root, _forget_foreign_artifact_repos, relocate_store
from rubricem_core.tracking.values import (
    _attempt_of,
    _claim_live,
    _clean_key,
    _clip,
    _is_live,
    _param_text,
    _refuse_secrets,
    _release_live,
    _retry,
    _safe_part_name,
)

log = logging.getLogger(__name__)


class ChildRun:
    """One flow's MLflow run. Safe to share between threads: every call names its run id."""

    def __init__(self, tracker: Tracker, run_id: str, flow_name: str):
        self.tracker = tracker
        self.run_id = run_id
        self.flow_name = flow_name
        self._carried: set[str] = set()  # metric names whose earlier-attempt points were carried forward
        self._earlier: dict[tuple[str, int], dict[str, Any]] | None = None  # read once per attempt
        self._carry_lock = threading.Lock()

    @property
    def client(self) -> MlflowClient:
        return self.tracker.client

    @property
    def experiment_id(self) -> str:
        return self.tracker.experiment_id()

    def ui_url(self, base: str | None = None) -> str:
        """The run's page in the MLflow UI (``base``, default :meth:`Tracker.ui_base`), model-training view."""
        return mlflow_ui_url(base or self.tracker.ui_base(), self.experiment_id, self.run_id)

    def log_params(self, params: Mapping[str, Any]) -> dict[str, str]:
        """Log (flattened) params; returns what was logged. MLflow params cannot change: a value
        already logged with another value (the parent run after a config change) keeps its first
        value, and the current one is recorded in the ``rubricem.params_changed`` tag (JSON)."""
        from mlflow.entities import Param

        flat = flatten_params(params)
        _refuse_secrets(list(flat), "param(s)")
        values = {_clean_key(k, "param"): _clip(_param_text(v), MAX_PARAM_VALUE_CHARS) for k, v in flat.items()}
        run = _retry(self.client.get_run, self.run_id)
        existing = run.data.params
        changed = {k: v for k, v in values.items() if k in existing and existing[k] != v}
        try:
            recorded = json.loads(run.data.tags.get(PARAMS_CHANGED_TAG, "{}"))
        except json.JSONDecodeError:
            recorded = {}
        recorded = recorded if isinstance(recorded, dict) else {}
        # a value changed back to the logged one is true again
        current = {k: v for k, v in {**recorded, **changed}.items() if k not in values or k in changed}
        if current != recorded:  # said once per change, not at every stage
            if changed:
                log.warning(
                    "run %s logged params %s with other values before; MLflow keeps those, the current ones "
                    "are in its %s tag",
                    self.run_id,
                    sorted(changed),
                    PARAMS_CHANGED_TAG,
                )
            self.set_tags({PARAMS_CHANGED_TAG: json.dumps(current, sort_keys=True)})
        new = [Param(k, v) for k, v in values.items() if k not in existing]
        for start in range(0, len(new), MAX_PARAMS_PER_BATCH):
            _retry(self.client.log_batch, self.run_id, params=new[start : start + MAX_PARAMS_PER_BATCH])
        return values

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        """Log metrics to MLflow and mirror them as rows of the ``metrics`` table (partition = step)."""
        from mlflow.entities import Metric

        if not metrics:
            return
        step = int(step)
        names: dict[str, float] = {}
        for name, value in metrics.items():
            try:
                number = float(value)
            except (TypeError, ValueError):
                raise ValueError(f"metric {name!r} has a non-numeric value {value!r}") from None
            names[_clean_key(name, "metric")] = number
        with self._carry_lock:
            first = set(names) - self._carried
            self._carried |= first
        if first:  # the earlier attempts' points below this step, so the chart is whole while it runs
            self._carry_forward(first, before_step=step)
        now = datetime.now(UTC)
        timestamp_ms = int(now.timestamp() * 1000)
        entities = [Metric(k, v, timestamp_ms, step) for k, v in names.items()]
        for start in range(0, len(entities), MAX_METRICS_PER_BATCH):
            _retry(self.client.log_batch, self.run_id, metrics=entities[start : start + MAX_METRICS_PER_BATCH])
        rows = [
            {"step": step, "name": k, "value": v, "flow": self.flow_name, "run_id": self.run_id, "logged_at": now}
            for k, v in names.items()
        ]
        # one file per (flow, step, metric names), not per run: a retry (a new attempt run) that logs
        # a step again replaces its rows instead of duplicating them; run_id names the attempt
        key = "\0".join([self.flow_name, *sorted(names)])
        self.tracker.store.write_table(
            "metrics",
            rows,
            partition={"step": step},
            part=f"{_safe_part_name(self.flow_name)}-{uuid.uuid5(uuid.NAMESPACE_OID, key).hex[:12]}",
            schema=METRICS_SCHEMA,
        )

    def _earlier_points(self) -> dict[tuple[str, int], dict[str, Any]]:
        """This flow's rows of the ``metrics`` table logged by other attempts, by (name, step); read
        once (a row this attempt replaced since is skipped later: the run has that step already)."""
        if self._earlier is None:
            self._earlier = self._read_earlier_points()
        return self._earlier

    def _read_earlier_points(self) -> dict[tuple[str, int], dict[str, Any]]:
        prefix = f"{_safe_part_name(self.flow_name)}-"
        points: dict[tuple[str, int], dict[str, Any]] = {}
        for path in self.tracker.store.files("metrics"):
            if not path.name.startswith(prefix):
                continue
            try:
                rows = read_parquet_file(path).to_pylist()
            except StoreError as exc:  # a torn file of a killed attempt: its step is simply not carried
                log.warning("not carrying metrics forward from %s: %s", path, exc)
                continue
            for row in rows:
                if row["flow"] != self.flow_name or row["run_id"] == self.run_id:
                    continue
                key = (row["name"], int(row["step"]))
                if key not in points or row["logged_at"] > points[key]["logged_at"]:
                    points[key] = row
        return points

    def _carry_forward(self, names: set[str] | None = None, before_step: int | None = None) -> int:
        """Log the earlier attempts' points (``names``, steps below ``before_step``; None: all) that this
        run lacks, with their original timestamps; returns how many. MLflow only."""
        from mlflow.entities import Metric

        rows = [
            row
            for (name, step), row in self._earlier_points().items()
            if (names is None or name in names) and (before_step is None or step < before_step)
        ]
        if not rows:
            return 0
        have = {
            name: {m.step for m in _retry(self.client.get_metric_history, self.run_id, name)}
            for name in {r["name"] for r in rows}
        }
        entities = [
            Metric(r["name"], float(r["value"]), int(r["logged_at"].timestamp() * 1000), int(r["step"]))
            for r in sorted(rows, key=lambda r: (r["step"], r["name"]))
            if int(r["step"]) not in have[r["name"]]
        ]
        for start in range(0, len(entities), MAX_METRICS_PER_BATCH):
            _retry(self.client.log_batch, self.run_id, metrics=entities[start : start + MAX_METRICS_PER_BATCH])
        return len(entities)

    def carry_forward(self) -> int:
        """Complete this attempt's charts with every step of the earlier attempts it did not log itself
        (called when the attempt ends); returns how many points were added."""
        with self._carry_lock:
            return self._carry_forward()

    def log_artifact(self, path: str | os.PathLike[str], artifact_path: str | None = None) -> None:
        local = Path(path)
        if not local.exists():
            raise FileNotFoundError(f"artifact {local} does not exist")
        if local.is_dir():
            _retry(self.client.log_artifacts, self.run_id, str(local), artifact_path)
        else:
            _retry(self.client.log_artifact, self.run_id, str(local), artifact_path)

    def log_dict(self, obj: Any, name: str) -> None:
        """Store ``obj`` as a JSON (or .yaml/.yml) artifact file called ``name``."""
        if not Path(name).suffix:
            name = f"{name}.json"
        _retry(self.client.log_dict, self.run_id, obj, name)

    def set_tags(self, tags: Mapping[str, Any]) -> None:
        from mlflow.entities import RunTag

        _refuse_secrets([str(k) for k in tags], "tag(s)")
        entities = [RunTag(_clean_key(k, "tag"), _clip(_param_text(v), MAX_TAG_VALUE_CHARS)) for k, v in tags.items()]
        for start in range(0, len(entities), MAX_PARAMS_PER_BATCH):
            _retry(self.client.log_batch, self.run_id, tags=entities[start : start + MAX_PARAMS_PER_BATCH])


class Tracker:
    """MLflow bookkeeping of one pipeline run directory.

    ``uri``: a tracking server (``tracking.uri``); empty or None: the run directory's own SQLite store.
    """

    def __init__(self, run_dir: str | os.PathLike[str], experiment: str = "rubricem", uri: str | None = None):
        self.run_dir = Path(run_dir).expanduser().resolve()
        self.experiment = experiment
        self.store = RunStore(self.run_dir)
        layout = RunLayout(self.run_dir)
        self.mlflow_dir = layout.mlflow_dir
        self.db_path = layout.mlflow_db
        self.is_local = is_local_store(uri)
        # the store's name in the state file: the run ids there belong to it
        self.store_key = LOCAL_STORE if self.is_local else str(uri).strip()
        self.tracking_uri = f"sqlite:///{self.db_path}" if self.is_local else self.store_key
        # where this run dir's artifacts go; None: wherever the tracking server puts them
        self.artifact_uri: str | None = _artifact_root(self.run_dir) if self.is_local else None
        self.state_path = layout.tracking_state_file
        self._client: MlflowClient | None = None
        self._experiment_id: str | None = None
        self._lock = threading.RLock()
        self._flock_depth = 0  # _state_lock re-entered by the thread holding it must not flock again

    # ---- plumbing ------------------------------------------------------------------------------
    @property
    def client(self) -> MlflowClient:
        with self._lock:
            if self._client is None:
                apply_offline_defaults()  # telemetry off before mlflow is imported
                # MLflow prints its own run links (GenAI view) when a run on a server ends; ours are
                # in the flow summaries and logs, in the model-training view
                os.environ.setdefault("MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT", "true")
                from mlflow import MlflowClient

                if self.is_local:
                    self.mlflow_dir.mkdir(parents=True, exist_ok=True)
                    self._follow_run_dir()  # before MLflow reads any stored location
                self._client = MlflowClient(tracking_uri=self.tracking_uri)
            if self.artifact_uri is not None:
                _forget_foreign_artifact_repos(self.artifact_uri)
            return self._client

    @classmethod
    def from_config(cls, run_dir: str | os.PathLike[str], tracking: Any) -> Tracker | None:
        """The tracker a flow logs with (``tracking``: the config's TrackingConfig), None when disabled."""
        if not tracking.enabled:
            return None
        return cls(run_dir, experiment=tracking.experiment, uri=tracking.uri)

    @contextlib.contextmanager
    def _state_lock(self) -> Iterator[None]:
        """Serializes state-file updates across threads (RLock) and processes (flock); re-entrant."""
        with self._lock:
            if self._flock_depth:
                self._flock_depth += 1
                try:
                    yield
                finally:
                    self._flock_depth -= 1
                return
            self.state_path.parent.mkdir(parents=True, exist_ok=True)
            with open(self.state_path.parent / f".{STATE_FILE}.lock", "w") as handle:
                fcntl.flock(handle, fcntl.LOCK_EX)
                self._flock_depth = 1
                try:
                    yield
                finally:
                    self._flock_depth = 0
                    fcntl.flock(handle, fcntl.LOCK_UN)

    def _read_state(self) -> dict[str, Any]:
        if not self.state_path.exists():
            return {}
        try:
            state = json.loads(self.state_path.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise TrackingError(f"cannot read MLflow state file {self.state_path}: {exc}") from exc
        if not isinstance(state, dict) or not isinstance(state.get("children", {}), dict):
            raise TrackingError(f"MLflow state file {self.state_path} is not a JSON object with a 'children' map")
        return state

    def _write_state(self, state: dict[str, Any]) -> None:
        """Also records which path the store was written for, to notice a moved or copied run dir."""
        state["run_dir"] = str(self.run_dir)
        state.setdefault("store", self.store_key)
        atomic_write_text(self.state_path, json.dumps(state, indent=2, sort_keys=True))

    def _state_of_this_store(self) -> dict[str, Any]:
        """The state file's runs when they are this run dir's on this store, else ``{}`` (a new parent).

        Another store (``tracking.uri`` changed) does not hold them; on a tracking server a copy of a
        run dir (the recorded directory still exists) must not log into the original's runs.
        """
        state = self._read_state()
        if state.get("store", LOCAL_STORE) != self.store_key:
            return {}
        recorded = state.get("run_dir")
        if (
            not self.is_local
            and isinstance(recorded, str)
            and recorded != str(self.run_dir)
            and Path(recorded).is_dir()
        ):
            return {}
        return state

    def _follow_run_dir(self) -> None:
        """A moved or copied run dir must use its own artifacts, not those of the path it was made at."""
        if not self.db_path.is_file():
            return  # a fresh store is created for this path
        with self._state_lock():
            try:
                state: dict[str, Any] | None = self._read_state() if self.state_path.exists() else None
            except TrackingError:
                state = None  # reported by parent_run_id(); the store itself still says where it was
            recorded = state.get("run_dir") if state else None
            if recorded == str(self.run_dir):
                return
            moved = relocate_store(self.db_path, self.run_dir, recorded if isinstance(recorded, str) else None)
            if moved:
                log.info(
                    "run dir %s was moved or copied: artifact locations %s now point at %s",
                    self.run_dir,
                    moved,
                    self.artifact_uri,
                )
            if state is not None:
                self._write_state(state)

    def experiment_id(self) -> str:
        with self._lock:
            if self._experiment_id is None:
                self._experiment_id = self._open_experiment()
            return self._experiment_id

    def _open_experiment(self) -> str:
        """The experiment's id, created (or restored) as a model-training experiment."""
        from mlflow.exceptions import MlflowException

        found = _retry(self.client.get_experiment_by_name, self.experiment)
        if found is None:
            try:
                return _retry(
                    self.client.create_experiment,
                    self.experiment,
                    artifact_location=self.artifact_uri,  # None: the tracking server's default
                    tags={EXPERIMENT_KIND_TAG: MODEL_TRAINING_KIND},
                )
            except MlflowException:  # another process created it first
                found = _retry(self.client.get_experiment_by_name, self.experiment)
                if found is None:
                    raise
        if found.lifecycle_stage == "deleted":
            _retry(self.client.restore_experiment, found.experiment_id)
        if found.tags.get(EXPERIMENT_KIND_TAG) != MODEL_TRAINING_KIND:
            _retry(self.client.set_experiment_tag, found.experiment_id, EXPERIMENT_KIND_TAG, MODEL_TRAINING_KIND)
        return found.experiment_id

    def ui_base(self) -> str:
        """The MLflow UI serving this tracker's store (see :func:`ui_base`)."""
        return ui_base(None if self.is_local else self.tracking_uri)

    def experiment_ui_url(self, base: str | None = None) -> str:
        """The experiment's runs in the MLflow UI (``base``, default :meth:`ui_base`), model-training view."""
        return mlflow_ui_url(base or self.ui_base(), self.experiment_id())

    def run_ui_url(self, run_id: str, base: str | None = None) -> str:
        """A run's page in the MLflow UI (``base``, default :meth:`ui_base`), model-training view."""
        return mlflow_ui_url(base or self.ui_base(), self.experiment_id(), run_id)

    def links(self, child: ChildRun | None = None) -> dict[str, str | None]:
        """What a flow summary links: ``mlflow_url`` (the child run, else the parent run) and
        ``mlflow_db``, the run dir's store to start ``mlflow ui`` on (None on a tracking server)."""
        run_id = child.run_id if child is not None else self.parent_run_id()
        return {"mlflow_url": self.run_ui_url(run_id), "mlflow_db": self.tracking_uri if self.is_local else None}

    def _get_run(self, run_id: str | None) -> Run | None:
        """The run ``run_id`` of this store, None if it is not there."""
        from mlflow.exceptions import MlflowException

        if not run_id:
            return None
        try:
            return _retry(self.client.get_run, run_id)
        except MlflowException as exc:
            if exc.error_code == "RESOURCE_DOES_NOT_EXIST":
                return None
            raise

    def _reopen(self, run: Run) -> str:
        """A run about to be logged to again, restored if it was soft-deleted; returns its id."""
        if run.info.lifecycle_stage == "deleted":
            _retry(self.client.restore_run, run.info.run_id)
        return run.info.run_id

    # ---- runs ----------------------------------------------------------------------------------
    def recorded_parent_id(self) -> str | None:
        """The parent run the state file names for this run dir on this store; None if there is none
        yet (nothing is created: the report logs only into a run that was tracked)."""
        with self._state_lock():
            run_id = self._state_of_this_store().get("run_id")
        return run_id if isinstance(run_id, str) and run_id else None

    def parent_run_id(self) -> str:
        """The pipeline run's parent MLflow run, created on first use and reused afterwards."""
        with self._state_lock():
            experiment_id = self.experiment_id()  # opening it also gives an older store the model-training kind
            state = self._state_of_this_store()
            known = self._get_run(state.get("run_id"))
            if known is not None:
                if state.get("run_dir") != str(self.run_dir):  # moved (a local store was relocated already)
                    _retry(self.client.set_tag, known.info.run_id, RUN_DIR_TAG, str(self.run_dir))
                    self._write_state(state)
                return self._reopen(known)
            run = _retry(
                self.client.create_run,
                experiment_id,
                run_name=self.run_dir.name,
                tags={RUN_DIR_TAG: str(self.run_dir)},
            )
            # a new parent (fresh or recreated MLflow DB, another store, a copy) invalidates any remembered children
            self._write_state(
                {"run_id": run.info.run_id, "experiment_id": experiment_id, "children": {}, "store": self.store_key}
            )
            return run.info.run_id

    def child_run_id(self, flow_name: str) -> str:
        """The child run that a run of ``flow_name`` logs to now: the one this process has open, else
        a new attempt under the parent (the stage's current run from now on)."""
        return self._child_run_id(flow_name, claim=False)

    def _child_run_id(self, flow_name: str, claim: bool, label: str | None = None) -> str:
        if not flow_name or not flow_name.strip():
            raise ValueError("flow_name must be a non-empty string")
        parent = self.parent_run_id()
        with self._state_lock():
            state = self._read_state()
            children: dict[str, str] = state.setdefault("children", {})
            previous = self._get_run(children.get(flow_name))
            if previous is not None and previous.info.status == "RUNNING" and _is_live(previous.info.run_id):
                run_id = previous.info.run_id  # nested in a run of this process: the same attempt
            else:
                run_id = self._new_attempt(parent, flow_name, previous, label)
                children[flow_name] = run_id
                self._write_state(state)
            if claim:  # under the lock, so a concurrent caller sees it open, not crashed
                _claim_live(run_id)
            return run_id

    def _new_attempt(self, parent: str, flow_name: str, previous: Run | None, label: str | None = None) -> str:
        """A new child run for ``flow_name``: attempt 1, or the one after ``previous`` (closed FAILED
        if a crash left it RUNNING, and no longer the stage's current run). ``label`` names what this run
        does instead of its attempt number (an evaluation's checkpoint: several in a row are no retries)."""
        tags = {"mlflow.parentRunId": parent, FLOW_TAG: flow_name, CURRENT_TAG: "true"}
        attempt = 1
        if previous is not None:
            if previous.info.lifecycle_stage == "active":  # a deleted run takes no updates
                if previous.info.status == "RUNNING":
                    _retry(self.client.set_terminated, previous.info.run_id, status="FAILED")
                _retry(self.client.set_tag, previous.info.run_id, CURRENT_TAG, "false")
            attempt = _attempt_of(previous) + 1
            tags[RETRY_OF_TAG] = previous.info.run_id
        tags[ATTEMPT_TAG] = str(attempt)
        name = f"{flow_name} · {label}" if label else flow_name if attempt == 1 else f"{flow_name} · attempt {attempt}"
        return _retry(self.client.create_run, self.experiment_id(), run_name=name, tags=tags).info.run_id

    @contextlib.contextmanager
    def child_run(
        self,
        flow_name: str,
        params: Mapping[str, Any] | None = None,
        tags: Mapping[str, Any] | None = None,
        label: str | None = None,
    ) -> Iterator[ChildRun]:
        """Run a flow inside a new attempt run: RUNNING while inside, then FINISHED, FAILED or KILLED.

        ``tags`` are set on entry (e.g. ``prefect.flow_run_id``/``prefect.flow_run_url`` to link the
        Prefect flow run), and the parent's headline params are refreshed from ``config.yaml``. On exit
        the attempt carries forward the earlier attempts' steps it did not log. The parent follows its
        stages: RUNNING while one runs, then the status of the stage that ended last, so a completed
        pipeline leaves it FINISHED and a failed stage leaves it FAILED until a rerun resumes it.
        """
        # refused before any run is created or reopened
        _refuse_secrets(list(flatten_params(params or {})), "param(s)")
        _refuse_secrets([str(k) for k in (tags or {})], "tag(s)")
        run_id = self._child_run_id(flow_name, claim=True, label=label)
        try:
            parent = self.parent_run_id()
            self.log_headline_params()
            for live in (parent, run_id):  # a resumed parent is live again
                _retry(self.client.update_run, live, status="RUNNING")
            child = ChildRun(self, run_id, flow_name)
            status = "FINISHED"
            try:
                if tags:
                    child.set_tags(tags)
                if params:
                    child.log_params(params)
                yield child
            except (KeyboardInterrupt, SystemExit):
                status = "KILLED"
                raise
            except BaseException:
                status = "FAILED"
                raise
            finally:
                try:
                    child.carry_forward()
                except Exception as exc:  # the points are in the metrics table; the stage's outcome stands
                    log.warning("run %s: could not carry the earlier attempts' metrics forward: %s", run_id, exc)
                for ended in (run_id, parent):
                    _retry(self.client.set_terminated, ended, status=status)
        finally:
            _release_live(run_id)

    def headline_params(self) -> dict[str, Any]:
        """The :data:`HEADLINE_KEYS` of the run directory's ``config.yaml`` (``{}`` without one)."""
        path = RunLayout(self.run_dir).config_file
        try:
            raw = yaml.safe_load(path.read_text(encoding="utf-8")) if path.is_file() else None
        except (OSError, yaml.YAMLError, UnicodeDecodeError) as exc:
            log.warning("no headline params for the parent run: cannot read %s: %s", path, exc)
            return {}
        flat = flatten_params(raw) if isinstance(raw, dict) else {}
        return {key: flat[key] for key in HEADLINE_KEYS if key in flat}

    def log_headline_params(self) -> dict[str, str]:
        """Log the headline settings on the parent run (new keys; a changed value goes to its
        ``rubricem.params_changed`` tag); returns them."""
        headline = self.headline_params()
        if not headline:
            return {}
        return ChildRun(self, self.parent_run_id(), "pipeline").log_params(headline)

    def log_parent_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        """Headline metrics on the parent run (the evaluation scores, step = the checkpoint's updates,
        so the latest value is the newest checkpoint's). MLflow only: the stage's own run mirrors them."""
        from mlflow.entities import Metric

        timestamp_ms = int(time.time() * 1000)
        entities = [Metric(_clean_key(k, "metric"), float(v), timestamp_ms, int(step)) for k, v in metrics.items()]
        for start in range(0, len(entities), MAX_METRICS_PER_BATCH):
            _retry(self.client.log_batch, self.parent_run_id(), metrics=entities[start : start + MAX_METRICS_PER_BATCH])

    def log_parent_artifact(self, path: str | os.PathLike[str], artifact_path: str | None = None) -> str:
        """Log a file or folder under the parent run (run-level artifacts: reports, plots); returns its id."""
        run_id = self.parent_run_id()
        ChildRun(self, run_id, "parent").log_artifact(path, artifact_path)
        return run_id

    def finish(self, status: str = "FINISHED") -> None:
        """Close the parent run at the end of the pipeline (FINISHED, FAILED or KILLED)."""
        _retry(self.client.set_terminated, self.parent_run_id(), status=status)
