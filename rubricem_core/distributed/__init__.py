"""Data-parallel training across ranks: who am I, which micro-batches are mine, how the ranks start.

- ``ranks``: rank / world size from torch.distributed (or the launcher's environment), process-group
  start for the plain-torch backend, a barrier that is a no-op in one process.
- ``shard``: the global micro-batches of one optimizer step split across ranks, each with its share
  of the global token mean (so N ranks give the update of one rank on the same batch).
- ``cluster``: the Ray cluster the flow process drives (a local one, or one it joins).
- ``actors``: trainer ranks as Ray actors in one placement group (RankGroup), their logs and metric
  lines streamed back, a failing rank named with its node and output tail (RankFailure).
"""

from rubricem_core.distributed.ranks import barrier, init_process_group, is_main, rank, world_size
from rubricem_core.distributed.shard import ShardItem, shard_micro_batches

__all__ = [
    "ShardItem",
    "barrier",
    "init_process_group",
    "is_main",
    "rank",
    "shard_micro_batches",
    "world_size",
]
