"""A ``gloo`` backend for vLLM's weight-transfer API: the CPU twin of its ``nccl`` backend.

vLLM's weight transfer (``--weight-transfer-config '{"backend": "nccl"}'``, routes
``/init_weight_transfer_engine``, ``/start_weight_update``, ``/update_weights``, ``/finish_weight_update``)
broadcasts the trainer's weights into the server's workers over NCCL, which needs GPUs. This backend is
the same protocol over a gloo process group, so the whole push (trainer ranks gathering ZeRO-3
parameters tensor by tensor, the server's layerwise reload) runs and is tested on a CPU with vLLM's CPU
build. vLLM loads it as a general plugin (entry point ``vllm.general_plugins`` in pyproject.toml), in
every process that builds a worker; ``register`` adds the backend to vLLM's engine registry.

The worker's rank in the transfer group follows vLLM's NCCL engine: the trainer is rank 0, worker w of
data-parallel replica d is ``rank_offset + d × (TP × PP) + w``. The trainer side is
rubricem_core.rollout.weight_transfer (it imports no vLLM).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Any

BACKEND = "gloo"
GROUP_PREFIX = "rubricem-weight-transfer"  # the transfer group's keys in the trainer's store


def register() -> None:
    """vLLM general plugin: make ``backend: gloo`` a weight-transfer engine (idempotent: vLLM may load
    plugins more than once in a process)."""
    try:
        from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory
    except ImportError:  # a vLLM without the weight-transfer API: nothing to add, and vLLM must still start
        return
    try:
        WeightTransferEngineFactory.register_engine(BACKEND, gloo_engine_class())
    except ValueError:  # already registered in this process
        pass


def gloo_engine_class() -> type:
    """The engine class; built on call so that importing this module needs no vLLM."""
    import torch
    import torch.distributed as dist
    from vllm.distributed.weight_transfer.base import (
        WeightTransferEngine,
        WeightTransferInitInfo,
        WeightTransferUpdateInfo,
    )

    @dataclass
    class GlooInitInfo(WeightTransferInitInfo):
        master_address: str
        master_port: int
        rank_offset: int
        world_size: int
        timeout_s: float = 600.0
        group_prefix: str = GROUP_PREFIX  # this group's keys in the trainer's store
        group_key: str = ""  # the trainer's key sealing the rendezvous (rubricem_core.distributed.guard.sealed_store)

    @dataclass
    class GlooUpdateInfo(WeightTransferUpdateInfo):
        names: list[str]
        dtype_names: list[str]
        shapes: list[list[int]]

        def __post_init__(self) -> None:
            if not len(self.names) == len(self.dtype_names) == len(self.shapes):
                raise ValueError(
                    f"names, dtype_names and shapes differ in length: "
                    f"{len(self.names)}, {len(self.dtype_names)}, {len(self.shapes)}"
                )

    class GlooWeightTransferEngine(WeightTransferEngine[GlooInitInfo, GlooUpdateInfo]):
        """Receives each tensor by a gloo broadcast from the trainer (rank 0) and loads it through the
        model's ``load_weights``, inside vLLM's layerwise reload (as the NCCL engine does)."""

        init_info_cls = GlooInitInfo
        update_info_cls = GlooUpdateInfo

        def __init__(self, config: Any, vllm_config: Any, device: Any, model: Any) -> None:
            super().__init__(config, vllm_config, device, model)
            self.group: Any = None
            self.rendezvous: Any = None

        def init_transfer_engine(self, init_info: GlooInitInfo) -> None:
            from rubricem_core.distributed.guard import gloo_group, sealed_store

            parallel = self.parallel_config
            rank = parallel.data_parallel_index * parallel.world_size + parallel.rank + init_info.rank_offset
            timeout = timedelta(seconds=init_info.timeout_s)
            store = dist.TCPStore(init_info.master_address, init_info.master_port, is_master=False, timeout=timeout)
            # a trainer rank 0 on this machine (master on loopback): the group's connections listen on loopback
            # only; else (replicas on other nodes) on the address gloo picks, as the trainer's side does
            if not init_info.group_key:
                raise ValueError(
                    "gloo weight transfer: init_info.group_key is missing (the trainer seals the rendezvous)"
                )
            self.rendezvous = sealed_store(store, init_info.group_key, init_info.group_prefix)  # kept with the group
            self.group = gloo_group(
                self.rendezvous,
                rank,
                init_info.world_size,
                init_info.timeout_s,
                loopback=init_info.master_address in ("127.0.0.1", "localhost", "::1"),
            )

        def start_weight_update(self) -> None:
            from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

            initialize_layerwise_reload(self.model)

        def finish_weight_update(self) -> None:
            from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

            finalize_layerwise_reload(self.model, self.model_config)

        def update_weights(self, update_info: dict[str, Any]) -> None:
            # the base class also synchronizes an accelerator; a gloo broadcast has returned whole
            self.receive_weights(self.parse_update_info(update_info))

        def receive_weights(self, update_info: GlooUpdateInfo) -> None:
            if self.group is None:
                raise RuntimeError("gloo weight transfer not initialized: call /init_weight_transfer_engine first")
            failure: Exception | None = None
            for name, dtype_name, shape in zip(update_info.names, update_info.dtype_names, update_info.shapes):
                weight = torch.empty(shape, dtype=getattr(torch, dtype_name), device=self.device)
                self.group.broadcast(weight, 0).wait()
                if failure is None:
                    try:
                        self.model.load_weights([(name, weight)])
                    except Exception as exc:  # receive the rest all the same: the trainer's broadcasts complete
                        failure = exc  # and the group stays in step; the update fails with the first error
            if failure is not None:
                raise failure

        def shutdown(self) -> None:
            self.group = self.rendezvous = None

    return GlooWeightTransferEngine
