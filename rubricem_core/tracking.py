"""MLflow tracking for one pipeline run directory: a parent run per run dir, child runs per flow.

Everything lives inside the run dir (``mlflow/mlflow.db`` SQLite store, ``mlflow/artifacts``), so a
run directory is self-contained and can be inspected with ``mlflow ui``. Rules:

* **Run ids** are persisted in ``state/mlflow_parent.json`` (parent id, the latest child id per flow,
  and the absolute run-dir path the store was written for).
* **Retries.** A flow whose remembered child run ended FINISHED reuses it (a rerun with nothing new
  to do must not clutter the experiment). One that ended FAILED or KILLED, or is still RUNNING
  because a crashed process never closed it (marked FAILED now), gets a new child run under the same
  parent, ``"<flow> (attempt N)"``, tagged ``rubricem.flow`` and ``rubricem.attempt``; its charts
  start clean instead of zig-zagging over the steps logged again from the last checkpoint.
* **Moved or copied run dirs.** MLflow stores absolute artifact locations. When the store is opened
  from another path than the one recorded, the stored locations under the old
  ``<run_dir>/mlflow/artifacts`` are rewritten to this directory's (one SQLite transaction, under
  the state-file lock, before any MLflow call), so a copy reads and writes its own artifacts.
* **UI view.** The experiment is tagged ``mlflow.experimentKind=custom_model_development`` (the tag
  MLflow 3's kind selector writes) so it opens as a model-training experiment; MLflow 3.17's UI
  picks the view from its ``workflowType`` switch instead, which :meth:`Tracker.experiment_ui_url`
  sets in the link.
* **Threads.** All calls go through ``MlflowClient`` with explicit run ids: the global active-run
  stack of ``mlflow.start_run`` is per-thread state that concurrent Prefect tasks would trample.
* **Metrics** are mirrored into the ``metrics`` Parquet table for SQL, one file per (flow, step,
  metric names): a step logged again by a retry replaces its rows, ``run_id`` names the attempt.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import re
import sqlite3
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator, Mapping
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from rubricem_core.layout import TRACKING_STATE_FILE, RunLayout
from rubricem_core.offline import apply_offline_defaults
from rubricem_core.redact import is_secret_name, redact_text
from rubricem_core.schemas import METRICS_SCHEMA
from rubricem_core.store import RunStore, atomic_write_text

if TYPE_CHECKING:
    from mlflow import MlflowClient
    from mlflow.entities import Run

log = logging.getLogger(__name__)
T = TypeVar("T")

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
RUN_DIR_TAG = "rubricem.run_dir"
DEFAULT_UI = "http://127.0.0.1:5000"
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


def _clip(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _param_text(value: Any) -> str:
    """A param or tag value as MLflow stores it, credentials of any URL in it masked."""
    if isinstance(value, str):
        return redact_text(value)
    if isinstance(value, (list, tuple, dict)):
        try:
            return redact_text(json.dumps(value, sort_keys=True, default=str))
        except (TypeError, ValueError):
            return redact_text(str(value))
    return str(value)


def _clean_key(name: str, kind: str) -> str:
    key = _KEY_CHARS.sub("_", str(name)).strip()
    if not key:
        raise ValueError(f"{kind} name {name!r} is empty")
    if len(key) > MAX_KEY_CHARS:
        raise ValueError(f"{kind} name {name[:60]!r}… is longer than MLflow's {MAX_KEY_CHARS} characters")
    return key


def _refuse_secrets(names: list[str], kind: str) -> None:
    secret = [n for n in names if is_secret_name(n)]
    if secret:
        raise ValueError(
            f"refusing to log {kind} {secret}: the name looks like a secret (key/token/secret/password); "
            "secrets come from the environment and are never tracked"
        )


def _is_locked_error(exc: Exception) -> bool:
    return "database is locked" in str(exc).lower() or "database table is locked" in str(exc).lower()


def _retry(fn: Callable[..., T], *args: Any, attempts: int = 10, **kwargs: Any) -> T:
    """SQLite allows one writer; concurrent tasks get "database is locked" and simply try again."""
    delay = 0.05
    for attempt in range(attempts):
        try:
            return fn(*args, **kwargs)
        except Exception as exc:
            if not _is_locked_error(exc) or attempt == attempts - 1:
                raise
            time.sleep(delay)
            delay = min(delay * 2, 1.0)
    raise AssertionError("unreachable")


def _safe_part_name(flow: str) -> str:
    return re.sub(r"[^A-Za-z0-9_\-]+", "_", flow).strip("_") or "flow"


_LIVE_RUNS: Counter[str] = Counter()  # child runs inside a child_run() block of this process
_LIVE_LOCK = threading.Lock()


def _claim_live(run_id: str) -> None:
    """Marks ``run_id`` as run by this process, so its RUNNING status is not taken for a crash."""
    with _LIVE_LOCK:
        _LIVE_RUNS[run_id] += 1


def _release_live(run_id: str) -> None:
    with _LIVE_LOCK:
        _LIVE_RUNS[run_id] -= 1
        if _LIVE_RUNS[run_id] <= 0:
            del _LIVE_RUNS[run_id]


def _is_live(run_id: str) -> bool:
    with _LIVE_LOCK:
        return _LIVE_RUNS[run_id] > 0


def _attempt_of(run: Run) -> int:
    try:
        return max(1, int(run.data.tags.get(ATTEMPT_TAG, "1")))
    except ValueError:
        return 1


def _artifact_root(run_dir: str | os.PathLike[str]) -> str:
    return RunLayout(run_dir).mlflow_artifacts_dir.as_uri()


def _tables(conn: sqlite3.Connection) -> set[str]:
    return {name for (name,) in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}


def _stored_roots(conn: sqlite3.Connection) -> set[str]:
    """Artifact roots (``file://…/mlflow/artifacts``) of the run-dir paths the experiments were made in."""
    rows = conn.execute("SELECT artifact_location FROM experiments").fetchall()
    return {
        loc
        for (loc,) in rows
        if isinstance(loc, str) and loc.startswith("file://") and loc.endswith("/mlflow/artifacts")
    }


def _rewrite_prefix(conn: sqlite3.Connection, tables: set[str], old: str, new: str) -> int:
    """Replace the prefix ``old`` (a whole path component) by ``new`` in every stored location."""
    changed = 0
    for table, column, condition in _LOCATION_COLUMNS:
        if table in tables:
            cursor = conn.execute(
                f"UPDATE {table} SET {column} = ? || substr({column}, ?) "
                f"WHERE {condition}({column} = ? OR substr({column}, 1, ?) = ?)",
                (new, len(old) + 1, old, len(old) + 1, old + "/"),
            )
            changed += cursor.rowcount
    return changed


def relocate_store(db: Path, run_dir: Path, recorded_run_dir: str | None = None) -> list[str]:
    """Point the artifact locations of the SQLite store ``db`` at ``run_dir``'s ``mlflow/artifacts``.

    MLflow stores absolute locations, so a copied or moved run dir would otherwise read and write
    the original's artifacts. Old roots are those of the experiments plus ``recorded_run_dir``'s;
    everything changes in one transaction. Returns the old roots that were rewritten.
    """
    own = _artifact_root(run_dir)
    conn = sqlite3.connect(db, timeout=60, isolation_level=None)
    try:
        conn.execute("BEGIN IMMEDIATE")
        try:
            tables = _tables(conn)
            old = _stored_roots(conn) if "experiments" in tables else set()
            if recorded_run_dir:
                old.add(_artifact_root(recorded_run_dir))
            old.discard(own)
            moved = [root for root in sorted(old) if _rewrite_prefix(conn, tables, root, own)]
            if moved and "tags" in tables:
                conn.execute(
                    "UPDATE tags SET value = ? WHERE key = ? AND value != ?", (str(run_dir), RUN_DIR_TAG, str(run_dir))
                )
            conn.execute("COMMIT")
        except BaseException:
            conn.execute("ROLLBACK")
            raise
    except sqlite3.Error as exc:
        raise TrackingError(f"cannot update the artifact locations in {db}: {exc}") from exc
    finally:
        conn.close()
    return moved


def _forget_foreign_artifact_repos(own_root: str) -> None:
    """Drop MLflow's cached artifact repositories that point into another run dir's artifacts.

    MLflow caches them per run id for the whole process, whatever the store; a copied run dir has
    the original's run ids, so a process that touched both would send the copy's artifact reads
    and writes to the original (or, after a move, recreate the old path).
    """
    try:
        from mlflow.tracking._tracking_service import utils as service_utils

        cache = service_utils._artifact_repos_cache
        entries = list(cache.items())
    except (ImportError, AttributeError, RuntimeError):
        return
    for resource_id, repo in entries:
        uri = getattr(repo, "artifact_uri", None)
        if (
            isinstance(uri, str)
            and uri.startswith("file://")
            and "/mlflow/artifacts/" in uri
            and not uri.startswith(own_root + "/")
        ):
            cache.pop(resource_id, None)


class ChildRun:
    """One flow's MLflow run. Safe to share between threads: every call names its run id."""

    def __init__(self, tracker: Tracker, run_id: str, flow_name: str):
        self.tracker = tracker
        self.run_id = run_id
        self.flow_name = flow_name

    @property
    def client(self) -> MlflowClient:
        return self.tracker.client

    @property
    def experiment_id(self) -> str:
        return self.tracker.experiment_id()

    def ui_url(self, base: str = DEFAULT_UI) -> str:
        """The run's page in ``mlflow ui`` (served at ``base``), for links from Prefect artifacts."""
        return f"{base.rstrip('/')}/#/experiments/{self.experiment_id}/runs/{self.run_id}"

    def log_params(self, params: Mapping[str, Any]) -> dict[str, str]:
        """Log (flattened) params; returns what was logged. Values already logged with a different
        value (a resumed run whose config changed) are kept, warned about and listed in a tag."""
        from mlflow.entities import Param

        flat = flatten_params(params)
        _refuse_secrets(list(flat), "param(s)")
        values = {_clean_key(k, "param"): _clip(_param_text(v), MAX_PARAM_VALUE_CHARS) for k, v in flat.items()}
        existing = _retry(self.client.get_run, self.run_id).data.params
        conflicts = sorted(k for k, v in values.items() if k in existing and existing[k] != v)
        if conflicts:
            log.warning(
                "run %s already has different values for params %s; keeping the first values", self.run_id, conflicts
            )
            self.set_tags({"rubricem.param_conflicts": ",".join(conflicts)})
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
    """MLflow bookkeeping of one pipeline run directory."""

    def __init__(self, run_dir: str | os.PathLike[str], experiment: str = "rubricem"):
        self.run_dir = Path(run_dir).expanduser().resolve()
        self.experiment = experiment
        self.store = RunStore(self.run_dir)
        layout = RunLayout(self.run_dir)
        self.mlflow_dir = layout.mlflow_dir
        self.db_path = layout.mlflow_db
        self.tracking_uri = f"sqlite:///{self.db_path}"
        self.artifact_uri = _artifact_root(self.run_dir)
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
                from mlflow import MlflowClient

                self.mlflow_dir.mkdir(parents=True, exist_ok=True)
                self._follow_run_dir()  # before MLflow reads any stored location
                self._client = MlflowClient(tracking_uri=self.tracking_uri)
            _forget_foreign_artifact_repos(self.artifact_uri)
            return self._client

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
        atomic_write_text(self.state_path, json.dumps(state, indent=2, sort_keys=True))

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
                    artifact_location=self.artifact_uri,
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

    def experiment_ui_url(self, base: str = DEFAULT_UI) -> str:
        """The experiment's runs in ``mlflow ui`` at ``base``, opened in the model-training view.

        MLflow 3.17's UI chooses GenAI or model training by its ``workflowType`` switch (URL
        parameter, else the browser's last choice), not by the experiment tag.
        """
        return f"{base.rstrip('/')}/#/experiments/{self.experiment_id()}/runs?workflowType=machine_learning"

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
    def parent_run_id(self) -> str:
        """The pipeline run's parent MLflow run, created on first use and reused afterwards."""
        with self._state_lock():
            experiment_id = self.experiment_id()  # opening it also gives an older store the model-training kind
            state = self._read_state()
            known = self._get_run(state.get("run_id"))
            if known is not None:
                return self._reopen(known)
            run = _retry(
                self.client.create_run,
                experiment_id,
                run_name=self.run_dir.name,
                tags={RUN_DIR_TAG: str(self.run_dir)},
            )
            # a new parent (fresh or recreated MLflow DB) invalidates any remembered children
            self._write_state({"run_id": run.info.run_id, "experiment_id": experiment_id, "children": {}})
            return run.info.run_id

    def child_run_id(self, flow_name: str) -> str:
        """The child run that a run of ``flow_name`` logs to now.

        The remembered child when it ended FINISHED (or is open in this process); otherwise a new
        attempt under the same parent, so a retry's charts do not zig-zag over the failed ones.
        """
        return self._child_run_id(flow_name, claim=False)

    def _child_run_id(self, flow_name: str, claim: bool) -> str:
        if not flow_name or not flow_name.strip():
            raise ValueError("flow_name must be a non-empty string")
        parent = self.parent_run_id()
        with self._state_lock():
            state = self._read_state()
            children: dict[str, str] = state.setdefault("children", {})
            previous = self._get_run(children.get(flow_name))
            if previous is not None and self._reusable(previous):
                run_id = self._reopen(previous)
            else:
                run_id = self._new_attempt(parent, flow_name, previous)
                children[flow_name] = run_id
                self._write_state(state)
            if claim:  # under the lock, so a concurrent caller sees it open, not crashed
                _claim_live(run_id)
            return run_id

    @staticmethod
    def _reusable(run: Run) -> bool:
        """FINISHED: a rerun with nothing new must not clutter the experiment. RUNNING is reusable
        only while this process runs it; otherwise the process that ran it crashed."""
        status = run.info.status
        return status == "FINISHED" or (status == "RUNNING" and _is_live(run.info.run_id))

    def _new_attempt(self, parent: str, flow_name: str, previous: Run | None) -> str:
        """A new child run for ``flow_name``: attempt 1, or the one after ``previous`` (closed FAILED
        if a crash left it RUNNING)."""
        tags = {"mlflow.parentRunId": parent, FLOW_TAG: flow_name}
        attempt = 1
        if previous is not None:
            if previous.info.status == "RUNNING":
                _retry(self.client.set_terminated, previous.info.run_id, status="FAILED")
            attempt = _attempt_of(previous) + 1
            tags[RETRY_OF_TAG] = previous.info.run_id
        tags[ATTEMPT_TAG] = str(attempt)
        name = flow_name if attempt == 1 else f"{flow_name} (attempt {attempt})"
        return _retry(self.client.create_run, self.experiment_id(), run_name=name, tags=tags).info.run_id

    @contextlib.contextmanager
    def child_run(
        self, flow_name: str, params: Mapping[str, Any] | None = None, tags: Mapping[str, Any] | None = None
    ) -> Iterator[ChildRun]:
        """Run a flow inside its child run: RUNNING while inside, then FINISHED, FAILED or KILLED.

        ``tags`` are set on entry (e.g. ``prefect.flow_run_id``/``prefect.flow_run_url`` to link the
        Prefect flow run). The parent follows its stages: RUNNING while one runs, then the status of
        the stage that ended last, so a completed pipeline leaves it FINISHED and a failed stage
        leaves it FAILED until a rerun resumes it.
        """
        # refused before any run is created or reopened
        _refuse_secrets(list(flatten_params(params or {})), "param(s)")
        _refuse_secrets([str(k) for k in (tags or {})], "tag(s)")
        run_id = self._child_run_id(flow_name, claim=True)
        try:
            parent = self.parent_run_id()
            for live in (parent, run_id):  # a reused run is live again
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
                for ended in (run_id, parent):
                    _retry(self.client.set_terminated, ended, status=status)
        finally:
            _release_live(run_id)

    def log_parent_artifact(self, path: str | os.PathLike[str], artifact_path: str | None = None) -> str:
        """Log a file or folder under the parent run (run-level artifacts: reports, plots); returns its id."""
        run_id = self.parent_run_id()
        ChildRun(self, run_id, "parent").log_artifact(path, artifact_path)
        return run_id

    def finish(self, status: str = "FINISHED") -> None:
        """Close the parent run at the end of the pipeline (FINISHED, FAILED or KILLED)."""
        _retry(self.client.set_terminated, self.parent_run_id(), status=status)
