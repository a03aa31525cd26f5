"""The rollout fleet's replicas placed by Ray (``rollout.placement: ray``): one ``ReplicaHost`` actor owns
each `vllm serve` process, on the node and GPUs Ray gave it; the driver talks to the servers over HTTP.

    fleet = start_ray_fleet(model_dir, replicas=4, tensor_parallel_size=2, log_path=state / "vllm-server.log")
    engine = VLLMServerEngine(fleet, tokenizer)   # as with start_fleet: routing, re-sends, weights, sleep

Why an actor owning the server process, not vLLM's engine inside the actor: the server keeps vLLM's own
process model (its engine core and TP workers), its CUDA image and pinned torch, the weight-transfer
routes and the API-key middleware, exactly as with ``placement: local``; the actor adds what Ray is for —
placement on a node with ``num_gpus = tensor_parallel_size`` (Ray sets its CUDA_VISIBLE_DEVICES, passed
on to the server), a lifetime tied to the run, and death detection. vLLM's engine inside the actor would
tie this project's Python environment to vLLM's pinned torch.

Placement: one placement group per fleet (``distributed.placement.ActorPlacement``, as the trainer ranks'),
a bundle per replica ({"GPU": TP, "CPU": 1} on a cluster with GPUs, else {"CPU": 1}), strategy PACK: replicas share as few nodes as they fit on, so a fleet that fits
beside the driver stays on loopback and a weight push crosses as few NICs as it can; PACK is soft, so a
fleet larger than one node still spreads over several (SPREAD would scatter even a small fleet across
nodes for no gain: a replica already is the unit of failure, and its TP group lives in one bundle, on one
node, either way).

Addresses: a replica on the driver's node listens on 127.0.0.1; one on another node listens on that node's
address (the one Ray knows it by), guarded by the server's API key on every route
(vllm_auth.RequireApiKey); the key reaches the actor only as a call argument over Ray's own channel.

Failures: a replica is lost when its process exits or its actor dies (``ray.kill``, a lost node): the
server is started with PR_SET_PDEATHSIG, so it dies with its actor; the fleet re-sends the replica's calls
to the others exactly as with local processes (docs/rollout_fleet.md), and when none is left its error
names every replica's node and log tail.
"""

from __future__ import annotations

import collections
import logging
import os
import time
from pathlib import Path
from typing import Any

import httpx

from rubricem_core.rollout.types import RolloutError
from rubricem_core.rollout.vllm_fleet import VLLMFleet, replica_log
from rubricem_core.rollout.vllm_server import ServerClient, ServerProcess

log = logging.getLogger(__name__)
TAIL_LINES = 80


class ReplicaHost:
    """One replica's `vllm serve` process on this actor's node (a Ray actor: ``ray.remote(ReplicaHost)``)."""

    def __init__(self, replica: int, env: dict[str, str]) -> None:
        os.environ.update(env)
        self.replica = replica
        self.process: ServerProcess | None = None

    def start(
        self,
        model_dir: str,
        api_key: str,
        driver_node_id: str,
        startup_timeout_s: float,
        server_kwargs: dict[str, Any],
    ) -> dict[str, Any]:
        """Start the server (loopback on the driver's node, else this node's address) and wait until it
        answers; where it runs and its URL."""
        import ray

        ctx = ray.get_runtime_context()
        node_id = ctx.get_node_id()
        from rubricem_core.distributed.cluster import node_address

        ip = node_address(node_id)
        host = "127.0.0.1" if node_id == driver_node_id else ip
        gpus = [str(g) for g in ray.get_gpu_ids()]  # what Ray set this actor's CUDA_VISIBLE_DEVICES to
        try:  # the server gets SIGTERM if this actor's process is killed outright (ServerProcess)
            self.process = ServerProcess(model_dir, api_key=api_key, host=host, devices=gpus or None, **server_kwargs)
            self.process.wait_ready(startup_timeout_s, api_key)
        except BaseException as exc:
            self.stop()
            raise RolloutError(f"on node {ip} (GPUs {gpus or 'none'}): {exc}") from None
        return {
            "base_url": self.process.base_url,
            "ip": ip,
            "node_id": node_id,
            "pid": os.getpid(),
            "server_pid": self.process.proc.pid,
            "gpus": gpus,
        }

    def tail(self) -> str:
        return self.process.tail() if self.process is not None else ""

    def exit_code(self, broken_connection: bool, wait_s: float) -> int | None:
        """The server's exit code, or None while it runs (after a broken connection it gets ``wait_s`` to
        finish dying)."""
        if self.process is None or not self.process.dead(broken_connection, wait_s):
            return None
        return self.process.returncode

    def stop(self) -> None:
        if self.process is not None:
            self.process.stop()


class RayReplica(ServerClient):
    """The driver's client of a server a ReplicaHost started (``info``: what ``start`` returned)."""

    def __init__(self, actor: Any, replica: int, info: dict[str, Any], log_path: Path | None, **kwargs: Any) -> None:
        super().__init__(info["base_url"], **kwargs)
        self.actor, self.replica, self.info, self.log_path = actor, replica, info, log_path
        self._why: str | None = None
        self._last_tail = ""

    @property
    def where(self) -> str:
        i = self.info
        return f"node {i['ip']} (actor pid {i['pid']}, server pid {i['server_pid']}, GPUs {i['gpus'] or 'none'})"

    def dead(self, exc: BaseException | None = None, wait_s: float = 10.0) -> bool:
        """Whether the server is gone: its process exited, or its actor died (then so did the server)."""
        import ray
        from ray.exceptions import GetTimeoutError, RayActorError

        if self._why is not None:
            return True
        broken = isinstance(exc, httpx.TransportError)
        try:
            code = ray.get(self.actor.exit_code.remote(broken, wait_s), timeout=wait_s + 30)
        except GetTimeoutError:  # an actor too busy to answer is not known dead
            return False
        except RayActorError as died:  # ActorDiedError, ActorUnavailableError: the actor (and its server) is gone
            self._why = f"lost its Ray actor ({type(died).__name__}: {_first_line(died)})"
            return True
        if code is None:
            return False
        self._why = f"exited with code {code}"
        self.tail()  # while the actor still answers
        return True

    def tail(self) -> str:
        """The server's last lines: from its actor, else (the actor is gone) from its log file where this
        process can read it, else the last lines fetched."""
        import ray

        try:
            self._last_tail = ray.get(self.actor.tail.remote(), timeout=10)
            return self._last_tail
        except Exception:
            pass
        if self.log_path is not None and self.log_path.exists():
            with self.log_path.open(errors="replace") as f:
                return "\n".join(line.rstrip("\n") for line in collections.deque(f, maxlen=TAIL_LINES))
        return self._last_tail or f"(no output reachable: the log is {self.log_path} on {self.info['ip']})"

    def lost_reason(self) -> str:
        return f"on {self.where} {self._why or 'is gone'}; last lines:\n{self.tail()}"

    def close(self) -> None:
        import ray

        super().close()
        try:
            ray.get(self.actor.stop.remote(), timeout=60)
        except Exception:  # gone already, or stuck: killed below
            pass
        try:
            ray.kill(self.actor, no_restart=True)
        except Exception:
            pass


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else ""


def start_ray_fleet(
    model_dir: str | Path,
    replicas: int,
    *,
    tensor_parallel_size: int = 1,
    log_path: str | Path | None = None,
    startup_timeout_s: float = 900.0,
    request_timeout_s: float = 600.0,
    max_concurrency: int = 64,
    weight_transfer: str | None = None,
    api_key: str | None = None,
    env: dict[str, str] | None = None,
    **server_kwargs: Any,
) -> VLLMFleet:
    """``replicas`` servers of ``model_dir``, each owned by a ReplicaHost actor in one placement group of the
    connected Ray cluster (rubricem_core.distributed.cluster.connect first), started at once; a replica that
    cannot be placed or started stops the others and the error names its node and output tail."""
    import ray

    from rubricem_core.distributed.cluster import RAY_ENV, uses_gpus
    from rubricem_core.distributed.guard import vllm_api_key
    from rubricem_core.distributed.placement import ActorPlacement, actor_bundle

    if not ray.is_initialized():
        raise RolloutError("rollout.placement: ray needs a connected Ray (distributed.cluster.connect)")
    api_key = api_key or vllm_api_key()
    gpu = uses_gpus()
    bundle = actor_bundle(tensor_parallel_size if gpu else 0)
    placed = ActorPlacement("rubricem-rollout", [bundle] * replicas)

    def unplaced() -> RolloutError:
        return RolloutError(
            f"Ray could not place {replicas} vLLM replicas within {startup_timeout_s:.0f}s (each needs {bundle}; "
            f"rollout.replicas × rollout.tensor_parallel_size GPUs beside the trainer's); the cluster has "
            f"{ray.cluster_resources()}, free {ray.available_resources()}"
        )

    try:
        placed.wait(startup_timeout_s, unplaced)
        actor_env = {**RAY_ENV, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
        driver_node = ray.get_runtime_context().get_node_id()
        kwargs = {
            "tensor_parallel_size": tensor_parallel_size,
            "weight_transfer": weight_transfer,
            "env": env,
            **server_kwargs,
        }
        actors = placed.start(
            ReplicaHost,
            # max_concurrency 4: tail/exit_code/stop answer while start waits for the server
            {"num_cpus": 1, "num_gpus": tensor_parallel_size if gpu else 0, "max_concurrency": 4},
            [(r, actor_env) for r in range(replicas)],
        )
        refs = []
        for r, actor in enumerate(actors):
            log_r = replica_log(log_path, r)
            refs.append(
                actor.start.remote(
                    str(model_dir),
                    api_key,
                    driver_node,
                    startup_timeout_s,
                    {**kwargs, "log_path": str(log_r) if log_r else None},
                )
            )
        infos = _gather_started(refs, startup_timeout_s)
    except BaseException:
        placed.kill()
        raise
    clients = [
        RayReplica(
            actors[r],
            r,
            infos[r],
            replica_log(log_path, r),
            api_key=api_key,
            model_dir=model_dir,
            tensor_parallel_size=tensor_parallel_size,
            weight_transfer=weight_transfer,
            max_concurrency=max_concurrency,
            request_timeout_s=request_timeout_s,
        )
        for r in range(replicas)
    ]
    nodes = sorted({i["ip"] for i in infos})
    log.info("%d vLLM replicas placed by Ray on node(s) %s: %s", replicas, nodes, [c.base_url for c in clients])
    return VLLMFleet(clients, on_close=placed.kill)


def _gather_started(refs: list[Any], timeout_s: float) -> list[dict[str, Any]]:
    """Every replica's start result; the first failure (raised, actor died, timed out) as a RolloutError
    naming the replica, its node and its output's tail."""
    import ray
    from ray.exceptions import RayTaskError

    pending = {ref: r for r, ref in enumerate(refs)}
    results: dict[int, dict[str, Any]] = {}
    deadline = time.monotonic() + timeout_s + 60
    while pending:
        done, _ = ray.wait(list(pending), num_returns=1, timeout=max(0.0, deadline - time.monotonic()))
        if not done:
            r = min(pending.values())
            raise RolloutError(f"vLLM replica {r} did not start within {timeout_s:.0f}s")
        ref = done[0]
        r = pending.pop(ref)
        try:
            results[r] = ray.get(ref)
        except RayTaskError as exc:  # the server failed to start: the cause carries its output's tail
            raise RolloutError(f"vLLM replica {r} (a Ray actor) failed to start: {exc.cause or exc}") from None
        except Exception as exc:  # the actor died
            raise RolloutError(
                f"vLLM replica {r}'s Ray actor died while starting ({type(exc).__name__}: {_first_line(exc)})"
            ) from None
    return [results[r] for r in range(len(refs))]
