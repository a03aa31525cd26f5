"""The ranks of a node other than node 0: ``rubricem ranks sft|rl --run-dir R --node-rank K``.

On several nodes the flow runs on node 0 only (it alone writes Parquet and MLflow and talks to Prefect).
When its task starts the ranks it writes a launch file under ``<run_dir>/state/launch/`` (a file system
every node sees); each other node waits for that file, then starts its own ``nproc_per_node`` ranks with
the same torchrun rendezvous (``distributed.master_addr``/``master_port``) and node rank K. A node's
command ends when the launch does, with torchrun's exit code. When node 0 has nothing to train (SFT
already finished, every RL step done) it writes a launch file that says so (``announce_no_launch``), and
the other nodes' commands end with exit code 0 instead of waiting for a launch that never comes.

Which launch file is this launch's: node 0 records its launch id (``RUBRICEM_LAUNCH_ID``, shared by all
pods of one Kubernetes Job: the Job's uid) in every launch file it writes. Given a launch id (``--launch-id``,
default that variable), a node takes a launch file if and only if it carries the same id, however old;
one with another id, or none, is a past launch's. Without a launch id, a launch file written more than a
minute before the command started is a past launch's. Either way a launch file marked ended (its ranks
have exited) is never joined.

A launch file sets only the variables of ``LAUNCH_ENV`` in the ranks' environment (the control store's
address and session); any other (``PYTHONPATH``, ``LD_PRELOAD``...) is refused with ``LaunchFileError``,
so whoever can write the shared volume cannot choose what another node's Python imports. The launch
secret comes from this node's own ``RUBRICEM_LAUNCH_SECRET``, else from ``state/launch/secret``, which
node 0 writes with mode 0600 (a file others may read is refused).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

from rubricem_core.config import RunConfig
from rubricem_core.distributed.guard import SECRET_ENV, SECRET_FILE, read_secret_file
from rubricem_core.distributed.launch import run_ranks, wait_for_launch_file
from rubricem_core.distributed.spec import launch_path, launch_spec

LAUNCHES = {
    "sft": ("sft.json", "rubricem_core.distributed.sft_worker"),
    "rl": ("rl.json", "rubricem_core.distributed.rl_ranks"),
}


# the only variables a launch file may set in the ranks' environment (rl_ranks' control store and session)
LAUNCH_ENV = frozenset({"RUBRICEM_CONTROL", "RUBRICEM_CONTROL_SESSION"})


class LaunchFileError(ValueError):
    """A launch file asks for something no launch of this project writes."""


def launch_environment(path: Path, env: Any) -> dict[str, str]:
    """The ``env`` of launch file ``path``, refused unless every name is in ``LAUNCH_ENV`` and every value a string."""
    if env is None:
        return {}
    if not isinstance(env, dict):
        raise LaunchFileError(f"{path}: 'env' must be an object of variable names to strings")
    refused = sorted(str(k) for k in env if k not in LAUNCH_ENV)
    if refused:
        raise LaunchFileError(
            f"{path}: refused to set {', '.join(refused)} from a launch file: a launch file may set only "
            f"{', '.join(sorted(LAUNCH_ENV))}"
        )
    if not all(isinstance(v, str) for v in env.values()):
        raise LaunchFileError(f"{path}: every 'env' value must be a string")
    return dict(env)


def node_secret(run_dir: str) -> dict[str, str]:
    """The launch secret for this node's ranks: this node's own variable, else node 0's 0600 file (none: {})."""
    if os.environ.get(SECRET_ENV):
        return {}  # the ranks inherit it
    path = launch_path(run_dir, SECRET_FILE)
    return {SECRET_ENV: read_secret_file(path)} if path.exists() else {}


STALE_SLACK_S = 60.0  # without a launch id: a launch file written up to this long before the command counts
LAUNCH_ID_ENV = "RUBRICEM_LAUNCH_ID"  # the launch id of node 0's launch files and the nodes that join them


def launch_id_from_env() -> str | None:
    """This process's launch id (``RUBRICEM_LAUNCH_ID``); None when unset or empty."""
    return os.environ.get(LAUNCH_ID_ENV) or None


def with_launch_id(payload: dict[str, Any]) -> dict[str, Any]:
    """Node 0: a launch file's content with this process's launch id (unchanged without one)."""
    launch_id = launch_id_from_env()
    return payload if launch_id is None else {**payload, "launch_id": launch_id}


def join_launch(
    run_dir: str,
    kind: str,
    node_rank: int,
    wait_s: float = 3600.0,
    started: float | None = None,
    launch_id: str | None = None,
) -> None:
    """Start this node's ranks of node 0's next ``kind`` launch (sft or rl) and wait for them. With
    ``launch_id`` the launch file must carry that id; without, a launch file older than ``started`` (the
    command's start, default now) minus a minute is a past launch's."""
    if kind not in LAUNCHES:
        raise ValueError(f"unknown launch {kind!r}; expected one of {sorted(LAUNCHES)}")
    name, module = LAUNCHES[kind]
    path = launch_path(run_dir, name)
    started = time.time() if started is None else started
    spec = wait_for_launch_file(path, newer_than=started - STALE_SLACK_S, wait_s=wait_s, launch_id=launch_id or None)
    if spec.get("nothing_to_do"):
        print(f"node 0 has nothing to train for {kind} ({spec['nothing_to_do']}): no ranks started", flush=True)
        return
    env = launch_environment(path, spec.get("env"))
    cfg = RunConfig.model_validate(spec["config"])
    if not 0 < node_rank < cfg.distributed.nnodes:
        raise ValueError(
            f"--node-rank {node_rank} must be in 1..{cfg.distributed.nnodes - 1} "
            f"(distributed.nnodes={cfg.distributed.nnodes}; node 0 runs the flow)"
        )
    run_ranks(
        launch_spec(cfg, node_rank=node_rank),
        module,
        ["--spec", str(path.resolve())],
        on_line=lambda line: print(line, flush=True),
        env={**env, **node_secret(run_dir)} if env else None,
    )


def announce_no_launch(run_dir: str, kind: str, why: str) -> None:
    """Node 0: this run has no ``kind`` launch to join (written only when several nodes take part)."""
    from rubricem_core.store import atomic_write_text

    atomic_write_text(launch_path(run_dir, LAUNCHES[kind][0]), json.dumps(with_launch_id({"nothing_to_do": why})))
