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

import contextlib
import fcntl
import json
import logging
import os
import re
import shlex
import sqlite3
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator, Mapping
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import yaml

from rubricem_core.layout import TRACKING_STATE_FILE, RunLayout
from rubricem_core.offline import OFFLINE_DEFAULTS, apply_offline_defaults
from rubricem_core.redact import is_secret_name, redact_text
from rubricem_core.schemas import METRICS_SCHEMA
from rubricem_core.store import RunStore, StoreError, atomic_write_text, read_parquet_file

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
