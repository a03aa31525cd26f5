"""Rollout engines: multi-turn, tool-augmented generation at the token level (RL and evaluation).

``types`` holds the contract (SamplingParams, RolloutRequest, RolloutEngine, finish reasons);
``hf_engine`` is the transformers engine with a KV cache kept across tool turns; ``baseline`` is the
naive re-encode-every-turn loop used only by ``bench/rollout_engine.py``.
"""
from rubricem_core.rollout.hf_engine import HFRolloutEngine
from rubricem_core.rollout.types import (
    ANSWERED,
    ERROR,
    FINISH_REASONS,
    TOOL_BUDGET,
    TRUNCATED,
    ForcedContext,
    ForcedPolicy,
    RolloutEngine,
    RolloutError,
    RolloutRequest,
    SamplingParams,
)

__all__ = [
    "ANSWERED", "ERROR", "FINISH_REASONS", "TOOL_BUDGET", "TRUNCATED", "ForcedContext", "ForcedPolicy",
    "HFRolloutEngine", "RolloutEngine", "RolloutError", "RolloutRequest", "SamplingParams",
]
