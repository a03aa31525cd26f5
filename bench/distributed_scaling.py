"""Data-parallel scaling on Ray, Ray's overhead per RL step, and the per-GPU memory plan.

1. Throughput at 1 and 2 trainer ranks (RankGroup actors on a local Ray, gloo on this CPU, one thread per
   rank): train tokens/s of SFT steps and of SS-GRPO updates on the same global batches (each rank given
   only its micro-batches' trajectories, as RayPolicy sends them; a random-init Qwen3; report only).
2. Ray's overhead per RL step: a RayPolicy (the rl flow's trainer) on 2 ranks; an update as the driver
   sees it (plan, per-rank slices through the object store, the call, the metrics back) against the
   seconds the ranks spent inside it, and the ``weights()`` transfer (rank 0's gathered weights to the
   driver). The figure: (driver − slowest rank) / driver, per step.
3. The memory plan (rubricem_core.distributed.memory) checked against a tiny model: its parameter count
   against the model's, and the activations the plan says a forward pass saves against the tensors
   autograd really saved (with and without gradient checkpointing), and the weights + optimizer bytes per rank
   against what DeepSpeed's ZeRO-1 and ZeRO-3 optimizers hold on 2 ranks.
4. The plan for Qwen3-8B (data/models/qwen3-8b.json) on 8 × 80 GB: ZeRO-3, bf16, gradient checkpointing,
   16k-token micro-batches, the reference replicated and sharded. The figure: the gpu profile's rank 0
   (sharded reference, vLLM's 40% of the same GPU), which must fit (≤ 90% of a GPU).

    .venv/bin/python bench/distributed_scaling.py [--quick] [--gpus 8] [--gpu-gib 80]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

import torch  # noqa: E402

from bench.run_all import figure_line  # noqa: E402
from rubricem_core.distributed.memory import (  # noqa: E402
    ModelShape,
    TrainSetup,
    memory_plan,
    saved_activation_bytes,
)

GIB = 2**30
TINY = dict(
    vocab_size=4096,
    hidden_size=256,
    intermediate_size=768,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    max_position_embeddings=4096,
)


def tiny_model(seed: int = 0):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    return Qwen3ForCausalLM(Qwen3Config(**TINY))


# ---- 1. throughput (on every rank of a RankGroup) -----------------------------------------------------
def synthetic_trajectories(n: int, seq: int, vocab: int, seed: int = 0) -> list:
    from rubricem_core.trajectory import TokenTrajectory

    g = torch.Generator().manual_seed(seed)
    return [
        TokenTrajectory(
            token_ids=torch.randint(3, vocab, (seq,), generator=g).tolist(),
            loss_mask=[0] * 16 + [1] * (seq - 16),
            stage_ids=[-1] * 16 + [3] * (seq - 16),
            logprobs=[float("nan")] * 16 + [-8.0] * (seq - 16),
        )
        for _ in range(n)
    ]


def throughput_rank(steps: int, micro: int, seq: int) -> dict[str, float] | None:
    """SFT steps, then SS-GRPO updates, on this rank's share of the same global batches; rank 0's tokens/s."""
    import torch.distributed as dist

    from rubricem_core.batching import collate
    from rubricem_core.logprobs import sft_loss
    from rubricem_core.rl.update import UpdateConfig, ss_grpo_update, update_plan
    from rubricem_core.training import TrainerConfig, make_trainer

    torch.set_num_threads(1)
    rank, world = dist.get_rank(), dist.get_world_size()
    trajs = synthetic_trajectories(2 * micro, seq, TINY["vocab_size"])
    trainer = make_trainer(tiny_model(), TrainerConfig(lr=1e-4, total_steps=2 * steps + 2))
    batches = [collate(trajs[2 * i : 2 * i + 2], 0) for i in range(micro)]
    weights = [float(b.loss_mask.sum()) for b in batches]
    trainer.step(batches, sft_loss, weights=weights)  # warm-up
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(steps):
        trainer.step(batches, sft_loss, weights=weights)
    sft_s = time.perf_counter() - t0
    ref = tiny_model()
    advs = [[0.0] * 16 + [float((-1) ** i)] * (seq - 16) for i in range(len(trajs))]
    config = UpdateConfig(clip_high=0.28, max_tokens_per_batch=2 * seq)
    plan = update_plan(trajs, config)
    mine = plan.rank_indices(rank, world)  # what the driver would send this rank
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(steps):
        ss_grpo_update(trainer, ref, {i: trajs[i] for i in mine}, {i: advs[i] for i in mine}, 0, config, plan=plan)
    update_s = time.perf_counter() - t0
    if rank != 0:
        return None
    tokens = steps * sum(len(t) for t in trajs)
    return {"sft_tokens_per_s": tokens / sft_s, "update_tokens_per_s": tokens / update_s}


def zero_rank(stage: int) -> dict[str, int] | None:
    """Per-rank bytes of DeepSpeed's optimizer after one step: Adam moments and its flat fp32/param groups."""
    import torch.distributed as dist

    from rubricem_core.training import TrainerConfig, make_trainer

    torch.set_num_threads(1)
    trainer = make_trainer(tiny_model(), TrainerConfig(lr=1e-3, backend="deepspeed", zero_stage=stage, total_steps=3))
    ids = torch.randint(0, TINY["vocab_size"], (2, 64))
    trainer.step([ids, ids], lambda m, b: (m(input_ids=b).logits.float().mean(), {}))
    opt = trainer.engine.optimizer

    def nbytes(obj, seen: dict[int, int]) -> dict[int, int]:
        if isinstance(obj, torch.Tensor) and obj.numel() > 1:
            seen.setdefault(obj.data_ptr(), obj.numel() * obj.element_size())
        elif isinstance(obj, dict):
            for v in obj.values():
                nbytes(v, seen)
        elif isinstance(obj, (list, tuple)):
            for v in obj:
                nbytes(v, seen)
        return seen

    adam = sum(nbytes(list(opt.optimizer.state.values()), {}).values())
    flat: dict[int, int] = {}
    for name in (
        "bit16_groups_flat",
        "single_partition_of_fp32_groups",  # ZeRO-1/2: all weights, master partition
        "fp16_partitioned_groups_flat",
        "fp32_partitioned_groups_flat",
    ):  # ZeRO-3: both partitions
        if hasattr(opt, name):
            nbytes(getattr(opt, name), flat)
    return {"adam": adam, "flat": sum(flat.values())} if dist.get_rank() == 0 else None


def on_ranks(ranks: int, target: str, *args) -> dict:
    """``target(*args)`` on ``ranks`` actors of the local Ray; rank 0's result."""
    import tempfile

    from rubricem_core.distributed.actors import RankGroup

    with tempfile.TemporaryDirectory() as tmp:
        group = RankGroup("bench", ranks, Path(tmp), timeout_s=900)
        try:
            return group.run(target, *args)[0]
        finally:
            group.close()


# ---- 2. Ray's overhead per RL step -------------------------------------------------------------------
POLICY = {
    "policy.vocab_size": 2048,
    "policy.hidden_size": 128,
    "policy.n_layers": 2,
    "policy.n_heads": 4,
    "policy.n_kv_heads": 2,
    "policy.intermediate_size": 384,
    "tracking.enabled": False,
    "distributed.nproc_per_node": 2,
}


def ray_overhead(steps: int, n_trajs: int, seq: int) -> dict[str, float]:
    """Driver-side seconds of RayPolicy.update and .weights against the seconds inside the ranks."""
    import tempfile

    from rubricem_core.config import load_config
    from rubricem_core.rl.ray_policy import RayPolicy
    from rubricem_core.rl.update import UpdateConfig
    from rubricem_core.sft import prepare_policy

    cfg = load_config("tiny", POLICY)
    words = "the agent searches reads cites and answers every question about rivers cities and dates".split()
    texts = [" ".join(words[(i + j) % len(words)] for j in range(40)) for i in range(200)]
    settings = UpdateConfig.from_rl(cfg.rl, temperature=1.0)
    with tempfile.TemporaryDirectory() as tmp:
        base = prepare_policy(cfg.policy, Path(tmp) / "base", texts, seed=0)
        policy = RayPolicy(str(Path(tmp) / "run"), cfg, base)
        try:
            vocab = len(policy.tokenizer)
            trajs = synthetic_trajectories(n_trajs, seq, vocab, seed=1)
            advs = [[0.0] * 16 + [float((-1) ** i)] * (seq - 16) for i in range(n_trajs)]
            policy.update(trajs, advs, settings)  # warm-up
            driver, inside, weights_s = [], [], []
            for _ in range(steps):
                t0 = time.perf_counter()
                policy.update(trajs, advs, settings)
                driver.append(time.perf_counter() - t0)
                inside.append(max(policy.group.call("update_seconds")))
                t0 = time.perf_counter()
                state = policy.weights()
                weights_s.append(time.perf_counter() - t0)
            weight_bytes = sum(v.numel() * v.element_size() for v in state.values())
        finally:
            policy.close()
    mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
    return {
        "driver_s": mean(driver),
        "rank_s": mean(inside),
        "weights_s": mean(weights_s),
        "weight_mb": weight_bytes / 2**20,
        "tokens": n_trajs * seq,
    }


# ---- 3. the plan against a tiny model ------------------------------------------------------------
def measured_saved_bytes(checkpointing: bool, batch: int = 2, seq: int = 1024) -> int:
    from rubricem_core.logprobs import token_logprobs

    model = tiny_model()
    model.train()
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.config.use_cache = False
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        ptr = t.untyped_storage().data_ptr()
        if ptr not in params:
            saved[ptr] = t.untyped_storage().nbytes()  # each storage once, however many ops keep it
        return t

    ids = torch.randint(0, TINY["vocab_size"], (batch, seq))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        token_logprobs(model, ids, torch.ones_like(ids))
    return sum(saved.values())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer, shorter steps")
    parser.add_argument("--gpus", type=int, default=8)
    parser.add_argument("--gpu-gib", type=float, default=80.0)
    args = parser.parse_args()
    import os

    from rubricem_core.config import DistributedConfig
    from rubricem_core.distributed.cluster import connect, disconnect

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    t0 = time.perf_counter()
    connect(DistributedConfig())  # a local Ray (or RAY_ADDRESS's cluster)
    print(f"(Ray up in {time.perf_counter() - t0:.1f}s)")
    try:
        run(args)
    finally:
        disconnect()


def run(args: argparse.Namespace) -> None:
    steps, micro, seq = (2, 4, 256) if args.quick else (4, 8, 512)
    print("1. data-parallel throughput on Ray actors (gloo, one thread per rank; the same global batches)")
    base = None
    for ranks in (1, 2):
        r = on_ranks(ranks, "bench.distributed_scaling:throughput_rank", steps, micro, seq)
        base = base or r
        print(
            f"   {ranks} rank{'s' if ranks > 1 else ' '}: SFT {r['sft_tokens_per_s']:8.0f} tok/s "
            f"(x{r['sft_tokens_per_s'] / base['sft_tokens_per_s']:.2f})   SS-GRPO update "
            f"{r['update_tokens_per_s']:8.0f} tok/s (x{r['update_tokens_per_s'] / base['update_tokens_per_s']:.2f})"
        )

    o_steps, n_trajs, o_seq = (3, 8, 256) if args.quick else (5, 16, 512)
    print(f"2. Ray's overhead per RL step (RayPolicy on 2 ranks, {n_trajs} trajectories x {o_seq} tokens)")
    o = ray_overhead(o_steps, n_trajs, o_seq)
    overhead = o["driver_s"] - o["rank_s"]
    print(
        f"   update: driver {o['driver_s']:.3f}s, inside the slowest rank {o['rank_s']:.3f}s, Ray "
        f"{overhead:.3f}s = {overhead / o['driver_s']:.1%} of the update"
    )
    print(
        f"   weights(): {o['weights_s']:.3f}s for {o['weight_mb']:.1f} MiB to the driver; "
        f"(update overhead + weights) / (update + weights) = "
        f"{(overhead + o['weights_s']) / (o['driver_s'] + o['weights_s']):.1%}"
    )

    print("3. the plan against a tiny Qwen3 (fp32, 2 x 1024 tokens)")
    shape = ModelShape.from_config(TINY)
    n_params = sum(p.numel() for p in tiny_model().parameters())
    print(f"   parameters: plan {shape.params:,}  model {n_params:,}")
    ratios = []
    for gc in (False, True):
        plan = saved_activation_bytes(shape, 2048, 4, gc, seq_len=1024, fused_attention=True)
        measured = measured_saved_bytes(gc)
        ratios.append(measured / plan)
        print(
            f"   saved activations, checkpointing {'on ' if gc else 'off'}: plan {plan / 2**20:7.1f} MiB  "
            f"measured {measured / 2**20:7.1f} MiB  (measured/plan {measured / plan:.3f})"
        )
    for stage in (1, 3):
        got = on_ranks(2, "bench.distributed_scaling:zero_rank", stage)
        plan = memory_plan(shape, TrainSetup(n_gpus=2, zero_stage=stage, precision="fp32"))
        planned = plan.weights + plan.optimizer  # what DeepSpeed's optimizer holds: weights, master, moments
        ratios.append((got["adam"] + got["flat"]) / planned)
        print(
            f"   ZeRO-{stage} on 2 ranks, per rank: plan weights+optimizer {planned / 2**20:6.2f} MiB  measured "
            f"{(got['adam'] + got['flat']) / 2**20:6.2f} MiB (Adam moments {got['adam'] / 2**20:.2f}, flat groups "
            f"{got['flat'] / 2**20:.2f})"
        )

    print(f"4. Qwen3-8B on {args.gpus} x {args.gpu_gib:.0f} GiB (ZeRO-3, bf16, checkpointing, 16k-token micro-batches)")
    qwen = ModelShape.from_config(json.loads((REPO_ROOT / "data" / "models" / "qwen3-8b.json").read_text()))
    rows = {}
    for name, kw in {
        "replicated reference": dict(reference="replicated"),
        "sharded reference": dict(reference="sharded"),
        "sharded, optimizer offload": dict(reference="sharded", offload=True),
        "no checkpointing": dict(reference="sharded", gradient_checkpointing=False),
        "LoRA r=16, all linear": dict(reference="sharded", lora_rank=16),
        "LoRA r=64, all linear": dict(reference="sharded", lora_rank=64),
    }.items():
        rows[name] = memory_plan(qwen, TrainSetup(n_gpus=args.gpus, gpu_bytes=int(args.gpu_gib * GIB), **kw))
    print(f"   {'':28s}" + "".join(f"{k:>12s}" for k in rows["sharded reference"].as_dict()) + "    fits")
    for name, plan in rows.items():
        print(f"   {name:28s}" + "".join(f"{v / GIB:10.1f}Gi" for v in plan.as_dict().values()) + f"    {plan.fits}")
    print(f"   ({qwen.params / 1e9:.2f}B parameters; buffers, CUDA context and fragmentation: keep 10% free)")
    # the gpu profile: sharded reference, and vLLM's 40% of GPU 0 beside trainer rank 0
    chosen = memory_plan(
        qwen, TrainSetup(n_gpus=args.gpus, gpu_bytes=int(args.gpu_gib * GIB), reference="sharded", engine_fraction=0.4)
    )
    print(
        f"   gpu profile on rank 0 (sharded reference, vLLM's 40% beside it): {chosen.total / GIB:.1f} GiB, "
        f"fits: {chosen.fits}"
    )
    checked = all(0.9 <= r <= 1.1 for r in ratios)
    print(
        figure_line(
            "qwen3_8b_gpu_profile_rank0",
            round(chosen.total / GIB, 1),
            "GiB",
            f"fits in 0.9 x {args.gpu_gib:.0f} GiB, plan within 10% of measured on tiny",
            chosen.fits and checked,
        )
    )


if __name__ == "__main__":
    main()
