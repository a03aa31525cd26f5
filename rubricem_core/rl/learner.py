"""A step's updates, in the one order every path applies them:

    for update in step_updates(cfg, step):                 # the deferred reflection update, then SS-GRPO
        batch, settings = update_inputs(store, cfg, update, tokenizer.decode)  # from the tables that mark them done
        metrics = policy.update(batch.trajectories, batch.token_advantages, settings)

The live tasks apply one each (reflection-update, then ss-grpo-update: rl.steps) and a rebuilt session
replays them from the tables (rl.session.replay_updates), so the weights, optimizer state, schedule and
RNG of a resumed run are the uninterrupted run's: same inputs, same calls, same order.

That order also names the weights: a ``WeightsVersion`` says how far along it a set of weights is, for the
trainer and for the engine alike, so "which updates does this hold" is one comparison, not a set of flags.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from rubricem_core.config import RunConfig
from rubricem_core.rl.progress import reflection_source_step
from rubricem_core.rl.update import TrainingBatch, UpdateConfig, reflection_training_batch, training_batch
from rubricem_core.store import RunStore


@dataclass(frozen=True)
class StepUpdate:
    """One optimizer update of a step: ``kind`` reflection (GRPO on the reflection tokens of
    ``source_step``'s candidates) or task (SS-GRPO on ``source_step``'s judged rollouts, the step's own)."""

    kind: Literal["reflection", "task"]
    step: int  # the step it is applied in
    source_step: int  # the step whose tables it trains on


@dataclass(frozen=True, order=True)
class WeightsVersion:
    """How far along the run's ordered updates a set of weights is: every update of the steps ≤ ``step``
    (-1: the SFT policy), then the first ``of_next`` updates of step ``step`` + 1 (1: its deferred
    reflection update, applied before its task update). Ordered as the updates are applied."""

    step: int
    of_next: int = 0

    def __str__(self) -> str:
        return f"step {self.step}" + (f" + {self.of_next} update(s) of step {self.step + 1}" if self.of_next else "")


def updates_between(
    cfg: RunConfig, start: WeightsVersion, end: WeightsVersion
) -> list[tuple[StepUpdate, WeightsVersion]]:
    """The updates that bring weights at ``start`` to ``end``, in order, each with the version it leaves."""
    out: list[tuple[StepUpdate, WeightsVersion]] = []
    for step in range(start.step + 1, end.step + 2):
        updates = step_updates(cfg, step)
        for i, update in enumerate(updates):
            before = WeightsVersion(step - 1, i)
            after = WeightsVersion(step, 0) if i + 1 == len(updates) else WeightsVersion(step - 1, i + 1)
            if start <= before and after <= end:
                out.append((update, after))
    return out


def step_updates(cfg: RunConfig, step: int) -> list[StepUpdate]:
    """The updates applied during ``step``, in order: the deferred reflection update on the new-query
    step before it (curriculum.reflection_source; recipes with the reflection loop), then SS-GRPO."""
    source = reflection_source_step(cfg, step)
    reflection = [StepUpdate("reflection", step, source)] if source is not None else []
    return [*reflection, StepUpdate("task", step, step)]


def update_settings(cfg: RunConfig, temperature: float) -> UpdateConfig:
    """The update's settings from the `rl` section, at the temperature the trained tokens were sampled with."""
    return UpdateConfig.from_rl(cfg.rl, temperature)


def update_inputs(
    store: RunStore, cfg: RunConfig, update: StepUpdate, decode: Callable[[list[int]], str]
) -> tuple[TrainingBatch, UpdateConfig]:
    """The batch and settings of ``update``, from the tables its source step wrote (`reflections`; or
    `rollouts` and `stage_rewards`); ``decode`` (the policy tokenizer's) finds each stage's opening tag
    under `rl.stage_boundary: leaving`."""
    key = {"step": update.source_step}
    if update.kind == "reflection":
        batch = reflection_training_batch(store.read_rows("reflections", key))
        return batch, update_settings(cfg, cfg.reflection.temperature)
    leaving = decode if cfg.rl.stage_boundary == "leaving" else None
    batch = training_batch(store.read_rows("rollouts", key), store.read_rows("stage_rewards", key), leaving)
    return batch, update_settings(cfg, cfg.rollout.temperature)
