"""One SS-GRPO step, assembled in one place from the ``ssgrpo`` functions:

    ga = group_advantages(R, lam, failed)                  # per query: G = R Λᵀ, A = per-stage normalization
    rows = reward_rows(step, query_id, rollout_ids, ga)    # the step's `stage_rewards` (R, G, A), final
    batch = training_batch(rollouts, rows)                 # judged trajectories, a[i, t] = A[i, stage(t)]
    metrics = ss_grpo_update(trainer, ref_model, batch.trajectories, batch.token_advantages, pad_id, config)

The judge task writes ``reward_rows`` once; the update task trains on exactly those A values, so what
SQL shows is what was trained on. The update is one optimizer step over length-bucketed micro-batches
weighted by their policy tokens; each rank first recomputes the old logprobs with the trainer's model
(the gap to the engine's sampling logprobs is a metric) and the reference logprobs with the frozen
reference model for its own micro-batches.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from rubricem_core.batching import TokenBatch, bucket_batches, collate
from rubricem_core.config import RLConfig
from rubricem_core.judge.aggregate import stage_reward_rows
from rubricem_core.logprobs import token_logprobs
from rubricem_core.rl.records import rollout_trajectory
from rubricem_core.scaffold import STAGES
from rubricem_core.ssgrpo import policy_loss, stage_advantages, stage_returns, token_advantages
from rubricem_core.trajectory import TokenTrajectory


@dataclass(frozen=True)
class UpdateConfig:
    """The numbers of one clipped policy-gradient step besides its trajectories."""

    temperature: float = 1.0  # the sampling temperature the logprobs are taken at
    clip_low: float = 0.2  # ratios below 1 − clip_low (for a < 0) get no gradient
    clip_high: float = 0.2  # ratios above 1 + clip_high (for a > 0) get no gradient
    kl_coef: float = 0.001  # β of the k3 KL to the reference
    max_tokens_per_batch: int = 16384  # padded tokens per micro-batch

    @classmethod
    def from_rl(cls, rl: RLConfig, temperature: float) -> UpdateConfig:
        """The `rl` section's settings at the temperature the trained tokens were sampled with."""
        return cls(
            temperature=temperature,
            clip_low=rl.clip_low,
            clip_high=rl.clip_high,
            kl_coef=rl.kl_coef,
            max_tokens_per_batch=rl.max_tokens_per_batch,
        )


# ---- R → G → A ----------------------------------------------------------------------------------
@dataclass
class GroupAdvantages:
    R: np.ndarray  # n×K stage rewards (NaN: no rubric / failed judgment)
    G: np.ndarray  # n×K returns (NaN: no return)
    A: np.ndarray  # n×K advantages (NaN only on failed judgments: they get none, never 0)


def group_advantages(R: np.ndarray, lam: torch.Tensor, failed: Sequence[bool] | None = None) -> GroupAdvantages:
    """G = R Λᵀ and per-stage group-normalized A for one query's group; a failed judgment's row has
    no return and no advantage."""
    R_t = torch.as_tensor(np.asarray(R, dtype=np.float64))
    G = stage_returns(R_t, lam.to(R_t.dtype)).numpy()
    A = stage_advantages(torch.as_tensor(G)).numpy()
    if failed is not None and any(failed):
        rows = np.asarray(failed, dtype=bool)
        G, A = G.copy(), A.copy()
        G[rows], A[rows] = np.nan, np.nan
    return GroupAdvantages(R=np.asarray(R, dtype=np.float64), G=G, A=A)


def reward_rows(step: int, query_id: str, rollout_ids: Sequence[str], ga: GroupAdvantages) -> list[dict[str, Any]]:
    """The group's final `stage_rewards` rows: R, G and A, NULL where NaN."""
    return stage_reward_rows(step, query_id, rollout_ids, ga.R, G=ga.G, A=ga.A)


# ---- A → token advantages -----------------------------------------------------------------------
def per_token_advantages(traj: TokenTrajectory, A_row: Sequence[float]) -> list[float]:
    """Stage advantage on every trained token; 0 on prompt, tool output and stage-less tokens."""
    A = torch.as_tensor(np.asarray(A_row, dtype=np.float64)).view(1, -1)
    stage_ids = torch.tensor([traj.stage_ids], dtype=torch.long)
    mask = torch.tensor([traj.loss_mask])
    return token_advantages(A, stage_ids, mask)[0].tolist()


@dataclass
class TrainingBatch:
    """The judged trajectories of one step with their token advantages, and the reward statistics."""

    trajectories: list[TokenTrajectory] = field(default_factory=list)
    token_advantages: list[list[float]] = field(default_factory=list)
    stage_means: dict[str, float] = field(default_factory=dict)  # reward/{R,G,A}/{stage}_mean


def training_batch(rollouts: list[dict[str, Any]], rewards: list[dict[str, Any]]) -> TrainingBatch:
    """Every rollout whose judgment did not fail, in table order, with a[t] = A[stage(t)] from the
    step's `stage_rewards`; failed judgments are left out of the update (never scored 0)."""
    by_key = {(r["rollout_id"], r["stage"]): r for r in rewards}
    batch = TrainingBatch()
    stats: dict[str, list[float]] = {f"{m}/{s}": [] for m in ("R", "G", "A") for s in STAGES}
    for row in rollouts:
        if row["judge_failed"]:
            continue
        stage_rows = [by_key[(row["rollout_id"], s)] for s in STAGES]
        for s, reward in zip(STAGES, stage_rows):
            for name in ("R", "G", "A"):
                if reward[name] is not None:
                    stats[f"{name}/{s}"].append(float(reward[name]))
        traj = rollout_trajectory(row)
        batch.trajectories.append(traj)
        batch.token_advantages.append(per_token_advantages(traj, [r["A"] for r in stage_rows]))
    batch.stage_means = {f"reward/{k}_mean": float(np.mean(v)) for k, v in stats.items() if v}
    return batch


# ---- the loss and the optimizer step --------------------------------------------------------------
def make_loss_fn(config: UpdateConfig):
    def loss_fn(model: torch.nn.Module, batch: TokenBatch) -> tuple[torch.Tensor, dict[str, float]]:
        logp = token_logprobs(model, batch.input_ids, batch.attention_mask, temperature=config.temperature)
        loss, metrics = policy_loss(
            logp,
            batch.old_logprobs,
            batch.ref_logprobs,
            batch.advantages,
            batch.loss_mask.to(logp.dtype),
            clip_low=config.clip_low,
            clip_high=config.clip_high,
            kl_coef=config.kl_coef,
        )
        if batch.sampled_logprobs is not None:
            # engine vs trainer on the same weights: how far the sampler's numbers are from ours
            mask = batch.loss_mask.bool()
            gap = (batch.old_logprobs - batch.sampled_logprobs).abs()[mask]
            metrics["logprob_gap_mean"] = float(gap.mean()) if gap.numel() else 0.0
            metrics["logprob_gap_max"] = float(gap.max()) if gap.numel() else 0.0
        return loss, metrics

    return loss_fn


def _logprobs_on_model_device(model: torch.nn.Module, batch: TokenBatch, temperature: float) -> torch.Tensor:
    # The reference model may sit on another device than the trainer's batch.
    device = next(model.parameters()).device
    return token_logprobs(model, batch.input_ids.to(device), batch.attention_mask.to(device), temperature=temperature)


def make_prepare_fn(ref_model: torch.nn.Module | None, temperature: float):
    """Old logprobs recomputed by the trainer's model (in eval mode) and reference logprobs by the
    frozen reference, for the micro-batches of this rank, with the weights of before the step."""

    def prepare(model: torch.nn.Module, batch: TokenBatch) -> TokenBatch:
        was_training = model.training
        model.eval()
        old = token_logprobs(model, batch.input_ids, batch.attention_mask, temperature=temperature)
        model.train(was_training)
        batch.old_logprobs = old.float()
        if ref_model is not None:
            ref = _logprobs_on_model_device(ref_model, batch, temperature)
            batch.ref_logprobs = ref.to(old.device).float()
        return batch

    return prepare


def ss_grpo_update(
    trainer: Any,
    ref_model: torch.nn.Module | None,
    trajectories: list[TokenTrajectory],
    token_advs: list[list[float]],
    pad_id: int,
    config: UpdateConfig,
) -> dict[str, float]:
    """One optimizer step on the given (judged, non-failed) trajectories. On several ranks every rank
    passes the same trajectories; each computes old/reference logprobs and gradients for its shard."""
    if not trajectories:
        return {"skipped": 1.0}
    lengths = [len(t) for t in trajectories]
    micro: list[TokenBatch] = []
    for idx in bucket_batches(lengths, config.max_tokens_per_batch):
        trajs = [trajectories[i] for i in idx]
        sampled = [[0.0 if (m == 0 or math.isnan(lp)) else lp for m, lp in zip(t.loss_mask, t.logprobs)] for t in trajs]
        micro.append(
            collate(trajs, pad_id, extras={"advantages": [token_advs[i] for i in idx], "sampled_logprobs": sampled})
        )
    metrics = trainer.step(
        micro,
        make_loss_fn(config),
        weights=[float(b.loss_mask.sum()) for b in micro],
        prepare=make_prepare_fn(ref_model, config.temperature),
    )
    metrics["policy_tokens"] = float(sum(int(b.loss_mask.sum()) for b in micro))
    return {k: float(v) for k, v in metrics.items() if isinstance(v, (int, float))}
