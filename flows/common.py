"""What every flow does first: hold its run directory and resolve the run config against the one
recorded there."""

from __future__ import annotations

import functools
import hashlib
import inspect
import logging
import os
import re
import signal
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any, TypeVar

from pydantic import WithJsonSchema

from rubricem_core.config import PROFILES_DIR, ConfigError, RunConfig
from rubricem_core.offline import apply_offline_defaults
from rubricem_core.run_config import base_config, record_config
from rubricem_core.runlock import run_dir_lock
from rubricem_core.store import RunStore, StoreError

apply_offline_defaults()

F = TypeVar("F", bound=Callable[..., Any])


def profile_names() -> list[str]:
    """The profiles under data/profiles (tiny, small, gpu, research, ...)."""
    return sorted(p.stem for p in PROFILES_DIR.glob("*.yaml"))


# The `profile` parameter of every flow. The deployment form (its JSON schema) offers the profiles
# under data/profiles as a dropdown; a direct call (the CLI) may also name a YAML file, which the
# config loader reads. The form's list is fixed when the deployment is registered (`prefect deploy`).
Profile = Annotated[
    str | None,
    WithJsonSchema(
        {
            "anyOf": [{"type": "string", "enum": profile_names()}, {"type": "null"}],
            "title": "profile",
            "description": "a profile under data/profiles; empty: the run directory's own config.yaml",
        }
    ),
]


# What a run's parameters must not change when the run was started from a deployment (the Prefect UI or API):
# the commands and environment of the processes it starts, and the tool servers it runs (an MCP tool's
# `server` is a command line). Whoever can start a flow run could otherwise run a shell on the worker.
COMMAND_FIELDS = ("tools.specs", "rollout.server_python", "rollout.server_env")
ALLOW_COMMANDS_ENV = "RUBRICEM_ALLOW_COMMAND_OVERRIDES"


def refuse_command_changes(run_dir: str, profile: str | None, cfg: RunConfig) -> None:
    """A flow run of a deployment whose parameters change ``COMMAND_FIELDS`` from the profile (or the run
    directory's recorded config) is refused, unless the worker's own environment sets
    ``RUBRICEM_ALLOW_COMMAND_OVERRIDES=1`` (a flow run's job variables cannot: setting it there is refused)."""
    from prefect.runtime import deployment, flow_run

    if not (deployment.id or flow_run.parent_deployment_id):
        return  # the CLI or a Python call: the user runs their own commands anyway
    base = base_config(run_dir, profile, {})
    changed = [f for f in COMMAND_FIELDS if _field(cfg, f) != _field(base, f)]
    if not changed:
        return
    job_env = (flow_run.job_variables or {}).get("env") or {}
    if ALLOW_COMMANDS_ENV in job_env:
        raise ConfigError(f"{ALLOW_COMMANDS_ENV} is the worker operator's to set, not a flow run's job variable")
    if os.environ.get(ALLOW_COMMANDS_ENV) == "1":
        return
    raise ConfigError(
        f"a flow run of a deployment may not change {', '.join(changed)} (the commands, environment and tool "
        f"servers it starts): put them in the profile, or start the worker with {ALLOW_COMMANDS_ENV}=1"
    )


def _field(cfg: RunConfig, dotted: str) -> Any:
    value: Any = cfg
    for part in dotted.split("."):
        value = getattr(value, part)
    return value.model_dump() if hasattr(value, "model_dump") else value


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
    refuse_command_changes(run_dir, profile, cfg)
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
        from prefect.runtime import flow_run

        # a refused run names the Prefect flow run holding the directory, not only its process
        holder = f"{flow_fn.__name__} (Prefect flow run '{flow_run.name}')" if flow_run.name else flow_fn.__name__
        with run_dir_lock(bound.arguments["run_dir"], command=holder):
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


def experiment_links(cfg: RunConfig, run_dir: str) -> dict[str, str | None]:
    """The links section of the pipeline run's summary: the run directory's MLflow experiment (its
    parent run and one child run per stage) and the store to start `mlflow ui` on; None when untracked."""
    from rubricem_core.tracking import Tracker

    tracker = Tracker.from_config(run_dir, cfg.tracking)
    if tracker is None:
        return {"mlflow_url": None, "mlflow_db": None}
    return {
        "mlflow_url": tracker.experiment_ui_url(),
        "mlflow_db": tracker.tracking_uri if tracker.is_local else None,
    }


def mark_stale_runs_crashed(run_dir: str) -> int:
    """Flow and task runs of this run directory that the server still shows Running or Pending, left
    by a process that died (a SIGKILL, a lost node) — this flow run holds the run directory's lock, so
    nothing else is writing it. Marked Crashed, so the UI does not show a dead subflow running forever
    under its completed retry. Returns how many flow runs were marked."""
    from prefect import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterState, FlowRunFilterStateType
    from prefect.runtime import flow_run
    from prefect.states import Crashed

    here = str(Path(run_dir).resolve())
    own = {str(flow_run.id)}
    message = "its process died (found by a later run of the same run directory, which holds its lock)"
    with get_client(sync_client=True) as client:
        runs = client.read_flow_runs(
            flow_run_filter=FlowRunFilter(state=FlowRunFilterState(type=FlowRunFilterStateType(any_=_RUNNING))),
            limit=200,
        )
        stale = [
            r
            for r in runs
            if str(r.id) not in own
            and isinstance(r.parameters.get("run_dir"), str)
            and str(Path(r.parameters["run_dir"]).resolve()) == here
        ]
        _end_runs(client, stale, Crashed, message, live_states=_RUNNING)
    return len(stale)


# ---- a top-level run that crashes or is cancelled ends its subflows and task runs too ---------------
_RUNNING = ["RUNNING", "PENDING"]  # a run of another flow run's process (a Scheduled one may wait for a worker)
_LIVE = [*_RUNNING, "SCHEDULED", "PAUSED", "CANCELLING"]  # what a dead parent leaves under it (task retries too)


def _end_runs(
    client: Any,
    flow_runs: list[Any],
    state: Callable[..., Any],
    message: str,
    spare: Any = None,
    live_states: list[str] = _LIVE,
) -> tuple[int, int]:
    """Put ``flow_runs`` (those in ``live_states``, but ``spare``: the run whose hook this is, which its
    engine ends) and their task runs in ``live_states`` into ``state`` (Crashed or Cancelled), forced: the
    process that would have finished them is gone. Returns the counts."""
    from prefect.client.schemas.filters import (
        FlowRunFilter,
        FlowRunFilterId,
        TaskRunFilter,
        TaskRunFilterState,
        TaskRunFilterStateType,
    )

    live = [r for r in flow_runs if r.id != spare and (r.state is None or r.state.type.value in live_states)]
    for run in live:
        client.set_flow_run_state(run.id, state(message=f"flow run {run.name}: {message}"), force=True)
    if not flow_runs:
        return len(live), 0
    tasks = client.read_task_runs(
        flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[r.id for r in flow_runs])),
        task_run_filter=TaskRunFilter(state=TaskRunFilterState(type=TaskRunFilterStateType(any_=live_states))),
    )
    for task_run in tasks:
        client.set_task_run_state(task_run.id, state(message=f"task run {task_run.name}: {message}"), force=True)
    return len(live), len(tasks)


def subflow_runs(client: Any, root_id: Any) -> list[Any]:
    """Every subflow run below the flow run ``root_id``, at any depth (pipeline → rl → rl_step)."""
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterParentFlowRunId

    found: list[Any] = []
    parents = [root_id]
    while parents:
        children = client.read_flow_runs(
            flow_run_filter=FlowRunFilter(parent_flow_run_id=FlowRunFilterParentFlowRunId(any_=parents)),
            limit=200,
        )
        children = [c for c in children if c.id not in {f.id for f in found}]
        found += children
        parents = [c.id for c in children]
    return found


def killed_by(message: str | None) -> str | None:
    """The signal a crashed run's process died of, from the state message the worker writes
    ("Process exited with status code: -9"; a shell's 128 + N too), e.g. "signal SIGKILL (9)"."""
    text = message or ""
    for words, name in (("termination signal", "SIGTERM"), ("interrupt signal", "SIGINT")):  # in-process
        if words in text:
            return f"signal {name} ({signal.Signals[name].value})"
    match = re.search(r"(?:status|exit) code:? (-?\d+)", text)
    if not match:
        return None
    code = int(match.group(1))
    number = -code if code < 0 else code - 128 if 128 < code < 160 else None
    if number is None:
        return None
    try:
        return f"signal {signal.Signals(number).name} ({number})"
    except ValueError:
        return f"signal {number}"


def end_subruns(flow: Any, flow_run: Any, state: Any) -> None:
    """on_crashed / on_cancellation hook of every flow: the subflow and task runs under a flow run that
    crashed (its process was killed; the worker runs this hook) or is being cancelled are ended with
    it, so none stays Running in the UI until the next run of the run directory. The run's log says
    which signal killed it, where the state message tells."""
    from prefect import get_client
    from prefect.logging.loggers import flow_run_logger
    from prefect.states import Cancelled, Crashed

    log = flow_run_logger(flow_run, flow)
    crashed = state.is_crashed()
    signal_name = killed_by(state.message) if crashed else None
    if signal_name:
        log.error(
            "flow run %s was killed by %s (an OOM killer, `kill -9`, a preempted node): no clean-up ran; "
            "a retry resumes from the Parquet already written",
            flow_run.name,
            signal_name,
        )
    what = f"its parent flow run {flow_run.name} " + (
        f"crashed ({signal_name or state.message or 'process died'})" if crashed else "was cancelled"
    )
    try:
        with get_client(sync_client=True) as client:
            subflows = subflow_runs(client, flow_run.id)
            root = client.read_flow_run(flow_run.id)
            ended = Crashed if crashed else Cancelled
            n_flows, n_tasks = _end_runs(client, [root, *subflows], ended, what, spare=root.id)
    except Exception as exc:  # noqa: BLE001 - bookkeeping on the server; the next run does it too
        log.warning("could not end the subflow and task runs of %s: %s", flow_run.name, exc)
        return
    if n_flows or n_tasks:
        log.info(
            "marked %d subflow run(s) and %d task run(s) of %s %s",
            n_flows,
            n_tasks,
            flow_run.name,
            "Crashed" if crashed else "Cancelled",
        )


RUN_HOOKS: dict[str, Any] = {"on_crashed": [end_subruns], "on_cancellation": [end_subruns]}
