"""One SS-GRPO update: stage rewards → returns → advantages → token advantages → clipped loss.

Reads top to bottom: per group, G = R Λᵀ and A = per-stage normalization; every policy token of stage
k gets A[i, k]; old logprobs are recomputed by the trainer's model (the gap to the engine's sampling
logprobs is a metric), reference logprobs by the frozen reference model; then one optimizer step over
length-bucketed micro-batches weighted by their policy tokens.
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
        return loss, metrics

    return loss_fn


def _logprobs_on_model_device(model: torch.nn.Module, batch: TokenBatch, temperature: float) -> torch.Tensor:
    # Batches are collated on the CPU; the trainer's and reference models may sit on a GPU.
    device = next(model.parameters()).device
    return token_logprobs(model, batch.input_ids.to(device), batch.attention_mask.to(device), temperature=temperature)


@torch.no_grad()
def _fill_logprobs(batch: TokenBatch, model: torch.nn.Module, ref_model: torch.nn.Module | None,
                   temperature: float) -> dict[str, float]:
    sampled = batch.old_logprobs  # collate() got the engine's sampling logprobs here
    was_training = model.training
    model.eval()
    old = _logprobs_on_model_device(model, batch, temperature).to(sampled.device)
    model.train(was_training)
    mask = batch.loss_mask.bool()
    gap = (old - sampled).abs()[mask]
    batch.old_logprobs = old.float()
    if ref_model is not None:
        batch.ref_logprobs = _logprobs_on_model_device(ref_model, batch, temperature).to(sampled.device).float()
    return {"gap_sum": float(gap.sum()), "gap_max": float(gap.max()) if gap.numel() else 0.0, "n": int(mask.sum())}


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
    """One optimizer step on the given (judged, non-failed) trajectories."""
    if not trajectories:
        return {"skipped": 1.0}
    lengths = [len(t) for t in trajectories]
    micro: list[TokenBatch] = []
    gap_sum = gap_max = 0.0
    n_tok = 0
    for idx in bucket_batches(lengths, max_tokens_per_batch):
        trajs = [trajectories[i] for i in idx]
        sampled = [[0.0 if (m == 0 or math.isnan(lp)) else lp for m, lp in zip(t.loss_mask, t.logprobs)] for t in trajs]
        batch = collate(trajs, pad_id, extras={"advantages": [token_advs[i] for i in idx], "old_logprobs": sampled})
        stats = _fill_logprobs(batch, trainer.model, ref_model, temperature)
        gap_sum += stats["gap_sum"]
        gap_max = max(gap_max, stats["gap_max"])
        n_tok += stats["n"]
        micro.append(batch)
    loss_fn = make_loss_fn(temperature, clip_low, clip_high, kl_coef)
    metrics = trainer.step(micro, loss_fn, weights=[float(b.loss_mask.sum()) for b in micro])
    metrics["logprob_gap_mean"] = gap_sum / max(1, n_tok)
    metrics["logprob_gap_max"] = gap_max
    metrics["policy_tokens"] = float(n_tok)
    return {k: float(v) for k, v in metrics.items() if isinstance(v, (int, float))}
