"""One optimizer step over micro-batches, on the primitives both trainers (plain torch, DeepSpeed) give:

    shard = trainer.micro_batches(micro_batches, weights, prepare)  # this rank's share, on its device
    for i, (item, batch) in enumerate(shard):
        with trainer.forward(sync=i == len(shard) - 1):            # autocast; ranks sync on the last
            loss, metrics = loss_fn(trainer.module, batch)
        trainer.backward(loss, item.scale)                          # scaled: a share of the global step
        acc.add(loss, metrics, item.scale, pad=item.pad)
    metrics = trainer.optimizer_step(acc)                           # clip, step, schedule

``Trainer.step`` is that loop for any ``loss_fn`` (SFT, tests, benches); the RL update writes the same loop
out with its loss (rubricem_core.rl.update.ss_grpo_update), so it reads top to bottom from logprobs to
the optimizer step.
"""

from __future__ import annotations

import contextlib
import math
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from rubricem_core.distributed.shard import ShardItem, shard_micro_batches
from rubricem_core.training.config import TrainerConfig

LossFn = Callable[[Any, Any], "tuple[Tensor, dict[str, Any]]"]
PrepareFn = Callable[[Any, Any], Any]  # (model, micro_batch) -> micro_batch, run without gradients


class Trainer(ABC):
    """What both backends are (TorchTrainer, DeepSpeedTrainer): the step's primitives, which each
    defines, ``step`` (one optimizer step over them for any ``loss_fn``), checkpoints and weights."""

    model: nn.Module  # the unwrapped HF model
    global_step: int
    cfg: TrainerConfig
    backend: str
    device: torch.device

    @property
    @abstractmethod
    def module(self) -> Any:
        """What a loss runs: the model, its DDP wrapper or the DeepSpeed engine."""

    @abstractmethod
    def micro_batches(
        self, micro_batches: list[Any], weights: Sequence[float] | None, prepare: PrepareFn | None
    ) -> list[tuple[ShardItem, Any]]:
        """Begins a step: this rank's shard of the step's global ``micro_batches``, on its device,
        ``prepare``d without gradients (what needs the weights of before the step)."""

    @abstractmethod
    def forward(self, sync: bool) -> contextlib.AbstractContextManager:
        """Where a micro-batch's loss is computed; ``sync``: the step's last on this rank (the ranks'
        gradients are reduced in its backward)."""

    @abstractmethod
    def backward(self, loss: Tensor, scale: float) -> None:
        """The gradient of ``scale`` × ``loss`` (``scale``: the micro-batch's share of the global step)."""

    @abstractmethod
    def optimizer_step(self, acc: MetricsAccumulator) -> dict[str, float]:
        """Ends the step: metrics combined over the ranks, the update applied; the step's metrics."""

    @abstractmethod
    def forward_only(self, micro_batches: list[Any], weights: Sequence[float] | None, fn: PrepareFn) -> None:
        """``fn(model, micro_batch)`` without gradients on this rank's shard (the one ``micro_batches``
        gives for the same list and weights)."""

    @abstractmethod
    def save(self, directory: str | Path, extra: dict[str, Any] | None = None, tokenizer: Any = None) -> Path: ...

    @abstractmethod
    def load(self, directory: str | Path) -> dict[str, Any]: ...

    @abstractmethod
    def state_dict_for_sync(self) -> dict[str, Tensor]: ...

    def step(
        self,
        micro_batches: list[Any],
        loss_fn: LossFn,
        weights: Sequence[float] | None = None,
        prepare: PrepareFn | None = None,
    ) -> dict[str, float]:
        """One optimizer step over ``micro_batches`` — the step's *global* list, the same on every rank;
        each rank trains on its shard — with ``loss_fn(module, micro_batch) -> (loss, metrics)``. Returns
        loss, grad_norm (before clipping), lr (the one this step used), step (steps done), step_time_s,
        tokens_per_s (when the loss_fn's metrics have ``n_tokens``) and the loss_fn's other metrics
        combined over all ranks' micro-batches."""
        acc = MetricsAccumulator()
        shard = self.micro_batches(micro_batches, weights, prepare)
        for i, (item, batch) in enumerate(shard):
            with self.forward(sync=i == len(shard) - 1):
                loss, metrics = loss_fn(self.module, batch)
            self.backward(loss, item.scale)
            acc.add(loss, metrics, item.scale, pad=item.pad)
        return self.optimizer_step(acc)


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
