"""The Ray cluster the flow process drives its trainer ranks (and rollout replicas) on.

    connect(cfg.distributed)      # join distributed.ray_address / RAY_ADDRESS, else start a local Ray
    ...                           # RankGroup(...) places actors on it
    disconnect()                  # shut down only a Ray this process started

A local Ray is known by 127.0.0.1 (its ports listen on every interface, guarded by Ray's token
authentication, on by default; a warning when RAY_AUTH_MODE=disabled turns it off), has no dashboard and no usage statistics, and offers the
machine's CPUs and GPUs (``distributed.train_devices``: only those GPUs). A cluster (KubeRay, ``ray
start``) is joined as it is: its own token authentication guards it (docs/distributed.md).
"""

from __future__ import annotations

import logging
import os
import threading
from pathlib import Path
from typing import Any

from rubricem_core.config import DistributedConfig
from rubricem_core.redact import redact_text

log = logging.getLogger(__name__)

# what every process of ours on a Ray node needs: offline, quiet, no telemetry
RAY_ENV = {
    "RAY_USAGE_STATS_ENABLED": "0",
    "RAY_DEDUP_LOGS": "0",
}
_started_here = False
_lock = threading.Lock()


def cluster_address(d: DistributedConfig) -> str | None:
    """The cluster to join: ``distributed.ray_address``, else ``RAY_ADDRESS`` (None: start a local Ray)."""
    return d.ray_address or os.environ.get("RAY_ADDRESS") or None


def connect(d: DistributedConfig) -> None:
    """This process as the driver of a Ray cluster (idempotent)."""
    global _started_here
    import ray

    with _lock:
        if ray.is_initialized():
            return
        os.environ.update({k: v for k, v in RAY_ENV.items() if k not in os.environ})
        address = cluster_address(d)
        common: dict[str, Any] = {"log_to_driver": False, "configure_logging": False}
        if address is not None:
            log.info("joining the Ray cluster at %s", redact_text(address))
            ray.init(address=address, **common)
            return
        import torch

        if os.environ.get("RAY_AUTH_MODE") == "disabled":
            # Ray's ports listen on every interface; its token authentication is what guards them
            log.warning("RAY_AUTH_MODE=disabled: this local Ray's ports are open to anyone who reaches this machine")
        gpus = torch.cuda.device_count() if d.train_devices is None else len(d.train_devices)
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        if d.train_devices is not None:  # the raylet starts with only these GPUs visible
            os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(str(i) for i in d.train_devices)
        try:
            ray.init(
                _node_ip_address="127.0.0.1",
                include_dashboard=False,
                # the workers import what this process imports (a checkout on sys.path, tests' helpers)
                runtime_env={"env_vars": {"PYTHONPATH": import_path()}},
                num_cpus=os.cpu_count() or 1,
                num_gpus=gpus,
                **common,
            )
        finally:
            if d.train_devices is not None:
                if visible is None:
                    os.environ.pop("CUDA_VISIBLE_DEVICES", None)
                else:
                    os.environ["CUDA_VISIBLE_DEVICES"] = visible
        _started_here = True
        private_token_files()
        log.info("started a local Ray on 127.0.0.1 (%d CPUs, %d GPUs)", os.cpu_count() or 1, gpus)


def private_token_files(home: Path | None = None) -> list[Path]:
    """Ray writes the token it generates to ``~/.ray/auth_token`` readable by all (0644) and reuses it in every
    later run; the token is the cluster's only guard, so it is made the owner's alone (0600, the folder 0700).
    Returns the files changed."""
    folder = (home or Path.home()) / ".ray"
    changed = []
    if folder.is_dir():
        if folder.stat().st_mode & 0o077:
            folder.chmod(0o700)
        for path in folder.glob("*token*"):
            if path.is_file() and path.stat().st_mode & 0o077:
                path.chmod(0o600)
                changed.append(path)
    return changed


def import_path() -> str:
    """This process's own import roots (sys.path minus the interpreter's), as a PYTHONPATH."""
    import sys
    import sysconfig

    ours = {sysconfig.get_paths()[k] for k in ("stdlib", "platstdlib", "purelib", "platlib")}
    roots = [str(Path(p or ".").resolve()) for p in sys.path if not p.endswith(".zip")]
    keep = [p for p in roots if Path(p).is_dir() and p not in ours and not p.startswith(sys.base_prefix)]
    extra = os.environ.get("PYTHONPATH", "")
    return os.pathsep.join(dict.fromkeys([*keep, *[e for e in extra.split(os.pathsep) if e]]))


def disconnect() -> None:
    """Shut down the Ray this process started (a cluster it joined keeps running)."""
    global _started_here
    import ray

    with _lock:
        if ray.is_initialized() and _started_here:
            ray.shutdown()
        _started_here = False


def uses_gpus() -> bool:
    """Whether the cluster has GPUs for the trainer ranks (else they are gloo ranks on CPUs)."""
    import ray

    return float(ray.cluster_resources().get("GPU", 0)) > 0


def node_address(node_id: str) -> str:
    """The address Ray knows a node by (127.0.0.1 on a local Ray), which its other nodes reach it at."""
    import ray

    for node in ray.nodes():
        if node["NodeID"] == node_id:
            return str(node["NodeManagerAddress"])
    return str(ray.util.get_node_ip_address())
