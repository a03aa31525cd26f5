"""Trainers with one interface (plain torch and DeepSpeed) and checkpoints with exact resume.

    trainer = make_trainer(model, TrainerConfig(lr=1e-4, total_steps=100))
    metrics = trainer.step(micro_batches, loss_fn)      # loss_fn(model, micro_batch) -> (loss, metrics)
    trainer.save(path, extra={"data_position": k});  extra = trainer.load(path)
    trainer.model                                        # the unwrapped HF model
    trainer.state_dict_for_sync()                        # full weights for a rollout engine

DeepSpeed is imported only when ``backend="deepspeed"`` is asked for.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import Tensor, nn

from rubricem_core.training.checkpoint import CheckpointError, latest_checkpoint, load_checkpoint, save_checkpoint
from rubricem_core.training.config import TrainerConfig, TrainerConfigError
from rubricem_core.training.torch_trainer import LossFn, TorchTrainer


class Trainer(Protocol):
    model: nn.Module
    global_step: int
    cfg: TrainerConfig
    backend: str
    device: torch.device

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
    "Trainer",
    "TrainerConfig",
    "TrainerConfigError",
    "latest_checkpoint",
    "load_checkpoint",
    "make_trainer",
    "save_checkpoint",
]
