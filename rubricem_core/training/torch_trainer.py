"""Plain-torch trainer: AdamW, warm-up + cosine schedule, gradient clipping, optional bf16 autocast.

One optimizer step per ``step()`` call, read top to bottom::

    for each micro-batch:  loss = loss_fn(model, mb);  (loss * scale_i).backward()
    clip;  optimizer.step();  scheduler.step();  zero_grad

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
from dataclasses import asdict
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np
import torch
from torch import Tensor, nn

from rubricem_core.policy.loading import auto_device
from rubricem_core.training.checkpoint import (
    CheckpointError,
    load_checkpoint,
    restore_rng_state,
    save_checkpoint,
)
from rubricem_core.training.config import TrainerConfig
from rubricem_core.training.schedule import make_scheduler

log = logging.getLogger(__name__)

LossFn = Callable[[Any, Any], "tuple[Tensor, dict[str, Any]]"]


# ------------------------------------------------------------------- helpers shared by backends
def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def param_groups(model: nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """Decay matrices (embeddings, projections); never biases or norm weights (1-D)."""
    decay, no_decay = [], []
    for p in model.parameters():
        if p.requires_grad:
            (decay if p.ndim >= 2 else no_decay).append(p)
    groups = [{"params": decay, "weight_decay": weight_decay}]
    if no_decay:
        groups.append({"params": no_decay, "weight_decay": 0.0})
    return groups


def build_optimizer(model: nn.Module, cfg: TrainerConfig) -> torch.optim.AdamW:
    # A plain torch AdamW in both backends: DeepSpeed wraps this instance, so no fused/CPU-Adam op
    # has to be JIT-compiled and the two backends run the same update rule.
    return torch.optim.AdamW(param_groups(model, cfg.weight_decay), lr=cfg.lr, betas=cfg.betas, eps=cfg.eps)


def micro_batch_scales(n: int, weights: Sequence[float] | None) -> list[float]:
    """Scale of each micro-batch's loss so the step is the weighted mean (see module docstring)."""
    if n == 0:
        raise ValueError("step() needs at least one micro-batch")
    if weights is None:
        return [1.0 / n] * n
    if len(weights) != n:
        raise ValueError(f"weights has {len(weights)} values for {n} micro-batches")
    total = float(sum(weights))
    if not total > 0 or any(w < 0 for w in weights):
        raise ValueError(f"weights must be >= 0 with a positive sum, got {list(weights)}")
    return [float(w) / total for w in weights]


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
    """Combines per-micro-batch metrics: counts (``n_*`` keys) add up; everything else is averaged
    with the step's micro-batch scales over the micro-batches that reported it (a stage missing
    from one micro-batch does not drag its mean towards 0)."""

    def __init__(self) -> None:
        self.loss = 0.0
        self.sums: dict[str, float] = {}
        self.weights: dict[str, float] = {}

    def add(self, loss: Tensor, metrics: dict[str, Any], scale: float) -> None:
        self.loss += scale * float(loss.detach().float())
        for key, value in metrics.items():
            if isinstance(value, Tensor):
                if value.numel() != 1:
                    continue
                value = float(value.detach().float())
            if not isinstance(value, (int, float)) or isinstance(value, bool):
                continue
            count = key.startswith("n_")
            self.sums[key] = self.sums.get(key, 0.0) + (float(value) if count else scale * float(value))
            self.weights[key] = 1.0 if count else self.weights.get(key, 0.0) + scale

    def result(self, grad_norm: float, lr: float, step: int, seconds: float) -> dict[str, float]:
        out = {k: v / self.weights[k] if self.weights[k] > 0 else v for k, v in self.sums.items()}
        out.update(loss=self.loss, grad_norm=grad_norm, lr=lr, step=float(step), step_time_s=seconds)
        if "n_tokens" in out:
            out["tokens_per_s"] = out["n_tokens"] / max(seconds, 1e-9)
        return out


def check_finite(grad_norm: float, loss: float, step: int, applied: bool = False) -> None:
    if not math.isfinite(grad_norm):
        outcome = (
            "the update was applied: resume from the last checkpoint" if applied else "the update was not applied"
        )
        raise FloatingPointError(f"non-finite gradient norm {grad_norm} at step {step} (loss {loss}); {outcome}")


def warn_schedule_drift(saved: dict[str, Any], cfg: TrainerConfig, directory: str | Path) -> None:
    """A resume continues the checkpoint's learning-rate curve exactly; say so when the current
    config asks for another one (e.g. more total_steps), instead of silently ignoring it."""
    keys = ("lr", "warmup_steps", "total_steps", "min_lr_ratio")
    changed = {k: (saved[k], getattr(cfg, k)) for k in keys if k in saved and saved[k] != getattr(cfg, k)}
    if changed:
        log.warning(
            "resuming from %s keeps its learning-rate schedule; these settings differ and are ignored "
            "(checkpoint, now): %s", directory, changed,
        )


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
    """One-process trainer. ``model`` is the HF model itself (moved to ``cfg.device``)."""

    backend = "torch"

    def __init__(self, model: nn.Module, cfg: TrainerConfig) -> None:
        self.cfg = cfg
        seed_everything(cfg.seed)
        self.device = auto_device() if cfg.device == "auto" else torch.device(cfg.device)
        self.model = model.to(self.device)
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
        self, micro_batches: list[Any], loss_fn: LossFn, weights: Sequence[float] | None = None
    ) -> dict[str, float]:
        """One optimizer step over ``micro_batches``; returns loss, grad_norm (before clipping), lr
        (the one this step used), step (steps done), step_time_s, tokens_per_s (when the loss_fn's
        metrics have ``n_tokens``) and the loss_fn's other metrics combined over micro-batches."""
        t0 = time.perf_counter()
        scales = micro_batch_scales(len(micro_batches), weights)
        acc = MetricsAccumulator()
        lr = self.optimizer.param_groups[0]["lr"]
        self.optimizer.zero_grad(set_to_none=True)
        for micro_batch, scale in zip(micro_batches, scales):
            with self._autocast():
                loss, metrics = loss_fn(self.model, to_device(micro_batch, self.device))
            (loss * scale).backward()
            acc.add(loss, metrics, scale)
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

    # ------------------------------------------------------------------------------ checkpoints
    def save(self, directory: str | Path, extra: dict[str, Any] | None = None, tokenizer: Any = None) -> Path:
        """Atomic checkpoint: HF weights + optimizer, scheduler, step, RNG and ``extra`` (plain
        Python types and tensors only, e.g. a data-loader position)."""
        state = {
            "backend": self.backend,
            "global_step": self.global_step,
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "config": _plain(asdict(self.cfg)),
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
        warn_schedule_drift(state.get("config", {}), self.cfg, directory)
        return dict(state.get("extra") or {})

    def state_dict_for_sync(self) -> dict[str, Tensor]:
        """Full weights (name → tensor, detached views, no copy) for a rollout engine's weight sync."""
        return {k: v.detach() for k, v in self.model.state_dict().items()}


def _plain(x: Any) -> Any:
    """Tuples → lists so the saved config loads under ``torch.load(weights_only=True)``."""
    if isinstance(x, dict):
        return {k: _plain(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_plain(v) for v in x]
    return x
