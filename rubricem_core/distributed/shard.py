"""One optimizer step's micro-batches split across data-parallel ranks.

Every rank is given the same global list of micro-batches (the schedule is a pure function of the seed)
and their weights (trained tokens). Rank r trains on micro-batches r, r+N, r+2N, …; a rank with fewer
than ceil(M/N) pads with a copy of a real micro-batch at scale 0, because DeepSpeed (ZeRO-3 most of
all) needs every rank to run the same number of forward and backward passes.

Each micro-batch's scale is its weight over the *global* total, so summing the ranks' gradients gives
exactly the gradient of one rank on the whole step: the loss stays the global token mean.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class ShardItem:
    index: int  # position in the global micro-batch list
    scale: float  # share of the global step's loss (0 for padding)
    pad: bool = False  # a scale-0 copy that only keeps the ranks' collectives in step


def micro_batch_scales(n: int, weights: Sequence[float] | None) -> list[float]:
    """Scale of each micro-batch's loss so the step is the weighted mean of the micro-batch losses
    (every micro-batch weighs 1 without ``weights``)."""
    if n == 0:
        raise ValueError("step() needs at least one micro-batch")
    if weights is None:
        return [1.0 / n] * n
    if len(weights) != n:
        raise ValueError(f"weights has {len(weights)} values for {n} micro-batches")
    total = float(sum(weights))
    if not total > 0 or any(w < 0 for w in weights):
        raise ValueError(f"weights must be >= 0 with a positive sum, got {list(weights)}")
    return [float(w) / total for w in weights]


def shard_micro_batches(n: int, weights: Sequence[float] | None, rank: int, world_size: int) -> list[ShardItem]:
    """This rank's micro-batches of a step of ``n`` (ceil(n / world_size) items, padding included)."""
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is not in a world of {world_size}")
    scales = micro_batch_scales(n, weights)
    mine = [ShardItem(i, scales[i]) for i in range(rank, n, world_size)]
    per_rank = math.ceil(n / world_size)
    while len(mine) < per_rank:
        mine.append(ShardItem(mine[-1].index if mine else rank % n, 0.0, pad=True))
    return mine
