"""MLflow tracking for one pipeline run directory: a parent run per run dir, a child run per flow.

Everything lives inside the run dir (``mlflow/mlflow.db`` SQLite store, ``mlflow/artifacts``), so a
run directory is self-contained and can be copied or inspected with ``mlflow ui``. Run ids are
persisted in ``state/mlflow_parent.json``, which makes re-entering a flow after a crash resume the
same child run instead of creating duplicates. All calls go through ``MlflowClient`` with explicit
run ids: the global active-run stack of ``mlflow.start_run`` is per-thread state that concurrent
Prefect tasks would trample. Metrics are mirrored into the ``metrics`` Parquet table for SQL.
"""
from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import re
import threading
import time
import uuid
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator, Mapping, TypeVar

import pyarrow as pa

from rubricem_core.offline import apply_offline_defaults
from rubricem_core.store import RunStore, atomic_write_text

if TYPE_CHECKING:
    from mlflow import MlflowClient

log = logging.getLogger(__name__)
T = TypeVar("T")

# MLflow's documented limits (mlflow.utils.validation); kept here so importing this module stays cheap
MAX_PARAM_VALUE_CHARS = 6000
MAX_TAG_VALUE_CHARS = 8000
MAX_KEY_CHARS = 250
MAX_PARAMS_PER_BATCH = 100
MAX_METRICS_PER_BATCH = 1000

METRICS_SCHEMA = pa.schema(
    [
        ("step", pa.int64()),
        ("name", pa.string()),
        ("value", pa.float64()),
        ("flow", pa.string()),
        ("run_id", pa.string()),
        ("logged_at", pa.timestamp("us", tz="UTC")),
    ]
)

STATE_FILE = "mlflow_parent.json"
# A name is secret-like when its last word is one of these ("api_key", "hf_token", "db_password",
# "openaiApiKey"). Judging by the last word lets names that only point at a secret or merely mention
# the word pass: "api_key_env" (an env var name), "api_key_secret_block", "max_tokens", "token_level".
SECRET_LAST_WORDS = frozenset({"key", "apikey", "token", "secret", "password", "passwd", "pwd", "credential", "credentials"})
_KEY_CHARS = re.compile(r"[^\w\-. /:]")  # MLflow accepts alphanumerics, _ - . space / :
_WORDS = re.compile(r"[A-Z]?[a-z]+|[A-Z]+(?![a-z])|\d+")


class TrackingError(RuntimeError):
    """MLflow state of a run directory is unusable (corrupt state file, unreachable store)."""


def is_secret_name(name: str) -> bool:
    leaf = str(name).rsplit(".", 1)[-1]
    words = [w.lower() for part in re.split(r"[^A-Za-z0-9]+", leaf) for w in _WORDS.findall(part)]
    if not words or words[-1] not in SECRET_LAST_WORDS:
        return False
    return not (len(words) > 1 and words[-2] == "per")  # a unit such as cost_per_token


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
    if isinstance(value, str):
        return value
    if isinstance(value, (list, tuple, dict)):
        try:
            return json.dumps(value, sort_keys=True, default=str)
        except (TypeError, ValueError):
            return str(value)
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


class ChildRun:
    """One flow's MLflow run. Safe to share between threads: every call names its run id."""

    def __init__(self, tracker: "Tracker", run_id: str, flow_name: str):
        self.tracker = tracker
        self.run_id = run_id
        self.flow_name = flow_name

    @property
    def client(self) -> "MlflowClient":
        return self.tracker.client

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
            log.warning("run %s already has different values for params %s; keeping the first values", self.run_id, conflicts)
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
        now = datetime.now(timezone.utc)
        timestamp_ms = int(now.timestamp() * 1000)
        entities = [Metric(k, v, timestamp_ms, step) for k, v in names.items()]
        for start in range(0, len(entities), MAX_METRICS_PER_BATCH):
            _retry(self.client.log_batch, self.run_id, metrics=entities[start : start + MAX_METRICS_PER_BATCH])
        rows = [
            {"step": step, "name": k, "value": v, "flow": self.flow_name, "run_id": self.run_id, "logged_at": now}
            for k, v in names.items()
        ]
        # one file per (run, step, metric names): a resumed flow that logs a step again replaces its
        # rows instead of duplicating them
        key = "\0".join([self.run_id, *sorted(names)])
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
        self.mlflow_dir = self.run_dir / "mlflow"
        self.tracking_uri = f"sqlite:///{self.mlflow_dir / 'mlflow.db'}"
        self.artifact_uri = (self.mlflow_dir / "artifacts").as_uri()
        self.state_path = self.run_dir / "state" / STATE_FILE
        self._client: MlflowClient | None = None
        self._experiment_id: str | None = None
        self._lock = threading.RLock()

    # ---- plumbing ------------------------------------------------------------------------------
    @property
    def client(self) -> "MlflowClient":
        with self._lock:
            if self._client is None:
                apply_offline_defaults()  # telemetry off before mlflow is imported
                from mlflow import MlflowClient

                self.mlflow_dir.mkdir(parents=True, exist_ok=True)
                self._client = MlflowClient(tracking_uri=self.tracking_uri)
            return self._client

    @contextlib.contextmanager
    def _state_lock(self) -> Iterator[None]:
        """Serializes state-file updates across threads (RLock) and processes (flock)."""
        with self._lock:
            self.state_path.parent.mkdir(parents=True, exist_ok=True)
            with open(self.state_path.parent / f".{STATE_FILE}.lock", "w") as handle:
                fcntl.flock(handle, fcntl.LOCK_EX)
                try:
                    yield
                finally:
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
        atomic_write_text(self.state_path, json.dumps(state, indent=2, sort_keys=True))

    def experiment_id(self) -> str:
        from mlflow.exceptions import MlflowException

        with self._lock:
            if self._experiment_id is None:
                found = _retry(self.client.get_experiment_by_name, self.experiment)
                if found is None:
                    try:
                        self._experiment_id = _retry(
                            self.client.create_experiment, self.experiment, artifact_location=self.artifact_uri
                        )
                    except MlflowException:  # another process created it first
                        found = _retry(self.client.get_experiment_by_name, self.experiment)
                        if found is None:
                            raise
                if found is not None:
                    if found.lifecycle_stage == "deleted":
                        _retry(self.client.restore_experiment, found.experiment_id)
                    self._experiment_id = found.experiment_id
            return self._experiment_id

    def _live_run(self, run_id: str | None) -> bool:
        """True when ``run_id`` exists in this store (restoring it if it was soft-deleted)."""
        from mlflow.exceptions import MlflowException

        if not run_id:
            return False
        try:
            run = _retry(self.client.get_run, run_id)
        except MlflowException as exc:
            if exc.error_code == "RESOURCE_DOES_NOT_EXIST":
                return False
            raise
        if run.info.lifecycle_stage == "deleted":
            _retry(self.client.restore_run, run_id)
        return True

    # ---- runs ----------------------------------------------------------------------------------
    def parent_run_id(self) -> str:
        """The pipeline run's parent MLflow run, created on first use and reused afterwards."""
        with self._state_lock():
            state = self._read_state()
            if self._live_run(state.get("run_id")):
                return state["run_id"]
            run = _retry(
                self.client.create_run,
                self.experiment_id(),
                run_name=self.run_dir.name,
                tags={"rubricem.run_dir": str(self.run_dir)},
            )
            # a new parent (fresh or recreated MLflow DB) invalidates any remembered children
            self._write_state({"run_id": run.info.run_id, "experiment_id": self.experiment_id(), "children": {}})
            return run.info.run_id

    def child_run_id(self, flow_name: str) -> str:
        """The child run of ``flow_name`` under the parent; the same id every time it is asked for."""
        if not flow_name or not flow_name.strip():
            raise ValueError("flow_name must be a non-empty string")
        parent = self.parent_run_id()
        with self._state_lock():
            state = self._read_state()
            children: dict[str, str] = state.setdefault("children", {})
            if self._live_run(children.get(flow_name)):
                return children[flow_name]
            run = _retry(
                self.client.create_run,
                self.experiment_id(),
                run_name=flow_name,
                tags={"mlflow.parentRunId": parent, "rubricem.flow": flow_name},
            )
            children[flow_name] = run.info.run_id
            self._write_state(state)
            return run.info.run_id

    @contextlib.contextmanager
    def child_run(self, flow_name: str, params: Mapping[str, Any] | None = None) -> Iterator[ChildRun]:
        """Run a flow inside its child run: RUNNING while inside, then FINISHED, FAILED or KILLED.

        The parent follows its stages: RUNNING while one runs, then the status of the stage that
        ended last, so a completed pipeline leaves it FINISHED and a failed stage leaves it FAILED
        until a rerun resumes it.
        """
        run_id = self.child_run_id(flow_name)
        parent = self.parent_run_id()
        for live in (parent, run_id):  # a resumed run is live again
            _retry(self.client.update_run, live, status="RUNNING")
        child = ChildRun(self, run_id, flow_name)
        if params:
            child.log_params(params)
        status = "FINISHED"
        try:
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

    def log_parent_artifact(self, path: str | os.PathLike[str], artifact_path: str | None = None) -> str:
        """Log a file or folder under the parent run (run-level artifacts: reports, plots); returns its id."""
        run_id = self.parent_run_id()
        ChildRun(self, run_id, "parent").log_artifact(path, artifact_path)
        return run_id

    def finish(self, status: str = "FINISHED") -> None:
        """Close the parent run at the end of the pipeline (FINISHED, FAILED or KILLED)."""
        _retry(self.client.set_terminated, self.parent_run_id(), status=status)

