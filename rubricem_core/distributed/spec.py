"""From the run config's ``distributed`` section to a torchrun launch."""
from __future__ import annotations

import socket

from rubricem_core.config import RunConfig
from rubricem_core.distributed.launch import LaunchSpec


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
        nproc_per_node=d.nproc_per_node, nnodes=d.nnodes, node_rank=d.node_rank if node_rank is None else node_rank,
        master_addr=d.master_addr or "127.0.0.1", master_port=d.master_port, rdzv_backend=d.rdzv_backend,
        devices=tuple(d.train_devices) if d.train_devices is not None else None,
    )
