"""Copy probe: the batch is built right, the score equals a loop reference, and it separates a model
that copies by content from one that copies a fixed distance back."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from rubricem_core import scaffold
from rubricem_core.policy.copy_probe import copy_accuracy, copy_task_batch, ordinary_token_ids, probe_copying
from rubricem_core.policy.tokenizer import SPECIAL_TOKENS, TAG_TOKENS, train_bpe_tokenizer
from rubricem_core.sim.tiny_policy import TinyPolicySpec, init_tiny_model, tiny_qwen3_config

VOCAB = 512


class LookBack(torch.nn.Module):
    """Predicts the token that followed the latest earlier occurrence of the current token
    (``by_content``), or the token ``offset`` positions back."""

    def __init__(self, by_content: bool, offset: int = 64):
        super().__init__()
        self.by_content, self.offset = by_content, offset

    def forward(self, input_ids: torch.Tensor) -> SimpleNamespace:
        batch, width = input_ids.shape
        logits = torch.zeros(batch, width, VOCAB)
        for row in range(batch):
            seq = input_ids[row].tolist()
            for pos in range(width):
                if self.by_content:
                    earlier = [j for j in range(pos) if seq[j] == seq[pos]]
                    guess = seq[earlier[-1] + 1] if earlier else 0
                else:
                    guess = seq[pos + 1 - self.offset] if pos + 1 - self.offset >= 0 else 0
                logits[row, pos, guess] = 1.0
        return SimpleNamespace(logits=logits)


def test_batch_repeats_one_span_per_row_at_varying_distances():
    ids = torch.arange(10, VOCAB)
    input_ids, labels = copy_task_batch(ids, batch_size=64, span_tokens=16, generator=torch.Generator().manual_seed(0))
    assert input_ids.shape == labels.shape == (64, 64)
    distances = set()
    for row in range(64):
        scored = (labels[row] != -100).nonzero().flatten().tolist()
        assert scored == list(range(scored[0], scored[-1] + 1)) and len(scored) >= 3
        second = scored[0] - 1
        length = len(scored) + 1
        matches = [
            f
            for f in range(second - length + 1)
            if torch.equal(input_ids[row, f : f + length], input_ids[row, second : second + length])
        ]
        assert matches, f"row {row}: the labelled span has no earlier copy"
        distances.add(second - matches[-1])
        assert torch.equal(labels[row, scored], input_ids[row, scored])
    assert len(distances) > 5  # no fixed offset to exploit


def test_copy_accuracy_matches_a_loop_over_positions():
    spec = TinyPolicySpec(vocab_size=VOCAB, hidden_size=32, n_layers=1, n_heads=2, n_kv_heads=1, intermediate_size=64)
    model = init_tiny_model(tiny_qwen3_config(spec, eos_token_id=1, pad_token_id=0), seed=3)
    input_ids, labels = copy_task_batch(torch.arange(10, VOCAB), 4, 8, torch.Generator().manual_seed(1))
    logits = model(input_ids=input_ids).logits
    hits = total = 0
    for row in range(input_ids.shape[0]):
        for pos in range(1, input_ids.shape[1]):
            if labels[row, pos] != -100:
                total += 1
                hits += int(logits[row, pos - 1].argmax() == input_ids[row, pos])
    assert copy_accuracy(model, input_ids, labels) == pytest.approx(hits / total)


@pytest.fixture(scope="module")
def tokenizer():
    return train_bpe_tokenizer([scaffold.system_prompt(), scaffold.EXAMPLE_TRACE], vocab_size=VOCAB)


def test_ordinary_token_ids_leave_out_special_and_tag_tokens(tokenizer):
    ids = set(ordinary_token_ids(tokenizer))
    reserved = {tokenizer.convert_tokens_to_ids(t) for t in (*SPECIAL_TOKENS, *TAG_TOKENS)}
    assert ids and not ids & reserved and len(ids) == len(tokenizer) - len(reserved)


@pytest.mark.parametrize("span", [16, 32])
def test_probe_passes_content_copying_and_fails_shortcuts(tokenizer, span):
    assert len(tokenizer) <= VOCAB
    content = probe_copying(LookBack(by_content=True), tokenizer, span_tokens=(span,), rows=16)[span]
    fixed = probe_copying(LookBack(by_content=False, offset=span), tokenizer, span_tokens=(span,), rows=16)[span]
    spec = TinyPolicySpec(vocab_size=VOCAB, hidden_size=32, n_layers=1, n_heads=2, n_kv_heads=1, intermediate_size=64)
    untrained = init_tiny_model(tiny_qwen3_config(spec, eos_token_id=1, pad_token_id=0), seed=0)
    random_init = probe_copying(untrained, tokenizer, span_tokens=(span,), rows=16)[span]
    assert content > 0.8  # with ~460 ordinary tokens a token can repeat by chance and mislead the oracle
    assert fixed < 0.3
    assert random_init < 0.05
