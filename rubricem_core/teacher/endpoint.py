"""Run one round of teacher requests (a Batch API job or concurrent calls).

Endpoint settings come from the one factory of every endpoint, ``rubricem_core.llm.endpoints``
(``endpoint_settings`` is re-exported here for older imports).
"""

from __future__ import annotations

from collections.abc import Callable

from rubricem_core.config import TeacherConfig
from rubricem_core.llm.batch import BatchClient
from rubricem_core.llm.concurrent import run_concurrent
from rubricem_core.llm.endpoints import endpoint_settings
from rubricem_core.llm.types import ChatRequest, ChatResult, EndpointSettings, RetryStats

BUILTIN_PREFIX = "rubricem-teacher/"

__all__ = ["BUILTIN_PREFIX", "endpoint_settings", "is_builtin", "run_round"]


def is_builtin(model: str) -> bool:
    return model.startswith(BUILTIN_PREFIX)


def run_round(
    requests: list[ChatRequest],
    cfg: TeacherConfig,
    settings: EndpointSettings,
    resume_batch_id: str | None = None,
    on_submitted: Callable[[str], None] | None = None,
    on_result: Callable[[ChatResult], None] | None = None,
    stats: RetryStats | None = None,
) -> list[ChatResult]:
    """One round: a single Batch API job (mode=batch) or bounded concurrent calls. ``stats`` gets the
    round's retries, 429s and seconds waited (per request, and the batch path's file and batch calls)."""
    if not requests:
        return []
    if cfg.mode == "batch":
        if is_builtin(cfg.model):
            raise ValueError(
                "teacher.mode=batch needs a provider with a Batch API; the built-in teacher "
                "(rubricem-teacher/...) runs with teacher.mode=concurrent"
            )
        client = BatchClient(settings)
        results = client.run(requests, resume_batch_id=resume_batch_id, on_submitted=on_submitted)
        if stats is not None:
            stats.add_retries(client.stats.retries, client.stats.rate_limited, client.stats.wait_s)
    else:
        results = run_concurrent(requests, settings, on_result=on_result)
    if stats is not None:
        for result in results:
            stats.add_result_retries(result)
    return results
