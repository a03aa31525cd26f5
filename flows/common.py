"""What every flow does first: hold its run directory and resolve the run config against the one
recorded there."""
from __future__ import annotations

import functools
import inspect
from pathlib import Path
from typing import Any, Callable, TypeVar

from rubricem_core.config import ConfigError, RunConfig
from rubricem_core.offline import apply_offline_defaults
from rubricem_core.run_config import base_config, record_config
from rubricem_core.runlock import run_dir_lock
from rubricem_core.store import RunStore, StoreError

apply_offline_defaults()

F = TypeVar("F", bound=Callable[..., Any])


def resolve_config(
    run_dir: str, profile: str | None = None, overrides: dict[str, Any] | None = None, config: RunConfig | None = None,
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
            return flow_fn(*args, **kwargs)

    return locked  # type: ignore[return-value]


def require_tables(run_dir: str, tables: list[str], command: str) -> None:
    """A prerequisite missing from the run directory is named with the command that makes it."""
    store = RunStore(run_dir)
    missing = [t for t in tables if not store.files(t)]
    if missing:
        raise StoreError(f"{run_dir} has no {', '.join(missing)} yet: run `rubricem {command} --run-dir {run_dir}` "
                         "first (or the whole pipeline: `rubricem run`)")
