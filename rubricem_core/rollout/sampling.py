"""Token sampling for the transformers engine: temperature, top-k/top-p, inverse-CDF draws.

Sampling is by inverse CDF with one uniform number per row per step, drawn from the row's own
``random.Random`` (see ``batch.row_rng``), so a row's draws do not depend on the other rows. The
logprob recorded is that of the distribution drawn from: log-softmax of the temperature-scaled,
top-k/top-p-filtered logits; for temperature 0 it is the plain T=1 log-softmax of the argmax token.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from rubricem_core.rollout.types import SamplingParams


def filter_top_k_top_p(scaled: torch.Tensor, top_k: list[int], top_p: list[float]) -> torch.Tensor:
    """Set logits outside each row's top-k and top-p (nucleus) set to -inf; at least one token stays."""
    vocab = scaled.shape[-1]
    if all(k == 0 or k >= vocab for k in top_k) and all(p >= 1.0 for p in top_p):
        return scaled
    device = scaled.device
    sorted_logits, order = scaled.sort(dim=-1, descending=True)
    rank = torch.arange(vocab, device=device)[None, :]
    ks = torch.tensor([k if 0 < k < vocab else vocab for k in top_k], device=device)
    drop = rank >= ks[:, None]
    probs = torch.softmax(sorted_logits.masked_fill(drop, float("-inf")), dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs
    ps = torch.tensor(top_p, device=device, dtype=probs.dtype)
    drop |= (mass_before >= ps[:, None]) & (rank > 0)
    return scaled.scatter(1, order, sorted_logits.masked_fill(drop, float("-inf")))


def draw(
    logits: torch.Tensor, settings: Sequence[SamplingParams], uniforms: Sequence[float]
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per row of ``logits`` ([rows, vocab], float) from one uniform number each.

    Returns the tokens and the log-probabilities of the whole sampled distribution (``[rows, vocab]``),
    so a caller that overrides a token (a forced policy) can still read its logprob.
    """
    device = logits.device
    temps = torch.tensor([s.temperature for s in settings], device=device)
    greedy = temps == 0
    scaled = logits / torch.where(greedy, torch.ones_like(temps), temps)[:, None]
    scaled = filter_top_k_top_p(scaled, [s.top_k for s in settings], [s.top_p for s in settings])
    logp = torch.log_softmax(scaled, dim=-1)
    cdf = logp.exp().cumsum(dim=-1)
    u = torch.tensor(list(uniforms), device=device, dtype=cdf.dtype)
    drawn = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True).squeeze(1)
    tokens = torch.where(greedy, scaled.argmax(dim=-1), drawn.clamp_max(logits.shape[-1] - 1))
    return tokens, logp
