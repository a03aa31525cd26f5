"""Learning-rate schedule: linear warm-up, then cosine decay to a floor.

The multiplier is a small callable object rather than a closure, so LambdaLR's state_dict carries
its parameters and a resumed run continues on exactly the same curve.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from torch.optim import Optimizer
from torch.optim.lr_scheduler import LambdaLR


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
