"""Plain-torch trainer: AdamW, warm-up + cosine schedule, gradient clipping, optional bf16 autocast.

One optimizer step per ``step()`` call, on the primitives of rubricem_core.training.step::

    for each of this rank's micro-batches (micro_batches):  with forward(sync):  loss = loss_fn(module, mb)
                                                           backward(loss, scale_i)
    optimizer_step:  clip;  optimizer.step();  scheduler.step();  zero_grad

Data parallel: on Ray trainer ranks (WORLD_SIZE > 1) every rank holds the whole model and optimizer, is
given the same global micro-batches and trains on its shard (rubricem_core.distributed.shard). The model
runs under torch's DistributedDataParallel, which sums the gradients across ranks in buckets while the
last micro-batch's backward still runs (the others accumulate locally, ``no_sync``). The scales are
shares of the global total, so the summed gradient, and hence every rank's update, equals one process
training on all micro-batches.

Micro-batch weighting (the same in both backends): the update is the gradient of
``sum_i w_i * loss_i / sum_i w_i``. Without ``weights`` every micro-batch weighs 1, so the step is
the gradient of the mean of the micro-batch losses. Pass ``weights`` (e.g. each micro-batch's number
of loss tokens, with a loss_fn that returns a per-token mean) to make the step equal to one big
batch of all tokens. The weights must be known before the backward passes (they scale each
backward), which is why they are an argument and not read from the loss_fn's metrics.
"""

from __future__ import annotations

import contextlib
import logging
import math
import random
import time
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import Tensor, nn

from rubricem_core.distributed.ranks import init_process_group, train_device
from rubricem_core.distributed.shard import (
    ShardItem,
    micro_batch_scales,  # noqa: F401  (re-exported)
)
from rubricem_core.training.adapters import is_adapter_model, merged_state_dict
from rubricem_core.training.checkpoint import (
    CheckpointError,
    load_checkpoint,
    restore_rng_state,
    save_checkpoint,
)
from rubricem_core.training.config import TrainerConfig
from rubricem_core.training.params import full_ndim
from rubricem_core.training.schedule import make_scheduler, resume_schedule
from rubricem_core.training.step import (
    MetricsAccumulator,
    PrepareFn,
    Trainer,
    check_finite,
    local_micro_batches,
    to_device,  # noqa: F401  (re-exported)
)

log = logging.getLogger(__name__)


def enable_gradient_checkpointing(model: nn.Module) -> None:
    """Recompute activations in the backward pass (HF models): activation memory per layer boundary
    instead of per op, for about a third more compute. Non-reentrant, as ZeRO-3 needs."""
    if not hasattr(model, "gradient_checkpointing_enable"):
        raise ValueError(f"{type(model).__name__} does not support gradient checkpointing")
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if getattr(model, "config", None) is not None:
        model.config.use_cache = False  # a KV cache is useless (and warned about) while training


# ------------------------------------------------------------------- helpers shared by backends
def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def param_groups(model: nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """Decay matrices (embeddings, projections); never biases or norm weights (1-D)."""
    decay: list[nn.Parameter] = []
    no_decay: list[nn.Parameter] = []
    for p in model.parameters():
        if p.requires_grad:
            (decay if full_ndim(p) >= 2 else no_decay).append(p)  # a ZeRO-3 placeholder is 1-D
    groups = [{"params": decay, "weight_decay": weight_decay}]
    if no_decay:
        groups.append({"params": no_decay, "weight_decay": 0.0})
    return groups


def build_optimizer(model: nn.Module, cfg: TrainerConfig) -> torch.optim.AdamW:
    # A plain torch AdamW in both backends: DeepSpeed wraps this instance, so no fused/CPU-Adam op
    # has to be JIT-compiled and the two backends run the same update rule.
    return torch.optim.AdamW(param_groups(model, cfg.weight_decay), lr=cfg.lr, betas=cfg.betas, eps=cfg.eps)


def _bf16_autocast_works(device: torch.device) -> bool:
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported()
    try:
        with torch.autocast(device.type, dtype=torch.bfloat16):
            out = torch.ones(2, 2, device=device) @ torch.ones(2, 2, device=device)
        return out.dtype == torch.bfloat16
    except (RuntimeError, ValueError):
        return False


# ---------------------------------------------------------------------------------- the trainer
class TorchTrainer(Trainer):
    """Replicated data-parallel trainer (one process, or one per Ray trainer rank). ``model`` is
    the HF model itself (moved to ``cfg.device``; ``cuda:LOCAL_RANK`` under a launcher)."""

    backend = "torch"

    def __init__(self, model: nn.Module, cfg: TrainerConfig) -> None:
        self.cfg = cfg
        init_process_group()
        self.world_size = dist.get_world_size() if dist.is_initialized() else 1
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        seed_everything(cfg.seed)
        self.device = train_device(cfg.device)
        if cfg.gradient_checkpointing:
            enable_gradient_checkpointing(model)
        self.model = model.to(self.device)
        # what the loss runs: with several ranks DDP, which also starts every rank from rank 0's weights
        self.ddp: nn.parallel.DistributedDataParallel | None = None
        if self.world_size > 1:
            self.ddp = nn.parallel.DistributedDataParallel(
                self.model,
                device_ids=[self.device.index] if self.device.type == "cuda" else None,
                broadcast_buffers=False,  # the weights move only by identical updates
            )
            self.ddp.register_comm_hook(None, _sum_gradients)
        self.model.train()
        self.autocast_dtype: torch.dtype | None = None
        if cfg.precision == "bf16":
            if _bf16_autocast_works(self.device):
                self.autocast_dtype = torch.bfloat16
            else:
                warnings.warn(f"bf16 autocast does not work on {self.device}; training in fp32", stacklevel=2)
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.optimizer = build_optimizer(model, cfg)
        self.scheduler = make_scheduler(self.optimizer, cfg.warmup_steps, cfg.total_steps, cfg.min_lr_ratio)
        self.global_step = 0
        self._step_t0 = time.perf_counter()

    def _autocast(self) -> contextlib.AbstractContextManager:
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.autocast_dtype)

    @property
    def module(self) -> nn.Module:
        """What a loss runs: with several ranks the DDP wrapper (it syncs the gradients), else the model."""
        return self.ddp or self.model

    # ---- the step's primitives (rubricem_core.training.step) ----
    def micro_batches(
        self, micro_batches: list[Any], weights: Sequence[float] | None, prepare: PrepareFn | None
    ) -> list[tuple[ShardItem, Any]]:
        """Begins a step: this rank's shard of ``micro_batches``, on its device, ``prepare``d."""
        self._step_t0 = time.perf_counter()
        self.optimizer.zero_grad(set_to_none=True)
        items, batches = local_micro_batches(
            micro_batches, weights, self.device, self.model, prepare, autocast=self._autocast
        )
        return list(zip(items, batches))

    def forward(self, sync: bool) -> contextlib.AbstractContextManager:
        """Where a micro-batch's loss is computed: under autocast, and with several ranks under DDP's
        ``no_sync`` unless ``sync`` (DDP sums the ranks' gradients during the last backward; the ones
        before accumulate here)."""
        stack = contextlib.ExitStack()
        if self.ddp is not None and not sync:
            stack.enter_context(self.ddp.no_sync())
        stack.enter_context(self._autocast())
        return stack

    def backward(self, loss: Tensor, scale: float) -> None:
        (loss * scale).backward()

    def optimizer_step(self, acc: MetricsAccumulator) -> dict[str, float]:
        """Ends the step: every rank's metrics combined, gradients clipped, the optimizer and schedule
        stepped (not on a non-finite gradient norm: that raises)."""
        lr = self.optimizer.param_groups[0]["lr"]  # the rate this step uses
        acc.all_reduce()
        max_norm = self.cfg.max_grad_norm if self.cfg.max_grad_norm > 0 else math.inf
        grad_norm = float(torch.nn.utils.clip_grad_norm_(self.params, max_norm))
        if not math.isfinite(grad_norm):
            self.optimizer.zero_grad(set_to_none=True)
            check_finite(grad_norm, acc.loss, self.global_step)
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.global_step += 1
        return acc.result(grad_norm, lr, self.global_step, time.perf_counter() - self._step_t0)

    def forward_only(self, micro_batches: list[Any], weights: Sequence[float] | None, fn: PrepareFn) -> None:
        """``fn(model, micro_batch)`` without gradients, under the step's autocast, on this rank's
        shard of ``micro_batches`` — the shard ``step`` gives it for the same list and weights. For
        what must see the weights of before several optimizer steps (PPO's old logprobs)."""
        local_micro_batches(micro_batches, weights, self.device, self.model, fn, autocast=self._autocast)

    # ------------------------------------------------------------------------------ checkpoints
    def save(self, directory: str | Path, extra: dict[str, Any] | None = None, tokenizer: Any = None) -> Path:
        """Atomic checkpoint: HF weights + optimizer, scheduler, step, RNG and ``extra`` (plain
        Python types and tensors only, e.g. a data-loader position). Collective with several ranks:
        every rank calls it, rank 0 writes (the ranks hold identical state)."""
        if self.world_size > 1:
            if self.rank == 0:
                self._save(directory, extra, tokenizer)
            dist.barrier()
            return Path(directory)
        return self._save(directory, extra, tokenizer)

    def _save(self, directory: str | Path, extra: dict[str, Any] | None, tokenizer: Any) -> Path:
        state = {
            "backend": self.backend,
            "global_step": self.global_step,
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "config": _plain(self.cfg.model_dump()),
            "extra": extra or {},
        }
        return save_checkpoint(directory, self.model, tokenizer, state, meta={"backend": self.backend})

    def load(self, directory: str | Path) -> dict[str, Any]:
        """Restore weights, optimizer, scheduler, step and RNG; returns the ``extra`` dict."""
        ckpt = load_checkpoint(directory, model=self.model)
        state = ckpt.trainer_state
        if state.get("backend") != self.backend:
            raise CheckpointError(
                f"checkpoint {directory} was written by the {state.get('backend')!r} backend; its optimizer "
                f"state cannot be resumed by the {self.backend!r} trainer (its weights load with load_checkpoint)"
            )
        try:
            self.optimizer.load_state_dict(state["optimizer"])
            self.scheduler.load_state_dict(state["scheduler"])
        except (KeyError, ValueError, RuntimeError) as exc:
            raise CheckpointError(f"{directory}: optimizer/scheduler state does not fit this model: {exc}") from exc
        self.global_step = int(state["global_step"])
        restore_rng_state(state["rng"])
        resume_schedule(self.scheduler, self.cfg, directory)  # extends it when total_steps grew
        return dict(state.get("extra") or {})

    def state_dict_for_sync(self) -> dict[str, Tensor]:
        """Full weights (name → tensor, detached views, no copy) for a rollout engine's weight sync; with LoRA
        adapters, the merged weights under the base model's names (policy/adapters.py)."""
        if is_adapter_model(self.model):
            return merged_state_dict(self.model)
        return {k: v.detach() for k, v in self.model.state_dict().items()}


def _sum_gradients(state, bucket):  # noqa: ANN001, ANN202 (DDP rejects the string annotations of this module)
    """DDP's communication hook (a dist.GradBucket → a future of its tensor): the sum over ranks (DDP's
    own averages). The micro-batch scales are shares of the global step, so the sum is the full gradient."""
    return dist.all_reduce(bucket.buffer(), async_op=True).get_future().then(lambda fut: fut.value()[0])


def _plain(x: Any) -> Any:
    """Tuples → lists so the saved config loads under ``torch.load(weights_only=True)``."""
    if isinstance(x, dict):
        return {k: _plain(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_plain(v) for v in x]
    return x
