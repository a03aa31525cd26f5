"""The trainer side of vLLM's weight-transfer API: push the trainer's weights into a `vllm serve` process.

    pusher = WeightPusher(trainer.model, backend="nccl", timeout_s=600)
    seconds = pusher.push("http://127.0.0.1:8000", n_workers=2, is_sender=rank == 0)   # on every trainer rank

Every trainer rank iterates the model's parameters in the same order; a ZeRO-3 parameter is gathered on
its own (``deepspeed.zero.GatheredParameters``), sent, and partitioned again, so no rank ever holds more
than one whole tensor beyond its shard and nothing sent is a 0-size placeholder. Rank 0 alone talks to
the server: ``/init_weight_transfer_engine`` once (the server's workers join a process group with it),
then per push ``/start_weight_update``, ``/update_weights`` (answered once the workers have received
every tensor of the broadcast that rank 0 runs meanwhile) and ``/finish_weight_update`` (vLLM's
layerwise reload applies its post-processing). The caller then drops the server's prefix cache.

A rollout fleet (several `vllm serve` replicas) gets one push through ONE transfer group: rank 0 and
every replica's workers (replica r's worker w at rank ``1 + r × n_workers + w``). ``FleetWeightSync`` fans
each control call out to all replicas at once (the init call with each replica's own ``rank_offset``),
so every tensor is broadcast once, whatever the number of replicas (NCCL's broadcast pipelines it over
the ring/tree; R groups would make rank 0 send R copies). It is what vLLM's own multi-engine client
(RayVLLMWeightSyncClient) does for data-parallel engines.

The flow process's own engine takes the Ray trainer ranks' weights through Ray's object store
(rubricem_core.rl.ray_policy: ``RayPolicy.weights``): no checkpoint is written for it.

Backends: ``nccl`` is vLLM's own trainer engine (NCCLTrainerWeightTransferEngine, imported from vLLM,
which the trainer's environment must have: the ``gpu`` extra); ``gloo`` is the same protocol over a gloo
group (rubricem_core.rollout.vllm_gloo on the server side), for CPUs and the tests.
"""

from __future__ import annotations

import secrets
import socket
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import FIRST_EXCEPTION, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import torch
from torch import nn

from rubricem_core.distributed.guard import bound_store, gloo_group, group_token, sealed_store, vllm_api_key
from rubricem_core.processes import free_port
from rubricem_core.rollout.types import RolloutError
from rubricem_core.rollout.vllm_gloo import GROUP_PREFIX
from rubricem_core.training.adapters import is_adapter_model, merged_named_tensors, merged_params

BACKENDS = ("nccl", "gloo")
LOOPBACK = "127.0.0.1"


class WeightTransferError(RolloutError):
    """A weight push to the vLLM server failed (the server's reply or the transfer group says why)."""


@dataclass(frozen=True)
class ParamMeta:
    """One parameter as the server will receive it: vLLM's ParamMeta fields."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]


def _zero3(param: nn.Parameter) -> bool:
    return hasattr(param, "ds_id")  # DeepSpeed ZeRO-3 marks its partitioned parameters so


class ModelWeights:
    """vLLM's WeightSource over a trainer's module: whole tensors in ``named_parameters`` order. A tied
    ``lm_head.weight`` is sent too, under its own name: vLLM's layerwise reload counts a layer as loaded
    only when its own names arrive, and puts the old tensors back into one that got nothing (the tied
    head would keep the old embedding). Iterating is collective under ZeRO-3: every rank must do it."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model

    def metadata(self) -> list[ParamMeta]:
        if is_adapter_model(self.model):  # LoRA: the merged weights, under the base model's names
            return [
                ParamMeta(n, p.dtype, tuple(p.ds_shape) if _zero3(p) else tuple(p.shape))
                for n, p in merged_params(self.model)
            ]
        return [
            ParamMeta(name, p.dtype, tuple(p.ds_shape) if _zero3(p) else tuple(p.shape))
            for name, p in self.model.named_parameters(remove_duplicate=False)
        ]

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        if is_adapter_model(self.model):  # base + (alpha/r)·BA per layer, computed beside the base
            yield from merged_named_tensors(self.model)
            return
        for name, param in self.model.named_parameters(remove_duplicate=False):
            if _zero3(param):
                import deepspeed

                # a copy of the gathered tensor: the parameter is partitioned again when the loop moves on,
                # and vLLM's NCCL sender may still hold what it was given (packing several into one buffer,
                # or a broadcast enqueued on a stream)
                with deepspeed.zero.GatheredParameters([param]):
                    whole = param.data.clone()
                yield name, whole
            else:
                yield name, param.detach()


class ServerWeightSync:
    """vLLM's weight-sync control plane over its HTTP routes (served with ``VLLM_SERVER_DEV_MODE=1``),
    with the launch's API key (the server refuses any request without it)."""

    def __init__(self, base_url: str, timeout_s: float, api_key: str | None = None) -> None:
        import httpx

        self.base_url = base_url.rstrip("/")
        headers = {"Authorization": f"Bearer {api_key or vllm_api_key()}"}
        self.http = httpx.Client(base_url=self.base_url, timeout=timeout_s, headers=headers)

    def _post(self, path: str, body: dict[str, Any] | None = None) -> None:
        response = self.http.post(path, json=body)
        if response.status_code != 200:
            raise WeightTransferError(
                f"vLLM server {self.base_url} answered {path} with HTTP {response.status_code}: {response.text[:1000]}"
            )

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self._post("/init_weight_transfer_engine", {"init_info": init_info})

    def start_weight_update(self) -> None:
        self._post("/start_weight_update")

    def update_weights(self, update_info: dict[str, Any]) -> None:
        self._post("/update_weights", {"update_info": update_info})

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self._post("/finish_weight_update", {"weight_version": weight_version} if weight_version else None)

    def close(self) -> None:
        self.http.close()


class FleetWeightSync:
    """The control plane of one transfer group spanning several servers of ``n_workers`` workers each:
    every call goes to all of them concurrently and returns when all have answered, or raises the
    first failure at once (a stuck server must not hide another's answer)."""

    def __init__(self, base_urls: Sequence[str], n_workers: int, timeout_s: float) -> None:
        self.clients = [ServerWeightSync(url, timeout_s) for url in base_urls]
        self.n_workers = n_workers

    def _all(self, fn: Callable[[ServerWeightSync, int], None]) -> None:
        if len(self.clients) == 1:
            fn(self.clients[0], 0)
            return
        pool = ThreadPoolExecutor(max_workers=len(self.clients))
        try:
            futures = [pool.submit(fn, client, r) for r, client in enumerate(self.clients)]
            wait(futures, return_when=FIRST_EXCEPTION)
            for future in futures:
                if future.done() and future.exception() is not None:
                    future.result()
            for future in futures:
                future.result()
        finally:
            pool.shutdown(wait=False)  # a server stuck in a broadcast must not hang the trainer too

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        offset = int(init_info.get("rank_offset", 1))  # the trainer's senders sit below it

        def init(client: ServerWeightSync, r: int) -> None:
            client.init_weight_transfer_engine({**init_info, "rank_offset": offset + r * self.n_workers})

        self._all(init)

    def start_weight_update(self) -> None:
        self._all(lambda client, _: client.start_weight_update())

    def update_weights(self, update_info: dict[str, Any]) -> None:
        self._all(lambda client, _: client.update_weights(update_info))

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self._all(lambda client, _: client.finish_weight_update(weight_version))

    def close(self) -> None:
        for client in self.clients:
            client.close()


def is_loopback(host: str) -> bool:
    return host in ("127.0.0.1", "localhost", "::1")


def master_address_for(server_url: str | Sequence[str]) -> str:
    """The transfer group's master address for these servers, on trainer rank 0: 127.0.0.1 when every server
    listens on loopback (the fleet runs beside rank 0), else the address this node reaches the first remote
    server from (its route's source address: what that server's workers can connect back to)."""
    remote = [u for u in server_urls(server_url) if not is_loopback(urlsplit(u).hostname or "")]
    if not remote:
        return LOOPBACK
    parts = urlsplit(remote[0])
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:  # no packet is sent: a route lookup
        probe.connect((parts.hostname or "", parts.port or 80))
        return str(probe.getsockname()[0])


def server_urls(server_url: str | Sequence[str]) -> tuple[str, ...]:
    """One server's URL or a fleet's, as a tuple (the order fixes the replicas' ranks)."""
    urls = (server_url,) if isinstance(server_url, str) else tuple(server_url)
    if not urls:
        raise WeightTransferError("no vLLM server to push weights to")
    return urls


def update_info(meta: list[ParamMeta]) -> dict[str, Any]:
    """The per-push update info both backends' workers read: what to receive, in order."""
    return {
        "names": [m.name for m in meta],
        "dtype_names": [str(m.dtype).removeprefix("torch.") for m in meta],
        "shapes": [list(m.shape) for m in meta],
    }


def checked(source: ModelWeights, meta: list[ParamMeta]) -> Iterator[tuple[str, torch.Tensor]]:
    """The source's tensors, each checked against the metadata the workers were sent (a mismatch would
    split the stream differently on the two sides: a hang or garbage weights)."""
    n = 0
    for name, tensor in source:
        want = meta[n] if n < len(meta) else None
        if want is None or (name, tensor.dtype, tuple(tensor.shape)) != (want.name, want.dtype, want.shape):
            raise WeightTransferError(
                f"parameter {n} is {name} {tensor.dtype} {tuple(tensor.shape)}, but the server was told "
                f"{want.name + ' ' + str(want.dtype) + ' ' + str(want.shape) if want else 'there are only ' + str(n)}"
            )
        n += 1
        yield name, tensor
    if n != len(meta):
        raise WeightTransferError(f"sent {n} parameters, but the server waits for {len(meta)}")


class GlooSender:
    """Rank 0 of a gloo group with the server's workers (ranks 1..n), vLLM's NCCL trainer engine's
    protocol over gloo. Non-sender trainer ranks only iterate the source (ZeRO-3's gathers)."""

    def __init__(self, client: FleetWeightSync | None, source: ModelWeights, group: Any, store: Any = None) -> None:
        self.client, self.source, self.group = client, source, group
        self.store = store  # the workers' rendezvous store (and its sealed view) live as long as the group
        self.pending: Any = None  # the broadcast under way

    @classmethod
    def trainer_init(
        cls,
        client: FleetWeightSync | None,
        source: ModelWeights,
        world_size: int,
        timeout_s: float,
        master_address: str = LOOPBACK,
    ) -> GlooSender:
        if client is None:
            return cls(None, source, None)

        # The store listens on ``master_address`` only: loopback when every server runs beside rank 0, else
        # rank 0's node address. Either way the group's name and rendezvous key travel to the workers only
        # over the API-key-guarded HTTP route, and the rendezvous is sealed with that key.
        store = bound_store(master_address, timeout_s)
        prefix = f"{GROUP_PREFIX}/{group_token(purpose='vllm-push')}/{secrets.token_hex(8)}"
        group_key = secrets.token_hex(32)  # seals the rendezvous: no stranger on the store joins the group
        init = {
            "master_address": master_address,
            "master_port": store.port,
            "rank_offset": 1,
            "world_size": world_size,
            "timeout_s": timeout_s,
            "group_prefix": prefix,
            "group_key": group_key,
        }
        # the workers block in the rendezvous until this rank joins: ask them from a side thread
        with ThreadPoolExecutor(max_workers=1) as pool:
            joined = pool.submit(client.init_weight_transfer_engine, init)
            rendezvous = sealed_store(store, group_key, prefix)
            group = gloo_group(rendezvous, 0, world_size, timeout_s, loopback=is_loopback(master_address))
            joined.result()
        return cls(client, source, group, (store, rendezvous))

    def send_weights(self) -> None:
        if self.client is None:
            for _ in self.source:  # this rank's part of each gather
                pass
            return
        meta = self.source.metadata()
        self.client.start_weight_update()
        pool = ThreadPoolExecutor(max_workers=1)
        try:
            received = pool.submit(self.client.update_weights, update_info(meta))
            for _name, tensor in checked(self.source, meta):
                self.pending = self.group.broadcast(tensor.contiguous(), 0)
                _wait(self.pending, received)
            received.result()
        finally:
            pool.shutdown(wait=False)  # a worker stuck in a broadcast must not hang this rank too
        self.client.finish_weight_update()

    def shutdown(self) -> None:
        if self.pending is not None and not self.pending.is_completed():
            # destroying a gloo group waits for its unfinished work (up to the group's timeout): keep it
            _ABANDONED.append((self.group, self.store, self.pending))
        self.group = self.store = self.pending = None


_ABANDONED: list[tuple[Any, Any, Any]] = []  # groups left with a broadcast no worker will receive


def _wait(work: Any, received: Future[None]) -> None:
    """Wait for one broadcast; if the server's /update_weights has failed meanwhile (a worker that could
    not load a tensor stops receiving), raise its answer now instead of waiting out the group's timeout."""
    while not work.is_completed():
        if received.done():
            received.result()  # raises the server's error; a success means the workers have it all
        time.sleep(0.0002)
    work.wait()


def _nccl_sender(
    client: FleetWeightSync | None, source: ModelWeights, world_size: int, is_sender: bool, master_address: str
) -> Any:
    try:
        from vllm.distributed.weight_transfer.nccl_engine import (
            NCCLTrainerInitInfo,
            NCCLTrainerWeightTransferEngine,
        )
    except ImportError as exc:
        raise WeightTransferError(
            "rollout.weight_transfer: nccl pushes with vLLM's NCCL trainer engine, which the trainer ranks "
            f"import, and vLLM does not import here ({exc}); install the gpu extra in the trainer's environment "
            "or use rollout.weight_transfer: checkpoint"
        ) from exc
    init = NCCLTrainerInitInfo(
        master_address=master_address, master_port=free_port(), world_size=world_size, rank=0 if is_sender else 1
    )
    return NCCLTrainerWeightTransferEngine.trainer_init(init, client=client, source=source)


class WeightPusher:
    """One trainer rank's side of the transfer to one vLLM server or a fleet of them, opened on the first
    push and kept (the servers' workers stay in the group) until ``close`` or until the servers change
    (a fleet that lost a replica: the next push opens a new group with the survivors).

    ``master_address``: where rank 0 listens for the group's rendezvous (the gloo store, NCCL's bootstrap).
    127.0.0.1, the default, serves a fleet beside rank 0; replicas on other nodes (``rollout.placement: ray``)
    need rank 0's node address: ``master_address_for(urls)`` gives the right one for a fleet's URLs. A
    loopback master with a server that is not on loopback is refused (its workers could never join)."""

    def __init__(self, model: nn.Module, backend: str, timeout_s: float, master_address: str = LOOPBACK) -> None:
        if backend not in BACKENDS:
            raise ValueError(f"rollout.weight_transfer: unknown backend {backend!r}; expected one of {BACKENDS}")
        self.source = ModelWeights(model)
        self.backend = backend
        self.timeout_s = timeout_s
        self.master_address = master_address
        self._client: FleetWeightSync | None = None
        self._sender: Any = None
        self._urls: tuple[str, ...] | None = None

    def push(self, server_url: str | Sequence[str], n_workers: int, is_sender: bool) -> float:
        """Send every weight to the ``n_workers`` workers of each server (one URL, or a fleet's list);
        the seconds it took (every rank calls this; only the sender talks to the servers)."""
        started = time.perf_counter()
        urls = server_urls(server_url)
        remote = [u for u in urls if not is_loopback(urlsplit(u).hostname or "")]
        if remote and is_loopback(self.master_address):
            raise WeightTransferError(
                f"vLLM servers {remote} are on another node, but the weight-transfer group's master address is "
                f"{self.master_address}, which they cannot reach: give WeightPusher master_address = trainer "
                "rank 0's node address (master_address_for(urls))"
            )
        if self._sender is None or self._urls != urls:
            self.close()
            self._urls = urls
            self._client = FleetWeightSync(urls, n_workers, self.timeout_s) if is_sender else None
            world_size = 1 + len(urls) * n_workers
            if self.backend == "nccl":
                self._sender = _nccl_sender(self._client, self.source, world_size, is_sender, self.master_address)
            else:
                self._sender = GlooSender.trainer_init(
                    self._client, self.source, world_size, self.timeout_s, self.master_address
                )
        try:
            self._sender.send_weights()
        except BaseException:
            self.close()  # the group is out of step now: the next push opens a new one
            raise
        return time.perf_counter() - started

    def close(self) -> None:
        if self._sender is not None:
            self._sender.shutdown()
            self._sender = None
        if self._client is not None:
            self._client.close()
            self._client = None
