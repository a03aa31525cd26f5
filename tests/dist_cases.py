"""Work that the 2-rank ≡ 1-rank tests run on every rank of a RankGroup (``group.run(dist_cases.<case>, arg)``).

Each case is a plain function of its arguments that returns what the test compares (weights, metrics,
which micro-batches each rank trained on) from rank 0 (None from the others). The single-rank reference is
computed by the test in its own process with the same functions, so "2 ranks ≡ 1 rank" compares two runs
of one code path.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from rubricem_core.testing.tiny_models import (
    PAD,
    VOCAB,
    rl_advantages,
    rl_trajectories,
    tiny_model,
    with_sampled_logprobs,
)
from rubricem_core.training import TrainerConfig, make_trainer


def lm_batch(i: int, n_seqs: int, seq_len: int = 16) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + i)
    return {"input_ids": torch.randint(0, VOCAB, (n_seqs, seq_len), generator=g), "id": torch.tensor([i])}


SEEN: list[int] = []


def lm_loss(model, micro_batch):
    """Mean next-token NLL of the micro-batch; records which micro-batch this rank trained on."""
    SEEN.append(int(micro_batch["id"][0]))
    ids = micro_batch["input_ids"]
    logits = model(input_ids=ids).logits[:, :-1].float()
    loss = F.cross_entropy(logits.reshape(-1, VOCAB), ids[:, 1:].reshape(-1))
    return loss, {"n_tokens": ids[:, 1:].numel(), "nll": loss.detach(), "nll_max": loss.detach()}


def trainer_steps(
    cfg: dict, n_steps: int = 2, sizes=(2, 3, 1, 2, 3), model: torch.nn.Module | None = None
) -> tuple[dict, list[dict], list[list[int]]]:
    """Steps of 5 micro-batches (an odd count: a 2-rank run pads one) weighted by their tokens."""
    torch.set_num_threads(1)
    trainer = make_trainer(tiny_model() if model is None else model, TrainerConfig(**cfg))
    history, seen = [], []
    for s in range(n_steps):
        micro = [lm_batch(10 * s + i, n) for i, n in enumerate(sizes)]
        SEEN.clear()
        history.append(trainer.step(micro, lm_loss, weights=[15.0 * n for n in sizes]))
        seen.append(list(SEEN))
    weights = {k: v.detach().float().clone() for k, v in trainer.state_dict_for_sync().items()}
    return weights, history, seen


def ppo_update(cfg: dict, update: dict, lora_rank: int = 0) -> tuple[dict, list[dict], list[list[int]]]:
    """One SS-GRPO update with sample reuse (minibatches × epochs), the reference a copy of the start. On
    several ranks each is given only the trajectories of its own micro-batches, as RayPolicy sends them.
    ``lora_rank``: LoRA adapters train, the reference is the same model with them off (as LocalPolicy)."""
    import copy

    from rubricem_core.config import LoraSettings
    from rubricem_core.rl.update import UpdateConfig, ss_grpo_update, update_plan
    from rubricem_core.training.adapters import AdapterDisabled, add_adapter

    torch.set_num_threads(1)
    model = tiny_model()
    if lora_rank:
        model = add_adapter(model, LoraSettings(rank=lora_rank, alpha=2 * lora_rank), base="tiny", seed=0)
        ref = AdapterDisabled(model)
    else:
        ref = copy.deepcopy(model).eval().requires_grad_(False)
    trajs = rl_trajectories(7)
    with_sampled_logprobs(trajs, model, shift=0.1)
    advs = rl_advantages(trajs)
    config = UpdateConfig(**update)
    trainer = make_trainer(model, TrainerConfig(**cfg))
    if dist.is_initialized() and dist.get_world_size() > 1:
        plan = update_plan(trajs, config)
        mine = plan.rank_indices(dist.get_rank(), dist.get_world_size())
        assert len(mine) < len(trajs), mine  # the slice is a part, not the whole payload
        metrics = ss_grpo_update(
            trainer, ref, {i: trajs[i] for i in mine}, {i: advs[i] for i in mine}, PAD, config, plan=plan
        )
    else:
        metrics = ss_grpo_update(trainer, ref, trajs, advs, PAD, config)
    weights = {k: v.detach().float().clone() for k, v in trainer.state_dict_for_sync().items()}
    return weights, [metrics], []


# ---- the cases, run on every rank ----------------------------------------------------------------
def trainer(arg: dict) -> dict[str, Any] | None:
    return _result(*trainer_steps(arg))


def zero_init(arg: dict) -> dict[str, Any] | None:
    """The tiny model saved by the test, loaded straight into ZeRO-3 partitions, then trained."""
    from transformers import AutoModelForCausalLM

    from rubricem_core.training.params import full_numel, is_partitioned
    from rubricem_core.training.zero_init import partitioned_loading, policy_ds_config

    arg = dict(arg)
    model_dir = arg.pop("model_dir")
    with partitioned_loading(policy_ds_config(model_dir, TrainerConfig(**arg))):
        model = AutoModelForCausalLM.from_pretrained(model_dir)
    whole = AutoModelForCausalLM.from_pretrained(model_dir)  # after the block: loaded whole again
    params = list(model.parameters())
    extra = {
        "partitioned": is_partitioned(model),
        "placeholder_numel": sum(p.numel() for p in params),  # what the module itself holds: nothing
        "partition_numel": sum(p.ds_tensor.numel() for p in params),  # this rank's share
        "full_numel": sum(full_numel(p) for p in params),
        "after_block_partitioned": is_partitioned(whole),
    }
    return _result(*trainer_steps(arg, model=model), extra=extra)


def ppo(arg: dict) -> dict[str, Any] | None:
    return _result(*ppo_update(arg["trainer"], arg["update"], arg.get("lora_rank", 0)))


def _result(weights: dict, history: list[dict], seen: list[list[int]], extra: dict | None = None) -> dict | None:
    """Rank 0: its weights and metrics, and every rank's micro-batches and ``extra``; None on the others."""
    parts: list = [None] * dist.get_world_size()
    dist.all_gather_object(parts, seen)
    loads: list = [None] * dist.get_world_size()
    dist.all_gather_object(loads, extra or {})
    if dist.get_rank() != 0:
        return None
    return {"weights": weights, "history": history, "seen": parts, "world_size": dist.get_world_size(), "loads": loads}
