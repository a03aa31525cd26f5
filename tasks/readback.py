"""Tasks that find their work already in the run directory end in Prefect's own `Cached` state.

The run directory's Parquet is the cache: a partition (or checkpoint) appears whole, and only once its
work is complete, so a task that finds it reads it back instead of recomputing (a retried flow run
resumes there). Prefect 3 shows a cache hit as ``Completed(name="Cached")``; such a task returns
``read_back(result, where)`` — that state, with a message naming what it read back — so a retry lists
the read-back tasks as Cached in the UI. Prefect's result-store cache is not used: its copy of a result
could outlive or disagree with the Parquet; here a task is Cached exactly when its Parquet says so (a
failed task writes no completing partition, so it is never reported Cached).

Calling a `ParquetTask` returns the task's result (the dict), as calling a plain task does; its state
is returned with ``return_state=True``, and ``.submit()`` futures resolve to the result too.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from prefect import Task
from prefect.cache_policies import NO_CACHE
from prefect.states import Completed, State

from rubricem_core.store import RunStore, cached_task_metrics

CACHED = "Cached"  # Prefect's name for a Completed state that a cache hit produced


class ParquetTask(Task):
    """A task whose function may return ``read_back(...)``; a call still returns the plain result."""

    def __call__(self, *args: Any, return_state: bool = False, wait_for: Any = None, **kwargs: Any) -> Any:
        state = super().__call__(*args, return_state=True, wait_for=wait_for, **kwargs)  # type: ignore[call-overload]
        return state if return_state else state.result()


def parquet_task(**options: Any) -> Callable[[Callable[..., Any]], ParquetTask]:
    """``@task(**options)`` for a task that reads its finished Parquet back (no Prefect cache policy:
    the Parquet decides)."""

    def decorate(fn: Callable[..., Any]) -> ParquetTask:
        return ParquetTask(fn=fn, cache_policy=NO_CACHE, **options)

    return decorate


def read_back(result: dict[str, Any], where: str | Path, run_dir: str | Path | None = None) -> State:
    """The final state of a task run that read its output back: Completed, named Cached, carrying
    ``result``; ``where`` (shown relative to ``run_dir``) names the partition or checkpoint."""
    shown = Path(where)
    if run_dir is not None:
        try:
            shown = shown.resolve().relative_to(Path(run_dir).resolve())
        except ValueError:
            pass
    return Completed(name=CACHED, message=f"read back from {shown}", data=result)


def read_back_step(
    store: RunStore, task: str, step: int, where: str | Path, extra: dict[str, float] | None = None
) -> State:
    """``read_back`` for an RL step's task: its saved metrics (with ``extra``), from ``where``."""
    metrics = cached_task_metrics(store, task, step) | (extra or {})
    return read_back({"cached": True, "metrics": metrics}, where, store.run_dir)
