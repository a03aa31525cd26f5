"""LLM client layer: everything goes through litellm.

- ``types``: ChatRequest, ChatResult, EndpointSettings (no litellm import; cheap for config code)
- ``concurrent``: run_concurrent / arun_concurrent for providers without a Batch API
- ``batch``: BatchClient for OpenAI-format Batch APIs (upload, create, poll, resubmit failures)
- ``cost``: call_cost from litellm's bundled price map or per-token prices

The litellm-backed names are imported lazily: importing litellm takes seconds, and code that only
needs the data types (config validation, table schemas) should not pay for it.
"""

from __future__ import annotations

import importlib
from typing import Any

from rubricem_core.offline import apply_offline_defaults

# litellm reads LITELLM_LOCAL_MODEL_COST_MAP at import: set before any submodule imports it, also when
# tasks are imported without the flows (a notebook), or it fetches its price map from GitHub.
apply_offline_defaults()

from rubricem_core.llm.types import (
    ChatRequest,
    ChatResult,
    EndpointSettings,
    LLMRequestError,
    LLMSettingsError,
)

_LAZY = {
    "run_concurrent": "rubricem_core.llm.concurrent",
    "arun_concurrent": "rubricem_core.llm.concurrent",
    "BatchClient": "rubricem_core.llm.batch",
    "BatchError": "rubricem_core.llm.batch",
    "BatchTimeoutError": "rubricem_core.llm.batch",
    "call_cost": "rubricem_core.llm.cost",
}

__all__ = ["ChatRequest", "ChatResult", "EndpointSettings", "LLMRequestError", "LLMSettingsError", *_LAZY]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'rubricem_core.llm' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
