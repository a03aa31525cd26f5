"""Tiny random Qwen3 (and Llama) models, a BPE tokenizer over a small world, and token trajectories for
update tests, shared by tests and benches."""

from __future__ import annotations

import math
import random

import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

from rubricem_core.batching import collate
from rubricem_core.logprobs import token_logprobs
from rubricem_core.policy.tokenizer import train_bpe_tokenizer
from rubricem_core.scaffold import EXAMPLE_TRACE
from rubricem_core.trajectory import TokenTrajectory

VOCAB = 512
PAD = 0


def tiny_config(
    vocab_size: int, hidden: int = 64, layers: int = 2, arch: str = "qwen3", **extra
) -> Qwen3Config | LlamaConfig:
    """The tiny test models' shape: 4 attention heads over 2 KV heads, an MLP twice ``hidden`` wide,
    128 positions; ``extra`` sets or overrides any other config field."""
    fields = dict(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=hidden // 4,
        max_position_embeddings=128,
    )
    return (LlamaConfig if arch == "llama" else Qwen3Config)(**{**fields, **extra})


def tiny_model(seed: int = 0, tie: bool = False, arch: str = "qwen3") -> Qwen3ForCausalLM | LlamaForCausalLM:
    """A random 2-layer Qwen3 (or, ``arch="llama"``, the SmolLM2 family's Llama) of the same sizes."""
    torch.manual_seed(seed)
    model = LlamaForCausalLM if arch == "llama" else Qwen3ForCausalLM
    return model(tiny_config(VOCAB, arch=arch, tie_word_embeddings=tie))


def world_tokenizer(world, vocab_size: int = 600):
    """A byte-level BPE over a synthetic world's documents and questions and the scaffold's example."""
    texts = [d.text for d in world.documents] + [q.question for q in world.queries] + [EXAMPLE_TRACE] * 4
    return train_bpe_tokenizer(texts, vocab_size=vocab_size)


def tool_policy(tok, seed: int = 0, attn: str = "sdpa", max_positions: int = 4096) -> Qwen3ForCausalLM:
    """A tiny random Qwen3 (eval mode) sized to ``tok``, for rollout-engine tests with real tools."""
    torch.manual_seed(seed)
    extra = dict(tie_word_embeddings=True, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
    config = tiny_config(len(tok), max_position_embeddings=max_positions, **extra)
    config._attn_implementation = attn
    return Qwen3ForCausalLM(config).eval()


# ---- trajectories for update tests: random ids, stages 0..3, a prompt and a tool output untrained
def rl_trajectories(n: int = 6, seed: int = 3) -> list[TokenTrajectory]:
    """Prompt tokens (untrained), then policy tokens of stages 0..3, some tool output in between."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        length = rng.randint(20, 40)
        ids = [rng.randrange(1, VOCAB) for _ in range(length)]
        mask = [0] * 5 + [1 if not 15 <= t < 19 else 0 for t in range(5, length)]
        stages = [-1] * 5 + [min(3, (t - 5) * 4 // (length - 5)) for t in range(5, length)]
        out.append(TokenTrajectory(ids, mask, stages, [math.nan] * length, n_tool_calls=i % 2))
    return out


def rl_advantages(trajs: list[TokenTrajectory]) -> list[list[float]]:
    return [[(0.5 + i / 4) * (1 if i % 2 else -1) * m for m in t.loss_mask] for i, t in enumerate(trajs)]


def with_sampled_logprobs(trajs: list[TokenTrajectory], model: torch.nn.Module, shift: float = 0.0) -> None:
    """The sampler's logprobs: the model's own (an on-policy engine), shifted by ``shift`` per token."""
    batch = collate(trajs, PAD)
    with torch.no_grad():
        logp = token_logprobs(model, batch.input_ids, batch.attention_mask)
    for row, t in enumerate(trajs):
        t.logprobs = [float(logp[row, j]) + shift if m else math.nan for j, m in enumerate(t.loss_mask)]
