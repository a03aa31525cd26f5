"""Turn a TeacherConfig into litellm endpoint settings, and run one round of requests."""
from __future__ import annotations

from typing import Callable

from rubricem_core.config import EndpointConfig, TeacherConfig, require_env
from rubricem_core.llm.batch import BatchClient
from rubricem_core.llm.concurrent import run_concurrent
from rubricem_core.llm.types import ChatRequest, ChatResult, EndpointSettings

BUILTIN_PREFIX = "rubricem-teacher/"


def is_builtin(model: str) -> bool:
    return model.startswith(BUILTIN_PREFIX)


def endpoint_settings(cfg: EndpointConfig, api_key: str | None = None) -> EndpointSettings:
    """litellm settings for a teacher or judge endpoint. ``api_key`` overrides the environment (the
    Prefect layer passes a Secret block's value); batch fields exist on the teacher only."""
    if api_key is None and cfg.api_key_env:
        api_key = require_env(cfg.api_key_env, purpose=f"model {cfg.model}")
    batch = {
        name: getattr(cfg, name)
        for name in ("batch_poll_interval_s", "batch_poll_max_interval_s", "batch_timeout_s", "max_batch_resubmits")
        if hasattr(cfg, name)
    }
    return EndpointSettings(
        model=cfg.model,
        api_base=cfg.api_base,
        api_key=api_key,
        custom_llm_provider=cfg.custom_llm_provider,
        timeout_s=cfg.timeout_s,
        max_retries=cfg.max_retries,
        max_concurrency=cfg.max_concurrency,
        **batch,
        input_cost_per_token=cfg.input_cost_per_token,
        output_cost_per_token=cfg.output_cost_per_token,
    )


def run_round(
    requests: list[ChatRequest],
    cfg: TeacherConfig,
    settings: EndpointSettings,
    resume_batch_id: str | None = None,
    on_submitted: Callable[[str], None] | None = None,
    on_result: Callable[[ChatResult], None] | None = None,
) -> list[ChatResult]:
    """One round: a single Batch API job (mode=batch) or bounded concurrent calls."""
    if not requests:
        return []
    if cfg.mode == "batch":
        if is_builtin(cfg.model):
            raise ValueError(
                "teacher.mode=batch needs a provider with a Batch API; the built-in teacher "
                "(rubricem-teacher/...) runs with teacher.mode=concurrent"
            )
        client = BatchClient(settings)
        return client.run(requests, resume_batch_id=resume_batch_id, on_submitted=on_submitted)
    return run_concurrent(requests, settings, on_result=on_result)
