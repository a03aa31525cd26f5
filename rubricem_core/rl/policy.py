"""The RL trainer in one process: the ``Policy`` protocol the session drives, and ``LocalPolicy`` (trainer +
frozen reference), which the flow process builds for one rank and every Ray trainer rank builds for itself
(rubricem_core.rl.ray_policy)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

import torch

from rubricem_core.config import RunConfig
from rubricem_core.policy.loading import load_for_training, load_policy
from rubricem_core.recipes import get_recipe
from rubricem_core.rl.curriculum import reflection_source, schedule_length
from rubricem_core.rl.update import SSGRPOLearner, UpdateConfig
from rubricem_core.rollout.weight_transfer import LOOPBACK, WeightPusher, master_address_for
from rubricem_core.training import TrainerConfig, make_trainer
from rubricem_core.training.adapters import AdapterDisabled, write_adapter
from rubricem_core.trajectory import TokenTrajectory


def reflection_on(cfg: RunConfig) -> bool:
    return bool(get_recipe(cfg.rl.recipe).reflection)


def total_updates(cfg: RunConfig) -> int:
    """Optimizer steps of the whole run (the LR schedule's length): every task and reflection update
    takes minibatches × epochs of them."""
    steps = schedule_length(cfg.rl.window, cfg.rl.n_windows)
    reflection_updates = sum(reflection_source(s, cfg.rl.window) is not None for s in range(steps))
    updates = steps + (reflection_updates if reflection_on(cfg) else 0)
    return updates * cfg.rl.minibatches * cfg.rl.epochs


def rl_trainer_config(cfg: RunConfig) -> TrainerConfig:
    return TrainerConfig.from_settings(cfg.rl, total_steps=max(1, total_updates(cfg)), seed=cfg.seed)


class Policy(Protocol):
    """Where the trainer and the reference live; the tasks drive it through these calls only."""

    tokenizer: Any  # the policy's tokenizer (the engine encodes and decodes with it)

    def update(
        self, trajectories: list[TokenTrajectory], token_advs: list[list[float]], settings: UpdateConfig
    ) -> dict[str, float]: ...

    def save(self, directory: Path, extra: dict[str, Any]) -> None: ...

    def load(self, directory: Path) -> dict[str, Any]: ...

    def weights(self) -> dict[str, torch.Tensor] | None:
        """Full current weights for an engine in this process, by transfer (no file); both policies
        return them (None would make the engine read a checkpoint directory)."""

    def push_weights(self, server_url: str | Sequence[str], backend: str, n_workers: int) -> float:
        """Push the current weights into a vLLM server's workers, or every replica's of a fleet (a list
        of URLs: one transfer group over all of them; vLLM's weight-transfer API, from the process or
        ranks that hold them); the seconds it took."""

    def save_adapter(self, directory: Path) -> None:
        """Write the current LoRA adapter in peft's format (what a server loads at run time)."""

    def close(self) -> None: ...

    def log_to(self, on_line: Any) -> None:
        """Where the trainer ranks' output lines go (the calling task's log)."""


def load_reference(base: Path, cfg: RunConfig, device: torch.device) -> torch.nn.Module:
    """The frozen KL reference, placed as ``rl.reference`` says: on the trainer's device (a GPU when
    there is one), in host memory, or partitioned over the trainer ranks by ZeRO-3 inference (its
    forward is then collective, which the update's per-rank shards keep in step)."""
    if cfg.rl.reference != "sharded":
        where = device if cfg.rl.reference == "replicated" else "cpu"
        ref, _ = load_policy(str(base), dtype=cfg.policy.dtype, device=where)
        return ref.requires_grad_(False)
    from rubricem_core.training.deepspeed_trainer import import_deepspeed
    from rubricem_core.training.zero_init import partitioned_loading

    deepspeed = import_deepspeed()
    zero: dict[str, Any] = {"stage": 3}
    if cfg.rl.offload_params:
        zero["offload_param"] = {"device": "cpu"}
    config = {
        "train_micro_batch_size_per_gpu": 1,
        "zero_optimization": zero,
        "bf16": {"enabled": cfg.rl.precision == "bf16"},
        "steps_per_print": 2**31 - 1,
    }
    if cfg.distributed.world_size > 1:
        with partitioned_loading(config):  # never whole on a rank: built in its partitions
            ref, _ = load_policy(str(base), dtype=cfg.policy.dtype)
    else:
        ref, _ = load_policy(str(base), dtype=cfg.policy.dtype)
    ref.requires_grad_(False)
    engine, *_ = deepspeed.initialize(model=ref, config=config)
    engine.eval()
    return engine.module


class LocalPolicy(SSGRPOLearner):
    """Trainer and frozen reference in this process (also what every trainer rank builds); its
    ``update`` is the SS-GRPO update itself (SSGRPOLearner.update)."""

    def __init__(self, base: Path, cfg: RunConfig) -> None:
        trainer_cfg = rl_trainer_config(cfg)
        model, self.tokenizer = load_for_training(base, cfg.policy.dtype, trainer_cfg, lora=cfg.policy.lora)
        trainer = make_trainer(model, trainer_cfg)
        # β = 0: the KL term is 0 whatever the reference says, so none is loaded and none runs a forward.
        # With LoRA the reference is the trainer's own model with its adapter off: no second copy.
        ref_model: torch.nn.Module | None = None
        if cfg.rl.kl_coef > 0:
            lora = cfg.policy.lora.enabled
            ref_model = AdapterDisabled(trainer.model) if lora else load_reference(base, cfg, trainer.device)
        super().__init__(trainer, ref_model, self.tokenizer.pad_token_id)
        self._transfer_timeout_s = cfg.distributed.timeout_s
        self._pusher: WeightPusher | None = None

    @property
    def device(self) -> torch.device:
        return self.trainer.device

    def save(self, directory: Path, extra: dict[str, Any]) -> None:
        self.trainer.save(directory, extra=extra, tokenizer=self.tokenizer)

    def load(self, directory: Path) -> dict[str, Any]:
        return self.trainer.load(directory)

    def weights(self) -> dict[str, torch.Tensor] | None:
        # gathered under ZeRO-3 (the module's own parameters are 0-size placeholders there)
        return self.trainer.state_dict_for_sync()

    def push_weights(
        self, server_url: str | Sequence[str], backend: str, n_workers: int, is_sender: bool = True
    ) -> float:
        """On every trainer rank (each takes part in ZeRO-3's gathers; the sender, rank 0, talks to the
        server); the transfer group opened by the first push is kept for the next ones."""
        if self._pusher is None:  # one server, one backend per session
            # loopback for a fleet beside rank 0; this node's address for replicas Ray placed elsewhere
            master = master_address_for(server_url) if is_sender else LOOPBACK
            self._pusher = WeightPusher(self.trainer.model, backend, self._transfer_timeout_s, master_address=master)
        return self._pusher.push(server_url, n_workers, is_sender)

    def save_adapter(self, directory: Path, is_writer: bool = True) -> None:
        """On every trainer rank (ZeRO-3 gathers the adapter's partitions); rank 0 writes."""
        write_adapter(self.trainer.model, directory, is_writer=is_writer)

    def close(self) -> None:
        if self._pusher is not None:
            self._pusher.close()
            self._pusher = None

    def log_to(self, on_line: Any) -> None:
        pass  # this process logs for itself
