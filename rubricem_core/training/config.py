"""Trainer settings shared by the plain-torch and DeepSpeed backends.

One dataclass, so SFT and RL (SS-GRPO) build it from their own pydantic sections and the two
backends read the same numbers. Every field carries its help text in ``metadata["help"]``.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

PRECISIONS = ("fp32", "bf16")
BACKENDS = ("torch", "deepspeed")


class TrainerConfigError(ValueError):
    """A TrainerConfig field is out of range; the message names the field."""


def _help(text: str, **kw: Any) -> Any:
    return field(metadata={"help": text}, **kw)


@dataclass
class TrainerConfig:
    lr: float = _help("Peak learning rate (reached at the end of warm-up).", default=1e-5)
    weight_decay: float = _help(
        "AdamW decoupled weight decay, applied to matrices only (not to biases or norm weights).", default=0.0
    )
    betas: tuple[float, float] = _help("AdamW (beta1, beta2).", default=(0.9, 0.95))
    eps: float = _help("AdamW epsilon.", default=1e-8)
    warmup_steps: int = _help("Optimizer steps of linear warm-up from lr/warmup_steps to lr.", default=0)
    total_steps: int = _help(
        "Optimizer steps of the whole run; the cosine reaches lr*min_lr_ratio after this many steps.",
        default=1000,
    )
    min_lr_ratio: float = _help("Final learning rate as a fraction of lr (cosine floor).", default=0.1)
    grad_accum_steps: int = _help(
        "Micro-batches per optimizer step that DeepSpeed's batch-size bookkeeping is told about. "
        "step() itself accumulates over however many micro-batches it is given (the last one is "
        "the accumulation boundary), so this only matters for DeepSpeed's logged sample counts.",
        default=1,
    )
    max_grad_norm: float = _help("Clip the global gradient 2-norm to this; 0 disables clipping.", default=1.0)
    precision: str = _help(
        "fp32, or bf16: torch backend = fp32 weights with bf16 autocast (falls back to fp32 with a "
        "warning where bf16 autocast does not work); deepspeed backend = bf16 weights with fp32 "
        "master weights in the optimizer.",
        default="fp32",
    )
    seed: int = _help("Seeds python, numpy and torch when the trainer is built.", default=0)
    backend: str = _help("torch (one process, plain AdamW) or deepspeed (ZeRO, any number of ranks).", default="torch")
    zero_stage: int = _help("DeepSpeed ZeRO stage 0-3 (deepspeed backend only).", default=1)
    offload: bool = _help(
        "DeepSpeed: keep optimizer state in CPU memory (ZeRO 1-3; the optimizer step runs on the CPU).",
        default=False,
    )
    offload_params: bool = _help(
        "DeepSpeed ZeRO-3: keep the parameter partitions in CPU memory too (fetched per layer).",
        default=False,
    )
    gradient_checkpointing: bool = _help(
        "Recompute activations in the backward pass (HF gradient checkpointing, non-reentrant): "
        "activation memory of the layer boundaries only, for about a third more compute.",
        default=False,
    )
    device: str = _help(
        "torch backend: 'auto' (cuda if available, else cpu), 'cpu', 'cuda', 'cuda:1', ...", default="auto"
    )
    deepspeed_overrides: dict[str, Any] = _help(
        "Keys merged (recursively) over the generated DeepSpeed config, e.g. "
        "{'zero_optimization': {'reduce_bucket_size': 5e8}}.",
        default_factory=dict,
    )

    def __post_init__(self) -> None:
        self.betas = tuple(self.betas)  # type: ignore[assignment]  # YAML gives lists; checked just below
        checks = [
            ("lr", self.lr > 0, "must be > 0"),
            ("weight_decay", self.weight_decay >= 0, "must be >= 0"),
            ("betas", len(self.betas) == 2 and all(0 <= b < 1 for b in self.betas), "must be two values in [0, 1)"),
            ("eps", self.eps > 0, "must be > 0"),
            ("warmup_steps", self.warmup_steps >= 0, "must be >= 0"),
            ("total_steps", self.total_steps >= 1, "must be >= 1"),
            ("min_lr_ratio", 0 <= self.min_lr_ratio <= 1, "must be in [0, 1]"),
            ("grad_accum_steps", self.grad_accum_steps >= 1, "must be >= 1"),
            ("max_grad_norm", self.max_grad_norm >= 0, "must be >= 0 (0 disables clipping)"),
            ("precision", self.precision in PRECISIONS, f"must be one of {PRECISIONS}"),
            ("backend", self.backend in BACKENDS, f"must be one of {BACKENDS}"),
            ("zero_stage", self.zero_stage in (0, 1, 2, 3), "must be 0, 1, 2 or 3"),
            (
                "offload",
                not self.offload or (self.backend == "deepspeed" and self.zero_stage >= 1),
                "needs backend='deepspeed' with zero_stage >= 1 (ZeRO-0 and the torch backend have no offload)",
            ),
            (
                "offload_params",
                not self.offload_params or (self.backend == "deepspeed" and self.zero_stage == 3),
                "needs backend='deepspeed' with zero_stage=3 (only ZeRO-3 partitions parameters)",
            ),
        ]
        for name, ok, why in checks:
            if not ok:
                raise TrainerConfigError(f"TrainerConfig.{name}={getattr(self, name)!r} {why}")

    @classmethod
    def help(cls) -> dict[str, str]:
        """Field name → help text (for CLIs and docs)."""
        return {f.name: f.metadata["help"] for f in fields(cls)}
