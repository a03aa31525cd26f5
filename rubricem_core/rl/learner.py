"""A step's updates, in the one order every path applies them:

    for update in step_updates(cfg, step):                 # the deferred reflection update, then SS-GRPO
        batch, settings = update_inputs(store, cfg, update, tokenizer.decode)  # from the tables that mark them done
        metrics = policy.update(batch.trajectories, batch.token_advantages, settings)

The live tasks apply one each (reflection-update, then ss-grpo-update: rl.steps) and a rebuilt session
replays them from the tables (rl.session.replay_updates), so the weights, optimizer state, schedule and
RNG of a resumed run are the uninterrupted run's: same inputs, same calls, same order.
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
