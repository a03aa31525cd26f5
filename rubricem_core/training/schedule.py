"""Learning-rate schedule: linear warm-up, then cosine decay to a floor.

The multiplier is a small callable object rather than a closure, so LambdaLR's state_dict carries
its parameters and a resumed run continues on exactly the same curve.

On resume (``resume_schedule``, shared by both trainer backends) the checkpoint's curve is kept,
except its length: a config with another ``total_steps`` (a run extended with more RL windows or SFT
epochs) re-plans the curve for the new total from the checkpoint's step on.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch import Tensor
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LambdaLR

from rubricem_core.training.config import TrainerConfig

log = logging.getLogger(__name__)

SCHEDULE_KEYS: tuple[str, ...] = ("lr", "warmup_steps", "total_steps", "min_lr_ratio")


@dataclass
class WarmupCosine:
    """lr multiplier after ``step`` optimizer steps.

    Warm-up: (step + 1) / warmup_steps for step < warmup_steps, so the first update already moves
    (a zero-lr first step would waste a batch) and step warmup_steps - 1 runs at the peak.
    Decay: cosine from 1 at step = warmup_steps to min_lr_ratio at step = total_steps; constant after.
    """

    warmup_steps: int
    total_steps: int
    min_lr_ratio: float

    def __call__(self, step: int) -> float:
        if step < self.warmup_steps:
            return (step + 1) / self.warmup_steps
        decay_steps = max(1, self.total_steps - self.warmup_steps)
        progress = min(1.0, (step - self.warmup_steps) / decay_steps)
        return self.min_lr_ratio + (1.0 - self.min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def make_scheduler(optimizer: Optimizer, warmup_steps: int, total_steps: int, min_lr_ratio: float) -> LambdaLR:
    """A LambdaLR over ``optimizer`` (every param group follows the same curve)."""
    return LambdaLR(optimizer, WarmupCosine(warmup_steps, total_steps, min_lr_ratio))


def scheduler_settings(scheduler: LambdaLR) -> dict[str, Any] | None:
    """The schedule a (loaded) scheduler follows, in TrainerConfig's names; None if it is not ours."""
    curves = scheduler.lr_lambdas
    if not curves or not all(isinstance(c, WarmupCosine) for c in curves):
        return None
    curve = curves[0]
    return {
        "lr": scheduler.base_lrs[0],
        "warmup_steps": curve.warmup_steps,
        "total_steps": curve.total_steps,
        "min_lr_ratio": curve.min_lr_ratio,
    }


def retarget_total_steps(scheduler: LambdaLR, total_steps: int) -> None:
    """Re-plan the curve for ``total_steps``, staying at the scheduler's step: the lr of every step
    from here on is the one a fresh schedule planned for ``total_steps`` gives at that step."""
    for curve in scheduler.lr_lambdas:
        curve.total_steps = total_steps
    # what LambdaLR.step() would have set at this step, computed the same way (bit-exact with a fresh one)
    values = [base * curve(scheduler.last_epoch) for curve, base in zip(scheduler.lr_lambdas, scheduler.base_lrs)]
    for group, value in zip(scheduler.optimizer.param_groups, values):
        if isinstance(group["lr"], Tensor):
            group["lr"].fill_(value)
        else:
            group["lr"] = value
    scheduler._last_lr = [group["lr"] for group in scheduler.optimizer.param_groups]


def resume_schedule(scheduler: LambdaLR, cfg: TrainerConfig, directory: str | Path) -> None:
    """After a resume restored the checkpoint's scheduler: reconcile it with the current config.

    - ``total_steps`` follows the config when it differs and is not behind the checkpoint's step:
      extending a run extends its schedule (logged, naming both totals).
    - ``lr``, ``warmup_steps`` and ``min_lr_ratio`` keep the checkpoint's values (changing them would
      make the lr jump mid-run): a warning names what the config asked for instead of silently
      ignoring it. So does a total_steps behind the checkpoint's step.
    The loaded scheduler itself is compared, not the checkpoint's saved config: a checkpoint written
    after an earlier resume may carry a config that its schedule never followed.
    """
    saved = scheduler_settings(scheduler)
    if saved is None:
        return
    step = scheduler.last_epoch  # optimizer steps done (LambdaLR counts one per scheduler.step())
    changed = {k: (saved[k], getattr(cfg, k)) for k in SCHEDULE_KEYS if saved[k] != getattr(cfg, k)}
    if "total_steps" in changed and cfg.total_steps >= step:
        old, new = changed.pop("total_steps")
        retarget_total_steps(scheduler, new)
        log.info(
            "resuming from %s at step %d: the learning-rate schedule planned for %d total steps now runs to %d; "
            "from this step on the lr follows the %d-step curve as if it had been planned from the start "
            "(next lr %.3g)",
            directory,
            step,
            old,
            new,
            new,
            scheduler.get_last_lr()[0],
        )
    if changed:
        log.warning(
            "resuming from %s keeps its learning-rate schedule; these settings differ and are ignored "
            "(checkpoint, now): %s",
            directory,
            changed,
        )
