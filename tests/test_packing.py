"""Sample packing: sequences end to end in rows with restarting position ids, for SFT and the RL update.

Each packed path is checked against the padded one it replaces: the same logprobs token for token, the
same SFT loss and gradients, the same SS-GRPO step (weights after it), on Qwen3 and Llama shapes.
"""

from __future__ import annotations

import copy
import math
import random

import pytest
import torch

from rubricem_core.batching import (
    bucket_batches,
    collate,
    collate_micro_batch,
    collate_packed,
    pack_batches,
    pack_rows,
    padding_fraction,
)
from rubricem_core.config import ConfigError, SFTConfig, load_config
from rubricem_core.logprobs import batch_logprobs, sft_loss
from rubricem_core.rl.update import UpdateConfig, ss_grpo_update, update_plan
from rubricem_core.sft import step_schedule
from rubricem_core.testing.tiny_models import PAD, rl_advantages, rl_trajectories, tiny_model, with_sampled_logprobs
from rubricem_core.training.config import TrainerConfig
from rubricem_core.training.torch_trainer import TorchTrainer
from rubricem_core.trajectory import TokenTrajectory
from tests.tiny_models import one_thread  # noqa: F401 (an autouse fixture)


def _sequence(n: int) -> TokenTrajectory:
    return TokenTrajectory([1] * n, [1] * n, [0] * n, [math.nan] * n)


def _lengths(n: int = 40, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.choice([rng.randint(5, 30), rng.randint(60, 120)]) for _ in range(n)]


# ---- the plan --------------------------------------------------------------------------------------
@pytest.mark.parametrize("pack_length", [None, 128, 150], ids=["one-row", "rows-128", "rows-150"])
@pytest.mark.parametrize("shuffle_seed", [None, 7], ids=["sorted", "shuffled"])
def test_packed_micro_batches_hold_every_sequence_once_within_their_rows_and_budget(pack_length, shuffle_seed):
    lengths, budget = _lengths(), 512
    batches = pack_batches(lengths, budget, pack_length, shuffle_seed=shuffle_seed)
    assert sorted(i for b in batches for i in b) == list(range(len(lengths)))
    row_length = pack_length or budget
    n_rows = 0
    for batch in batches:
        rows = pack_rows([lengths[i] for i in batch], row_length)  # what collate_packed lays out
        assert all(sum(lengths[batch[j]] for j in row) <= row_length for row in rows)
        assert len(rows) * row_length <= budget
        n_rows += len(rows)
    # next fit over each micro-batch rebuilds first-fit-decreasing's rows: no row lost to the split
    ffd = pack_batches(lengths, row_length, row_length)
    assert n_rows == len(ffd)


def test_packing_wastes_less_than_buckets_on_mixed_lengths():
    lengths, budget = _lengths(), 512
    seqs = [_sequence(n) for n in lengths]
    bucketed = [collate([seqs[i] for i in b], PAD) for b in bucket_batches(lengths, budget)]
    packed = [collate_packed([seqs[i] for i in b], PAD, budget) for b in pack_batches(lengths, budget)]
    assert sum(b.n_real_tokens for b in packed) == sum(b.n_real_tokens for b in bucketed) == sum(lengths)
    assert padding_fraction(packed) < 0.05 < padding_fraction(bucketed)
    assert len(packed) < len(bucketed)


@pytest.mark.parametrize(
    ("lengths", "budget", "pack_length", "message"),
    [
        ([10, 0], 64, None, "trajectory 1 is empty"),
        ([10, 70], 64, None, "trajectory 1 has 70 tokens, more than the pack length 64"),
        ([10, 40], 64, 32, "trajectory 1 has 40 tokens, more than the pack length 32"),
        ([10], 64, 128, "pack_length must be in [1, max_tokens_per_batch 64], got 128"),
    ],
)
def test_packing_refuses_what_cannot_fit(lengths, budget, pack_length, message):
    with pytest.raises(ValueError) as err:
        pack_batches(lengths, budget, pack_length)
    assert message in str(err.value)


def test_the_config_names_a_pack_length_that_cannot_hold_a_sequence_or_fit_a_micro_batch():
    with pytest.raises(ConfigError) as err:
        load_config("tiny", overrides=["rl.packing=true", "rl.pack_length=256"])
    assert "rl.pack_length 256 < rollout.max_total_tokens" in str(err.value)
    with pytest.raises(ConfigError) as err:
        load_config("tiny", overrides=["sft.packing=true", "sft.pack_length=65536"])
    assert "sft.pack_length 65536 > sft.max_tokens_per_batch" in str(err.value)
    cfg = load_config("tiny", overrides=["rl.packing=true", "sft.packing=true"])
    assert cfg.rl.packing and cfg.sft.packing and cfg.rl.pack_length is None


# ---- the tensors ----------------------------------------------------------------------------------
def test_a_packed_batch_places_each_sequence_and_its_extras_where_the_padded_batch_has_them():
    trajs = rl_trajectories(5)
    advs = rl_advantages(trajs)
    extras = {"advantages": advs}
    padded = collate(trajs, PAD, extras=extras)
    packed = collate_packed(trajs, PAD, 80, extras=extras)
    assert packed.n_real_tokens == padded.n_real_tokens
    assert packed.position_ids is not None and padded.position_ids is None
    seen = 0
    for r, row in enumerate(pack_rows([len(t) for t in trajs], 80)):
        offset = 0
        for i in row:
            n = len(trajs[i])
            span = slice(offset, offset + n)
            assert packed.position_ids[r, span].tolist() == list(range(n))
            for name in ("input_ids", "loss_mask", "stage_ids", "attention_mask", "advantages"):
                assert torch.equal(getattr(packed, name)[r, span], getattr(padded, name)[i, :n]), name
            offset += n
            seen += 1
        assert not packed.attention_mask[r, offset:].any()
    assert seen == len(trajs)


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_packed_logprobs_equal_the_padded_batch_token_for_token(arch, temperature):
    model = tiny_model(arch=arch).eval()
    trajs = rl_trajectories(6)
    padded, packed = collate(trajs, PAD), collate_packed(trajs, PAD, 100)
    assert packed.batch_size < padded.batch_size  # several sequences share a row
    with torch.no_grad():
        want = batch_logprobs(model, padded, temperature=temperature)
        got = batch_logprobs(model, packed, temperature=temperature)
    for r, row in enumerate(pack_rows([len(t) for t in trajs], 100)):
        offset = 0
        for i in row:
            n = len(trajs[i])
            torch.testing.assert_close(got[r, offset : offset + n], want[i, :n], atol=2e-5, rtol=1e-5)
            assert got[r, offset] == 0.0  # a sequence's first token: nothing of its own precedes it
            offset += n


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_the_sft_loss_and_its_gradients_equal_packed_and_padded(arch):
    trajs = rl_trajectories(6, seed=5)
    results = []
    for batch in (collate(trajs, PAD), collate_packed(trajs, PAD, 120)):
        model = tiny_model(1, arch=arch)
        loss, metrics = sft_loss(model, batch)
        loss.backward()
        results.append((loss.detach(), metrics["n_tokens"], [p.grad.clone() for p in model.parameters()]))
    (loss_a, n_a, grads_a), (loss_b, n_b, grads_b) = results
    assert n_a == n_b > 0
    torch.testing.assert_close(loss_b, loss_a, atol=1e-6, rtol=1e-5)
    for ga, gb in zip(grads_a, grads_b):
        torch.testing.assert_close(gb, ga, atol=1e-6, rtol=1e-4)


def _accumulate_into(total: torch.Tensor):
    def hook(grad: torch.Tensor) -> None:  # returns None: the gradient itself is left as it is
        total.add_(grad)

    return hook


# ---- the RL update -------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "options",
    [
        {},
        {"kl_coef": 0.05},
        {"minibatches": 2, "epochs": 2, "kl_coef": 0.05},
        {"importance_correction": "tis", "recompute_old": True},
    ],
    ids=["one-step", "kl", "ppo-reuse", "tis"],
)
@pytest.mark.parametrize("pack_length", [None, 90], ids=["one-row", "rows-90"])
def test_a_packed_ss_grpo_step_equals_the_bucketed_one(options, pack_length):
    trajs = rl_trajectories(8, seed=11)
    advs = rl_advantages(trajs)
    with_sampled_logprobs(trajs, tiny_model(0).eval(), shift=0.05)
    summed, metrics, padded = [], [], []
    for packing in (False, True):
        config = UpdateConfig(max_tokens_per_batch=180, packing=packing, pack_length=pack_length, **options)
        plan = update_plan(trajs, config)
        batches = [
            (collate_packed if packing else lambda t, pad, _: collate(t, pad))([trajs[i] for i in m], PAD, 180)
            for m in plan.parts[0]
        ]
        padded.append(sum(b.n_padded_tokens - b.n_real_tokens for b in batches))
        model = tiny_model(0)
        ref = copy.deepcopy(model).eval() if options.get("kl_coef") else None
        trainer = TorchTrainer(model, TrainerConfig(lr=1e-3, weight_decay=0.0, total_steps=100))
        # the gradients summed over every micro-batch of every step: compared directly, since Adam turns
        # float noise on a near-zero gradient into a full-lr move of that one weight
        grads = [torch.zeros_like(p) for p in model.parameters()]
        for p, g in zip(model.parameters(), grads):
            p.register_hook(_accumulate_into(g))
        metrics.append(ss_grpo_update(trainer, ref, trajs, advs, PAD, config))
        summed.append(grads)
    assert max(float(g.abs().max()) for g in summed[0]) > 1e-3  # the step has a gradient to compare
    for a, b in zip(summed[0], summed[1]):
        torch.testing.assert_close(b, a, atol=2e-6, rtol=1e-4)
    assert padded[1] < padded[0]  # fewer padding positions computed for the same step
    assert metrics[0]["policy_tokens"] == metrics[1]["policy_tokens"]
    for key in ("loss", "kl", "clip_fraction", "grad_norm"):
        if key in metrics[0]:
            assert metrics[1][key] == pytest.approx(metrics[0][key], abs=1e-5), key


# ---- SFT -----------------------------------------------------------------------------------------
def test_the_packed_sft_schedule_covers_every_sequence_each_epoch_in_fewer_micro_batches():
    lengths = _lengths(60, seed=2)
    plain = SFTConfig(epochs=2, max_tokens_per_batch=512, grad_accum_steps=1)
    packed = plain.model_copy(update={"packing": True})
    a, b = step_schedule(lengths, plain, seed=3), step_schedule(lengths, packed, seed=3)
    assert len(b) < len(a)
    half = len(b) // 2
    for epoch in (b[:half], b[half:]):
        assert sorted(i for step in epoch for micro in step for i in micro) == list(range(len(lengths)))
    assert step_schedule(lengths, packed, seed=3) == b  # a pure function of the seed (ranks agree)
    batch = collate_micro_batch([_sequence(lengths[i]) for i in b[0][0]], PAD, 512, packing=True)
    assert batch.position_ids is not None and batch.n_padded_tokens <= 512
