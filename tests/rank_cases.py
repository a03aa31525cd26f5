"""Tiny plain-Python work for tests/test_actors.py: what each RankWorker builds (``rank_cases.Ranked``) or
runs (a function of this module), so the RankGroup itself is what the tests exercise."""

from __future__ import annotations

import os
import time
from typing import Any

import torch
import torch.distributed as dist


class Ranked:
    """One rank's object: remembers its rank and what it was built with."""

    def __init__(self, tag: str) -> None:
        self.rank, self.tag = dist.get_rank(), tag

    def echo(self, *args: Any) -> dict[str, Any]:
        """What this rank was given (the test checks each rank got only its own)."""
        return {"rank": self.rank, "tag": self.tag, "args": args, "pid": os.getpid()}

    def all_reduce(self, value: float) -> float:
        t = torch.tensor([value], dtype=torch.float64)
        dist.all_reduce(t)
        return float(t.item())

    def wait_in_collective(self, sleeper: int, seconds: float) -> float:
        """Every rank prints, ``sleeper`` sleeps, the others block in an all_reduce waiting for it."""
        print(f"rank {self.rank} (pid {os.getpid()}) is about to wait: the last words of rank {self.rank}", flush=True)
        if self.rank == sleeper:
            time.sleep(seconds)
        return self.all_reduce(1.0)

    def fail(self, failing: int) -> None:
        """``failing`` raises after printing; the others block in a barrier it never reaches."""
        print(f"rank {self.rank} reading shard 17", flush=True)
        if self.rank == failing:
            raise ValueError("rank one broke: bad shard 17")
        dist.barrier()

    def rendezvous(self) -> tuple[str, int]:
        """The address and port of the process group's rendezvous store (rank 0's)."""
        return os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])


def rank_and_world() -> tuple[int, int]:
    return dist.get_rank(), dist.get_world_size()


def new_group_sum(late: int, delay_s: float) -> float:
    """A new gloo group among the ranks (as DeepSpeed makes its groups), rank ``late`` arriving ``delay_s``
    later; an all_reduce over it."""
    if dist.get_rank() == late:
        time.sleep(delay_s)
    print(f"rank {dist.get_rank()} joins a new group", flush=True)
    group = dist.new_group(backend="gloo")
    t = torch.ones(1)
    dist.all_reduce(t, group=group)
    return float(t.item())
