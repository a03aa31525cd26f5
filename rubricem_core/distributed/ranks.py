"""Rank and world size, read from torch.distributed once it is up, else from the environment.

A RankGroup's actors (distributed/actors.py) start the process group and set RANK, WORLD_SIZE, LOCAL_RANK,
MASTER_ADDR and MASTER_PORT before any training code runs; one process with none of them set is rank 0 of
a world of 1.
"""

from __future__ import annotations

import os
from datetime import timedelta

import torch
import torch.distributed as dist


def _up() -> bool:
    return dist.is_available() and dist.is_initialized()


def world_size() -> int:
    return dist.get_world_size() if _up() else int(os.environ.get("WORLD_SIZE", "1"))


def rank() -> int:
    return dist.get_rank() if _up() else int(os.environ.get("RANK", "0"))


def local_rank() -> int:
    return int(os.environ.get("LOCAL_RANK", "0"))


def is_main() -> bool:
    """Rank 0: the one rank that writes Parquet, MLflow, logs and the HF weights."""
    return rank() == 0


def barrier() -> None:
    if _up() and dist.get_world_size() > 1:
        dist.barrier()


TIMEOUT_ENV = "RUBRICEM_COLLECTIVE_TIMEOUT_S"  # distributed.timeout_s, passed to the ranks by the launcher


def init_process_group(timeout_s: float | None = None) -> None:
    """Start the default process group when a launcher asked for more than one rank (NCCL on GPUs,
    gloo on CPUs), with the run's collective timeout (``distributed.timeout_s``, 1800 s by default);
    nothing in one process or when it is already up. Both trainers call it, so DeepSpeed adopts it."""
    if _up() or int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return
    if timeout_s is None:
        timeout_s = float(os.environ.get(TIMEOUT_ENV, "1800"))
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(local_rank())
    dist.init_process_group(backend=backend, timeout=timedelta(seconds=timeout_s))


def train_device(requested: str) -> torch.device:
    """The device a rank trains on: ``cuda:LOCAL_RANK`` under a launcher with GPUs, else ``requested``
    ('auto' → cuda when there is one, else cpu)."""
    if requested == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda", local_rank() if world_size() > 1 else torch.cuda.current_device())
        return torch.device("cpu")
    return torch.device(requested)
