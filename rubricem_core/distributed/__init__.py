"""Data-parallel training across ranks: who am I, which micro-batches are mine, how the ranks start.

- ``ranks``: rank / world size from torch.distributed (or the launcher's environment), process-group
  start for the plain-torch backend, a barrier that is a no-op in one process.
- ``shard``: the global micro-batches of one optimizer step split across ranks, each with its share
  of the global token mean (so N ranks give the update of one rank on the same batch).
- ``launch``: the torchrun command a task runs to start its trainer ranks, and the loop that streams
  their output back (rank 0's metric lines included) and fails with the failing rank's traceback.
"""

from rubricem_core.distributed.ranks import barrier, init_process_group, is_main, rank, shutdown, world_size
from rubricem_core.distributed.shard import ShardItem, shard_micro_batches

__all__ = [
    "ShardItem",
    "barrier",
    "init_process_group",
    "is_main",
    "rank",
    "shard_micro_batches",
    "shutdown",
    "world_size",
]
