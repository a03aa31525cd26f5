"""The reflection meta-policy's core: what the policy writes, how it is judged, where it is kept.

- ``format``: the reflection prompt (question + raw trajectory only), the output format, parsing,
  validation codes, and the guidance text injected into later prompts
- ``judge``: ReflectionJudge (one call per source trajectory, privileged inputs, repair, failures
  recorded never scored 0)
- ``bank``: ReflectionBank, thread-safe, FAISS-indexed, persisted to Parquet

``judge`` pulls in litellm (seconds to import), so its names are imported lazily.
"""

from __future__ import annotations

import importlib
from typing import Any

from rubricem_core.reflection.bank import RETRIEVAL_MODES, BankEntry, BankError, ReflectionBank
from rubricem_core.reflection.format import (
    REFLECTION_CODES,
    REFLECTION_STOP,
    Reflection,
    guidance_text,
    parse_reflection,
    reflection_messages,
    validate_reflection,
)

_LAZY = {
    name: "rubricem_core.reflection.judge"
    for name in (
        "ReflectionJudge",
        "ReflectionJudgeInput",
        "ReflectionJudgeOptions",
        "ReflectionJudgeUsage",
        "CandidateScore",
        "best_candidate",
        "candidate_rewards",
        "reflection_rows",
    )
}

__all__ = [
    "BankEntry",
    "BankError",
    "ReflectionBank",
    "RETRIEVAL_MODES",
    "REFLECTION_CODES",
    "REFLECTION_STOP",
    "Reflection",
    "guidance_text",
    "parse_reflection",
    "reflection_messages",
    "validate_reflection",
    *_LAZY,
]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'rubricem_core.reflection' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
