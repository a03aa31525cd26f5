"""Length-bucketed batching and right-padded collation."""

from __future__ import annotations

import math
import random

import pytest
import torch

from rubricem_core.batching import TokenBatch, bucket_batches, collate, padding_fraction
from rubricem_core.trajectory import NO_STAGE, TokenTrajectory


def make_traj(prompt_len: int, policy_len: int, tool_len: int = 0, seed: int = 0) -> TokenTrajectory:
    """prompt, policy (plan), tool output (research), policy (answer) with distinct ids."""
    rng = random.Random(seed)
    traj = TokenTrajectory.empty()
    traj.append("prompt", None, [rng.randrange(3, 100) for _ in range(prompt_len)], "p")
    half = policy_len // 2
    traj.append("policy", "plan", [rng.randrange(3, 100) for _ in range(half)], "a", [-0.5] * half)
    if tool_len:
        traj.append("tool_output", "research", [rng.randrange(3, 100) for _ in range(tool_len)], "t")
    rest = policy_len - half
    traj.append("policy", "answer", [rng.randrange(3, 100) for _ in range(rest)], "b", [-1.0] * rest)
    return traj


def mixed_lengths(n: int, seed: int) -> list[TokenTrajectory]:
    rng = random.Random(seed)
    # Research traces: a long tail (a few very long ones, many short).
    return [
        make_traj(
            rng.randint(5, 20), rng.choice([rng.randint(10, 60), rng.randint(200, 900)]), rng.randint(0, 100), seed=i
        )
        for i in range(n)
    ]


@pytest.mark.parametrize("max_tokens,max_bs,seed", [(1000, None, None), (2048, 4, 1), (4096, None, 7), (1200, 1, 3)])
def test_bucket_invariants(max_tokens, max_bs, seed):
    trajs = mixed_lengths(80, seed=11)
    batches = bucket_batches(trajs, max_tokens, max_batch_size=max_bs, shuffle_seed=seed)
    flat = sorted(i for b in batches for i in b)
    assert flat == list(range(len(trajs)))  # every trajectory exactly once
    for batch in batches:
        assert batch
        assert len(batch) * max(len(trajs[i]) for i in batch) <= max_tokens
        if max_bs is not None:
            assert len(batch) <= max_bs
    # Lengths alone give the same grouping as the trajectories.
    assert bucket_batches([len(t) for t in trajs], max_tokens, max_bs, seed) == batches


def test_bucketing_pads_much_less_than_random_batching():
    trajs = mixed_lengths(200, seed=5)
    buckets = bucket_batches(trajs, max_tokens_per_batch=4096, shuffle_seed=0)
    bucketed = padding_fraction([collate([trajs[i] for i in b], pad_id=0) for b in buckets])
    # Random batches with the same batch sizes (so the same number of steps).
    order = list(range(len(trajs)))
    random.Random(0).shuffle(order)
    random_batches, at = [], 0
    for b in buckets:
        random_batches.append(order[at : at + len(b)])
        at += len(b)
    randomized = padding_fraction([collate([trajs[i] for i in b], pad_id=0) for b in random_batches])
    assert randomized > 0.3
    assert bucketed < 0.1
    assert bucketed < randomized / 4


def test_shuffle_seed_reproducible_and_changes_order():
    trajs = mixed_lengths(60, seed=2)
    a = bucket_batches(trajs, 2000, shuffle_seed=1)
    assert a == bucket_batches(trajs, 2000, shuffle_seed=1)
    assert a != bucket_batches(trajs, 2000, shuffle_seed=2)
    unshuffled = bucket_batches(trajs, 2000)
    firsts = [len(trajs[b[0]]) for b in unshuffled]
    assert firsts == sorted(firsts, reverse=True)  # longest first without a seed


def test_bucket_errors():
    trajs = [make_traj(5, 10), make_traj(5, 50)]
    with pytest.raises(ValueError, match="trajectory 1 has 55 tokens"):
        bucket_batches(trajs, 40)
    with pytest.raises(ValueError, match="max_tokens_per_batch"):
        bucket_batches(trajs, 0)
    with pytest.raises(ValueError, match="max_batch_size"):
        bucket_batches(trajs, 100, max_batch_size=0)


def test_collate_right_pads_and_keeps_values():
    trajs = [make_traj(3, 6, tool_len=4, seed=1), make_traj(2, 2, seed=2), make_traj(4, 9, tool_len=1, seed=3)]
    batch = collate(trajs, pad_id=1)
    width = max(len(t) for t in trajs)
    assert batch.input_ids.shape == (3, width) and batch.batch_size == 3
    assert batch.n_real_tokens == sum(len(t) for t in trajs) == int(batch.attention_mask.sum())
    assert batch.n_padded_tokens == 3 * width
    for row, traj in enumerate(trajs):
        n = len(traj)
        assert batch.input_ids[row, :n].tolist() == traj.token_ids
        assert batch.loss_mask[row, :n].tolist() == traj.loss_mask
        assert batch.stage_ids[row, :n].tolist() == traj.stage_ids
        assert batch.attention_mask[row].tolist() == [1] * n + [0] * (width - n)
        assert batch.input_ids[row, n:].tolist() == [1] * (width - n)
        assert batch.loss_mask[row, n:].sum() == 0
        assert batch.stage_ids[row, n:].tolist() == [NO_STAGE] * (width - n)
    assert batch.advantages is None and batch.old_logprobs is None
    assert padding_fraction([batch]) == pytest.approx(1 - batch.n_real_tokens / batch.n_padded_tokens)


def test_collate_extras_nan_only_off_the_mask():
    trajs = [make_traj(3, 4, tool_len=2, seed=1), make_traj(2, 2, seed=2)]
    # Sampling logprobs: NaN on prompt and tool tokens, real values on policy tokens.
    batch = collate(
        trajs,
        pad_id=0,
        extras={
            "old_logprobs": [t.logprobs for t in trajs],
            "advantages": [[0.5 * m for m in t.loss_mask] for t in trajs],
        },
    )
    assert batch.old_logprobs.dtype == torch.float32
    assert not torch.isnan(batch.old_logprobs).any()
    for row, traj in enumerate(trajs):
        expected = [0.0 if math.isnan(v) else v for v in traj.logprobs]
        assert batch.old_logprobs[row, : len(traj)].tolist() == expected
    assert batch.advantages.sum().item() == pytest.approx(0.5 * sum(t.n_policy_tokens for t in trajs))

    bad = [list(t.logprobs) for t in trajs]
    bad[1][trajs[1].loss_mask.index(1)] = math.nan
    with pytest.raises(ValueError, match=r"old_logprobs.*\[1\] is NaN at trained token"):
        collate(trajs, pad_id=0, extras={"old_logprobs": bad})
    with pytest.raises(ValueError, match=r"extras\['advantages'\]\[0\] has 1 values"):
        collate(trajs, pad_id=0, extras={"advantages": [[0.0], [0.0] * len(trajs[1])]})
    with pytest.raises(ValueError, match="unknown extras key 'rewards'"):
        collate(trajs, pad_id=0, extras={"rewards": [[0.0] * len(t) for t in trajs]})
    with pytest.raises(ValueError, match="at least one"):
        collate([], pad_id=0)


def test_batch_to_device_keeps_everything():
    batch = collate([make_traj(2, 3)], pad_id=0, extras={"ref_logprobs": [[0.1] * 5]})
    moved = batch.to("cpu")
    assert isinstance(moved, TokenBatch)
    assert torch.equal(moved.ref_logprobs, batch.ref_logprobs) and moved.n_real_tokens == 5
