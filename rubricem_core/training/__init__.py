"""Trainers with one interface (plain torch and DeepSpeed) and checkpoints with exact resume.

    trainer = make_trainer(model, TrainerConfig(lr=1e-4, total_steps=100))
    metrics = trainer.step(micro_batches, loss_fn)      # loss_fn(model, micro_batch) -> (loss, metrics)
    # or the same step written out on its primitives (training.step): micro_batches → forward/backward → optimizer_step
    trainer.save(path, extra={"data_position": k});  extra = trainer.load(path)
    trainer.model                                        # the unwrapped HF model
    trainer.state_dict_for_sync()                        # full weights for a rollout engine

DeepSpeed is imported only when ``backend="deepspeed"`` is asked for.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import Tensor, nn

from rubricem_core.distributed.shard import ShardItem
from rubricem_core.training.checkpoint import CheckpointError, latest_checkpoint, load_checkpoint, save_checkpoint
from rubricem_core.training.config import TrainerConfig, TrainerConfigError
from rubricem_core.training.step import LossFn, MetricsAccumulator, PrepareFn
from rubricem_core.training.torch_trainer import TorchTrainer


class Trainer(Protocol):
    model: nn.Module
    global_step: int
    cfg: TrainerConfig
    backend: str
    device: torch.device

    @property
    def module(self) -> Any:
        """What a loss runs (the model, its DDP wrapper, the DeepSpeed engine)."""

    def micro_batches(
        self, micro_batches: list[Any], weights: Sequence[float] | None, prepare: PrepareFn | None
    ) -> list[tuple[ShardItem, Any]]: ...

    def forward(self, sync: bool) -> contextlib.AbstractContextManager: ...

    def backward(self, loss: Tensor, scale: float) -> None: ...

    def optimizer_step(self, acc: MetricsAccumulator) -> dict[str, float]: ...

    def step(
        self,
        micro_batches: list[Any],
        loss_fn: LossFn,
        weights: Sequence[float] | None = None,
        prepare: Any = None,
    ) -> dict[str, float]: ...

    def forward_only(self, micro_batches: list[Any], weights: Sequence[float] | None, fn: Any) -> None: ...

    def save(self, directory: str | Path, extra: dict[str, Any] | None = None, tokenizer: Any = None) -> Path: ...

    def load(self, directory: str | Path) -> dict[str, Any]: ...

    def state_dict_for_sync(self) -> dict[str, Tensor]: ...


def make_trainer(model: nn.Module, cfg: TrainerConfig) -> Trainer:
    """The trainer for ``cfg.backend``; seeds python/numpy/torch with ``cfg.seed``."""
    if cfg.backend == "deepspeed":
        from rubricem_core.training.deepspeed_trainer import DeepSpeedTrainer

        return DeepSpeedTrainer(model, cfg)
    return TorchTrainer(model, cfg)


__all__ = [
    "CheckpointError",
    "LossFn",
    "MetricsAccumulator",
    "Trainer",
    "TrainerConfig",
    "TrainerConfigError",
    "latest_checkpoint",
    "load_checkpoint",
    "make_trainer",
    "save_checkpoint",
]
