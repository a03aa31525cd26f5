"""Per-token log-probabilities of a causal LM and the SFT loss built on them.

``log p(x_t | x_<t) = logit[x_t] - logsumexp(logits)``, computed over chunks of positions so the
float32 (B, T, V) log-softmax never exists at once: with V ≈ 150k, B·T = 32k tokens it would be
~19 GB. Under autograd each chunk is checkpointed, so backward recomputes the float32 chunk
instead of keeping every chunk's upcast copy alive.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.checkpoint import checkpoint

from rubricem_core.batching import TokenBatch
from rubricem_core.scaffold import STAGES
from rubricem_core.trajectory import REFLECTION_STAGE


def _logits_of(
    model: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor | None = None
) -> torch.Tensor:
    if position_ids is None:
        out = model(input_ids=input_ids, attention_mask=attention_mask)
    else:
        # Packed rows: position ids and no mask make transformers confine attention to each sequence;
        # a KV cache would turn that detection off, so none is built.
        out = model(input_ids=input_ids, position_ids=position_ids, use_cache=False)
    return out.logits if hasattr(out, "logits") else out


def _chunk_logprobs(logits: torch.Tensor, targets: torch.Tensor, temperature: float) -> torch.Tensor:
    logits = logits.float()
    if temperature != 1.0:
        logits = logits / temperature
    picked = logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    return picked - torch.logsumexp(logits, dim=-1)


def token_logprobs(
    model: Any,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    chunk_size: int = 1024,
    temperature: float = 1.0,
    position_ids: torch.Tensor | None = None,
) -> torch.Tensor:
    """(B, T) float32: ``out[:, t] = log p(ids[:, t] | ids[:, :t])``; ``out[:, 0]`` and padding are 0.

    ``temperature`` divides the logits, to match a sampler that used one. ``position_ids`` (packed rows,
    see ``batching.collate_packed``): each sequence is conditioned on itself only, and its first token,
    which nothing of its own precedes, gets 0 like ``out[:, 0]``.
    """
    if input_ids.dim() != 2 or input_ids.shape != attention_mask.shape:
        raise ValueError(
            f"input_ids and attention_mask must be (B, T) of one shape, got {tuple(input_ids.shape)} "
            f"and {tuple(attention_mask.shape)}"
        )
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if position_ids is not None and position_ids.shape != input_ids.shape:
        raise ValueError(
            f"position_ids {tuple(position_ids.shape)} must have input_ids' shape {tuple(input_ids.shape)}"
        )
    logits = _logits_of(model, input_ids, attention_mask, position_ids)
    batch, length = input_ids.shape
    # logits at t-1 predict the token at t.
    pred, targets = logits[:, :-1], input_ids[:, 1:]
    use_checkpoint = torch.is_grad_enabled() and logits.requires_grad
    pieces = []
    for start in range(0, length - 1, chunk_size):
        stop = min(start + chunk_size, length - 1)
        args = (pred[:, start:stop], targets[:, start:stop], temperature)
        if use_checkpoint:
            pieces.append(checkpoint(_chunk_logprobs, *args, use_reentrant=False))
        else:
            pieces.append(_chunk_logprobs(*args))
    first = torch.zeros(batch, 1, dtype=torch.float32, device=input_ids.device)
    out = torch.cat([first, *pieces], dim=1)
    if position_ids is not None:
        out = out * (position_ids != 0).to(out.dtype)  # a packed sequence's first token: nothing precedes it
    return out * attention_mask.to(out.dtype)  # padding positions carry no logprob


def batch_logprobs(model: Any, batch: TokenBatch, chunk_size: int = 1024, temperature: float = 1.0) -> torch.Tensor:
    """``token_logprobs`` of a batch, padded or packed, on the batch's device."""
    return token_logprobs(
        model,
        batch.input_ids,
        batch.attention_mask,
        chunk_size=chunk_size,
        temperature=temperature,
        position_ids=batch.position_ids,
    )


def target_mask(batch: TokenBatch) -> torch.Tensor:
    """Trained positions that something precedes: the loss mask without padding, position 0, and (packed)
    each sequence's first token."""
    mask = batch.loss_mask.bool() & batch.attention_mask.bool()
    mask[:, 0] = False
    if batch.position_ids is not None:
        mask &= batch.position_ids != 0
    return mask


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Mean of ``x`` over ``mask`` (NaN-safe at masked-out positions); 0 where the mask is empty."""
    keep = mask.bool()
    total = torch.where(keep, x, torch.zeros_like(x))
    count = keep.to(x.dtype)
    if dim is None:
        return total.sum() / count.sum().clamp(min=1)
    return total.sum(dim) / count.sum(dim).clamp(min=1)


def sft_loss(
    model: Any,
    batch: TokenBatch,
    n_tokens_total: int | None = None,
    chunk_size: int = 1024,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Token-level NLL over the batch's loss-mask tokens.

    The loss is ``sum(NLL) / n_tokens`` where ``n_tokens`` is this batch's trained-token count, or
    ``n_tokens_total`` when given (gradient accumulation: pass the count over all micro-batches so
    every token weighs the same). Position 0 (and a packed sequence's first token) is never a target: nothing precedes it.
    """
    logp = batch_logprobs(model, batch, chunk_size=chunk_size)
    mask = target_mask(batch)
    nll = -logp
    n_tokens = int(mask.sum())
    denom = n_tokens_total if n_tokens_total is not None else n_tokens
    if denom < 1:
        raise ValueError("sft_loss: the batch has no trained tokens (loss_mask is 0 everywhere)")
    loss = torch.where(mask, nll, torch.zeros_like(nll)).sum() / denom
    metrics: dict[str, float] = {"loss": float(loss.detach()), "n_tokens": float(n_tokens)}
    with torch.no_grad():
        metrics["nll"] = float(masked_mean(nll, mask))  # this batch's mean, whatever the normalizer
        for stage_id, stage in enumerate(STAGES):
            stage_mask = mask & (batch.stage_ids == stage_id)
            count = int(stage_mask.sum())
            if count:
                metrics[f"nll/{stage}"] = float(masked_mean(nll, stage_mask))
                metrics[f"n_tokens/{stage}"] = float(count)
        # per task of the SFT mix: research trajectories and reflections
        reflection = batch.stage_ids == REFLECTION_STAGE
        for task, task_mask in (("research", mask & ~reflection), ("reflection", mask & reflection)):
            count = int(task_mask.sum())
            if count:  # "research" is a stage name too: the task metrics have their own prefix
                metrics[f"task_nll/{task}"] = float(masked_mean(nll, task_mask))
                metrics[f"n_task_tokens/{task}"] = float(count)
    return loss, metrics
