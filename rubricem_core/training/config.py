"""The trainers' config: the ``sft``/``rl`` sections' TrainerSettings plus the run's own numbers.

TrainerSettings (rubricem_core/config/) declares every setting a user sets in a training section
(backend, ZeRO stage, precision, offload, lr, warm-up, ...); TrainerConfig adds what the run derives
(total steps, seed) or only code sets (AdamW betas/eps, device, DeepSpeed overrides), so SFT and RL build
it with ``TrainerConfig.from_settings(section, total_steps=..., seed=...)`` and both backends read the
same numbers. A bad value raises TrainerConfigError naming the field.
"""

from __future__ import annotations

from typing import Any

from pydantic import Field, ValidationError, field_validator

from rubricem_core.config import TrainerSettings


class TrainerConfigError(ValueError):
    """A TrainerConfig field is out of range; the message names the field."""


class TrainerConfig(TrainerSettings):
    betas: tuple[float, float] = Field(default=(0.9, 0.95), description="AdamW (beta1, beta2), each in [0, 1).")
    eps: float = Field(default=1e-8, gt=0, description="AdamW epsilon.")
    total_steps: int = Field(
        default=1000,
        ge=1,
        description="Optimizer steps of the whole run; the cosine reaches lr*min_lr_ratio after this many steps.",
    )
    grad_accum_steps: int = Field(
        default=1,
        ge=1,
        description="Micro-batches per optimizer step that DeepSpeed's batch-size bookkeeping is told about. "
        "step() itself accumulates over however many micro-batches it is given (the last one is the "
        "accumulation boundary), so this only matters for DeepSpeed's logged sample counts.",
    )
    seed: int = Field(default=0, description="Seeds python, numpy and torch when the trainer is built.")
    device: str = Field(
        default="auto", description="torch backend: 'auto' (cuda if available, else cpu), 'cpu', 'cuda', 'cuda:1', ..."
    )
    deepspeed_overrides: dict[str, Any] = Field(
        default_factory=dict,
        description="Keys merged (recursively) over the generated DeepSpeed config, e.g. "
        "{'zero_optimization': {'reduce_bucket_size': 5e8}}.",
    )

    def __init__(self, **data: Any) -> None:
        try:
            super().__init__(**data)
        except ValidationError as error:
            raise TrainerConfigError(_describe(error, data)) from None

    @field_validator("betas")
    @classmethod
    def _betas_in_range(cls, betas: tuple[float, float]) -> tuple[float, float]:
        if not all(0 <= b < 1 for b in betas):
            raise ValueError("must be two values in [0, 1)")
        return betas

    @classmethod
    def from_settings(cls, settings: TrainerSettings, **run: Any) -> TrainerConfig:
        """The trainer's config for a training section (``cfg.sft``, ``cfg.rl``): its TrainerSettings fields
        copied by name, ``run`` (total_steps, seed, ...) set or overriding."""
        shared = {name: getattr(settings, name) for name in TrainerSettings.model_fields}
        return cls(**{**shared, **run})

    @classmethod
    def help(cls) -> dict[str, str]:
        """Field name → help text (for CLIs and docs)."""
        return {name: field.description or "" for name, field in cls.model_fields.items()}


def _describe(error: ValidationError, data: dict[str, Any]) -> str:
    """``TrainerConfig.<field>=<value> <why>`` for the first problem pydantic found."""
    first = error.errors()[0]
    why = first["msg"].removeprefix("Value error, ")
    if not first["loc"]:  # a check across fields: its message starts with the field it is about
        return f"TrainerConfig.{why}"
    name, *inner = map(str, first["loc"])
    where = f" (at {name}[{']['.join(inner)}])" if inner else ""
    return f"TrainerConfig.{name}={data.get(name)!r} {why}{where}"
