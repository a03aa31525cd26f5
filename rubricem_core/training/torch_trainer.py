"""Plain-torch trainer: AdamW, warm-up + cosine schedule, gradient clipping, optional bf16 autocast.

One optimizer step per ``step()`` call, read top to bottom::

    for each of this rank's micro-batches:  loss = loss_fn(model, mb);  (loss * scale_i).backward()
    clip;  optimizer.step();  scheduler.step();  zero_grad

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
from collections.abc import Callable, Sequence
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
    shard_micro_batches,
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

log = logging.getLogger(__name__)

LossFn = Callable[[Any, Any], "tuple[Tensor, dict[str, Any]]"]
PrepareFn = Callable[[Any, Any], Any]  # (model, micro_batch) -> micro_batch, run without gradients


def enable_gradient_checkpointing(model: nn.Module) -> None:
    """Recompute activations in the backward pass (HF models): activation memory per layer boundary
    instead of per op, for about a third more compute. Non-reentrant, as ZeRO-3 needs."""
    if not hasattr(model, "gradient_checkpointing_enable"):
        raise ValueError(f"{type(model).__name__} does not support gradient checkpointing")
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if getattr(model, "config", None) is not None:
        model.config.use_cache = False  # a KV cache is useless (and warned about) while training


def local_micro_batches(
    micro_batches: list[Any],
    weights: Sequence[float] | None,
    device: torch.device,
    model: Any,
    prepare: PrepareFn | None,
    autocast: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
) -> tuple[list[ShardItem], list[Any]]:
    """This rank's shard of the step, on ``device``; ``prepare`` fills what needs the weights of
    before the step (e.g. old and reference logprobs) for every one of them before any backward,
    under the same ``autocast`` as the loss (so a recomputed old logprob matches the loss's own)."""
    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    rank = dist.get_rank() if world > 1 else 0
    items = shard_micro_batches(len(micro_batches), weights, rank, world)
    batches = [to_device(micro_batches[item.index], device) for item in items]
    if prepare is not None:
        with torch.no_grad(), autocast():
            batches = [prepare(model, b) for b in batches]
    return items, batches


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


def to_device(batch: Any, device: torch.device) -> Any:
    """Move tensors inside dicts/lists/tuples/dataclass-like objects with ``.to`` to ``device``."""
    if isinstance(batch, Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, dict):
        return {k: to_device(v, device) for k, v in batch.items()}
    if isinstance(batch, (list, tuple)):
        return type(batch)(to_device(v, device) for v in batch)
    to = getattr(batch, "to", None)
    if callable(to) and not isinstance(batch, nn.Module):
        return to(device)
    return batch


class MetricsAccumulator:
    """Combines per-micro-batch metrics: counts (``n_*`` keys) add up, ``*_max`` keys take the
    maximum; everything else is averaged with the step's micro-batch scales over the micro-batches
    that reported it (a stage missing from one micro-batch does not drag its mean towards 0)."""

    def __init__(self) -> None:
        self.loss = 0.0
        self.sums: dict[str, float] = {}
        self.weights: dict[str, float] = {}
        self.maxes: dict[str, float] = {}

    def add(self, loss: Tensor, metrics: dict[str, Any], scale: float, pad: bool = False) -> None:
        if pad:
            return  # a scale-0 copy that only kept the ranks in step
        self.loss += scale * float(loss.detach().float())
        for key, value in metrics.items():
            if isinstance(value, Tensor):
                if value.numel() != 1:
                    continue
                value = float(value.detach().float())
            if not isinstance(value, (int, float)) or isinstance(value, bool):
                continue
            if key.endswith("_max"):
                self.maxes[key] = max(self.maxes.get(key, -math.inf), float(value))
                continue
            count = key.startswith("n_")
            self.sums[key] = self.sums.get(key, 0.0) + (float(value) if count else scale * float(value))
            self.weights[key] = 1.0 if count else self.weights.get(key, 0.0) + scale

    def all_reduce(self) -> None:
        """Combine every rank's micro-batches: the scales are global shares, so sums add up to the
        global weighted means; counts add; ``*_max`` keys take the maximum."""
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
            return
        parts: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(parts, (self.loss, self.sums, self.weights, self.maxes))
        self.loss, self.sums, self.weights, self.maxes = 0.0, {}, {}, {}
        for loss, sums, weights, maxes in parts:
            self.loss += loss
            for key, value in sums.items():
                self.sums[key] = self.sums.get(key, 0.0) + value
                count = key.startswith("n_")
                self.weights[key] = 1.0 if count else self.weights.get(key, 0.0) + weights[key]
            for key, value in maxes.items():
                self.maxes[key] = max(self.maxes.get(key, -math.inf), value)

    def result(self, grad_norm: float, lr: float, step: int, seconds: float) -> dict[str, float]:
        out = {k: v / self.weights[k] if self.weights[k] > 0 else v for k, v in self.sums.items()}
        out.update(self.maxes)
        out.update(loss=self.loss, grad_norm=grad_norm, lr=lr, step=float(step), step_time_s=seconds)
        if "n_tokens" in out:
            out["tokens_per_s"] = out["n_tokens"] / max(seconds, 1e-9)
        return out


def check_finite(grad_norm: float, loss: float, step: int, applied: bool = False) -> None:
    if not math.isfinite(grad_norm):
        outcome = "the update was applied: resume from the last checkpoint" if applied else "the update was not applied"
        raise FloatingPointError(f"non-finite gradient norm {grad_norm} at step {step} (loss {loss}); {outcome}")


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
class TorchTrainer:
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

    def _autocast(self) -> contextlib.AbstractContextManager:
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.autocast_dtype)

    def step(
        self,
        micro_batches: list[Any],
        loss_fn: LossFn,
        weights: Sequence[float] | None = None,
        prepare: PrepareFn | None = None,
    ) -> dict[str, float]:
        """One optimizer step over ``micro_batches`` — the step's *global* list, the same on every
        rank; each rank trains on its shard. Returns loss, grad_norm (before clipping), lr (the one
        this step used), step (steps done), step_time_s, tokens_per_s (when the loss_fn's metrics have
        ``n_tokens``) and the loss_fn's other metrics combined over all ranks' micro-batches."""
        t0 = time.perf_counter()
        acc = MetricsAccumulator()
        lr = self.optimizer.param_groups[0]["lr"]
        self.optimizer.zero_grad(set_to_none=True)
        items, batches = local_micro_batches(
            micro_batches, weights, self.device, self.model, prepare, autocast=self._autocast
        )
        for i, (item, micro_batch) in enumerate(zip(items, batches)):
            # DDP sums the ranks' gradients during the last backward; the ones before accumulate here
            last = i == len(batches) - 1
            with self.ddp.no_sync() if self.ddp is not None and not last else contextlib.nullcontext():
                with self._autocast():
                    loss, metrics = loss_fn(self.ddp or self.model, micro_batch)
                (loss * item.scale).backward()
            acc.add(loss, metrics, item.scale, pad=item.pad)
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
        return acc.result(grad_norm, lr, self.global_step, time.perf_counter() - t0)

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
