"""Windowed curriculum: K steps of fresh batches, then the same K batches replayed.

New-query steps retrieve reflections across episodes (similar other queries); replay steps retrieve
the query's own reflection (within-episode). The schedule is a pure function of its inputs, so a
resumed run sees exactly the batches an uninterrupted run would.
"""

from __future__ import annotations

import random
from dataclasses import dataclass


@dataclass(frozen=True)
class StepPlan:
    step: int
    window: int
    phase: str  # "new" | "repeat"
    retrieval: str  # "cross" | "within" | "none"
    query_ids: tuple[str, ...]
    # a new-query step of a recipe with the reflection loop: reflections are written on its rollouts
    # (and the next step's deferred reflection update trains on them)
    reflects: bool = False


def windowed_schedule(
    query_ids: list[str],
    window: int,
    n_windows: int,
    queries_per_step: int,
    seed: int,
    reflection: bool = True,
) -> list[StepPlan]:
    """2·K·n_windows steps. Fresh batches walk a seeded shuffle of the queries (reshuffled on each
    pass), so every query is used before any repeats. Without reflection, retrieval is ``none``."""
    if not query_ids:
        raise ValueError("the RL curriculum needs at least one training query")
    if window < 1 or n_windows < 1 or queries_per_step < 1:
        raise ValueError("window, n_windows and queries_per_step must be >= 1")
    rng = random.Random(seed)
    order: list[str] = []
    cursor = 0

    def next_batch() -> tuple[str, ...]:
        nonlocal order, cursor
        batch: list[str] = []
        while len(batch) < min(queries_per_step, len(query_ids)):
            if cursor >= len(order):
                order = sorted(query_ids)
                rng.shuffle(order)
                cursor = 0
            if order[cursor] not in batch:
                batch.append(order[cursor])
            cursor += 1
        return tuple(batch)

    plans: list[StepPlan] = []
    step = 0
    for w in range(n_windows):
        fresh = [next_batch() for _ in range(window)]
        for batch in fresh:
            plans.append(StepPlan(step, w, "new", "cross" if reflection else "none", batch, reflects=reflection))
            step += 1
        for batch in fresh:
            plans.append(StepPlan(step, w, "repeat", "within" if reflection else "none", batch))
            step += 1
    return plans


def schedule_length(window: int, n_windows: int) -> int:
    """Steps of a windowed schedule: 2·K per window."""
    return 2 * window * n_windows


def replay_source_step(step: int, window: int) -> int | None:
    """The new-query step whose batch replay step ``step`` repeats; None for a new-query step.
    windowed_schedule lays each window out as K new steps, then their K replays in the same order."""
    return step - window if step % (2 * window) >= window else None


def reflection_source(step: int, window: int) -> int | None:
    """The step whose reflection candidates the deferred reflection update trains on during ``step``
    (applied before that step's task update): the step before, when it was a new-query step; None: no
    reflection update in ``step``."""
    if step < 1 or replay_source_step(step - 1, window) is not None:
        return None
    return step - 1


def sampling_step(step: int, async_steps: int) -> int:
    """The step whose weights sample step ``step``'s rollouts (-1: the SFT policy): the step before it
    on-policy, one earlier with one-step asynchronous RL (rl.async_steps: 1; its rollouts sample while
    the previous step's update runs)."""
    return max(step - 1 - async_steps, -1)


def reflect_before_next_rollouts(plan: StepPlan, next_plan: StepPlan | None, window: int) -> bool:
    """With one-step asynchronous RL the engine writes step ``plan``'s reflections and samples
    ``next_plan``'s rollouts during ``plan``'s update, one after the other: rollouts first, so they start
    at once and retrieve from the bank of the steps before ``plan``, unless ``next_plan`` replays
    ``plan`` (rl.window: 1), whose within-episode retrieval needs ``plan``'s reflections banked first."""
    return next_plan is not None and replay_source_step(next_plan.step, window) == plan.step
