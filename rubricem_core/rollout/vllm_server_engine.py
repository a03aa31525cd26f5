"""``VLLMServerEngine``: VLLMRolloutEngine's turn loop sampling through `vllm serve` (one server or a fleet)
over its HTTP API, and each step's weights into it (see vllm_server)."""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rubricem_core.rollout.types import RolloutError
from rubricem_core.rollout.vllm_engine import VLLMRolloutEngine
from rubricem_core.rollout.vllm_fleet import VLLMFleet
from rubricem_core.rollout.vllm_server import ServerClient


class VLLMServerEngine(VLLMRolloutEngine):
    """VLLMRolloutEngine whose turns are sampled by a VLLMServer or a VLLMFleet (processes and devices of
    their own); ``schedule`` ``async`` (rows never wait for each other) or ``lockstep``."""

    def __init__(
        self,
        server: ServerClient | VLLMFleet,
        tokenizer: Any,
        tool_names: Sequence[str] | None = ("search", "browse"),
        *,
        schedule: str = "async",
        **kwargs: Any,
    ) -> None:
        fleet = server if isinstance(server, VLLMFleet) else VLLMFleet([server])
        super().__init__(
            None,
            tokenizer,
            tool_names,
            sampler=fleet.sample,
            submit=fleet.submit,
            schedule=schedule,
            max_in_flight=fleet.max_concurrency,
            **kwargs,
        )
        self.fleet = fleet
        self.server = fleet  # what the session drives: sleep, wake_up, asleep
        self.model_path = fleet.model_dir
        if kwargs.get("stop_token_ids") is None:  # the model's generation-config eos ids too, as in-process
            self.stop_token_ids = frozenset(self._default_stops())

    def generate(self, requests: list[Any], tools: Any) -> list[Any]:
        self.fleet.router.forget()
        resent = self.fleet.stats["resent_calls"]
        trajectories = super().generate(requests, tools)
        self.stats["resent_calls"] = self.fleet.stats["resent_calls"] - resent
        self.stats["replicas_live"] = len(self.fleet.live)
        return trajectories

    def load_weights_from_dir(self, directory: str | Path) -> None:
        self.stats["update_weights_s"] = self.fleet.load_weights_from_dir(directory)

    def load_adapter(self, directory: str | Path) -> None:
        """A LoRA step's adapter into every replica (``rollout.weight_transfer: adapter``)."""
        self.stats["update_weights_s"] = self.fleet.load_adapter(directory)

    def push_weights(self, policy: Any) -> None:
        """The trainer's current weights, pushed by ``policy`` through vLLM's weight-transfer API into
        every live replica at once (one transfer group; rubricem_core.rollout.weight_transfer), then the
        prefix caches dropped."""
        if self.fleet.weight_transfer is None:
            raise RolloutError("this vLLM server was started without a weight-transfer backend")
        started = time.perf_counter()
        urls = self.fleet.base_urls
        self.stats["weight_push_s"] = policy.push_weights(
            urls[0] if len(urls) == 1 else urls, self.fleet.weight_transfer, self.fleet.n_workers
        )
        self.fleet.reset_prefix_cache()
        self.stats["update_weights_s"] = time.perf_counter() - started

    def update_weights(self, state_dict: Any) -> None:
        raise RolloutError(
            "the vLLM server engine loads weights from a checkpoint directory "
            "(load_weights_from_dir), not from tensors in this process"
        )

    def close(self) -> None:
        self.fleet.close()
