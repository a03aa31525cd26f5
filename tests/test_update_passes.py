"""The SS-GRPO update's passes: one optimizer step without the extra forward, PPO reuse (minibatches ×
epochs) with old logprobs from before the first step, and truncated importance sampling (TIS).

Each new path is checked against a second implementation: the old recompute path, a loop written here
step by step, or the formula worked by hand.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch

import dist_cases
from rubricem_core.batching import collate
from rubricem_core.logprobs import batch_logprobs, token_logprobs
from rubricem_core.rl.update import (
    UpdateConfig,
    importance_weights,
    minibatch_split,
    old_logprobs,
    ss_grpo_update,
)
from rubricem_core.ssgrpo import policy_loss
from rubricem_core.testing.tiny_models import PAD, rl_advantages, rl_trajectories, tiny_model, with_sampled_logprobs
from rubricem_core.training.config import TrainerConfig
from rubricem_core.training.torch_trainer import TorchTrainer
from tests.tiny_models import one_thread  # noqa: F401 (an autouse fixture)


def _trainer(seed: int = 0, lr: float = 1e-2) -> TorchTrainer:
    return TorchTrainer(tiny_model(seed), TrainerConfig(lr=lr, weight_decay=0.0, total_steps=100))


def _params(model: torch.nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


class _ForwardCounter:
    def __init__(self, model: torch.nn.Module) -> None:
        self.calls = 0
        model.register_forward_hook(self._count)

    def _count(self, *_: object) -> None:
        self.calls += 1


@pytest.mark.parametrize("kl_coef", [0.0, 0.05], ids=["no-kl", "kl"])
@pytest.mark.parametrize("max_tokens", [4096, 90], ids=["one-micro-batch", "several"])
def test_one_pass_without_the_extra_forward_equals_the_recompute(kl_coef, max_tokens):
    trajs = rl_trajectories()
    advs = rl_advantages(trajs)
    results = {}
    for recompute in (False, True):
        trainer = _trainer()
        ref = copy.deepcopy(trainer.model).eval().requires_grad_(False)
        with_sampled_logprobs(trajs, trainer.model)
        forwards = _ForwardCounter(trainer.model)
        config = UpdateConfig(kl_coef=kl_coef, max_tokens_per_batch=max_tokens, recompute_old=recompute)
        metrics = ss_grpo_update(trainer, ref, trajs, advs, PAD, config)
        results[recompute] = (metrics, _params(trainer.model), forwards.calls)
    (fast, w_fast, n_fast), (slow, w_slow, n_slow) = results[False], results[True]
    assert n_slow == 2 * n_fast > 0  # the recompute is one extra forward per micro-batch
    assert fast["optimizer_steps"] == 1.0
    assert fast["loss"] == pytest.approx(slow["loss"], abs=1e-6)
    assert fast["grad_norm"] == pytest.approx(slow["grad_norm"], abs=1e-6)
    assert fast["ratio_mean"] == pytest.approx(1.0, abs=1e-6) and fast["clip_fraction"] == 0.0
    assert max(float((a - b).abs().max()) for a, b in zip(w_fast, w_slow)) < 1e-6
    assert fast["logprob_gap_mean"] < 1e-5  # the sampler's logprobs were the trainer's own
    assert any(not torch.equal(a, b) for a, b in zip(w_fast, _params(tiny_model(0))))  # it trained


def test_no_kl_needs_no_reference_forward():
    """kl_coef 0 (the RL session then loads no reference): an update without a reference equals one
    whose reference runs its forwards for nothing, and a nonzero β with a moved reference differs."""
    trajs = rl_trajectories()
    advs = rl_advantages(trajs)
    runs = {}
    for name, ref_seed, kl in (("none", None, 0.0), ("ref", 1, 0.0), ("ref-kl", 1, 0.5)):
        trainer = _trainer()
        ref = None if ref_seed is None else tiny_model(ref_seed).eval().requires_grad_(False)
        ref_forwards = _ForwardCounter(ref) if ref is not None else None
        ss_grpo_update(trainer, ref, trajs, advs, PAD, UpdateConfig(kl_coef=kl, max_tokens_per_batch=90))
        runs[name] = (_params(trainer.model), ref_forwards.calls if ref_forwards else 0)
    assert runs["none"][1] == 0 and runs["ref"][1] > 0
    assert max(float((a - b).abs().max()) for a, b in zip(runs["none"][0], runs["ref"][0])) == 0.0
    assert max(float((a - b).abs().max()) for a, b in zip(runs["none"][0], runs["ref-kl"][0])) > 1e-6


def test_rl_session_loads_no_reference_without_kl(tmp_path):
    from rubricem_core.config import load_config
    from rubricem_core.rl.policy import LocalPolicy
    from tests.untrained_run import UNTRAINED_TINY, write_untrained_run

    overrides = {**UNTRAINED_TINY, "data.world.n_queries": 4}
    cfg = load_config("tiny", overrides)
    write_untrained_run(cfg, tmp_path / "run")
    base = tmp_path / "run" / "checkpoints" / "sft" / "final"
    assert LocalPolicy(base, cfg).ref_model is not None
    assert LocalPolicy(base, load_config("tiny", {**overrides, "rl.kl_coef": 0.0})).ref_model is None


def _hand_rolled_ppo(trainer, ref, trajs, advs, config: UpdateConfig) -> list[dict[str, float]]:
    """PPO reuse written out: every old and reference logprob first, then epochs × minibatches steps
    of the plain loss on one micro-batch each."""
    parts = minibatch_split(len(trajs), config.minibatches)
    batches = []
    for idx in parts:
        idx = sorted(idx, key=lambda i: -len(trajs[i]))  # rows in the update's order: longest first
        b = collate(
            [trajs[i] for i in idx],
            PAD,
            extras={"advantages": [advs[i] for i in idx], "sampled_logprobs": [trajs[i].logprobs for i in idx]},
        )
        with torch.no_grad():
            b.old_logprobs = old_logprobs(trainer.model, b, config.temperature)
            b.ref_logprobs = token_logprobs(ref, b.input_ids, b.attention_mask)
        batches.append(b)

    def loss_fn(model, b):  # the plain clipped loss on the old logprobs computed above
        logp = batch_logprobs(model, b, temperature=config.temperature)
        mask = b.loss_mask.to(logp.dtype)
        kw = {"clip_low": config.clip_low, "clip_high": config.clip_high, "kl_coef": config.kl_coef}
        return policy_loss(logp, b.old_logprobs, b.ref_logprobs, b.advantages, mask, **kw)

    out = []
    for _ in range(config.epochs):
        for b in batches:
            out.append(trainer.step([b], loss_fn, weights=[float(b.loss_mask.sum())]))
    return out


@pytest.mark.parametrize(("minibatches", "epochs"), [(2, 1), (1, 2), (3, 2)])
def test_ppo_reuse_takes_old_logprobs_from_before_the_first_step(minibatches, epochs):
    trajs = rl_trajectories()
    advs = rl_advantages(trajs)
    config = UpdateConfig(kl_coef=0.01, max_tokens_per_batch=4096, minibatches=minibatches, epochs=epochs)

    trainer = _trainer()
    ref = copy.deepcopy(trainer.model).eval().requires_grad_(False)
    with_sampled_logprobs(trajs, trainer.model)
    metrics = ss_grpo_update(trainer, ref, trajs, advs, PAD, config)

    by_hand = _trainer()
    steps = _hand_rolled_ppo(by_hand, ref, trajs, advs, config)

    assert metrics["optimizer_steps"] == len(steps) == minibatches * epochs
    assert trainer.global_step == by_hand.global_step == minibatches * epochs
    for a, b in zip(trainer.model.parameters(), by_hand.model.parameters()):
        assert float((a - b).abs().max().detach()) < 1e-6
    assert metrics["loss"] == pytest.approx(sum(s["loss"] for s in steps) / len(steps), abs=1e-6)
    # after the first step the policy has moved away from the old one: later ratios are not 1
    assert steps[-1]["ratio_max"] > 1.0 + 1e-4
    assert metrics["ratio_mean"] != pytest.approx(1.0, abs=1e-7)


def test_minibatch_split_is_contiguous_and_balanced():
    assert minibatch_split(7, 3) == [[0, 1], [2, 3, 4], [5, 6]]
    assert minibatch_split(2, 4) == [[0], [1]]
    assert sum(minibatch_split(32, 5), []) == list(range(32))


def test_importance_weights_by_hand():
    old = torch.tensor([[-1.0, -2.0, -0.5, -3.0]])
    sampled = torch.tensor([[-1.0, -1.0, -2.0, math.nan]])
    w = importance_weights(old, sampled, cap=2.0)
    # exp(0) = 1; exp(-1) ≈ 0.368; exp(1.5) ≈ 4.48 → capped at 2; unknown sampler logprob → 1
    assert torch.allclose(w, torch.tensor([[1.0, math.exp(-1.0), 2.0, 1.0]]))


def test_tis_weights_scale_each_tokens_surrogate():
    logp = torch.tensor([[-1.0, -2.0, -0.5]], requires_grad=True)
    adv = torch.tensor([[1.0, -1.0, 2.0]])
    mask = torch.ones(1, 3)
    w = torch.tensor([[1.0, 0.5, 2.0]])
    loss, _ = policy_loss(logp, logp.detach(), None, adv, mask, kl_coef=0.0, is_weights=w)
    loss.backward()
    # ratio 1 at the old policy: d/dlogp of -(w·ratio·a)/n is -w·a/n
    assert torch.allclose(logp.grad, -(w * adv) / 3)


@pytest.mark.parametrize("shift", [0.0, 0.3], ids=["on-policy", "off-policy"])
def test_tis_update_against_no_correction(shift):
    """On-policy samples (the sampler's logprobs are the trainer's) give weights 1: the same update as
    none. Samples from another policy give a different one, with weights below 1 (sampler likelier)."""
    trajs = rl_trajectories()
    advs = rl_advantages(trajs)
    out = {}
    for correction in ("none", "tis"):
        trainer = _trainer()
        with_sampled_logprobs(trajs, trainer.model, shift=shift)
        config = UpdateConfig(kl_coef=0.0, max_tokens_per_batch=4096, importance_correction=correction)
        out[correction] = (ss_grpo_update(trainer, None, trajs, advs, PAD, config), _params(trainer.model))
    (m_none, w_none), (m_tis, w_tis) = out["none"], out["tis"]
    diff = max(float((a - b).abs().max()) for a, b in zip(w_none, w_tis))
    if shift == 0.0:
        assert m_tis["tis_weight_mean"] == pytest.approx(1.0, abs=1e-5)
        assert diff < 1e-6
    else:
        assert m_tis["tis_weight_mean"] == pytest.approx(math.exp(-shift), rel=1e-3)
        assert m_tis["grad_norm"] == pytest.approx(m_none["grad_norm"] * math.exp(-shift), rel=1e-3)
        assert diff > 1e-5


def test_rl_settings_reach_the_update_and_the_schedule():
    from rubricem_core.config import load_config
    from rubricem_core.rl.policy import rl_trainer_config, total_updates

    base = load_config("tiny")
    cfg = load_config(
        "tiny", {"rl.minibatches": 2, "rl.epochs": 3, "rl.importance_correction": "tis", "rl.tis_cap": 1.5}
    )
    config = UpdateConfig.from_rl(cfg.rl, temperature=1.0)
    assert (config.minibatches, config.epochs, config.importance_correction, config.tis_cap) == (2, 3, "tis", 1.5)
    assert total_updates(cfg) == 6 * total_updates(base)
    assert rl_trainer_config(cfg).total_steps == 6 * rl_trainer_config(base).total_steps
    with pytest.raises(ValueError, match="importance_correction"):
        load_config("tiny", {"rl.importance_correction": "vtrace"})


# Two micro-batches per minibatch (a 2-rank shard each) and PPO reuse: the pre-pass must give every rank the
# old logprobs of exactly the micro-batches its steps train on.
PPO_TRAINER = dict(lr=3e-3, weight_decay=0.0, total_steps=10)
PPO_UPDATE = dict(
    kl_coef=0.01, max_tokens_per_batch=120, minibatches=2, epochs=2, importance_correction="tis", tis_cap=2.0
)


def two_rank_ppo(tmp_path, arg: dict) -> dict:
    """``dist_cases.ppo(arg)`` on 2 gloo ranks (Ray actors of the session's local Ray); rank 0's result."""
    from rubricem_core.distributed.actors import RankGroup

    group = RankGroup("ppo", 2, tmp_path / "ranks", timeout_s=600)
    try:
        return group.run(dist_cases.ppo, arg)[0]
    finally:
        group.close()


@pytest.mark.slow
@pytest.mark.parametrize("backend, stage, tol", [("torch", 0, 1e-5), ("deepspeed", 3, 1e-4)])
def test_ppo_reuse_on_two_ranks_equals_one(ray_cluster, tmp_path, backend, stage, tol):
    """Each rank is given only its micro-batches' trajectories (as RayPolicy sends them)."""
    import dist_cases

    trainer_cfg = {**PPO_TRAINER, "backend": backend, "zero_stage": stage}
    ref_weights, (ref_metrics,), _ = dist_cases.ppo_update(PPO_TRAINER, PPO_UPDATE)
    got = two_rank_ppo(tmp_path, {"trainer": trainer_cfg, "update": PPO_UPDATE})
    metrics = got["history"][0]
    assert metrics["optimizer_steps"] == ref_metrics["optimizer_steps"] == 4
    assert metrics["loss"] == pytest.approx(ref_metrics["loss"], abs=1e-5)
    assert metrics["tis_weight_mean"] == pytest.approx(ref_metrics["tis_weight_mean"], rel=1e-5)
    assert max(float((ref_weights[k] - got["weights"][k]).abs().max()) for k in ref_weights) < tol


@pytest.mark.slow
@pytest.mark.parametrize("backend, stage, tol", [("torch", 0, 1e-5), ("deepspeed", 2, 1e-5), ("deepspeed", 3, 1e-4)])
def test_a_lora_update_on_two_ranks_equals_one(ray_cluster, tmp_path, backend, stage, tol):
    """LoRA adapters train (the reference: the same model with them off); the merged weights every rank
    ends with, as the push sends them, are the one-rank run's."""
    import dist_cases

    trainer_cfg = {**PPO_TRAINER, "backend": backend, "zero_stage": stage}
    ref_weights, (ref_metrics,), _ = dist_cases.ppo_update(PPO_TRAINER, PPO_UPDATE, lora_rank=4)
    start = dist_cases.tiny_model().state_dict()
    assert set(ref_weights) == set(start)  # the base model's names: what an engine loads
    assert max(float((ref_weights[k] - start[k]).abs().max()) for k in start) > 1e-4  # the adapter moved them
    got = two_rank_ppo(tmp_path, {"trainer": trainer_cfg, "update": PPO_UPDATE, "lora_rank": 4})
    metrics = got["history"][0]
    assert metrics["optimizer_steps"] == ref_metrics["optimizer_steps"] == 4
    assert metrics["loss"] == pytest.approx(ref_metrics["loss"], abs=1e-5)
    assert metrics["kl"] == pytest.approx(ref_metrics["kl"], abs=1e-6)
    assert max(float((ref_weights[k] - got["weights"][k]).abs().max()) for k in ref_weights) < tol


@pytest.mark.slow
@pytest.mark.parametrize("backend, stage, tol", [("torch", 0, 1e-5), ("deepspeed", 3, 1e-4)])
def test_a_packed_update_on_two_ranks_equals_one_rank_bucketed(ray_cluster, tmp_path, backend, stage, tol):
    """Packed rows of 60 tokens, two a micro-batch: each rank is given its packed micro-batches' trajectories
    (ZeRO-3 included: position ids pass through DeepSpeed's engine); the step's loss is the bucketed step's and
    the weights the one-rank packed run's."""
    import dist_cases

    packed = {**PPO_UPDATE, "packing": True, "pack_length": 60}
    _, (bucketed_metrics,), _ = dist_cases.ppo_update(PPO_TRAINER, PPO_UPDATE)
    ref_weights, (ref_metrics,), _ = dist_cases.ppo_update(PPO_TRAINER, packed)
    trainer_cfg = {**PPO_TRAINER, "backend": backend, "zero_stage": stage}
    got = two_rank_ppo(tmp_path, {"trainer": trainer_cfg, "update": packed})
    metrics = got["history"][0]
    assert metrics["optimizer_steps"] == ref_metrics["optimizer_steps"] == bucketed_metrics["optimizer_steps"] == 4
    assert metrics["loss"] == pytest.approx(ref_metrics["loss"], abs=1e-5)
    assert ref_metrics["loss"] == pytest.approx(bucketed_metrics["loss"], abs=1e-5)
    assert max(float((ref_weights[k] - got["weights"][k]).abs().max()) for k in ref_weights) < tol
