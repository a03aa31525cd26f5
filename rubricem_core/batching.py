"""Length-bucketed batching and right-padded collation of token trajectories.

Research trajectories vary from a few hundred to many thousand tokens; batching them at random
spends most of the compute on padding. Sorting by length and filling batches up to a padded-token
budget keeps padding small and memory per step bounded.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence, Sized
from dataclasses import dataclass, fields

import torch

from rubricem_core.trajectory import NO_STAGE, TokenTrajectory

EXTRA_FIELDS = ("advantages", "old_logprobs", "ref_logprobs", "sampled_logprobs")


@dataclass
class TokenBatch:
    """Right-padded tensors of shape (B, T); padding has attention 0, loss 0, stage NO_STAGE."""

    input_ids: torch.Tensor  # long
    attention_mask: torch.Tensor  # long, 1 on real tokens
    loss_mask: torch.Tensor  # long, 1 on trained (policy) tokens
    stage_ids: torch.Tensor  # long, NO_STAGE on prompt and padding
    n_real_tokens: int
    n_padded_tokens: int
    advantages: torch.Tensor | None = None  # float32, RL only
    old_logprobs: torch.Tensor | None = None
    ref_logprobs: torch.Tensor | None = None
    sampled_logprobs: torch.Tensor | None = None  # the rollout engine's (NaN: unknown): gap metric, TIS weights
    uid: int | None = None  # the micro-batch's position in an update that caches logprobs for it

    @property
    def batch_size(self) -> int:
        return int(self.input_ids.shape[0])

    def to(self, device: torch.device | str) -> TokenBatch:
        moved = {
            f.name: (v.to(device) if isinstance(v, torch.Tensor) else v)
            for f in fields(self)
            for v in [getattr(self, f.name)]
        }
        return TokenBatch(**moved)


def bucket_batches(
    trajs: Sequence[Sized | int],
    max_tokens_per_batch: int,
    max_batch_size: int | None = None,
    shuffle_seed: int | None = None,
) -> list[list[int]]:
    """Group indices of ``trajs`` so each batch's padded size (B × longest) fits the budget.

    ``trajs`` holds trajectories (anything with ``len``) or their lengths as ints.
    Every index appears exactly once. Batches are built longest first; ``shuffle_seed`` shuffles
    equal-length ties before sorting and the batch order after, so epochs differ but stay reproducible.
    """
    if max_tokens_per_batch < 1:
        raise ValueError(f"max_tokens_per_batch must be >= 1, got {max_tokens_per_batch}")
    if max_batch_size is not None and max_batch_size < 1:
        raise ValueError(f"max_batch_size must be >= 1 or None, got {max_batch_size}")
    lengths = [t if isinstance(t, int) else len(t) for t in trajs]
    for index, length in enumerate(lengths):
        if length == 0:
            raise ValueError(f"trajectory {index} is empty")
        if length > max_tokens_per_batch:
            raise ValueError(
                f"trajectory {index} has {length} tokens, more than max_tokens_per_batch {max_tokens_per_batch}"
            )
    rng = random.Random(shuffle_seed)
    order = list(range(len(lengths)))
    if shuffle_seed is not None:
        rng.shuffle(order)
    order.sort(key=lambda i: -lengths[i])  # stable: ties keep the shuffled order

    batches: list[list[int]] = []
    current: list[int] = []
    for index in order:
        # Sorted longest first, so the batch's first member sets its padded length.
        longest = lengths[current[0]] if current else lengths[index]
        full = max_batch_size is not None and len(current) >= max_batch_size
        if current and (full or (len(current) + 1) * longest > max_tokens_per_batch):
            batches.append(current)
            current = []
        current.append(index)
    if current:
        batches.append(current)
    if shuffle_seed is not None:
        rng.shuffle(batches)
    return batches


def _pad_extra(name: str, values: list[list[float]], trajs: Sequence[TokenTrajectory], width: int) -> torch.Tensor:
    if len(values) != len(trajs):
        raise ValueError(f"extras[{name!r}] has {len(values)} rows for {len(trajs)} trajectories")
    out = torch.zeros(len(trajs), width, dtype=torch.float32)
    for row, (vals, traj) in enumerate(zip(values, trajs)):
        if len(vals) != len(traj):
            raise ValueError(f"extras[{name!r}][{row}] has {len(vals)} values for a {len(traj)}-token trajectory")
        clean = []
        for pos, (v, m) in enumerate(zip(vals, traj.loss_mask)):
            if v is None or math.isnan(v):
                # Sampling logprobs are NaN on prompt/tool tokens; NaN × 0 is still NaN in a loss.
                if m and name == "sampled_logprobs":
                    clean.append(math.nan)  # a trained token the sampler gave no logprob: kept unknown
                    continue
                if m:
                    raise ValueError(f"extras[{name!r}][{row}] is NaN at trained token {pos}")
                v = 0.0
            clean.append(float(v))
        out[row, : len(clean)] = torch.tensor(clean, dtype=torch.float32)
    return out


def collate(
    trajs: Sequence[TokenTrajectory],
    pad_id: int,
    extras: dict[str, list[list[float]]] | None = None,
) -> TokenBatch:
    """Right-pad trajectories into one batch; ``extras`` are per-token floats for RL."""
    if not trajs:
        raise ValueError("collate needs at least one trajectory")
    width = max(len(t) for t in trajs)
    shape = (len(trajs), width)
    input_ids = torch.full(shape, pad_id, dtype=torch.long)
    attention_mask = torch.zeros(shape, dtype=torch.long)
    loss_mask = torch.zeros(shape, dtype=torch.long)
    stage_ids = torch.full(shape, NO_STAGE, dtype=torch.long)
    for row, traj in enumerate(trajs):
        n = len(traj)
        input_ids[row, :n] = torch.tensor(traj.token_ids, dtype=torch.long)
        attention_mask[row, :n] = 1
        loss_mask[row, :n] = torch.tensor(traj.loss_mask, dtype=torch.long)
        stage_ids[row, :n] = torch.tensor(traj.stage_ids, dtype=torch.long)
    padded = {}
    for name, values in (extras or {}).items():
        if name not in EXTRA_FIELDS:
            raise ValueError(f"unknown extras key {name!r}; expected one of {EXTRA_FIELDS}")
        padded[name] = _pad_extra(name, values, trajs, width)
    return TokenBatch(
        input_ids=input_ids,
        attention_mask=attention_mask,
        loss_mask=loss_mask,
        stage_ids=stage_ids,
        n_real_tokens=sum(len(t) for t in trajs),
        n_padded_tokens=len(trajs) * width,
        **padded,
    )


def padding_fraction(batches: Sequence[TokenBatch]) -> float:
    """Share of all batch positions that are padding (0 = none wasted)."""
    padded = sum(b.n_padded_tokens for b in batches)
    if padded == 0:
        return 0.0
    return 1.0 - sum(b.n_real_tokens for b in batches) / padded
