"""Stage-structured GRPO: stage scores → returns → group advantages → token advantages → PPO loss.

For one group of ``n`` rollouts of a query with stage scores ``R`` (n×K, K = 4 stages in
``scaffold.STAGES`` order) and a credit matrix Λ (K×K):

    G = R Λᵀ                                   stage returns  (stage_returns)
    A[:, k] = (G[:, k] − mean) / (std + ε)      per stage, across the group  (stage_advantages)
    a[i, t] = A[i, stage_ids[i, t]]             every generated token of stage k  (token_advantages)
    loss = Σ_tokens [−min(ρa, clip(ρ)a) + β·k3] / #tokens   (policy_loss)

Missing scores (NaN) — the one rule every function here follows:

* ``R[i, k]`` is NaN when stage k of rollout i has no score: the stage had no rubrics for this query
  (its whole column is NaN) or the judgment of rollout i failed (its whole row is NaN).
* In ``stage_returns`` a missing score contributes 0 to other stages' returns. ``G[i, k]`` itself is
  NaN ("no return") when stage k's own score is part of its return (λ_kk ≠ 0) and is missing, or when
  every score it would sum (λ_kj ≠ 0) is missing. So a stage with no rubrics gets no return under any
  validated Λ (λ_kk = 1), while under ``terminal`` (λ_kk = 0 below the answer) every stage still
  receives the answer score — the DR Tulu broadcast. With ``unscored="downstream"``
  (rl.unscored_stage_return) only the second rule holds: under ``causal`` a stage with no rubrics gets
  the sum of the later stages' scores. A failed row is NaN everywhere.
* In ``stage_advantages`` NaN returns are left out of their stage's mean/std and get advantage 0;
  a stage with fewer than two returns, or whose returns are all equal, gives 0 to every rollout.
* Advantages are therefore always finite, and ``token_advantages``/``policy_loss`` never see NaN
  from here. ``policy_loss`` still ignores whatever sits at masked positions (old logprobs are NaN
  for tokens that were never sampled).
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from rubricem_core.scaffold import STAGES

LAMBDA_PRESETS: tuple[str, ...] = ("stage_local", "terminal", "causal", "discounted")
# Caps exp() of a log-ratio so one wild token cannot turn the loss into inf (verl does the same).
_MAX_LOG_RATIO = 20.0


class LambdaSpecError(ValueError):
    """A credit matrix Λ (name, dict or explicit matrix) is invalid; the message says which entry."""


# ----------------------------------------------------------------------------------------- Λ ----


def lambda_matrix(name: str, K: int = len(STAGES), gamma: float | None = None) -> torch.Tensor:
    """A K×K preset credit matrix; row k says which stage scores make up stage k's return.

    ``stage_local``: identity. ``terminal``: λ_kj = 1{j = K−1} (every stage gets the answer score).
    ``causal``: λ_kj = 1 for j ≥ k. ``discounted``: λ_kj = γ^(j−k) for j ≥ k (``gamma`` required).
    """
    if not isinstance(K, int) or K < 1:
        raise LambdaSpecError(f"K must be a positive int, got {K!r}")
    if name not in LAMBDA_PRESETS:
        raise LambdaSpecError(f"unknown lambda preset {name!r}; expected one of {list(LAMBDA_PRESETS)}")
    if name != "discounted" and gamma is not None:
        raise LambdaSpecError(f"gamma applies only to the 'discounted' preset, not {name!r}")
    if name == "stage_local":
        return torch.eye(K)
    if name == "terminal":
        lam = torch.zeros(K, K)
        lam[:, K - 1] = 1.0
        return lam
    if name == "causal":
        return torch.ones(K, K).triu()
    if gamma is None:
        raise LambdaSpecError("the 'discounted' preset needs gamma, e.g. {'name': 'discounted', 'gamma': 0.9}")
    if isinstance(gamma, bool) or not isinstance(gamma, (int, float)) or not 0.0 <= gamma <= 1.0:
        raise LambdaSpecError(f"discounted gamma must be a number in [0, 1], got {gamma!r}")
    k = torch.arange(K)
    offset = (k.view(1, K) - k.view(K, 1)).clamp(min=0).double()  # j − k above the diagonal
    return (float(gamma) ** offset).triu().float()


_DISCOUNTED_CALL = re.compile(r"^\s*discounted\s*\(\s*([^)]*?)\s*\)\s*$")


def as_lambda(spec: Any, K: int = len(STAGES)) -> torch.Tensor:
    """Λ from a preset name (``"causal"``, ``"discounted(0.9)"``), a dict ``{"name", "gamma"}``, or an
    explicit K×K matrix (list of lists or tensor), validated: square K×K, finite, λ_kk = 1, λ_kj = 0
    for j < k (a stage never takes credit from an earlier one)."""
    if isinstance(spec, str):
        call = _DISCOUNTED_CALL.match(spec)
        if call:
            try:
                gamma = float(call.group(1))
            except ValueError:
                raise LambdaSpecError(f"lambda spec {spec!r}: gamma {call.group(1)!r} is not a number") from None
            return lambda_matrix("discounted", K, gamma)
        return lambda_matrix(spec, K)
    if isinstance(spec, Mapping):
        unknown = set(spec) - {"name", "gamma"}
        if unknown:
            raise LambdaSpecError(f"lambda spec has unknown keys {sorted(unknown)}; allowed: name, gamma")
        if "name" not in spec:
            raise LambdaSpecError(f"lambda spec dict needs a 'name' (one of {list(LAMBDA_PRESETS)})")
        return lambda_matrix(spec["name"], K, spec.get("gamma"))
    if isinstance(spec, torch.Tensor) or (isinstance(spec, Sequence) and not isinstance(spec, (str, bytes))):
        return _validate_explicit(spec, K)
    raise LambdaSpecError(
        f"lambda spec must be a preset name, a {{'name', 'gamma'}} dict or a K×K matrix, got {type(spec).__name__}"
    )


def _validate_explicit(spec: Any, K: int) -> torch.Tensor:
    if isinstance(spec, torch.Tensor):
        lam = spec.detach().to("cpu", torch.float64)
    else:
        rows = list(spec)
        if len(rows) != K:
            raise LambdaSpecError(f"explicit lambda must be {K}×{K}; it has {len(rows)} rows")
        for k, row in enumerate(rows):
            if isinstance(row, (str, bytes)) or not isinstance(row, Sequence) or len(row) != K:
                size = len(row) if isinstance(row, Sequence) else type(row).__name__
                raise LambdaSpecError(f"explicit lambda must be {K}×{K}; row {k} is {size!r}")
            for j, value in enumerate(row):
                if isinstance(value, bool) or not isinstance(value, (int, float)):
                    raise LambdaSpecError(f"lambda[{k}][{j}] = {value!r} is not a number")
        lam = torch.tensor(rows, dtype=torch.float64)
    if lam.shape != (K, K):
        raise LambdaSpecError(f"explicit lambda must be {K}×{K}, got shape {tuple(lam.shape)}")
    for k in range(K):
        for j in range(K):
            value = lam[k, j].item()
            if not math.isfinite(value):
                raise LambdaSpecError(f"lambda[{k}][{j}] = {value} is not finite")
            if j < k and value != 0.0:
                raise LambdaSpecError(
                    f"lambda[{k}][{j}] = {value}: entries below the diagonal must be 0 "
                    f"(stage {k} cannot take credit from the earlier stage {j})"
                )
        if lam[k, k].item() != 1.0:
            raise LambdaSpecError(f"lambda[{k}][{k}] = {lam[k, k].item()}: diagonal entries must be 1")
    return lam.float()


# ------------------------------------------------------------------- returns and advantages ----


UNSCORED_STAGE_RETURNS: tuple[str, ...] = ("none", "downstream")


def stage_returns(R: torch.Tensor, lam: Any, unscored: str = "none") -> torch.Tensor:
    """G = R Λᵀ for one group (n×K); NaN scores count as 0, and G is NaN where it has no score to
    stand on (see the module docstring). ``lam`` is a K×K tensor or anything ``as_lambda`` takes.
    ``unscored`` (rl.unscored_stage_return), for a stage with no score of its own: ``none``, no return;
    ``downstream``, the return of the later scores its row of Λ sums (a search the judge wrote no
    rubric for still gets the credit of the answer it led to)."""
    if unscored not in UNSCORED_STAGE_RETURNS:
        raise ValueError(f"unknown unscored stage return {unscored!r}; expected one of {list(UNSCORED_STAGE_RETURNS)}")
    R = torch.as_tensor(R)
    if R.dim() != 2:
        raise ValueError(f"R must be (n, K), got shape {tuple(R.shape)}")
    if not R.is_floating_point():
        R = R.float()
    K = R.shape[1]
    lam = lam if isinstance(lam, torch.Tensor) else as_lambda(lam, K)
    if lam.shape != (K, K):
        raise ValueError(f"lambda must be {K}×{K} to match R (n×{K}), got shape {tuple(lam.shape)}")
    if not torch.isfinite(lam).all():
        raise ValueError("lambda has non-finite entries")
    lam = lam.to(device=R.device, dtype=R.dtype)
    missing = torch.isnan(R)
    G = torch.where(missing, torch.zeros_like(R), R) @ lam.T
    uses = lam != 0  # uses[k, j]: stage k's return sums stage j's score
    # any_score[i, k]: at least one score that stage k sums is present for rollout i.
    any_score = (~missing).to(R.dtype) @ uses.to(R.dtype).T > 0
    no_return = ~any_score
    if unscored == "none":
        no_return = no_return | (missing & torch.diagonal(uses).view(1, K))
    return torch.where(no_return, torch.full_like(G, math.nan), G)


def stage_advantages(G: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """Per-stage GRPO normalization across the group: (G − mean) / (std + eps), unbiased std.

    NaN returns (no score, failed judgment) are excluded from their stage's statistics and get 0;
    a stage with < 2 returns or all-equal returns gives 0 (no signal, not a division blow-up).
    """
    G = torch.as_tensor(G)
    if G.dim() != 2:
        raise ValueError(f"G must be (n, K), got shape {tuple(G.shape)}")
    if not G.is_floating_point():
        G = G.float()
    valid = ~torch.isnan(G)
    count = valid.sum(0)
    x = torch.where(valid, G, torch.zeros_like(G))
    mean = x.sum(0) / count.clamp(min=1)
    centered = torch.where(valid, G - mean, torch.zeros_like(G))
    std = (centered.square().sum(0) / (count - 1).clamp(min=1)).sqrt()
    # Signal needs two distinct valid returns. Tested as max > min, exactly: float noise in the mean
    # of tied values (~1e-8 in float32) divided by (0 + eps) would otherwise fake an advantage.
    hi = torch.where(valid, G, torch.full_like(G, -math.inf)).amax(0)
    lo = torch.where(valid, G, torch.full_like(G, math.inf)).amin(0)
    informative = hi > lo
    A = centered / (std + eps)
    return torch.where(valid & informative.view(1, -1), A, torch.zeros_like(A))


def token_advantages(A: torch.Tensor, stage_ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """(n×T) per-token advantages: token t of rollout i gets A[i, stage_ids[i, t]]; 0 where the mask
    is 0 (prompt, tool output, padding) or the stage id is −1 (``trajectory.NO_STAGE``)."""
    A, stage_ids, mask = torch.as_tensor(A), torch.as_tensor(stage_ids), torch.as_tensor(mask)
    if A.dim() != 2:
        raise ValueError(f"A must be (n, K), got shape {tuple(A.shape)}")
    if stage_ids.dim() != 2 or stage_ids.shape != mask.shape or stage_ids.shape[0] != A.shape[0]:
        raise ValueError(
            f"stage_ids and mask must both be (n, T) with n = {A.shape[0]} rows of A; got "
            f"stage_ids {tuple(stage_ids.shape)}, mask {tuple(mask.shape)}"
        )
    if stage_ids.is_floating_point() or stage_ids.dtype == torch.bool:
        raise ValueError(f"stage_ids must be integers, got {stage_ids.dtype}")
    K = A.shape[1]
    if stage_ids.numel() and (stage_ids.min() < -1 or stage_ids.max() >= K):
        raise ValueError(
            f"stage_ids must lie in -1..{K - 1}; got values from {stage_ids.min().item()} to {stage_ids.max().item()}"
        )
    keep = (mask != 0) & (stage_ids >= 0)
    picked = A.gather(1, stage_ids.clamp(min=0).long())
    return torch.where(keep, picked, torch.zeros_like(picked))


# ----------------------------------------------------------------------------------- the loss ----


def policy_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    ref_logp: torch.Tensor | None,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    kl_coef: float = 0.001,
    is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """PPO-clipped token loss with a k3 KL penalty, token-level aggregation over the whole batch.

    All tensors are (n×T) and aligned per token. Values at masked positions are ignored (they may be
    NaN) and receive exactly zero gradient. With no masked-in token the loss is a graph-connected 0,
    so every data-parallel rank can still call backward. ``is_weights`` (n×T, no gradient) multiply
    each token's clipped surrogate: the truncated importance weights π_old/π_sampler of samples drawn
    by another policy than the old one (``rl.importance_correction: tis``); the KL term is not weighted.
    """
    shapes = {"logp": logp.shape, "old_logp": old_logp.shape, "advantages": advantages.shape, "mask": mask.shape}
    if ref_logp is not None:
        shapes["ref_logp"] = ref_logp.shape
    if is_weights is not None:
        shapes["is_weights"] = is_weights.shape
    if len(set(shapes.values())) != 1:
        raise ValueError(f"policy_loss inputs must share one shape; got { {k: tuple(v) for k, v in shapes.items()} }")
    if not 0.0 <= clip_low < 1.0 or clip_high < 0.0:
        raise ValueError(f"need 0 <= clip_low < 1 and clip_high >= 0; got clip_low={clip_low}, clip_high={clip_high}")
    if kl_coef < 0.0:
        raise ValueError(f"kl_coef must be >= 0, got {kl_coef}")

    keep = mask != 0
    zeros = torch.zeros_like(logp)
    n_tokens = keep.sum()
    denom = n_tokens.clamp(min=1).to(logp.dtype)

    # logp → ratio. where() before exp() so NaN/garbage at masked positions never reaches backward.
    log_ratio = torch.where(keep, logp - old_logp.to(logp.dtype), zeros).clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)
    ratio = torch.exp(log_ratio)
    adv = torch.where(keep, advantages.to(logp.dtype), zeros)

    # → clip: the pessimistic (max-loss) branch of the clipped surrogate.
    unclipped = ratio * adv
    clipped = ratio.clamp(1.0 - clip_low, 1.0 + clip_high) * adv
    pg_per_token = -torch.minimum(unclipped, clipped)
    if is_weights is not None:
        pg_per_token = pg_per_token * torch.where(keep, is_weights.detach().to(logp.dtype), zeros)

    if ref_logp is not None:
        ref_diff = torch.where(keep, ref_logp.to(logp.dtype) - logp, zeros).clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)
        kl_per_token = torch.exp(ref_diff) - ref_diff - 1.0  # k3 estimator of KL(π‖π_ref), ≥ 0
    else:
        kl_per_token = zeros

    # → aggregate: every trained token weighs the same, whichever rollout it sits in.
    per_token = torch.where(keep, pg_per_token + kl_coef * kl_per_token, zeros)
    loss = per_token.sum() / denom

    with torch.no_grad():
        clipped_active = ((adv > 0) & (ratio > 1.0 + clip_high)) | ((adv < 0) & (ratio < 1.0 - clip_low))
        approx_kl_old = ratio - 1.0 - log_ratio  # k3 of KL(π_old‖π), from samples of π_old

        def mean_of(x: torch.Tensor) -> float:
            return (torch.where(keep, x.to(logp.dtype), zeros).sum() / denom).item()

        count = int(n_tokens.item())
        metrics = {
            "pg_loss": mean_of(pg_per_token),
            "kl": mean_of(kl_per_token),
            "clip_fraction": mean_of(clipped_active),
            "ratio_mean": mean_of(ratio),
            "ratio_max": torch.where(keep, ratio, zeros).max().item() if count else 0.0,
            "n_tokens": float(count),
            "approx_kl": mean_of(approx_kl_old),
        }
    return loss, metrics
