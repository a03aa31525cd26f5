"""Trainer ranks as Ray actors in one placement group, driven by remote calls from the flow process.

    group = RankGroup("rl", world_size=2, log_dir=layout.rank_logs_dir, timeout_s=1800)
    group.build(RLRank, base, cfg)                                    # every rank builds one
    metrics = group.call("update", ...)[0]                            # every rank, same arguments
    group.call_each("update", [args_of_rank_0, args_of_rank_1])       # each rank its own
    group.close()

Each rank is a ``RankWorker`` actor holding one bundle of the group's placement group (a GPU each when
the cluster has GPUs, else a CPU), with ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR`` (rank 0's
node) and ``MASTER_PORT`` set before it starts torch.distributed (NCCL on GPUs, gloo on CPUs); DeepSpeed
adopts that process group. A rank's stdout and stderr (C libraries included) go to its own file,
``<log_dir>/<kind>-rank<k>.log``; the driver tails the files while it waits and hands their lines to
``on_line``. Figures (losses, token counts) are calls' return values, never parsed from the output.

A rank that dies (its process is killed, its node is lost) or raises fails the call at once: Ray reports
a dead actor within milliseconds, the other ranks (who may be waiting in a collective) are killed with the
whole group, and ``RankFailure`` names the rank, its node and pid and ends with its log's last lines.
"""

from __future__ import annotations

import collections
import logging
import os
import secrets
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from rubricem_core import faults
from rubricem_core.distributed.cluster import node_address, uses_gpus
from rubricem_core.distributed.placement import ActorPlacement, actor_bundle

TAIL_LINES = 120
POLL_S = 0.2
log = logging.getLogger(__name__)


class RankFailure(RuntimeError):
    """A trainer rank died or raised; the message names it and holds the end of its output."""


class RankWorker:
    """One trainer rank (a Ray actor: ``ray.remote(RankWorker)``)."""

    def __init__(self, rank: int, world_size: int, log_file: str, env: dict[str, str]) -> None:
        self.rank, self.world_size = rank, world_size
        Path(log_file).parent.mkdir(parents=True, exist_ok=True)
        out = os.open(log_file, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(out, 1)  # C-level writes too (gloo, NCCL, DeepSpeed's native code)
        os.dup2(out, 2)
        os.close(out)
        sys.stdout = os.fdopen(1, "w", buffering=1, closefd=False)
        sys.stderr = os.fdopen(2, "w", buffering=1, closefd=False)
        os.environ.update(env)
        os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(world_size)})
        root = logging.getLogger()
        for handler in list(root.handlers):
            root.removeHandler(handler)
        logging.basicConfig(
            level=logging.INFO if rank == 0 else logging.WARNING,
            stream=sys.stdout,
            format=f"[rank {rank}] %(levelname)s %(name)s: %(message)s",
            force=True,
        )
        self.obj: Any = None

    def where(self) -> dict[str, Any]:
        import ray

        ctx = ray.get_runtime_context()
        return {
            "ip": node_address(ctx.get_node_id()),
            "node_id": ctx.get_node_id(),
            "pid": os.getpid(),
            "gpus": [str(g) for g in ray.get_gpu_ids()],
        }

    def open_rendezvous(self, host: str, timeout_s: float) -> int:
        """Rank 0: the process group's TCPStore, listening on ``host`` only (loopback when every rank is on
        this node); its port."""
        from rubricem_core.distributed.guard import bound_store

        self._server = bound_store(host, timeout_s)
        return int(self._server.port)

    def init_process_group(
        self, host: str, port: int, local_rank: int, timeout_s: float, key: str, loopback: bool
    ) -> None:
        """torch.distributed among the group's ranks (NCCL on GPUs, gloo on CPUs), meeting at rank 0's store
        through values sealed with the group's key: a stranger who reaches the port cannot join."""
        from datetime import timedelta

        import torch
        import torch.distributed as dist

        from rubricem_core.distributed.guard import sealed_store

        os.environ.update({"MASTER_ADDR": host, "MASTER_PORT": str(port), "LOCAL_RANK": str(local_rank)})
        if loopback:  # every rank on this machine: gloo and NCCL's bootstrap listen on 127.0.0.1 only
            os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
            os.environ.setdefault("NCCL_SOCKET_IFNAME", "lo")
        inner = (
            self._server
            if self.rank == 0
            else dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=timeout_s), use_libuv=True)
        )
        self._store = (inner, sealed_store(inner, key, "pg"))  # kept as long as the group
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        if backend == "nccl":
            torch.cuda.set_device(local_rank)
        dist.init_process_group(
            backend,
            store=self._store[1],
            rank=self.rank,
            world_size=self.world_size,
            timeout=timedelta(seconds=timeout_s),
        )

    def build(self, cls: Callable[..., Any], *args: Any, **kwargs: Any) -> None:
        """The object this rank serves calls on: ``cls(*args, **kwargs)``."""
        self.obj = cls(*args, **kwargs)

    def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        try:
            return getattr(self.obj, method)(*args, **kwargs)
        finally:
            sys.stdout.flush()

    def run(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """One function on this rank."""
        try:
            return fn(*args, **kwargs)
        finally:
            sys.stdout.flush()

    def shutdown(self) -> None:
        import torch.distributed as dist

        if self.obj is not None and hasattr(self.obj, "close"):
            self.obj.close()
        if dist.is_available() and dist.is_initialized():
            if dist.get_world_size() > 1:
                dist.barrier()
            dist.destroy_process_group()
        sys.stdout.flush()


class _LogTail:
    """Follows one rank's log file from where it was when the group started."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.offset = path.stat().st_size if path.exists() else 0
        self.tail: collections.deque[str] = collections.deque(maxlen=TAIL_LINES)
        self._partial = ""

    def read(self) -> list[str]:
        try:
            with self.path.open("rb") as f:
                f.seek(self.offset)
                data = f.read()
        except FileNotFoundError:
            return []
        self.offset += len(data)
        text = self._partial + data.decode("utf-8", errors="replace")
        lines = text.split("\n")
        self._partial = lines.pop()
        return lines


class RankGroup:
    """``world_size`` RankWorker actors in one placement group, torch.distributed started among them."""

    def __init__(
        self,
        kind: str,
        world_size: int,
        log_dir: Path,
        timeout_s: float = 1800.0,
        env: dict[str, str] | None = None,
        on_line: Callable[[str], None] = lambda line: None,
    ) -> None:
        import ray

        self.kind, self.world_size, self.timeout_s = kind, world_size, timeout_s
        self.on_line = on_line
        gpu = uses_gpus()
        self._bundle = actor_bundle(1 if gpu else 0)
        bundles = [dict(self._bundle) for _ in range(world_size)]
        # rank 0 on the driver's node: it writes beside the flow and pushes weights to the servers it started
        here = f"node:{ray.util.get_node_ip_address()}"
        if here in ray.cluster_resources():
            bundles[0][here] = 0.001
        self._placed: ActorPlacement | None = ActorPlacement(f"rubricem-{kind}", bundles)
        self.actors: list[Any] = []
        self.where: list[dict[str, Any]] = [{} for _ in range(world_size)]
        self.log_files = [Path(log_dir) / f"{kind}-rank{r}.log" for r in range(world_size)]
        self._tails = [_LogTail(p) for p in self.log_files]
        try:
            self._placed.wait(self.timeout_s, self._unplaced)
            rank_env = {"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"), "PYTHONUNBUFFERED": "1"}
            # the driver's fault injection, never a stale one the raylet inherited when this Ray started
            rank_env.update({var: os.environ.get(var, "") for var in (faults.ENV_VAR, faults.ACTION_VAR)})
            rank_env.update(env or {})
            self.actors = self._placed.start(
                RankWorker,
                # max_concurrency 2: a call and `where`/`shutdown` may overlap
                {"num_cpus": 1, "num_gpus": 1 if gpu else 0, "max_concurrency": 2},
                [(r, world_size, str(self.log_files[r]), rank_env) for r in range(world_size)],
            )
            self.where = self._gather([a.where.remote() for a in self.actors], "start")
            one_node = len({w["node_id"] for w in self.where}) == 1
            master = "127.0.0.1" if one_node else self.where[0]["ip"]
            key = secrets.token_hex(32)  # reaches the ranks through Ray's authenticated calls only
            port = self._gather([self.actors[0].open_rendezvous.remote(master, timeout_s)], "start", ranks=[0])[0]
            # on GPUs Ray shows each rank only its own device, which is then cuda:0 to it
            local = [0] * world_size if gpu else _local_ranks([w["node_id"] for w in self.where])
            self._gather(
                [
                    a.init_process_group.remote(master, port, local[r], timeout_s, key, one_node)
                    for r, a in enumerate(self.actors)
                ],
                "init_process_group",
            )
        except BaseException:
            self.kill()
            raise
        nodes = sorted({w["ip"] for w in self.where})
        log.info("%d %s ranks on %d node(s) %s, logs in %s", world_size, kind, len(nodes), nodes, log_dir)

    def _unplaced(self) -> RankFailure:
        import ray

        return RankFailure(
            f"Ray could not place {self.world_size} {self.kind} ranks within {self.timeout_s:.0f}s "
            f"(each needs {self._bundle}, rank 0 on the driver's node); cluster has {ray.cluster_resources()}"
        )

    # ---- calls -----------------------------------------------------------------------------------
    def build(self, cls: Callable[..., Any], *args: Any, **kwargs: Any) -> None:
        """Every rank builds the object it serves calls on: ``cls(*args, **kwargs)`` (an importable class:
        Ray sends it by its module and name)."""
        self._gather([a.build.remote(cls, *args, **kwargs) for a in self.actors], "build")

    def call(self, method: str, *args: Any, **kwargs: Any) -> list[Any]:
        """``method`` of every rank's object with the same arguments; the ranks' results in rank order."""
        return self._gather([a.call.remote(method, *args, **kwargs) for a in self.actors], method)

    def call_each(self, method: str, args_per_rank: Sequence[tuple[Any, ...]]) -> list[Any]:
        """``method`` of every rank's object, rank r with ``args_per_rank[r]`` (only its own data)."""
        if len(args_per_rank) != self.world_size:
            raise ValueError(f"{len(args_per_rank)} argument tuples for {self.world_size} ranks")
        return self._gather([a.call.remote(method, *args) for a, args in zip(self.actors, args_per_rank)], method)

    def run(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> list[Any]:
        """``fn(*args, **kwargs)`` on every rank (an importable function); the results in rank order."""
        return self._gather([a.run.remote(fn, *args, **kwargs) for a in self.actors], fn.__qualname__)

    def drain(self) -> None:
        """Hand over what the ranks wrote since the last call."""
        for r, tail in enumerate(self._tails):
            for line in tail.read():
                tail.tail.append(line)
                self.on_line(line if line.startswith("[rank") else f"[rank {r}] {line}")

    def _gather(self, refs: list[Any], what: str, ranks: list[int] | None = None) -> list[Any]:
        """The refs' values in order, streaming the logs meanwhile; RankFailure (and the group killed) as soon
        as one rank fails."""
        import ray

        ranks = list(range(len(refs))) if ranks is None else ranks
        pending = dict(zip(refs, ranks))
        results: dict[int, Any] = {}
        while pending:
            done, _ = ray.wait(list(pending), num_returns=1, timeout=POLL_S)
            self.drain()
            for ref in done:
                rank = pending.pop(ref)
                try:
                    results[rank] = ray.get(ref)
                except Exception as exc:  # a dead actor, or an exception it raised
                    rank, cause = self._first_cause(rank, exc, pending)
                    failure = self._failure(rank, what, cause)
                    self.kill()
                    raise failure from None
        return [results[r] for r in ranks]

    def _first_cause(self, rank: int, exc: BaseException, pending: dict[Any, int]) -> tuple[int, BaseException]:
        """The failure to report: a rank that died rather than one whose collective broke because of it
        (the survivors' gloo/NCCL errors often arrive first), waiting a moment for the others' outcomes."""
        import ray

        if not _raised(exc):
            return rank, exc
        done, _ = ray.wait(list(pending), num_returns=len(pending), timeout=2.0) if pending else ([], [])
        for ref in done:
            try:
                ray.get(ref)
            except Exception as other:
                if not _raised(other):
                    return pending[ref], other
        return rank, exc

    def _failure(self, rank: int, what: str, exc: BaseException) -> RankFailure:
        from ray.exceptions import ActorDiedError, RayActorError

        time.sleep(0.2)  # the last lines a dying rank wrote
        self.drain()
        where = self.where[rank] if rank < len(self.where) else {}
        node = f"node {where.get('ip', '?')} (pid {where.get('pid', '?')})"
        if isinstance(exc, (ActorDiedError, RayActorError)) and not _raised(exc):
            cause = f"died: {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}"
        else:
            cause = f"raised {_cause(exc)}"
        tail = list(self._tails[rank].tail) if rank < len(self._tails) else []
        if _raised(exc):  # its traceback, as Ray carried it back
            tail += ["--- traceback ---", *str(exc).splitlines()[-40:]]
        return RankFailure(
            f"{self.kind} trainer rank {rank} of {self.world_size} on {node} {cause} during {what!r}; "
            f"the other ranks were stopped. last lines of {self.log_files[rank]}:\n" + "\n".join(tail)
        )

    # ---- end -------------------------------------------------------------------------------------
    def close(self, timeout_s: float = 60.0) -> None:
        """Stop the ranks cleanly (their objects closed, process group destroyed), then remove the group."""
        import ray

        if self.actors:
            try:
                refs = [a.shutdown.remote() for a in self.actors]
                ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
                self.drain()
            except Exception as exc:  # a rank that cannot stop cleanly is killed below
                log.warning("%s ranks did not stop cleanly: %s", self.kind, exc)
        self.kill()

    def kill(self) -> None:
        """Kill every rank and remove the placement group (idempotent)."""
        if self._placed is not None:
            self._placed.kill()
            self._placed = None
        self.actors = []


def _local_ranks(node_ids: list[str]) -> list[int]:
    """Each rank's index among the ranks on its node (LOCAL_RANK)."""
    seen: dict[str, int] = collections.Counter()
    local = []
    for node in node_ids:
        local.append(seen[node])
        seen[node] += 1
    return local


def _raised(exc: BaseException) -> bool:
    """Whether a Ray error wraps an exception the rank's own code raised (not a death)."""
    from ray.exceptions import RayTaskError

    return isinstance(exc, RayTaskError)


def _cause(exc: BaseException) -> str:
    from ray.exceptions import RayTaskError

    if isinstance(exc, RayTaskError):
        return f"{type(exc.cause).__name__}: {exc.cause}" if exc.cause is not None else str(exc)
    return f"{type(exc).__name__}: {exc}"


def probe() -> dict[str, Any]:
    """What a rank sees (``RankGroup.run(probe)``): its rank, device, the CUDA devices Ray gave it, and an
    all-reduce over the group (the sum of the ranks + 1: world·(world+1)/2)."""
    import torch
    import torch.distributed as dist

    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    value = torch.tensor([float(dist.get_rank() + 1)], device=device)
    dist.all_reduce(value)
    return {
        "rank": dist.get_rank(),
        "world_size": dist.get_world_size(),
        "backend": str(dist.get_backend()),
        "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
        "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES", ""),
        "all_reduce": float(value.item()),
    }
