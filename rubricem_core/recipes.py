"""The four training recipes of the paper as typed presets.

A recipe fixes what the RL step optimizes: which stages the judge writes adaptive rubrics for, how
stage scores turn into returns (Λ), and whether the reflection meta-policy is trained. ``baseline`` is
the DR Tulu objective (answer-only evolving rubrics, the answer reward broadcast to every token);
``ss_grpo`` adds rubrics for every stage with causal credit; ``meta_policy`` and ``full`` add reflection
training to each. The PPO clip and KL settings are the same for every recipe and live in ``RLConfig``
(rl.clip_low, rl.clip_high, rl.kl_coef).
"""

from __future__ import annotations

from typing import Any

import torch
from pydantic import BaseModel, ConfigDict, Field, field_validator

from rubricem_core.config.base import check_known
from rubricem_core.scaffold import STAGES
from rubricem_core.ssgrpo import LambdaSpecError, as_lambda

# A preset name ("causal", "discounted(0.9)"), {"name": ..., "gamma": ...}, or an explicit K×K matrix.
LambdaSpec = str | dict[str, Any] | list[list[float]]


class Recipe(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    name: str = Field(description="Recipe name, recorded with the run.")
    lambda_spec: LambdaSpec = Field(
        description="Credit matrix Λ: stage_local | terminal | causal | discounted(γ) | "
        "{name, gamma} | explicit 4×4 matrix (λ_kk = 1, zero below the diagonal).",
    )
    judged_stages: list[str] = Field(
        description="Stages the judge writes adaptive rubrics for; other stages score NaN (no rubrics).",
    )
    reflection: bool = Field(description="Train the reflection meta-policy and use the reflection bank.")

    @field_validator("lambda_spec")
    @classmethod
    def _valid_lambda(cls, value: LambdaSpec) -> LambdaSpec:
        try:
            as_lambda(value, len(STAGES))
        except LambdaSpecError as err:
            raise ValueError(str(err)) from None
        return value

    @field_validator("judged_stages")
    @classmethod
    def _valid_stages(cls, value: list[str]) -> list[str]:
        check_known(value, STAGES, "unknown stages {unknown}; expected a subset of {known}")
        if not value:
            raise ValueError("judged_stages must name at least one stage")
        if len(set(value)) != len(value):
            raise ValueError(f"judged_stages repeats a stage: {value}")
        return [s for s in STAGES if s in value]  # canonical stage order

    def lam(self) -> torch.Tensor:
        """Λ as a K×K float tensor."""
        return as_lambda(self.lambda_spec, len(STAGES))


RECIPES: dict[str, Recipe] = {
    "baseline": Recipe(name="baseline", lambda_spec="terminal", judged_stages=["answer"], reflection=False),
    "ss_grpo": Recipe(name="ss_grpo", lambda_spec="causal", judged_stages=list(STAGES), reflection=False),
    "meta_policy": Recipe(name="meta_policy", lambda_spec="terminal", judged_stages=["answer"], reflection=True),
    "full": Recipe(name="full", lambda_spec="causal", judged_stages=list(STAGES), reflection=True),
}


def recipe_names() -> list[str]:
    return list(RECIPES)


def get_recipe(name: str) -> Recipe:
    """A fresh copy of a preset recipe (callers may change fields without touching the preset)."""
    if name not in RECIPES:
        raise ValueError(f"unknown recipe {name!r}; expected one of {recipe_names()}")
    return RECIPES[name].model_copy(deep=True)
