"""DeepSpeed trainer: the TorchTrainer interface on a ZeRO engine (stages 0-3, optional CPU offload).

The optimizer is a plain ``torch.optim.AdamW`` instance handed to ``deepspeed.initialize`` (ZeRO wraps
it), so no fused/CPU-Adam op is JIT-compiled. Clipping and accumulation are DeepSpeed's: each
micro-batch's backward goes through ``engine.backward`` with the accumulation boundary set on the
last micro-batch of the ``step()`` call, and ``engine.step()`` applies clipping, AdamW and the
schedule. Micro-batch weighting is the same as the torch backend's (see torch_trainer); across
ranks each rank trains on its shard of the step's micro-batches (rubricem_core.distributed.shard) and
DeepSpeed averages the per-rank gradients, which the world-size factor on each loss turns back into the
global token mean.

One process (tests, a single GPU, this CPU): just build the trainer. Missing RANK, WORLD_SIZE,
LOCAL_RANK, MASTER_ADDR and MASTER_PORT get single-process defaults; values a launcher set are never
touched. Without CUDA the CPU accelerator (``DS_ACCELERATOR=cpu``) and the gloo backend are used.

Several GPUs or nodes: run the same script under the ``deepspeed`` launcher; every rank executes the
same code and builds the same trainer (rank 0 alone writes the HF weights and trainer_state.pt)::

    deepspeed --num_gpus 8 train.py --your-args               # one node, 8 GPUs
    deepspeed --num_gpus 8 --module your_package.train ...     # same, as ``python -m``
    deepspeed --hostfile hosts.txt --num_nodes 2 --num_gpus 8 train.py ...

Checkpoints must be written to a file system every rank sees (each rank writes its optimizer shard).
Under ZeRO-3, ``trainer.model`` holds partitioned parameters: generate through a rollout engine fed by
``state_dict_for_sync()`` (which gathers them), or inside ``deepspeed.zero.GatheredParameters``.
"""

from __future__ import annotations

import contextlib
import copy
import math
import os
import shutil
import time
from collections.abc import Sequence
from functools import partial
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from rubricem_core.distributed.ranks import init_process_group
from rubricem_core.distributed.shard import ShardItem
from rubricem_core.processes import free_port
from rubricem_core.training.adapters import is_adapter_model, merged_state_dict
from rubricem_core.training.checkpoint import (
    CheckpointError,
    adapter_meta_of,
    capture_rng_state,
    commit,
    load_torch_file,
    load_trainer_state,
    read_meta,
    restore_rng_state,
    staging_dir,
    write_checkpoint_files,
)
from rubricem_core.training.config import TrainerConfig
from rubricem_core.training.params import full_numel
from rubricem_core.training.schedule import make_scheduler, resume_schedule
from rubricem_core.training.step import (
    MetricsAccumulator,
    PrepareFn,
    Trainer,
    check_finite,
    local_micro_batches,
)
from rubricem_core.training.torch_trainer import (
    _plain,
    build_optimizer,
    enable_gradient_checkpointing,
    seed_everything,
)

DS_DIR = "deepspeed"  # DeepSpeed's own checkpoint (module + optimizer shards) inside ours
DS_TAG = "state"
_DEFAULT_BUCKET = int(5e8)  # DeepSpeed's default bucket size (elements)


_MPI_VARS = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK")  # mpirun/srun: DeepSpeed discovers ranks


def prepare_environment() -> None:
    """Single-process defaults for the variables torch.distributed reads; never overrides, and
    sets none under an MPI launcher (DeepSpeed's MPI discovery needs them unset)."""
    if not any(v in os.environ for v in _MPI_VARS):
        for key, value in (("RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0"), ("MASTER_ADDR", "127.0.0.1")):
            os.environ.setdefault(key, value)
        if "MASTER_PORT" not in os.environ:
            os.environ["MASTER_PORT"] = str(free_port())
    if not torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")


def import_deepspeed() -> Any:
    """Import deepspeed after the environment is prepared (its accelerator is chosen on import).

    On the CPU accelerator, DeepSpeed's shared-memory allreduce op would be JIT-compiled when the
    communication backend starts (~2 minutes of C++ build); it is marked unavailable so gloo's
    allreduce is used and nothing is compiled."""
    prepare_environment()
    import deepspeed
    import deepspeed.ops
    from deepspeed.accelerator import get_accelerator

    if get_accelerator().device_name() == "cpu":
        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    return deepspeed


def _merge(base: dict[str, Any], override: dict[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(base)
    for key, value in override.items():
        out[key] = _merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def build_ds_config(cfg: TrainerConfig, n_params: int) -> dict[str, Any]:
    """The DeepSpeed JSON config for ``cfg`` (``cfg.deepspeed_overrides`` merged last)."""
    # Buckets larger than the model only waste memory (DeepSpeed preallocates them).
    bucket = int(min(_DEFAULT_BUCKET, max(2**20, n_params)))
    zero: dict[str, Any] = {
        "stage": cfg.zero_stage,
        "reduce_bucket_size": bucket,
        "allgather_bucket_size": bucket,
    }
    if cfg.zero_stage == 3:
        zero["stage3_prefetch_bucket_size"] = bucket
    if cfg.offload:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": torch.cuda.is_available()}
    if cfg.offload_params:
        zero["offload_param"] = {"device": "cpu", "pin_memory": torch.cuda.is_available()}
    config = {
        "train_micro_batch_size_per_gpu": 1,  # nominal: a micro-batch is whatever the loss_fn consumes
        "gradient_accumulation_steps": cfg.grad_accum_steps,
        "gradient_clipping": cfg.max_grad_norm,
        "zero_optimization": zero,
        "bf16": {"enabled": cfg.precision == "bf16"},
        # The client optimizer is a torch AdamW: allowed under ZeRO and under offload without
        # DeepSpeed's compiled CPU Adam.
        "zero_allow_untested_optimizer": True,
        "zero_force_ds_cpu_optimizer": False,
        "steps_per_print": 2**31 - 1,  # metrics come back from step(); no log spam
        "wall_clock_breakdown": False,
    }
    return _merge(config, cfg.deepspeed_overrides)


class DeepSpeedTrainer(Trainer):
    """``model`` is the unwrapped HF module (``engine.module``); the loss_fn receives the engine,
    which is called like the model (its forward runs the module, with ZeRO-3's hooks)."""

    backend = "deepspeed"

    def __init__(self, model: nn.Module, cfg: TrainerConfig) -> None:
        self.cfg = cfg
        self._ds = import_deepspeed()
        init_process_group()  # under a launcher: the run's backend and collective timeout, which DeepSpeed adopts
        seed_everything(cfg.seed)
        if cfg.gradient_checkpointing:
            enable_gradient_checkpointing(model)
        n_params = sum(full_numel(p) for p in model.parameters())  # a zero.Init-built model has placeholders
        self.ds_config = build_ds_config(cfg, n_params)
        optimizer = build_optimizer(model, cfg)
        scheduler = partial(
            make_scheduler, warmup_steps=cfg.warmup_steps, total_steps=cfg.total_steps, min_lr_ratio=cfg.min_lr_ratio
        )
        # DeepSpeed calls the scheduler factory with its wrapped optimizer, so the schedule drives
        # the learning rate ZeRO actually uses.
        self.engine, _, _, self.scheduler = self._ds.initialize(
            model=model, optimizer=optimizer, lr_scheduler=scheduler, config=self.ds_config
        )
        load_without_unpickling(self.engine)
        self.model: nn.Module = self.engine.module
        self.device = self.engine.device
        self.rank = torch.distributed.get_rank()
        self.world_size = torch.distributed.get_world_size()
        self.global_step = 0
        self._step_t0 = time.perf_counter()

    @property
    def module(self) -> Any:
        """What a loss runs: the DeepSpeed engine (its forward gathers ZeRO-3 partitions)."""
        return self.engine

    # ---- the step's primitives (rubricem_core.training.step) ----
    def micro_batches(
        self, micro_batches: list[Any], weights: Sequence[float] | None, prepare: PrepareFn | None
    ) -> list[tuple[ShardItem, Any]]:
        """Begins a step: this rank's shard of ``micro_batches``, on its device, ``prepare``d (the
        engine's own bf16 module needs no autocast)."""
        self._step_t0 = time.perf_counter()
        items, batches = local_micro_batches(micro_batches, weights, self.device, self.engine, prepare)
        return list(zip(items, batches))

    def forward(self, sync: bool) -> contextlib.AbstractContextManager:
        """Gradients are reduced across ranks (and the optimizer may step) only on the boundary: ``sync``."""
        self.engine.set_gradient_accumulation_boundary(sync)
        return contextlib.nullcontext()

    def backward(self, loss: Tensor, scale: float) -> None:
        # Our scale replaces 1/GAS; DeepSpeed averages the ranks' gradients, so × world size turns that
        # mean back into the sum of global shares.
        self.engine.backward(loss * (scale * self.world_size), scale_wrt_gas=False)

    def optimizer_step(self, acc: MetricsAccumulator) -> dict[str, float]:
        """Ends the step: every rank's metrics combined, the engine stepped (it clips); a non-finite
        gradient norm raises after the update was applied."""
        lr = float(self.engine.get_lr()[0])  # the rate this step uses
        acc.all_reduce()
        # ZeRO optimizers record the global norm during step(); ZeRO-0 in fp32 does not, and its
        # gradients are whole on every rank, so measure them before the step clears them.
        local_norm = self._grad_norm_of_module() if self.cfg.zero_stage == 0 else None
        self.engine.step()
        norm = self.engine.get_global_grad_norm()
        grad_norm = float(norm) if norm is not None else (local_norm if local_norm is not None else math.nan)
        self.global_step += 1
        if not math.isfinite(grad_norm):
            check_finite(grad_norm, acc.loss, self.global_step - 1, applied=True)
        return acc.result(grad_norm, lr, self.global_step, time.perf_counter() - self._step_t0)

    def forward_only(self, micro_batches: list[Any], weights: Sequence[float] | None, fn: Any) -> None:
        """As TorchTrainer.forward_only (the engine's own bf16 module needs no autocast). Collective
        under ZeRO-3: every rank runs as many forwards (shards are padded to one length)."""
        local_micro_batches(micro_batches, weights, self.device, self.engine, fn)

    def _grad_norm_of_module(self) -> float | None:
        grads = [p.grad for p in self.model.parameters() if p.grad is not None]
        if not grads:
            return None
        return float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g.float()) for g in grads])))

    # ------------------------------------------------------------------------------ checkpoints
    def save(self, directory: str | Path, extra: dict[str, Any] | None = None, tokenizer: Any = None) -> Path:
        """Collective: every rank must call it. DeepSpeed's module/optimizer shards, every rank's RNG,
        and (rank 0) the HF weights — gathered under ZeRO-3 — are staged, then renamed into place."""
        final = Path(directory)
        staging = staging_dir(final)
        dist = torch.distributed
        if self.rank == 0:
            shutil.rmtree(staging, ignore_errors=True)
            staging.mkdir(parents=True)
        dist.barrier()
        self.engine.save_checkpoint(str(staging / DS_DIR), tag=DS_TAG, client_state={"global_step": self.global_step})
        torch.save(capture_rng_state(), staging / f"rng_rank{self.rank}.pt")
        full = self.engine._zero3_consolidated_16bit_state_dict() if self.cfg.zero_stage == 3 else None
        dist.barrier()
        if self.rank == 0:
            state = {
                "backend": self.backend,
                "global_step": self.global_step,
                "world_size": self.world_size,
                "zero_stage": self.cfg.zero_stage,
                "config": _plain(self.cfg.model_dump()),
                "extra": extra or {},
            }
            try:
                write_checkpoint_files(staging, self.model, tokenizer, state, state_dict=full)
                meta = {"step": self.global_step, "backend": self.backend, **adapter_meta_of(self.model, final)}
                commit(staging, final, meta)
            except BaseException:
                shutil.rmtree(staging, ignore_errors=True)
                raise
        dist.barrier()
        return final

    def load(self, directory: str | Path) -> dict[str, Any]:
        """Collective: restore module, optimizer shards, scheduler, step and this rank's RNG."""
        directory = Path(directory)
        read_meta(directory)
        state = load_trainer_state(directory)
        if state.get("backend") != self.backend:
            raise CheckpointError(
                f"checkpoint {directory} was written by the {state.get('backend')!r} backend; the deepspeed "
                "trainer needs its optimizer shards (load the weights into the model before building the trainer)"
            )
        try:
            path, client = self.engine.load_checkpoint(
                str(directory / DS_DIR), tag=DS_TAG, load_optimizer_states=True, load_lr_scheduler_states=True
            )
        except Exception as exc:
            raise CheckpointError(
                f"DeepSpeed could not load {directory / DS_DIR}: {type(exc).__name__}: {exc}"
            ) from exc
        if path is None:
            raise CheckpointError(f"DeepSpeed found no checkpoint under {directory / DS_DIR} (tag {DS_TAG!r})")
        self.global_step = int(client.get("global_step", state["global_step"]))
        resume_schedule(self.scheduler, self.cfg, directory)  # extends it when total_steps grew
        rng_file = directory / f"rng_rank{self.rank}.pt"
        # A different world size has no file for this rank: fall back to rank 0's state.
        restore_rng_state(load_torch_file(rng_file) if rng_file.is_file() else state["rng"])
        return dict(state.get("extra") or {})

    def state_dict_for_sync(self) -> dict[str, Tensor]:
        """Full weights for a rollout engine. Collective under ZeRO-3 (gathered layer by layer;
        ranks other than 0 get an empty dict)."""
        if is_adapter_model(self.model):  # base + adapter merged, under the HF names (gathered under ZeRO-3)
            return merged_state_dict(self.model)
        if self.cfg.zero_stage == 3:
            return self.engine._zero3_consolidated_16bit_state_dict() or {}
        return {k: v.detach() for k, v in self.model.state_dict().items()}


def _deepspeed_safe_globals() -> list[Any]:
    """What DeepSpeed's checkpoints hold beyond tensors and plain containers, allowed by name for
    ``torch.load(weights_only=True)``."""
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    return [LossScaler, DynamicLossScaler, ZeroStageEnum, fragment_address]


def load_without_unpickling(engine: Any) -> None:
    """DeepSpeed's torch checkpoint engine loads its files with ``torch.load(weights_only=False)``: a file put
    on a shared runs volume would run code in every rank that resumes from it. Its ``load`` is replaced by one
    with ``weights_only=True`` that admits only DeepSpeed's own classes by name."""
    checkpoint_engine = getattr(engine, "checkpoint_engine", None)
    if checkpoint_engine is None:
        return
    allowed = _deepspeed_safe_globals()

    def load(path: str, map_location: Any = None) -> Any:
        with torch.serialization.safe_globals(allowed):
            return torch.load(path, map_location=map_location, weights_only=True)

    checkpoint_engine.load = load
