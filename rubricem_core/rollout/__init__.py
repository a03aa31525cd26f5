"""Rollout engines: multi-turn, tool-augmented generation at the token level (RL and evaluation).

``types`` holds the contract (SamplingParams, RolloutRequest, RolloutEngine, finish reasons);
``rows`` is one trajectory being generated (tokens, masks, stages, tool calls, finish reason) and
``batch`` the rows of one ``generate`` call, both shared by the engines; ``hf_engine`` is the
transformers engine with a KV cache kept across tool turns (``kv_cache``, ``sampling``);
``vllm_engine`` / ``vllm_server`` drive vLLM in process or over HTTP; ``baseline`` is the naive
re-encode-every-turn loop used only by ``bench/rollout_engine.py``.
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
    "ANSWERED",
    "ERROR",
    "FINISH_REASONS",
    "TOOL_BUDGET",
    "TRUNCATED",
    "ForcedContext",
    "ForcedPolicy",
    "HFRolloutEngine",
    "RolloutEngine",
    "RolloutError",
    "RolloutRequest",
    "SamplingParams",
]
