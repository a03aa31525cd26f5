"""What every flow does first: hold its run directory and resolve the run config against the one
recorded there."""

from __future__ import annotations

import functools
import hashlib
import inspect
import logging
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from rubricem_core.config import ConfigError, RunConfig
from rubricem_core.offline import apply_offline_defaults
from rubricem_core.run_config import base_config, record_config
from rubricem_core.runlock import run_dir_lock
from rubricem_core.store import RunStore, StoreError

apply_offline_defaults()

F = TypeVar("F", bound=Callable[..., Any])


def resolve_config(
    run_dir: str,
    profile: str | None = None,
    overrides: dict[str, Any] | None = None,
    config: RunConfig | None = None,
    command: str = "flow",
) -> RunConfig:
    """A full ``config`` (e.g. from the Prefect UI form) wins; else the profile plus dotted overrides,
    where no profile means the run directory's recorded config (``run_config.base_config``).

    The resolved config is checked against ``<run_dir>/config.yaml`` (rubricem_core.run_config: a
    change that would alter finished work is refused) and recorded there, so a run is reproducible
    from its directory alone.
    """
    cfg = config if config is not None else base_config(run_dir, profile, overrides or {})
    if Path(run_dir).exists() and not Path(run_dir).is_dir():
        raise ConfigError(f"run directory {run_dir} is a file, not a directory")
    Path(run_dir).mkdir(parents=True, exist_ok=True)
    record_config(run_dir, cfg, command)
    return cfg


def writes_run_dir(flow_fn: F) -> F:
    """The flow holds its run directory's lock (rubricem_core.runlock) from start to end: a second
    writer is refused at once; sub-flows of the same process re-enter it."""
    signature = inspect.signature(flow_fn)

    @functools.wraps(flow_fn)
    def locked(*args: Any, **kwargs: Any) -> Any:
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        with run_dir_lock(bound.arguments["run_dir"], command=flow_fn.__name__):
            route_core_logs()
            _crash_stale_runs(bound.arguments["run_dir"])
            return flow_fn(*args, **kwargs)

    return locked  # type: ignore[return-value]


def _crash_stale_runs(run_dir: str) -> None:
    """In a top-level flow run only (a subflow's parent already did it); housekeeping never fails a run."""
    from prefect import get_run_logger
    from prefect.runtime import flow_run

    if flow_run.parent_flow_run_id:
        return
    log = get_run_logger()
    try:
        n = mark_stale_runs_crashed(run_dir)
    except Exception as exc:  # noqa: BLE001 - the server's bookkeeping, not the run's work
        log.warning("could not check for crashed runs of %s: %s", run_dir, exc)
        return
    if n:
        log.info("marked %d flow run(s) of %s Crashed: their process had died", n, run_dir)


def require_tables(run_dir: str, tables: list[str], command: str) -> None:
    """A prerequisite missing from the run directory is named with the command that makes it."""
    store = RunStore(run_dir)
    missing = [t for t in tables if not store.files(t)]
    if missing:
        raise StoreError(
            f"{run_dir} has no {', '.join(missing)} yet: run `rubricem {command} --run-dir {run_dir}` "
            "first (or the whole pipeline: `rubricem run`)"
        )


# ---- what a flow run shows in Prefect ------------------------------------------------------------
def route_core_logs() -> None:
    """rubricem_core's log records (resume and cache messages, progress lines, retries) reach the
    Prefect run's log, not only the console: the library logs through `logging`, never through Prefect."""
    from prefect.logging.handlers import APILogHandler

    core = logging.getLogger("rubricem_core")
    core.setLevel(logging.INFO)
    if not any(isinstance(h, APILogHandler) for h in core.handlers):
        core.addHandler(APILogHandler())


def artifact_key(flow: str, run_dir: str) -> str:
    """Prefect artifact keys allow lowercase letters, digits and dashes: `<flow>-<run dir name>-<hash>`
    (the hash tells apart run directories of the same name)."""
    path = str(Path(run_dir).resolve())
    name = re.sub(r"[^a-z0-9]+", "-", f"{flow}-{Path(path).name}".lower()).strip("-")
    return f"{name}-{hashlib.sha1(path.encode()).hexdigest()[:6]}"


def publish_markdown(flow: str, run_dir: str, markdown: str, description: str) -> None:
    """The flow run's Markdown summary in Prefect's Artifacts tab; one key per flow and run directory,
    so the Artifacts page lists the versions of a run directory's summaries."""
    from prefect.artifacts import create_markdown_artifact

    create_markdown_artifact(markdown=markdown, key=artifact_key(flow, run_dir), description=description)


def prefect_links() -> dict[str, str]:
    """The current flow run's id and UI address, tagged on its MLflow run."""
    from prefect.runtime import flow_run

    tags = {"prefect.flow_run_id": str(flow_run.id)} if flow_run.id else {}
    if flow_run.ui_url:
        tags["prefect.flow_run_url"] = str(flow_run.ui_url)
    return tags


def mlflow_links(tracker: Any, child: Any) -> dict[str, str | None]:
    """The links section of a flow run's summary (rubricem_core.tracking builds every MLflow link): its
    child run's MLflow UI address and the store to start `mlflow ui` on; both None when untracked."""
    if tracker is None or child is None:
        return {"mlflow_url": None, "mlflow_db": None}
    return tracker.links(child)


def mark_stale_runs_crashed(run_dir: str) -> int:
    """Flow and task runs of this run directory that the server still shows Running or Pending, left
    by a process that died (a SIGKILL, a lost node) — this flow run holds the run directory's lock, so
    nothing else is writing it. Marked Crashed, so the UI does not show a dead subflow running forever
    under its completed retry. Returns how many flow runs were marked."""
    from prefect import get_client
    from prefect.client.schemas.filters import (
        FlowRunFilter,
        FlowRunFilterId,
        FlowRunFilterState,
        FlowRunFilterStateType,
        TaskRunFilter,
        TaskRunFilterState,
        TaskRunFilterStateType,
    )
    from prefect.client.schemas.objects import StateType
    from prefect.runtime import flow_run
    from prefect.states import Crashed

    here = str(Path(run_dir).resolve())
    live = [StateType.RUNNING, StateType.PENDING]
    own = {str(flow_run.id)}
    message = "its process died (found by a later run of the same run directory, which holds its lock)"
    with get_client(sync_client=True) as client:
        runs = client.read_flow_runs(
            flow_run_filter=FlowRunFilter(state=FlowRunFilterState(type=FlowRunFilterStateType(any_=live))), limit=200
        )
        stale = [
            r
            for r in runs
            if str(r.id) not in own
            and isinstance(r.parameters.get("run_dir"), str)
            and str(Path(r.parameters["run_dir"]).resolve()) == here
        ]
        for run in stale:
            client.set_flow_run_state(run.id, Crashed(message=f"flow run {run.name}: {message}"), force=True)
        if stale:
            tasks = client.read_task_runs(
                flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[r.id for r in stale])),
                task_run_filter=TaskRunFilter(state=TaskRunFilterState(type=TaskRunFilterStateType(any_=live))),
            )
            for task_run in tasks:
                client.set_task_run_state(
                    task_run.id, Crashed(message=f"task run {task_run.name}: {message}"), force=True
                )
    return len(stale)
