"""Parameter sizes that also hold for ZeRO-3 placeholders (a parameter built under ``zero.Init`` is
1-D and empty on every rank; DeepSpeed keeps its real shape in ``ds_shape``/``ds_numel``).

The trainers and zero_init.py read these; they live apart so that neither trainer imports zero_init.py
(which builds on the DeepSpeed trainer's config): no import cycle.
"""

from __future__ import annotations

import torch


def is_partitioned(model: torch.nn.Module) -> bool:
    """True for a module built under ``zero.Init`` (its parameters carry DeepSpeed ids)."""
    return any(hasattr(p, "ds_id") for p in model.parameters())


def full_numel(p: torch.nn.Parameter) -> int:
    """A parameter's size, also for a ZeRO-3 placeholder (whose own numel is 0)."""
    return int(getattr(p, "ds_numel", p.numel()))


def full_ndim(p: torch.nn.Parameter) -> int:
    """A parameter's number of dimensions, also for a ZeRO-3 placeholder (which is 1-D and empty)."""
    shape = getattr(p, "ds_shape", None)
    return len(shape) if shape is not None else p.ndim
