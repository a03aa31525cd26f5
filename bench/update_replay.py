"""A run's RL updates applied again, in the learner's order, to a fresh copy of a policy: what the replay
scripts (reflection_tag_replay.py, search_decision_replay.py) measure after each update.

The run is only read: each update's batch is the one its tables hold (`rl.learner.update_inputs`), so the
replay trains on what the run trained on. About 1–1.5 minutes an update on 2 CPU cores (SmolLM2-135M).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any


def replay_arguments(
    description: str, run: str, steps: int, probe_steps: str, probe_help: str
) -> argparse.ArgumentParser:
    """The options every replay script takes: the run, the starting policy, how many steps, which are probed."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--run-dir", type=Path, required=True, help=run)
    parser.add_argument("--checkpoint", type=Path, help="the policy to start from (default: the run's SFT policy)")
    parser.add_argument("--steps", type=int, default=steps, help="replay the updates of steps 0..N-1")
    parser.add_argument("--probe-steps", default=probe_steps, help=probe_help)
    return parser


RowsHook = Callable[[list[dict[str, Any]]], list[dict[str, Any]]]


@dataclass
class ReplayedUpdate:
    label: str  # e.g. "task update on step 3's rollouts"
    kind: str  # reflection | task
    source_step: int
    lr: float
    grad_norm: float
    batch: Any  # the TrainingBatch it trained on


class UpdateReplay:
    """The run's config, tables and a policy loaded from ``checkpoint`` (its SFT policy by default)."""

    def __init__(self, run_dir: Path, checkpoint: Path | None = None, rl: dict[str, Any] | None = None) -> None:
        """``rl``: `rl` fields to replay with instead of the run's (e.g. ``{"stage_boundary": "leaving"}``)."""
        from rubricem_core.rl.policy import LocalPolicy
        from rubricem_core.run_config import stored_config
        from rubricem_core.store import RunStore

        self.run_dir = run_dir
        cfg = stored_config(run_dir)
        if cfg is None:
            raise SystemExit(f"{run_dir}: no config.yaml (not a run directory)")
        if rl:
            cfg = cfg.model_copy(update={"rl": cfg.rl.model_copy(update=rl)})
        self.cfg = cfg
        self.store = RunStore(run_dir)
        self.policy = LocalPolicy(checkpoint or run_dir / "checkpoints" / "sft" / "final", self.cfg)
        self.tokenizer = self.policy.tokenizer

    def updates(self, n_steps: int, reflection_rows: RowsHook | None = None) -> Iterator[ReplayedUpdate]:
        """Applies the updates of steps 0..n_steps-1 one by one, yielding each after it is applied.
        ``reflection_rows`` may rewrite a reflection update's `reflections` rows before its batch is built."""
        from rubricem_core.rl.learner import step_updates, update_inputs, update_settings
        from rubricem_core.rl.update import reflection_training_batch

        for step in range(n_steps):
            for update in step_updates(self.cfg, step):
                if update.kind == "reflection" and reflection_rows is not None:
                    rows = reflection_rows(self.store.read_rows("reflections", {"step": update.source_step}))
                    batch = reflection_training_batch(rows)
                    settings = update_settings(self.cfg, self.cfg.reflection.temperature)
                else:
                    batch, settings = update_inputs(self.store, self.cfg, update, self.tokenizer.decode)
                metrics = self.policy.update(batch.trajectories, batch.token_advantages, settings)
                what = "candidates" if update.kind == "reflection" else "rollouts"
                yield ReplayedUpdate(
                    label=f"{update.kind} update on step {update.source_step}'s {what}",
                    kind=update.kind,
                    source_step=update.source_step,
                    lr=float(metrics["lr"]),
                    grad_norm=float(metrics["grad_norm"]),
                    batch=batch,
                )

    def next_token_logp(self, contexts: list[list[int]], token_ids: list[int]) -> list[list[float]]:
        """log p(token | context) for each context (rows) and token (columns), at the policy's weights now."""
        import torch

        model = self.policy.trainer.model
        model.eval()
        out = []
        with torch.no_grad():
            for ids in contexts:
                logp = torch.log_softmax(model(torch.tensor([ids])).logits[0, -1].float(), -1)
                out.append([float(logp[t]) for t in token_ids])
        model.train()
        return out
