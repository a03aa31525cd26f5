"""Batching of token trajectories: length buckets with right padding, or packed rows.

Research trajectories vary from a few hundred to many thousand tokens; batching them at random
spends most of the compute on padding. Two ways keep padding small and memory per step bounded:

- buckets (``bucket_batches`` + ``collate``): sorted by length, each batch B × its longest ≤ the budget;
- packing (``pack_batches`` + ``collate_packed``): sequences laid end to end in rows of ``pack_length``
  tokens, first-fit decreasing; position ids restart at each sequence, and the model, given position
  ids and no attention mask, confines attention to each sequence (transformers' packed-sequence mask),
  so every token's logprob, and so the loss, is the unpacked batch's.
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
    position_ids: torch.Tensor | None = None  # long, packed rows only: 0 at each sequence's first token

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


def _checked_lengths(trajs: Sequence[Sized | int], limit: int, what: str) -> list[int]:
    lengths = [t if isinstance(t, int) else len(t) for t in trajs]
    for index, length in enumerate(lengths):
        if length == 0:
            raise ValueError(f"trajectory {index} is empty")
        if length > limit:
            raise ValueError(f"trajectory {index} has {length} tokens, more than {what} {limit}")
    return lengths


def _longest_first(lengths: list[int], rng: random.Random | None) -> list[int]:
    """Indices by length, longest first; ``rng`` shuffles equal-length ties (the sort is stable)."""
    order = list(range(len(lengths)))
    if rng is not None:
        rng.shuffle(order)
    order.sort(key=lambda i: -lengths[i])
    return order


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
    lengths = _checked_lengths(trajs, max_tokens_per_batch, "max_tokens_per_batch")
    rng = random.Random(shuffle_seed)
    order = _longest_first(lengths, rng if shuffle_seed is not None else None)
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


def pack_rows(lengths: Sequence[int], pack_length: int) -> list[list[int]]:
    """Next fit: positions 0..n−1 in the given order, a new row when the next does not fit the current
    one. ``pack_batches`` lists a micro-batch's trajectories row by row, so this rebuilds its rows."""
    rows: list[list[int]] = []
    room = 0
    for index, length in enumerate(lengths):
        if length > pack_length:
            raise ValueError(f"trajectory {index} has {length} tokens, more than the pack length {pack_length}")
        if not rows or length > room:
            rows.append([])
            room = pack_length
        rows[-1].append(index)
        room -= length
    return rows


def pack_batches(
    trajs: Sequence[Sized | int],
    max_tokens_per_batch: int,
    pack_length: int | None = None,
    shuffle_seed: int | None = None,
) -> list[list[int]]:
    """Group indices of ``trajs`` into micro-batches of packed rows: rows of ``pack_length`` tokens
    (default: ``max_tokens_per_batch``, one row a micro-batch) filled first-fit decreasing, then
    ``max_tokens_per_batch // pack_length`` consecutive rows a micro-batch. Each micro-batch lists its
    trajectories row by row (``pack_rows`` rebuilds the rows). ``shuffle_seed`` as in ``bucket_batches``."""
    pack_length = max_tokens_per_batch if pack_length is None else pack_length
    if not 1 <= pack_length <= max_tokens_per_batch:
        raise ValueError(f"pack_length must be in [1, max_tokens_per_batch {max_tokens_per_batch}], got {pack_length}")
    lengths = _checked_lengths(trajs, pack_length, "the pack length")
    rng = random.Random(shuffle_seed)
    order = _longest_first(lengths, rng if shuffle_seed is not None else None)
    rows: list[list[int]] = []
    room: list[int] = []
    for index in order:  # first fit decreasing: a row's room only shrinks, so next fit rebuilds it
        row = next((r for r, free in enumerate(room) if lengths[index] <= free), None)
        if row is None:
            rows.append([])
            room.append(pack_length)
            row = len(rows) - 1
        rows[row].append(index)
        room[row] -= lengths[index]
    per_batch = max_tokens_per_batch // pack_length
    batches = [sum(rows[i : i + per_batch], []) for i in range(0, len(rows), per_batch)]
    if shuffle_seed is not None:
        rng.shuffle(batches)
    return batches


def _pad_extra(
    name: str, values: list[list[float]], trajs: Sequence[TokenTrajectory], width: int, slots: list[tuple[int, int]]
) -> torch.Tensor:
    """``values`` laid out like the trajectories: trajectory i at row/offset ``slots[i]`` of ``width``."""
    if len(values) != len(trajs):
        raise ValueError(f"extras[{name!r}] has {len(values)} rows for {len(trajs)} trajectories")
    out = torch.zeros(max(r for r, _ in slots) + 1, width, dtype=torch.float32)
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
        at, offset = slots[row]
        out[at, offset : offset + len(clean)] = torch.tensor(clean, dtype=torch.float32)
    return out


def _pad_extras(
    extras: dict[str, list[list[float]]] | None,
    trajs: Sequence[TokenTrajectory],
    width: int,
    slots: list[tuple[int, int]],
) -> dict[str, torch.Tensor]:
    padded = {}
    for name, values in (extras or {}).items():
        if name not in EXTRA_FIELDS:
            raise ValueError(f"unknown extras key {name!r}; expected one of {EXTRA_FIELDS}")
        padded[name] = _pad_extra(name, values, trajs, width, slots)
    return padded


def _lay_out(
    trajs: Sequence[TokenTrajectory],
    pad_id: int,
    rows: list[list[int]],
    extras: dict[str, list[list[float]]] | None,
    packed: bool,
) -> TokenBatch:
    """``rows[r]``: the trajectories laid end to end in row r, right-padded to the fullest row."""
    width = max(sum(len(trajs[i]) for i in row) for row in rows)
    shape = (len(rows), width)
    input_ids = torch.full(shape, pad_id, dtype=torch.long)
    attention_mask = torch.zeros(shape, dtype=torch.long)
    loss_mask = torch.zeros(shape, dtype=torch.long)
    stage_ids = torch.full(shape, NO_STAGE, dtype=torch.long)
    position_ids = torch.zeros(shape, dtype=torch.long)
    slots: list[tuple[int, int]] = [(0, 0)] * len(trajs)
    for r, row in enumerate(rows):
        offset = 0
        for i in row:
            traj, n = trajs[i], len(trajs[i])
            span = slice(offset, offset + n)
            input_ids[r, span] = torch.tensor(traj.token_ids, dtype=torch.long)
            attention_mask[r, span] = 1
            loss_mask[r, span] = torch.tensor(traj.loss_mask, dtype=torch.long)
            stage_ids[r, span] = torch.tensor(traj.stage_ids, dtype=torch.long)
            position_ids[r, span] = torch.arange(n)
            slots[i] = (r, offset)
            offset += n
        position_ids[r, offset:] = torch.arange(width - offset)  # padding: a sequence of its own
    return TokenBatch(
        input_ids=input_ids,
        attention_mask=attention_mask,
        loss_mask=loss_mask,
        stage_ids=stage_ids,
        n_real_tokens=sum(len(t) for t in trajs),
        n_padded_tokens=len(rows) * width,
        position_ids=position_ids if packed else None,
        **_pad_extras(extras, trajs, width, slots),
    )


def collate(
    trajs: Sequence[TokenTrajectory],
    pad_id: int,
    extras: dict[str, list[list[float]]] | None = None,
) -> TokenBatch:
    """Right-pad trajectories into one batch, one a row; ``extras`` are per-token floats for RL."""
    if not trajs:
        raise ValueError("collate needs at least one trajectory")
    return _lay_out(trajs, pad_id, [[i] for i in range(len(trajs))], extras, packed=False)


def collate_packed(
    trajs: Sequence[TokenTrajectory],
    pad_id: int,
    pack_length: int,
    extras: dict[str, list[list[float]]] | None = None,
) -> TokenBatch:
    """Trajectories (listed row by row, as ``pack_batches`` gives them) end to end in rows of at most
    ``pack_length`` tokens, each row right-padded to the fullest row. ``position_ids`` restart at 0 on
    each trajectory (padding counts on as a sequence of its own, masked out of every loss)."""
    if not trajs:
        raise ValueError("collate_packed needs at least one trajectory")
    return _lay_out(trajs, pad_id, pack_rows([len(t) for t in trajs], pack_length), extras, packed=True)


def plan_micro_batches(
    trajs: Sequence[Sized | int],
    max_tokens_per_batch: int,
    packing: bool = False,
    pack_length: int | None = None,
    shuffle_seed: int | None = None,
) -> list[list[int]]:
    """A training section's micro-batches (trajectory indices): packed rows with ``packing``, else length
    buckets; ``collate_micro_batch`` lays each one out the same way."""
    if packing:
        return pack_batches(trajs, max_tokens_per_batch, pack_length, shuffle_seed=shuffle_seed)
    return bucket_batches(trajs, max_tokens_per_batch, shuffle_seed=shuffle_seed)


def collate_micro_batch(
    trajs: Sequence[TokenTrajectory],
    pad_id: int,
    max_tokens_per_batch: int,
    packing: bool = False,
    pack_length: int | None = None,
    extras: dict[str, list[list[float]]] | None = None,
) -> TokenBatch:
    """One micro-batch of ``plan_micro_batches``: packed rows or a right-padded bucket."""
    if packing:
        return collate_packed(trajs, pad_id, pack_length or max_tokens_per_batch, extras=extras)
    return collate(trajs, pad_id, extras=extras)


def padding_fraction(batches: Sequence[TokenBatch]) -> float:
    """Share of all batch positions that are padding (0 = none wasted)."""
    padded = sum(b.n_padded_tokens for b in batches)
    if padded == 0:
        return 0.0
    return 1.0 - sum(b.n_real_tokens for b in batches) / padded
