"""From the run config's ``distributed`` section to a torchrun launch."""

from __future__ import annotations

import argparse
import json
import logging
import socket
import sys
from pathlib import Path
from typing import Any

from rubricem_core.config import RunConfig
from rubricem_core.distributed.launch import LaunchSpec
from rubricem_core.distributed.ranks import is_main, rank
from rubricem_core.layout import RunLayout


def launch_path(run_dir: str | Path, name: str) -> Path:
    """A file of the launches under ``<run_dir>/state/launch/`` (``sft.json``, ``rl.json``, payloads), its
    folder created: node 0 writes there and the other nodes read it, so it sits on the shared run dir."""
    folder = RunLayout(run_dir).launch_dir
    folder.mkdir(parents=True, exist_ok=True)
    return folder / name


def resolve_master(cfg: RunConfig) -> RunConfig:
    """The config with ``distributed.master_addr`` filled in: as given, else node 0's own host name
    (its FQDN, which pods of a Kubernetes Indexed Job with a subdomain resolve) on several nodes, else
    loopback. Node 0 resolves it before writing a launch file, so every node reads the same address."""
    d = cfg.distributed
    if d.master_addr is not None:
        return cfg
    addr = socket.getfqdn() if d.nnodes > 1 else "127.0.0.1"
    return cfg.model_copy(update={"distributed": d.model_copy(update={"master_addr": addr})})


def launch_spec(cfg: RunConfig, node_rank: int | None = None) -> LaunchSpec:
    d = resolve_master(cfg).distributed
    return LaunchSpec(
        nproc_per_node=d.nproc_per_node,
        nnodes=d.nnodes,
        node_rank=d.node_rank if node_rank is None else node_rank,
        master_addr=d.master_addr or "127.0.0.1",
        master_port=d.master_port,
        rdzv_backend=d.rdzv_backend,
        devices=tuple(d.train_devices) if d.train_devices is not None else None,
        timeout_s=d.timeout_s,
    )


def start_rank(description: str, argv: list[str] | None = None) -> tuple[dict[str, Any], RunConfig]:
    """A worker rank's start: ``--spec FILE`` parsed, logging to stdout (INFO on rank 0, warnings on the
    others, each line tagged with its rank), the launch file and its config read."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--spec", required=True, help="the launch file the launching task wrote")
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.INFO if is_main() else logging.WARNING,
        stream=sys.stdout,
        format=f"[rank {rank()}] %(levelname)s %(name)s: %(message)s",
    )
    spec = json.loads(Path(args.spec).read_text())
    return spec, RunConfig.model_validate(spec["config"])
