"""A tiny random Qwen3 and a one-thread fixture, shared by the trainer and checkpoint tests."""
from __future__ import annotations

import pytest
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

VOCAB = 512


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    # Matrices this small gain nothing from OpenMP threads, and on a busy 2-core machine two
    # spinning threads made a step ~15x slower (0.8 s vs 0.05 s measured).
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def tiny_model(seed: int = 0, tie: bool = False) -> Qwen3ForCausalLM:
    torch.manual_seed(seed)
    config = Qwen3Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=128, tie_word_embeddings=tie,
    )
    return Qwen3ForCausalLM(config)
