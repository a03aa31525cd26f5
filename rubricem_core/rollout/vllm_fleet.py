"""A fleet of `vllm serve` replicas (``rollout.replicas``): ``ReplicaRouter`` keeps each request's calls on
one replica and places new groups on the least loaded; ``VLLMFleet``/``start_fleet`` start them on their
devices and re-send a dead replica's calls to the others (see vllm_server, docs/rollout_fleet.md)."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

from rubricem_core.rollout.types import RolloutError
from rubricem_core.rollout.vllm_engine import TurnCall, TurnSample
from rubricem_core.rollout.vllm_server import ServerClient, VLLMServer, reload_source

log = logging.getLogger(__name__)
T = TypeVar("T")


def call_cost(call: TurnCall) -> int:
    """What a call adds to its replica's load: the tokens it sends and may sample."""
    return len(call.prompt_ids) + call.max_tokens


class ReplicaRouter:
    """Which replica serves a call. Every call of one request (its group) goes to the replica its first
    call went to; a group not placed yet goes to the live replica with the fewest outstanding tokens
    (``call_cost`` of its calls in flight), the lowest index on a tie. Placement never changes a result:
    every call carries its own seed, and every replica holds the same weights."""

    def __init__(self, n_replicas: int) -> None:
        if n_replicas < 1:
            raise RolloutError(f"a fleet needs at least one replica, got {n_replicas}")
        self.live = list(range(n_replicas))
        self.outstanding = [0] * n_replicas
        self.placed: dict[str, int] = {}
        self.lock = threading.Lock()

    def acquire(self, call: TurnCall) -> int:
        """The replica for ``call``, its cost counted as outstanding there until ``release``."""
        with self.lock:
            if not self.live:
                raise RolloutError("no live vLLM replica is left")
            replica = self.placed.get(call.request_id)
            if replica is None:
                replica = min(self.live, key=lambda r: (self.outstanding[r], r))
                self.placed[call.request_id] = replica
            self.outstanding[replica] += call_cost(call)
            return replica

    def release(self, replica: int, call: TurnCall) -> None:
        with self.lock:
            self.outstanding[replica] -= call_cost(call)

    def lose(self, replica: int) -> None:
        """A dead replica: nothing more goes there; its groups are placed again on their next call."""
        with self.lock:
            if replica in self.live:
                self.live.remove(replica)
            self.placed = {rid: r for rid, r in self.placed.items() if r != replica}

    def forget(self) -> None:
        """A new batch: its groups are placed afresh (the prefix caches are reset with new weights anyway)."""
        with self.lock:
            self.placed.clear()


class VLLMFleet:
    """Several replicas (ServerClients: VLLMServers, or ray_replicas.RayReplicas) of one model serving as one sampler: calls routed by ``ReplicaRouter``, at most
    ``server.max_concurrency`` in flight per replica; weights, prefix-cache resets, sleep and wake-up go
    to every live replica. A replica whose process exits has its calls re-sent to the others
    (``stats["resent_calls"]``; ``lost`` keeps why, with its log tail); when none is left, the call fails
    with every replica's log tail. ``on_close`` runs after every replica is closed (a Ray fleet: its
    placement group removed)."""

    def __init__(self, servers: Sequence[ServerClient], on_close: Callable[[], None] | None = None) -> None:
        self.servers = list(servers)
        self._on_close = on_close
        self.router = ReplicaRouter(len(self.servers))
        first = self.servers[0]
        for server in self.servers[1:]:
            if (server.model_dir, server.n_workers, server.weight_transfer) != (
                first.model_dir,
                first.n_workers,
                first.weight_transfer,
            ):
                raise RolloutError("every replica of a fleet must serve the same model, TP size and weight transfer")
        self.model_dir = first.model_dir
        self.n_workers = first.n_workers  # per replica
        self.weight_transfer = first.weight_transfer
        self.max_concurrency = sum(s.max_concurrency for s in self.servers)
        self.pools = [
            ThreadPoolExecutor(max_workers=s.max_concurrency, thread_name_prefix=f"vllm-replica-{r}")
            for r, s in enumerate(self.servers)
        ]
        self.lost: dict[int, str] = {}
        self.stats: dict[str, int] = {"resent_calls": 0}
        self.calls = [0] * len(self.servers)  # calls each replica answered
        self._lock = threading.Lock()

    @property
    def live(self) -> list[int]:
        with self.router.lock:
            return list(self.router.live)

    @property
    def base_urls(self) -> list[str]:
        """The live replicas' URLs, in replica order (their ranks in the weight-transfer group)."""
        return [self.servers[r].base_url for r in self.live]

    # ---- sampling -------------------------------------------------------------------------------
    def submit(self, call: TurnCall) -> Future[TurnSample]:
        replica = self._acquire(call)
        return self.pools[replica].submit(self._sample, call, replica)

    def sample(self, calls: list[TurnCall]) -> list[TurnSample]:
        """The lockstep schedule's sampler: every call submitted at once, answers in call order."""
        futures = [self.submit(call) for call in calls]
        return [future.result() for future in futures]

    def _sample(self, call: TurnCall, replica: int) -> TurnSample:
        while True:
            try:
                sample = self.servers[replica].sample_one(call)
            except Exception as exc:
                self.router.release(replica, call)
                if not self.servers[replica].dead(exc):
                    raise
                self._lose(replica)
                replica = self._reroute(call)
                continue
            self.router.release(replica, call)
            with self._lock:
                self.calls[replica] += 1
            return sample

    def _acquire(self, call: TurnCall) -> int:
        try:
            return self.router.acquire(call)
        except RolloutError:
            with self._lock:
                tails = "\n".join(f"--- replica {r} ---\n{why}" for r, why in sorted(self.lost.items()))
            raise RolloutError(f"every vLLM replica of the fleet has died:\n{tails}") from None

    def _reroute(self, call: TurnCall) -> int:
        replica = self._acquire(call)
        with self._lock:
            self.stats["resent_calls"] += 1
        return replica

    def _lose(self, replica: int) -> None:
        with self._lock:
            if replica in self.lost:
                return
            server = self.servers[replica]
            self.lost[replica] = server.lost_reason()
        self.router.lose(replica)
        log.warning(
            "vLLM replica %d (%s) died; its calls go to replicas %s. %s",
            replica,
            server.base_url,
            self.live,
            self.lost[replica],
        )

    # ---- every live replica -----------------------------------------------------------------------
    def _each(self, fn: Callable[[ServerClient], T]) -> list[T]:
        servers = [self.servers[r] for r in self.live]
        if not servers:
            raise RolloutError("no live vLLM replica is left")
        if len(servers) == 1:
            return [fn(servers[0])]
        with ThreadPoolExecutor(max_workers=len(servers)) as pool:
            return list(pool.map(fn, servers))

    def load_weights_from_dir(self, directory: str | Path) -> float:
        """Every live replica reloads the checkpoint (concurrently); the wall seconds."""
        started = time.perf_counter()
        reload_source(Path(directory))  # prepared once for the step; each replica then finds it in place
        self._each(lambda server: server.load_weights_from_dir(directory))
        return time.perf_counter() - started

    def load_adapter(self, directory: str | Path) -> float:
        """Every live replica loads the LoRA adapter in ``directory`` (concurrently); the wall seconds."""
        started = time.perf_counter()
        self._each(lambda server: server.load_adapter(directory))
        return time.perf_counter() - started

    def reset_prefix_cache(self) -> None:
        self._each(lambda server: server.reset_prefix_cache())

    @property
    def asleep(self) -> bool:
        return any(self.servers[r].asleep for r in self.live)

    def sleep(self) -> None:
        self._each(lambda server: server.sleep())

    def wake_up(self) -> None:
        self._each(lambda server: server.wake_up())

    def close(self) -> None:
        for pool in self.pools:
            pool.shutdown(wait=False, cancel_futures=True)
        for server in self.servers:
            server.close()
        if self._on_close is not None:
            self._on_close()
            self._on_close = None


def split_devices(devices: Sequence[int] | None, replicas: int, tensor_parallel_size: int) -> list[list[int] | None]:
    """Each replica's devices: consecutive runs of ``tensor_parallel_size`` from ``devices`` (None: every
    replica inherits the visible devices, e.g. CPUs)."""
    if devices is None:
        return [None] * replicas
    devices = list(devices)
    if replicas == 1:  # one server takes whatever it is given (colocated: the trainer's GPUs)
        return [devices]
    if len(devices) != replicas * tensor_parallel_size:
        raise RolloutError(
            f"rollout.devices lists {len(devices)} devices, but rollout.replicas={replicas} × "
            f"rollout.tensor_parallel_size={tensor_parallel_size} need {replicas * tensor_parallel_size}"
        )
    if len(set(devices)) != len(devices):
        raise RolloutError(f"rollout.devices lists a device twice: {devices}")
    t = tensor_parallel_size
    return [devices[r * t : (r + 1) * t] for r in range(replicas)]


def replica_log(log_path: str | Path | None, r: int) -> Path | None:
    """Replica r's log: ``log_path`` for replica 0, ``<stem>-<r><suffix>`` beside it for the others."""
    if log_path is None:
        return None
    path = Path(log_path)
    return path if r == 0 else path.with_name(f"{path.stem}-{r}{path.suffix}")


def start_fleet(
    model_dir: str | Path,
    replicas: int,
    *,
    devices: Sequence[int] | None = None,
    tensor_parallel_size: int = 1,
    log_path: str | Path | None = None,
    **server_kwargs: Any,
) -> VLLMFleet:
    """``replicas`` servers of ``model_dir`` started at once (``log_path``: replica 0's log; replica r's
    is ``<stem>-<r><suffix>`` beside it); a server that fails to start stops the others."""
    parts = split_devices(devices, replicas, tensor_parallel_size)
    if devices is None and replicas > 1:
        import torch

        if torch.cuda.is_available():  # every replica would take the same GPUs
            raise RolloutError(
                f"rollout.devices must list the fleet's GPUs ({replicas} replicas × {tensor_parallel_size}); "
                "without it every replica starts on the same visible devices"
            )

    def start(r: int) -> VLLMServer:
        return VLLMServer(
            model_dir,
            devices=parts[r],
            tensor_parallel_size=tensor_parallel_size,
            log_path=replica_log(log_path, r),
            **server_kwargs,
        )

    with ThreadPoolExecutor(max_workers=replicas) as pool:
        futures = [pool.submit(start, r) for r in range(replicas)]
    servers, errors = [], []
    for future in futures:
        try:
            servers.append(future.result())
        except BaseException as exc:
            errors.append(exc)
    if errors:
        for server in servers:
            server.close()
        raise errors[0]
    return VLLMFleet(servers)
