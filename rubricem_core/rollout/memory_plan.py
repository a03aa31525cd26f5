"""How much memory each `vllm serve` replica of a CPU fleet may take, decided before any starts.

vLLM's CPU build sizes its KV cache from ``VLLM_CPU_KVCACHE_SPACE`` (GiB) or, unset, from
``gpu_memory_utilization`` of the whole machine's memory: two replicas at the default 0.5 each claim half,
and the second is killed while it starts. The plan divides what the machine has free among the trainer
(its estimate, when this process trains), each replica's fixed cost (its weights and runtime) and their KV
caches: each replica's KV cache is what its concurrent calls can fill (``max_calls_per_replica`` sequences
of ``max_total_tokens``), capped at its equal share of the rest, and at least one full sequence. A layout
that cannot give every replica one sequence's cache is refused with the numbers, before anything starts.
A KV size given in ``rollout.server_env`` is kept, and refused when the replicas alone cannot hold it.

On GPUs each replica has devices of its own and ``gpu_memory_utilization`` is a fraction of them; this
plan is for the fleet that shares one host's memory.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path

from rubricem_core.rollout.types import RolloutError

GIB = 1 << 30
KV_ENV = "VLLM_CPU_KVCACHE_SPACE"
# a CPU `vllm serve` process's own resident memory beyond weights and KV cache (Python, torch, its engine
# core), measured ~0.9 GB for SmolLM2-135M on vllm-cpu 0.32
RUNTIME_BYTES = GIB
# what trains beside the fleet, per parameter: fp32 weights, gradients, Adam's two moments, the KL
# reference in the policy's dtype
TRAINER_BYTES_PER_PARAM = 20
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass(frozen=True)
class ReplicaMemoryPlan:
    replicas: int
    kv_cache_gib: int  # each replica's VLLM_CPU_KVCACHE_SPACE
    kv_needed_bytes: int  # what max_calls_per_replica full sequences fill
    weights_bytes: int
    trainer_bytes: int
    available_bytes: int
    given: bool  # kv_cache_gib came from rollout.server_env, not the plan

    def describe(self) -> str:
        source = f"{KV_ENV} given" if self.given else "derived"
        return (
            f"{self.replicas} vLLM replica(s) × ({self.kv_cache_gib} GiB KV cache, {source}; needs "
            f"{self.kv_needed_bytes / GIB:.2f} GiB for its concurrent calls + {_gib(self.weights_bytes)} weights + "
            f"{_gib(RUNTIME_BYTES)} runtime) + trainer {_gib(self.trainer_bytes)} of {_gib(self.available_bytes)} "
            "available"
        )


def _gib(n: int) -> str:
    return f"{n / GIB:.1f} GiB"


def kv_bytes_per_token(model_config: dict, dtype: str) -> int:
    """Keys and values of every layer for one token."""
    layers = int(model_config["num_hidden_layers"])
    heads = int(model_config["num_attention_heads"])
    kv_heads = int(model_config.get("num_key_value_heads") or heads)
    head_dim = int(model_config.get("head_dim") or model_config["hidden_size"] // heads)
    return 2 * layers * kv_heads * head_dim * DTYPE_BYTES[dtype]


def model_sizes(model_dir: str | Path) -> tuple[dict, int]:
    """(config.json, bytes of the weight files) of an HF checkpoint directory."""
    directory = Path(model_dir)
    config = json.loads((directory / "config.json").read_text(encoding="utf-8"))
    weights = sum(p.stat().st_size for p in directory.glob("*.safetensors"))
    return config, weights


def param_count(model_dir: str | Path) -> int:
    """Parameters in a checkpoint's safetensors files, from their headers (no tensor is read)."""
    total = 0
    for path in Path(model_dir).glob("*.safetensors"):
        with open(path, "rb") as f:
            header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
        for name, entry in header.items():
            if name != "__metadata__":
                total += math.prod(entry["shape"])
    return total


def plan_cpu_fleet(
    model_dir: str | Path,
    *,
    replicas: int,
    max_model_len: int,
    max_sequences: int,
    dtype: str,
    available_bytes: int,
    trainer_params: int = 0,
    kv_cache_gib: int | None = None,
) -> ReplicaMemoryPlan:
    """Each replica's KV cache (GiB) on a host with ``available_bytes`` free (see the module doc);
    RolloutError naming the numbers when the layout cannot fit."""
    config, weights = model_sizes(model_dir)
    if dtype not in DTYPE_BYTES:  # "auto": the checkpoint's own
        dtype = str(config.get("torch_dtype") or config.get("dtype") or "float32")
    per_token = kv_bytes_per_token(config, dtype if dtype in DTYPE_BYTES else "float32")
    one_sequence = per_token * max_model_len
    needed = one_sequence * max(1, max_sequences)
    trainer = TRAINER_BYTES_PER_PARAM * trainer_params
    left = available_bytes - trainer - replicas * (weights + RUNTIME_BYTES)
    share = left // replicas if left > 0 else 0
    given = kv_cache_gib is not None
    if kv_cache_gib is None:
        # whole GiB (the variable is an integer): what the calls fill, rounded up, within the share
        kv_cache_gib = min(math.ceil(needed / GIB), share // GIB)
    plan = ReplicaMemoryPlan(replicas, int(kv_cache_gib), needed, weights, trainer, available_bytes, given)
    if kv_cache_gib < 1 or kv_cache_gib * GIB < one_sequence:
        raise RolloutError(
            f"the vLLM fleet does not fit in memory: {plan.describe()}; each replica needs at least one "
            f"sequence's KV cache ({one_sequence / GIB:.2f} GiB at rollout.max_total_tokens={max_model_len}) and "
            f"whole GiB. Use fewer rollout.replicas, a shorter rollout.max_total_tokens, or free memory"
        )
    # a given size is checked against the replicas alone: the trainer may already hold its memory (then it
    # is not in available_bytes), and the operator chose the size
    if replicas * (kv_cache_gib * GIB + weights + RUNTIME_BYTES) + (0 if given else trainer) > available_bytes:
        raise RolloutError(
            f"the vLLM fleet does not fit in memory: {plan.describe()}; lower {KV_ENV} in rollout.server_env "
            "(or remove it and let the plan size it) or use fewer rollout.replicas"
        )
    return plan


def available_memory_bytes() -> int:
    """What the host can give without swapping: Linux's MemAvailable, else the free pages."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
