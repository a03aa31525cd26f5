"""RL trainer ranks as Ray actors that live as long as the RL session (the ``rl`` flow run).

    policy = RayPolicy(run_dir, cfg, base)     # distributed.world_size ranks, each an RLRank
    policy.update(trajectories, token_advs, settings)
    policy.weights()                           # rank 0's gathered weights, for the flow's own engine
    policy.push_weights(urls, "nccl", n)       # or straight into vLLM servers' workers
    policy.close()

Every rank builds the same ``LocalPolicy`` (trainer + frozen reference, their process group the ranks'
own). An update is planned once here (``update_plan``: the micro-batches of every optimizer step, from
the trajectories' lengths and loss masks) and each rank receives, through Ray's object store, only the
trajectories of its own micro-batches. ``save`` is the collective resumable checkpoint (every
``rl.checkpoint_every`` steps), ``load`` resumes one, ``weights`` gathers the weights on every rank (ZeRO-3:
parameter by parameter) and returns rank 0's copy through the object store. A rank that dies or raises
fails the call within a second with its rank, node and log tail (``RankFailure``), and the group is gone.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from rubricem_core.config import RunConfig
from rubricem_core.distributed.actors import RankGroup
from rubricem_core.distributed.cluster import connect
from rubricem_core.distributed.guard import SECRET_ENV, launch_secret
from rubricem_core.faults import fault_point
from rubricem_core.layout import RunLayout
from rubricem_core.policy.loading import load_tokenizer
from rubricem_core.rl.policy import LocalPolicy
from rubricem_core.rl.update import UpdateConfig, update_plan
from rubricem_core.trajectory import TokenTrajectory

log = logging.getLogger(__name__)


class RLRank:
    """One trainer rank's side (built inside a ``RankWorker`` actor)."""

    def __init__(self, base: str, cfg: dict[str, Any]) -> None:
        self.rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
        self.policy = LocalPolicy(Path(base), RunConfig.model_validate(cfg))
        self.last_update_s = 0.0  # seconds the last update took inside this rank (bench: Ray's overhead)

    def update(
        self,
        trajectories: dict[int, TokenTrajectory],
        token_advs: dict[int, list[float]],
        plan: Any,
        settings: dict[str, Any],
    ) -> dict[str, float]:
        fault_point("rl.rank_update")  # tests kill a rank here, mid-update
        start = time.perf_counter()
        try:
            return self.policy.update(trajectories, token_advs, UpdateConfig(**settings), plan=plan)
        finally:
            self.last_update_s = time.perf_counter() - start

    def update_seconds(self) -> float:
        return self.last_update_s

    def save(self, directory: str, extra: dict[str, Any]) -> None:
        self.policy.save(Path(directory), extra)

    def load(self, directory: str) -> dict[str, Any]:
        return self.policy.load(Path(directory))

    def weights(self) -> dict[str, torch.Tensor] | None:
        weights = self.policy.weights()  # collective under ZeRO-3: every rank gathers
        if self.rank != 0 or weights is None:
            return None
        return {k: v.detach().to("cpu") for k, v in weights.items()}

    def push_weights(self, server_url: str | Sequence[str], backend: str, n_workers: int) -> float:
        return self.policy.push_weights(server_url, backend, n_workers, is_sender=self.rank == 0)

    def save_adapter(self, directory: str) -> None:
        self.policy.save_adapter(Path(directory), is_writer=self.rank == 0)

    def close(self) -> None:
        self.policy.close()


class RayPolicy:
    """The ``Policy`` of rubricem_core.rl.session with its trainer in ``distributed.world_size`` Ray actors."""

    def __init__(self, run_dir: str, cfg: RunConfig, base: Path) -> None:
        connect(cfg.distributed)
        self.tokenizer = load_tokenizer(base)
        self.world_size = cfg.distributed.world_size
        self.group = RankGroup(
            "rl",
            self.world_size,
            RunLayout(run_dir).rank_logs_dir,
            timeout_s=cfg.distributed.timeout_s,
            # the run's secret (through Ray's authenticated call, never a file): rank 0 derives the vLLM
            # servers' API key from it for its weight pushes
            env={SECRET_ENV: launch_secret()},
            on_line=log.info,
        )
        try:
            self.group.build(RLRank, str(Path(base).resolve()), cfg.model_dump(mode="json"))
        except BaseException:
            self.group.kill()
            raise

    def log_to(self, on_line: Callable[[str], None]) -> None:
        self.group.on_line = on_line

    def update(
        self, trajectories: list[TokenTrajectory], token_advs: list[list[float]], settings: UpdateConfig
    ) -> dict[str, float]:
        if not trajectories:
            return {"skipped": 1.0}
        plan = update_plan(trajectories, settings)
        per_rank = []
        for rank in range(self.world_size):
            mine = plan.rank_indices(rank, self.world_size)
            per_rank.append(
                ({i: trajectories[i] for i in mine}, {i: token_advs[i] for i in mine}, plan, asdict(settings))
            )
        return self.group.call_each("update", per_rank)[0]

    def save(self, directory: Path, extra: dict[str, Any]) -> None:
        self.group.call("save", str(Path(directory).resolve()), extra)

    def load(self, directory: Path) -> dict[str, Any]:
        return self.group.call("load", str(Path(directory).resolve()))[0]

    def weights(self) -> dict[str, torch.Tensor]:
        return self.group.call("weights")[0]

    def push_weights(self, server_url: str | Sequence[str], backend: str, n_workers: int) -> float:
        return self.group.call("push_weights", server_url, backend, n_workers)[0]

    def save_adapter(self, directory: Path) -> None:
        self.group.call("save_adapter", str(Path(directory).resolve()))

    def close(self) -> None:
        self.group.close()
