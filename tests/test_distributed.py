"""Data parallel across gloo ranks: N ranks ≡ 1 rank on the same global batches (2 ranks as Ray actors of a
RankGroup), disjoint shards, the memory plan. The RankGroup itself (calls, failures, metric lines): tests/test_actors.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import dist_cases
from rubricem_core.distributed.shard import shard_micro_batches
from tiny_models import one_thread  # noqa: F401 (an autouse fixture)


# ------------------------------------------------------------------------------------ sharding
@pytest.mark.parametrize("n, world", [(5, 2), (4, 2), (1, 2), (7, 3), (3, 1), (2, 4)])
def test_shards_are_disjoint_cover_the_step_and_keep_the_global_mean(n, world):
    weights = [float(3 + i) for i in range(n)]
    shards = [shard_micro_batches(n, weights, r, world) for r in range(world)]
    real = [item.index for shard in shards for item in shard if not item.pad]
    assert sorted(real) == list(range(n))  # every micro-batch once, on one rank
    assert {len(s) for s in shards} == {-(-n // world)}  # the same number of passes on every rank
    assert all(item.scale == 0.0 for s in shards for item in s if item.pad)
    # shares of the global total: their sum over all ranks is 1, each is w_i / Σw
    assert sum(item.scale for s in shards for item in s) == pytest.approx(1.0)
    for s in shards:
        for item in s:
            if not item.pad:
                assert item.scale == pytest.approx(weights[item.index] / sum(weights))


def test_shard_rejects_a_rank_outside_the_world():
    with pytest.raises(ValueError, match="rank 2 is not in a world of 2"):
        shard_micro_batches(4, None, 2, 2)


# --------------------------------------------------------------------------- 2 ranks ≡ 1 rank
EQUIV = dict(lr=3e-3, weight_decay=0.1, warmup_steps=1, total_steps=5, max_grad_norm=1.0)


@pytest.fixture(scope="module")
def one_rank_reference():
    return dist_cases.trainer_steps(EQUIV)


def two_ranks(tmp_path: Path, case: str, arg: dict) -> dict:
    """``dist_cases.<case>(arg)`` on 2 gloo ranks (Ray actors of the session's local Ray); rank 0's result."""
    from rubricem_core.distributed.actors import RankGroup

    group = RankGroup("dist", 2, tmp_path / "ranks", timeout_s=600)
    try:
        return group.run(getattr(dist_cases, case), arg)[0]
    finally:
        group.close()


# Measured max |Δweight| after 2 steps: 3e-6 torch, 4e-6 ZeRO-1, 2e-5 ZeRO-3 (the steps move weights ~1e-2;
# Adam magnifies the rounding of a different summation order on near-zero gradients).
@pytest.mark.slow
@pytest.mark.parametrize("backend, stage, tol", [("torch", 0, 1e-5), ("deepspeed", 1, 1e-5), ("deepspeed", 3, 1e-4)])
def test_two_ranks_train_like_one_on_disjoint_micro_batches(
    ray_cluster, tmp_path, one_rank_reference, backend, stage, tol
):
    ref_weights, ref_history, ref_seen = one_rank_reference
    got = two_ranks(tmp_path, "trainer", {**EQUIV, "backend": backend, "zero_stage": stage})
    assert got["world_size"] == 2
    for step, ref in enumerate(ref_seen):
        shards = [got["seen"][r][step] for r in range(2)]
        assert set(shards[0]).isdisjoint(shards[1])  # each micro-batch on one rank (rank 1 pads with a copy)
        assert set(shards[0]) | set(shards[1]) == set(ref)
        assert len(shards[0]) == len(shards[1]) == 3
    assert [h["loss"] for h in got["history"]] == pytest.approx([h["loss"] for h in ref_history], abs=1e-5)
    assert [h["grad_norm"] for h in got["history"]] == pytest.approx([h["grad_norm"] for h in ref_history], rel=1e-5)
    assert [h["n_tokens"] for h in got["history"]] == [h["n_tokens"] for h in ref_history]  # the pad is not counted
    assert [h["nll_max"] for h in got["history"]] == pytest.approx([h["nll_max"] for h in ref_history])
    moved = max(float((ref_weights[k] - w).abs().max()) for k, w in dist_cases.tiny_model().state_dict().items())
    assert moved > 1e-3
    assert max(float((ref_weights[k] - got["weights"][k]).abs().max()) for k in ref_weights) < tol


@pytest.mark.slow
def test_zero3_ranks_load_straight_into_their_partitions_and_train_like_one(ray_cluster, tmp_path, one_rank_reference):
    """deepspeed.zero.Init loading: no rank ever holds the whole model (placeholders from the start, half
    the values each), and training from there is the 1-rank run, as loading whole then partitioning is."""
    ref_weights, ref_history, _ = one_rank_reference
    model_dir = tmp_path / "model"
    dist_cases.tiny_model().save_pretrained(model_dir)
    got = two_ranks(
        tmp_path, "zero_init", {**EQUIV, "backend": "deepspeed", "zero_stage": 3, "model_dir": str(model_dir)}
    )
    full = sum(p.numel() for p in dist_cases.tiny_model().parameters())
    for load in got["loads"]:
        assert load["partitioned"] and load["placeholder_numel"] == 0 and load["full_numel"] == full
        assert not load["after_block_partitioned"]
        assert load["partition_numel"] <= full // 2 + 64  # its share (ZeRO pads each partition a little)
    assert sum(load["partition_numel"] for load in got["loads"]) >= full
    assert [h["loss"] for h in got["history"]] == pytest.approx([h["loss"] for h in ref_history], abs=1e-5)
    assert max(float((ref_weights[k] - got["weights"][k]).abs().max()) for k in ref_weights) < 1e-4


# ------------------------------------------------------------------------------------ memory plan
@pytest.mark.parametrize("tie", [False, True])
def test_memory_plan_counts_the_parameters_of_a_real_qwen3(tie):
    from rubricem_core.distributed.memory import ModelShape

    model = dist_cases.tiny_model(tie=tie)
    shape = ModelShape.from_config(model.config.to_dict())
    assert shape.params == sum(p.numel() for p in model.parameters())


def test_memory_plan_partitions_like_zero_by_hand():
    from rubricem_core.distributed.memory import ModelShape, TrainSetup, memory_plan

    shape = ModelShape(hidden=8, intermediate=16, layers=1, heads=2, kv_heads=1, head_dim=4, vocab=10)
    p = shape.params  # 8*8 + 2*8*4 + 8*8 + 2*4 (attention) + 3*8*16 (mlp) + 2*8 (norms) + 2*10*8 + 8
    assert p == 64 + 64 + 64 + 8 + 384 + 16 + 160 + 8
    z3 = memory_plan(shape, TrainSetup(n_gpus=4, zero_stage=3, reference="sharded", micro_batch_tokens=4, seq_len=4))
    assert (z3.weights, z3.gradients, z3.optimizer, z3.reference) == (2 * p // 4, 2 * p // 4, 12 * p // 4, 2 * p // 4)
    z1 = memory_plan(shape, TrainSetup(n_gpus=4, zero_stage=1, precision="fp32", micro_batch_tokens=4, seq_len=4))
    # ZeRO keeps an fp32 master partition even when training in fp32
    assert (z1.weights, z1.gradients, z1.optimizer, z1.reference) == (4 * p, 4 * p, 12 * p // 4, 4 * p)
    z0 = memory_plan(shape, TrainSetup(n_gpus=4, zero_stage=0, precision="fp32", micro_batch_tokens=4, seq_len=4))
    assert z0.optimizer == 8 * p  # plain AdamW: two moments, no master copy
    off = memory_plan(
        shape, TrainSetup(n_gpus=4, offload=True, offload_params=True, reference="cpu", micro_batch_tokens=4, seq_len=4)
    )
    assert off.weights == off.optimizer == off.reference == 0 and off.gradients == 2 * p // 4
    deep = ModelShape(hidden=8, intermediate=16, layers=4, heads=2, kv_heads=1, head_dim=4, vocab=10)
    full, gc = (
        memory_plan(deep, TrainSetup(n_gpus=4, gradient_checkpointing=g, micro_batch_tokens=4, seq_len=4))
        for g in (False, True)
    )
    assert full.activations > gc.activations  # checkpointing keeps the layer inputs (and recomputes one layer)


@pytest.mark.parametrize("tie", [False, True])
def test_lora_adapters_counted_like_every_linear_layer_of_a_real_qwen3(tie):
    from rubricem_core.distributed.memory import ModelShape, lora_params

    model = dist_cases.tiny_model(tie=tie)
    shape = ModelShape.from_config(model.config.to_dict())
    linears = [m for name, m in model.named_modules() if isinstance(m, torch.nn.Linear) and "lm_head" not in name]
    assert len(linears) == 7 * shape.layers  # q, k, v, o, gate, up, down
    for rank in (1, 8):
        assert lora_params(shape, rank) == sum(rank * (m.in_features + m.out_features) for m in linears)


def test_a_lora_plan_trains_only_the_adapters_by_hand():
    from rubricem_core.distributed.memory import ModelShape, TrainSetup, lora_params, memory_plan

    shape = ModelShape(hidden=8, intermediate=16, layers=1, heads=2, kv_heads=1, head_dim=4, vocab=10)
    a = lora_params(shape, 2)
    assert a == 2 * ((8 + 8) + 2 * (8 + 4) + (8 + 8) + 2 * (8 + 16) + (16 + 8)) == 256
    p = shape.params
    setup = TrainSetup(n_gpus=4, zero_stage=3, reference="sharded", micro_batch_tokens=4, seq_len=4, lora_rank=2)
    plan = memory_plan(shape, setup)
    assert (plan.weights, plan.gradients, plan.optimizer, plan.reference) == (
        (p + a) * 2 // 4,
        a * 2 // 4,
        12 * a // 4,
        0,
    )
    full = memory_plan(shape, TrainSetup(n_gpus=4, zero_stage=3, reference="sharded", micro_batch_tokens=4, seq_len=4))
    assert plan.activations == full.activations and plan.total < full.total


def test_kv_cache_and_replica_plan_by_hand():
    from rubricem_core.distributed.memory import ModelShape, RolloutSetup, kv_bytes_per_token, replica_plan

    # Qwen3-8B: 36 layers, 8 KV heads of 128
    qwen8b = ModelShape(hidden=4096, intermediate=12288, layers=36, heads=32, kv_heads=8, head_dim=128, vocab=151936)
    assert kv_bytes_per_token(qwen8b, 2, 1) == 2 * 36 * 8 * 128 * 2 == 147456  # 144 KiB a token
    assert kv_bytes_per_token(qwen8b, 2, 2) == 147456 // 2
    assert kv_bytes_per_token(qwen8b, 2, 16) == 2 * 36 * 1 * 128 * 2  # a KV head per GPU at least
    setup = RolloutSetup(tensor_parallel_size=1, gpu_memory_utilization=0.9, max_model_len=16384)
    plan = replica_plan(qwen8b, setup)
    assert plan.weights == qwen8b.params * 2
    assert plan.kv_cache == int(0.9 * 80 * 2**30) - qwen8b.params * 2 - 2 * 2**30
    assert plan.kv_tokens == plan.kv_cache // 147456 and plan.full_sequences == plan.kv_tokens // 16384
    assert plan.fits and 20 <= plan.full_sequences <= 30  # ~55 GB of KV for 16k-token rows
    two = replica_plan(qwen8b, RolloutSetup(tensor_parallel_size=2, max_model_len=16384))
    assert two.full_sequences > 2 * plan.full_sequences  # half the weights per GPU leaves more than twice the KV
    tight = replica_plan(qwen8b, RolloutSetup(gpu_memory_utilization=0.22, max_model_len=16384))
    assert not tight.fits  # 17.6 GiB: the weights take 15.3 and the runtime 2, no room for one 16k-token row


def test_fleet_plan_splits_or_colocates_the_gpus():
    from rubricem_core.distributed.memory import ModelShape, RolloutSetup, TrainSetup, fleet_plan

    qwen8b = ModelShape(hidden=4096, intermediate=12288, layers=36, heads=32, kv_heads=8, head_dim=128, vocab=151936)
    train = TrainSetup(n_gpus=0, zero_stage=3, reference="sharded", micro_batch_tokens=16384, seq_len=16384)
    separate = fleet_plan(qwen8b, train, RolloutSetup(max_model_len=16384), total_gpus=16, replicas=8, colocate=False)
    assert (separate.trainer_gpus, separate.replicas) == (8, 8) and separate.fits
    colocated = fleet_plan(
        qwen8b, train, RolloutSetup(gpu_memory_utilization=0.35, max_model_len=16384), 16, 0, colocate=True
    )
    assert (colocated.trainer_gpus, colocated.replicas) == (16, 16)
    t = colocated.trainer
    assert colocated.sampling_peak == t.weights + t.optimizer + t.reference + int(0.35 * 80 * 2**30)
    assert colocated.update_peak == t.total
    greedy = fleet_plan(qwen8b, train, RolloutSetup(gpu_memory_utilization=0.9), 16, 0, colocate=True)
    assert not greedy.fits  # the engine's 90% on top of the trainer's resident state
    with pytest.raises(ValueError, match="leave none of 16"):
        fleet_plan(qwen8b, train, RolloutSetup(tensor_parallel_size=2), 16, 8, colocate=False)
