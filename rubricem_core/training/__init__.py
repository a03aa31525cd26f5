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

from torch import nn

from rubricem_core.training.checkpoint import CheckpointError, latest_checkpoint, load_checkpoint, save_checkpoint
from rubricem_core.training.config import TrainerConfig, TrainerConfigError
from rubricem_core.training.step import LossFn, MetricsAccumulator, Trainer
from rubricem_core.training.torch_trainer import TorchTrainer


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
