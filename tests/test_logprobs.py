"""Chunked token logprobs and the SFT loss, checked against naive full-softmax computations."""

from __future__ import annotations

import random

import pytest
import torch
from transformers import Qwen3ForCausalLM

import rubricem_core.logprobs as lp_mod
from rubricem_core.batching import collate
from rubricem_core.logprobs import masked_mean, sft_loss, token_logprobs
from rubricem_core.scaffold import STAGE_IDS
from rubricem_core.testing.tiny_models import tiny_config
from rubricem_core.trajectory import TokenTrajectory

VOCAB = 320


@pytest.fixture(scope="module")
def model() -> Qwen3ForCausalLM:
    torch.manual_seed(0)
    config = tiny_config(VOCAB, hidden=32)
    config._attn_implementation = "eager"
    return Qwen3ForCausalLM(config).eval()


def make_traj(seed: int, prompt_len: int, parts: list[tuple[str, str | None, int]]) -> TokenTrajectory:
    rng = random.Random(seed)
    traj = TokenTrajectory.empty()
    traj.append("prompt", None, [rng.randrange(VOCAB) for _ in range(prompt_len)], "")
    for kind, stage, n in parts:
        traj.append(kind, stage, [rng.randrange(VOCAB) for _ in range(n)], "")
    return traj


TRAJS = [
    make_traj(
        1,
        6,
        [
            ("policy", "plan", 5),
            ("policy", "research", 3),
            ("tool_output", "research", 7),
            ("policy", "research", 4),
            ("policy", "review", 3),
            ("policy", "answer", 6),
        ],
    ),
    make_traj(
        2,
        4,
        [("policy", "plan", 3), ("policy", "research", 2), ("tool_output", "research", 2), ("policy", "answer", 2)],
    ),
    make_traj(
        3,
        9,
        [
            ("policy", "plan", 8),
            ("policy", "research", 2),
            ("tool_output", "research", 5),
            ("policy", "research", 3),
            ("policy", "review", 5),
            ("policy", "answer", 9),
        ],
    ),
]


def naive_logprobs(model, input_ids, attention_mask, temperature=1.0) -> torch.Tensor:
    logits = model(input_ids=input_ids, attention_mask=attention_mask).logits.float() / temperature
    full = torch.log_softmax(logits, dim=-1)[:, :-1]  # the whole (B, T-1, V) at once
    picked = full.gather(-1, input_ids[:, 1:].unsqueeze(-1)).squeeze(-1)
    out = torch.cat([torch.zeros(input_ids.shape[0], 1), picked], dim=1)
    return out * attention_mask


@pytest.mark.parametrize("chunk_size", [1, 7, 16, 4096])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_chunked_equals_naive_with_padding(model, chunk_size, temperature):
    batch = collate(TRAJS, pad_id=0)
    assert batch.attention_mask.min() == 0  # the batch really has padding
    with torch.no_grad():
        ours = token_logprobs(
            model, batch.input_ids, batch.attention_mask, chunk_size=chunk_size, temperature=temperature
        )
        ref = naive_logprobs(model, batch.input_ids, batch.attention_mask, temperature)
    assert ours.shape == batch.input_ids.shape and ours.dtype == torch.float32
    torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-5)
    assert (ours[:, 0] == 0).all()
    assert (ours[batch.attention_mask == 0] == 0).all()
    real = batch.attention_mask.bool().clone()
    real[:, 0] = False
    assert (ours[real] < 0).all()  # real logprobs, not zeros


def test_padding_does_not_change_a_rows_logprobs(model):
    batch = collate(TRAJS, pad_id=0)
    with torch.no_grad():
        together = token_logprobs(model, batch.input_ids, batch.attention_mask, chunk_size=5)
        for row, traj in enumerate(TRAJS):
            alone = collate([traj], pad_id=0)
            single = token_logprobs(model, alone.input_ids, alone.attention_mask, chunk_size=5)
            torch.testing.assert_close(together[row, : len(traj)], single[0], rtol=1e-5, atol=1e-5)


def test_chunked_gradients_equal_naive(model):
    batch = collate(TRAJS, pad_id=0)
    model.zero_grad()
    (token_logprobs(model, batch.input_ids, batch.attention_mask, chunk_size=6) * batch.loss_mask).sum().backward()
    ours = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    (naive_logprobs(model, batch.input_ids, batch.attention_mask) * batch.loss_mask).sum().backward()
    ref = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    assert any(g.abs().sum() > 0 for g in ours)
    for a, b in zip(ours, ref):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


def test_float32_work_is_bounded_by_chunk(monkeypatch):
    """With bf16 logits, the float32 upcast only ever sees chunk_size positions at a time."""
    seen: list[tuple[int, ...]] = []
    real = lp_mod._chunk_logprobs

    def spy(logits, targets, temperature):
        seen.append(tuple(logits.shape))
        return real(logits, targets, temperature)

    monkeypatch.setattr(lp_mod, "_chunk_logprobs", spy)
    logits = torch.randn(2, 50, 1000).to(torch.bfloat16)
    ids = torch.randint(0, 1000, (2, 50))
    out = token_logprobs(lambda input_ids, attention_mask: logits, ids, torch.ones_like(ids), chunk_size=16)
    assert [s[1] for s in seen] == [16, 16, 16, 1]
    ref = torch.log_softmax(logits.float(), -1)[:, :-1].gather(-1, ids[:, 1:, None]).squeeze(-1)
    torch.testing.assert_close(out[:, 1:], ref)


def test_token_logprobs_rejects_bad_shapes(model):
    ids = torch.zeros(2, 5, dtype=torch.long)
    with pytest.raises(ValueError, match="same shape|one shape"):
        token_logprobs(model, ids, torch.ones(2, 4, dtype=torch.long))
    with pytest.raises(ValueError, match="chunk_size"):
        token_logprobs(model, ids, torch.ones_like(ids), chunk_size=0)


def test_masked_mean():
    x = torch.tensor([[1.0, float("nan"), 3.0], [4.0, 5.0, 6.0]])
    mask = torch.tensor([[1, 0, 1], [0, 0, 1]])
    assert masked_mean(x, mask).item() == pytest.approx((1 + 3 + 6) / 3)
    assert masked_mean(x, mask, dim=1).tolist() == pytest.approx([2.0, 6.0])
    assert masked_mean(x, torch.zeros_like(mask)).item() == 0.0


def hand_sft(model, trajs):
    """NLL of each trained token from a full-sequence softmax, one trajectory at a time."""
    per_token: list[tuple[int, float]] = []  # (stage id, nll)
    with torch.no_grad():
        for traj in trajs:
            ids = torch.tensor([traj.token_ids])
            logp = torch.log_softmax(model(input_ids=ids).logits[0].float(), -1)
            for t in range(1, len(traj)):
                if traj.loss_mask[t]:
                    per_token.append((traj.stage_ids[t], -logp[t - 1, traj.token_ids[t]].item()))
    return per_token


def test_sft_loss_equals_hand_computation(model):
    batch = collate(TRAJS, pad_id=0)
    loss, metrics = sft_loss(model, batch, chunk_size=8)
    per_token = hand_sft(model, TRAJS)
    assert metrics["n_tokens"] == len(per_token) == sum(t.n_policy_tokens for t in TRAJS)
    assert loss.item() == pytest.approx(sum(v for _, v in per_token) / len(per_token), rel=1e-5)
    assert metrics["loss"] == pytest.approx(loss.item())
    for stage, stage_id in STAGE_IDS.items():
        values = [v for s, v in per_token if s == stage_id]
        assert metrics[f"n_tokens/{stage}"] == len(values)
        assert metrics[f"nll/{stage}"] == pytest.approx(sum(values) / len(values), rel=1e-5)
    assert loss.requires_grad


def test_sft_loss_ignores_tool_and_prompt_targets():
    """With logits that ignore the input, only trained targets can move the loss."""
    torch.manual_seed(1)
    fixed = torch.randn(1, len(TRAJS[0]), VOCAB)
    model = lambda input_ids, attention_mask: fixed  # noqa: E731
    base = TRAJS[0]

    def loss_with(position: int) -> float:
        ids = list(base.token_ids)
        ids[position] = (ids[position] + 1) % VOCAB
        changed = TokenTrajectory(ids, list(base.loss_mask), list(base.stage_ids), list(base.logprobs))
        return sft_loss(model, collate([changed], pad_id=0))[0].item()

    reference = sft_loss(model, collate([base], pad_id=0))[0].item()
    untrained = [i for i, m in enumerate(base.loss_mask) if not m]
    trained = [i for i, m in enumerate(base.loss_mask) if m]
    assert len(untrained) == 6 + 7 and trained
    for position in untrained:
        assert loss_with(position) == reference
    assert all(loss_with(position) != reference for position in trained)


def test_gradient_accumulation_weighs_every_token_equally(model):
    """Two micro-batches with n_tokens_total give the gradient of one batch of all of them."""
    model.zero_grad()
    sft_loss(model, collate(TRAJS, pad_id=0))[0].backward()
    whole = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    total = sum(t.n_policy_tokens for t in TRAJS)
    for part in (TRAJS[:1], TRAJS[1:]):
        loss, _ = sft_loss(model, collate(part, pad_id=0), n_tokens_total=total)
        loss.backward()
    accumulated = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    for a, b in zip(accumulated, whole):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
    # The per-micro-batch mean would weigh the short trajectory's tokens more: different gradient.
    model.zero_grad()
    for part in (TRAJS[:1], TRAJS[1:]):
        (sft_loss(model, collate(part, pad_id=0))[0] / 2).backward()
    naive = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    assert max((a - b).abs().max().item() for a, b in zip(naive, whole)) > 1e-4


def test_sft_loss_without_trained_tokens_raises(model):
    traj = make_traj(9, 5, [("tool_output", "research", 4)])
    with pytest.raises(ValueError, match="no trained tokens"):
        sft_loss(model, collate([traj], pad_id=0))
