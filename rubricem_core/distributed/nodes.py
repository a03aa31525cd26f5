"""The ranks of a node other than node 0: ``rubricem ranks sft|rl --run-dir R --node-rank K``.

On several nodes the flow runs on node 0 only (it alone writes Parquet and MLflow and talks to Prefect).
When its task starts the ranks it writes a launch file under ``<run_dir>/state/launch/`` (a file system
every node sees); each other node waits for that file, then starts its own ``nproc_per_node`` ranks with
the same torchrun rendezvous (``distributed.master_addr``/``master_port``) and node rank K. A node's
command ends when the launch does, with torchrun's exit code.
"""
from __future__ import annotations

import time
from pathlib import Path

from rubricem_core.config import RunConfig
from rubricem_core.distributed.launch import run_ranks, wait_for_launch_file
from rubricem_core.distributed.spec import launch_spec

LAUNCHES = {"sft": ("sft.json", "rubricem_core.distributed.sft_worker"),
            "rl": ("rl.json", "rubricem_core.distributed.rl_ranks")}


def join_launch(run_dir: str, kind: str, node_rank: int, wait_s: float = 3600.0) -> None:
    """Start this node's ranks of node 0's next ``kind`` launch (sft or rl) and wait for them."""
    if kind not in LAUNCHES:
        raise ValueError(f"unknown launch {kind!r}; expected one of {sorted(LAUNCHES)}")
    name, module = LAUNCHES[kind]
    path = Path(run_dir) / "state" / "launch" / name
    spec = wait_for_launch_file(path, newer_than=time.time() - 1.0, wait_s=wait_s)
    cfg = RunConfig.model_validate(spec["config"])
    if not 0 < node_rank < cfg.distributed.nnodes:
        raise ValueError(f"--node-rank {node_rank} must be in 1..{cfg.distributed.nnodes - 1} "
                         f"(distributed.nnodes={cfg.distributed.nnodes}; node 0 runs the flow)")
    run_ranks(launch_spec(cfg, node_rank=node_rank), module, ["--spec", str(path.resolve())],
              on_line=lambda line: print(line, flush=True), env=spec.get("env"))
