"""One SS-GRPO update: stage rewards → returns → advantages → token advantages → clipped loss.

Reads top to bottom: per group, G = R Λᵀ and A = per-stage normalization; every policy token of stage
k gets A[i, k]; then one optimizer step over length-bucketed micro-batches weighted by their policy
tokens, in which each rank first recomputes the old logprobs with the trainer's model (the gap to the
engine's sampling logprobs is a metric) and the reference logprobs with the frozen reference model for
its own micro-batches.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from rubricem_core.batching import TokenBatch, bucket_batches, collate
from rubricem_core.logprobs import token_logprobs
from rubricem_core.ssgrpo import policy_loss, stage_advantages, stage_returns
from rubricem_core.trajectory import TokenTrajectory


@dataclass
class GroupAdvantages:
    R: np.ndarray  # n×K stage rewards (NaN: no rubric / failed judgment)
    G: np.ndarray  # n×K returns
    A: np.ndarray  # n×K advantages


def group_advantages(R: np.ndarray, lam: torch.Tensor) -> GroupAdvantages:
    R_t = torch.as_tensor(np.asarray(R, dtype=np.float64))
    G = stage_returns(R_t, lam.to(R_t.dtype))
    A = stage_advantages(G)
    return GroupAdvantages(R=np.asarray(R, dtype=np.float64), G=G.numpy(), A=A.numpy())


def per_token_advantages(traj: TokenTrajectory, A_row: np.ndarray) -> list[float]:
    """Stage advantage on every trained token; 0 on prompt, tool output and stage-less tokens."""
    out = []
    for mask, stage in zip(traj.loss_mask, traj.stage_ids):
        out.append(float(A_row[stage]) if mask and stage >= 0 else 0.0)
    return out


def make_loss_fn(temperature: float, clip_low: float, clip_high: float, kl_coef: float):
    def loss_fn(model: torch.nn.Module, batch: TokenBatch) -> tuple[torch.Tensor, dict[str, float]]:
        logp = token_logprobs(model, batch.input_ids, batch.attention_mask, temperature=temperature)
        loss, metrics = policy_loss(
            logp, batch.old_logprobs, batch.ref_logprobs, batch.advantages, batch.loss_mask.to(logp.dtype),
            clip_low=clip_low, clip_high=clip_high, kl_coef=kl_coef,
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
    max_tokens_per_batch: int,
    temperature: float,
    clip_low: float,
    clip_high: float,
    kl_coef: float,
) -> dict[str, float]:
    """One optimizer step on the given (judged, non-failed) trajectories. On several ranks every rank
    passes the same trajectories; each computes old/reference logprobs and gradients for its shard."""
    if not trajectories:
        return {"skipped": 1.0}
    lengths = [len(t) for t in trajectories]
    micro: list[TokenBatch] = []
    for idx in bucket_batches(lengths, max_tokens_per_batch):
        trajs = [trajectories[i] for i in idx]
        sampled = [[0.0 if (m == 0 or math.isnan(lp)) else lp for m, lp in zip(t.loss_mask, t.logprobs)] for t in trajs]
        micro.append(collate(trajs, pad_id, extras={"advantages": [token_advs[i] for i in idx],
                                                    "sampled_logprobs": sampled}))
    metrics = trainer.step(micro, make_loss_fn(temperature, clip_low, clip_high, kl_coef),
                           weights=[float(b.loss_mask.sum()) for b in micro],
                           prepare=make_prepare_fn(ref_model, temperature))
    metrics["policy_tokens"] = float(sum(int(b.loss_mask.sum()) for b in micro))
    return {k: float(v) for k, v in metrics.items() if isinstance(v, (int, float))}
