"""Where an RL run stands on disk: its checkpoints, the step marked done, which steps the learning curve
keeps, and which reflections train at a step."""

from __future__ import annotations

import json
import logging
import shutil
from collections.abc import Sequence
from pathlib import Path

from rubricem_core.config import RunConfig
from rubricem_core.layout import holds_policy
from rubricem_core.rl.curriculum import reflection_source, schedule_length
from rubricem_core.rl.policy import reflection_on
from rubricem_core.store import RunStore, atomic_write_text

log = logging.getLogger(__name__)


def rl_dir(store: RunStore) -> Path:
    return store.layout.rl_checkpoints_dir


def step_checkpoint(store: RunStore, step: int) -> Path:
    return store.layout.rl_step_checkpoint(step)


def start_policy(store: RunStore) -> Path:
    final = store.layout.sft_final
    if not holds_policy(final):
        raise FileNotFoundError(f"no SFT checkpoint at {final}: run `rubricem sft` (or the pipeline) first")
    return final


def completed_step(store: RunStore) -> int:
    """The last RL step whose update is applied and whose tables are written (-1: none). Its
    checkpoint may be older (rl.checkpoint_every): the steps after the newest checkpoint are replayed
    from their tables, which must therefore be there."""
    path = store.layout.rl_progress_file
    if not path.exists():
        return -1
    step = int(json.loads(path.read_text())["completed_step"])
    missing = replay_gaps(store, newest_checkpoint(store, step), step)
    if missing:
        raise FileNotFoundError(
            f"{path} says step {step} is complete but its checkpoint is missing, and so are the tables a "
            f"resume replays its update from: {', '.join(missing[:4])}"
        )
    return step


def mark_step_done(store: RunStore, step: int) -> None:
    """Record that step ``step`` is done: its update is applied and every table it needs is written. Without
    a checkpoint of that step, a resume replays its update from those tables (replay_updates)."""
    atomic_write_text(store.layout.rl_progress_file, json.dumps({"completed_step": step}))


def prune_checkpoints(store: RunStore, keep: int, curve: Sequence[int] = ()) -> None:
    """Keep the newest ``keep`` step checkpoints (a resume needs only the newest; the rest are for
    inspection and evaluation) and those of the learning-curve steps ``curve``."""
    kept = {step_checkpoint(store, step) for step in curve}
    ckpts = sorted(p for p in rl_dir(store).glob("step-*") if p.is_dir())
    for old in ckpts[:-keep]:
        if old not in kept:
            shutil.rmtree(old, ignore_errors=True)


def has_checkpoint(store: RunStore, step: int) -> bool:
    return (step_checkpoint(store, step) / "checkpoint.json").exists()


def newest_checkpoint(store: RunStore, at_most: int) -> int:
    """The newest complete RL step checkpoint at or before step ``at_most`` (-1: none, the SFT policy)."""
    steps = [
        int(p.name.removeprefix("step-"))
        for p in rl_dir(store).glob("step-*")
        if p.name.removeprefix("step-").isdigit() and (p / "checkpoint.json").exists()
    ]
    return max((s for s in steps if s <= at_most), default=-1)


def last_step(cfg: RunConfig) -> int:
    """The run's last RL step (windowed_schedule: 2·K steps per window)."""
    return schedule_length(cfg.rl.window, cfg.rl.n_windows) - 1


def checkpoint_due(cfg: RunConfig, step: int) -> bool:
    """Whether step ``step`` writes a resumable checkpoint: every rl.checkpoint_every steps, every
    learning-curve step (rl.eval_every), and always the last one (evaluation and the flow's result read it)."""
    return (step + 1) % cfg.rl.checkpoint_every == 0 or step in curve_steps(cfg) or step >= last_step(cfg)


def curve_steps(cfg: RunConfig) -> list[int]:
    """The RL steps whose checkpoints make the learning curve (rl.eval_every; never pruned), the last
    step included; [] without rl.eval_every."""
    every = cfg.rl.eval_every
    if every is None:
        return []
    last = last_step(cfg)
    return sorted({*range(every - 1, last + 1, every), last})


def curve_checkpoints(store: RunStore, cfg: RunConfig, before_last: bool = False) -> list[Path]:
    """The learning-curve checkpoints a run has written (rl.eval_every), oldest first; ``before_last``
    leaves out the last step's (the final checkpoint, which evaluation takes last on its own)."""
    steps = [s for s in curve_steps(cfg) if not (before_last and s >= last_step(cfg))]
    return [step_checkpoint(store, step) for step in steps if has_checkpoint(store, step)]


def reflection_source_step(cfg: RunConfig, step: int) -> int | None:
    """The step whose reflection candidates the deferred reflection update of ``step`` trains on (the
    new-query step before it; flows/rl.py runs it in ``step``, before the step's task update); None:
    no reflection update in ``step``."""
    return reflection_source(step, cfg.rl.window) if reflection_on(cfg) else None


def replay_gaps(store: RunStore, checkpoint: int, step: int, cfg: RunConfig | None = None) -> list[str]:
    """The table partitions a resume from checkpoint ``checkpoint`` lacks to replay the updates of the
    steps after it up to ``step`` (with ``cfg``: the reflection updates' candidates too); empty: none."""
    steps = range(checkpoint + 1, step + 1)
    need = [(table, s) for s in steps for table in ("rollouts", "stage_rewards")]
    if cfg is not None:
        need += [("reflections", src) for s in steps if (src := reflection_source_step(cfg, s)) is not None]
    have = {table: set(store.partitions(table, "step")) for table in {t for t, _ in need}}
    return [f"{table}/step={s:04d}" for table, s in need if s not in have[table]]
