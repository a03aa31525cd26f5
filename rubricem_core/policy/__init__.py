"""Policy models: the BPE tokenizer, loading any HF causal LM, GGUF conversion (the tiny Qwen3 is in sim/)."""

from __future__ import annotations

from rubricem_core.policy.gguf import convert_gguf_to_hf, find_packaged_gguf
from rubricem_core.policy.loading import PolicyLoadError, load_policy, model_summary
from rubricem_core.policy.tokenizer import CHAT_TEMPLATE, TAG_TOKENS, train_bpe_tokenizer

__all__ = [
    "CHAT_TEMPLATE",
    "PolicyLoadError",
    "TAG_TOKENS",
    "convert_gguf_to_hf",
    "find_packaged_gguf",
    "load_policy",
    "model_summary",
    "train_bpe_tokenizer",
]
