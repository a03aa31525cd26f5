"""Work that tests/test_distributed.py runs on several gloo ranks under torchrun (one case per call).

    python -m torch.distributed.run --standalone --nproc_per_node 2 tests/dist_cases.py CASE OUT_FILE [JSON]

Rank 0 writes what the test compares (weights, metrics, which micro-batches each rank trained on) to
OUT_FILE with torch.save; the single-rank reference is computed by the test in its own process with
the same functions, so "2 ranks ≡ 1 rank" compares two runs of one code path.
"""

from __future__ import annotations

import json
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F

from rubricem_core.distributed import shutdown
from rubricem_core.training import TrainerConfig, make_trainer
from tiny_models import PAD, VOCAB, rl_advantages, rl_trajectories, tiny_model, with_sampled_logprobs


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


def ppo_update(cfg: dict, update: dict) -> tuple[dict, list[dict], list[list[int]]]:
    """One SS-GRPO update with sample reuse (minibatches × epochs), the reference a copy of the start."""
    import copy

    from rubricem_core.rl.update import UpdateConfig, ss_grpo_update

    torch.set_num_threads(1)
    model = tiny_model()
    ref = copy.deepcopy(model).eval().requires_grad_(False)
    trajs = rl_trajectories(7)
    with_sampled_logprobs(trajs, model, shift=0.1)
    trainer = make_trainer(model, TrainerConfig(**cfg))
    metrics = ss_grpo_update(trainer, ref, trajs, rl_advantages(trajs), PAD, UpdateConfig(**update))
    weights = {k: v.detach().float().clone() for k, v in trainer.state_dict_for_sync().items()}
    return weights, [metrics], []


def main() -> None:
    case, out = sys.argv[1], sys.argv[2]
    arg = json.loads(sys.argv[3]) if len(sys.argv) > 3 else {}
    extra: dict = {}
    if case == "trainer":
        weights, history, seen = trainer_steps(arg)
    elif case == "zero_init":
        # the tiny model saved by the test, loaded straight into ZeRO-3 partitions, then trained
        from transformers import AutoModelForCausalLM

        from rubricem_core.training.params import full_numel, is_partitioned
        from rubricem_core.training.zero_init import partitioned_loading, policy_ds_config

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
        weights, history, seen = trainer_steps(arg, model=model)
    elif case == "ppo_update":
        weights, history, seen = ppo_update(arg["trainer"], arg["update"])
    else:
        raise SystemExit(f"unknown case {case!r}")
    parts: list = [None] * dist.get_world_size()
    dist.all_gather_object(parts, seen)
    loads: list = [None] * dist.get_world_size()
    dist.all_gather_object(loads, extra)
    if dist.get_rank() == 0:
        torch.save(
            {
                "weights": weights,
                "history": history,
                "seen": parts,
                "world_size": dist.get_world_size(),
                "loads": loads,
            },
            out,
        )
    shutdown()


if __name__ == "__main__":
    main()
