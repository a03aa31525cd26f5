"""Trainers: schedule numbers, accumulation, clipping, bf16, and DeepSpeed ≡ torch on this CPU."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from rubricem_core.testing.tiny_models import VOCAB, tiny_model
from rubricem_core.training import TrainerConfig, TrainerConfigError, make_trainer
from rubricem_core.training.schedule import WarmupCosine, make_scheduler
from rubricem_core.training.torch_trainer import micro_batch_scales
from tiny_models import one_thread  # noqa: F401 (an autouse fixture)


def batch(n_seqs: int, seq_len: int = 16, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"input_ids": torch.randint(0, VOCAB, (n_seqs, seq_len), generator=g)}


def lm_loss(model, micro_batch):
    """Mean next-token NLL over the micro-batch's tokens."""
    ids = micro_batch["input_ids"]
    logits = model(input_ids=ids).logits[:, :-1].float()
    loss = F.cross_entropy(logits.reshape(-1, VOCAB), ids[:, 1:].reshape(-1))
    return loss, {"n_tokens": ids[:, 1:].numel(), "nll": loss.detach()}


def params(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().float().clone() for k, v in model.named_parameters()}


def capture_grads(trainer) -> list[list[torch.Tensor]]:
    """Gradients as the optimizer sees them at each step (after accumulation and clipping)."""
    seen: list[list[torch.Tensor]] = []
    trainer.optimizer.register_step_pre_hook(
        lambda opt, args, kwargs: seen.append([p.grad.clone() for g in opt.param_groups for p in g["params"]])
    )
    return seen


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max()) for k in a)


# ------------------------------------------------------------------------------------ schedule
@pytest.mark.parametrize(
    "step, expected",
    [(0, 0.25), (1, 0.5), (3, 1.0), (4, 1.0), (9, 0.55), (14, 0.1), (40, 0.1)],
)
def test_warmup_cosine_curve(step, expected):
    # warm-up 4 steps, cosine over steps 4..14 to 0.1: the midpoint (step 9) is 0.1 + 0.9 / 2
    assert WarmupCosine(warmup_steps=4, total_steps=14, min_lr_ratio=0.1)(step) == pytest.approx(expected)


def test_scheduler_drives_optimizer_lr():
    p = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.AdamW([p], lr=2.0)
    sched = make_scheduler(opt, warmup_steps=2, total_steps=6, min_lr_ratio=0.0)
    seen = []
    for _ in range(7):
        seen.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    expected = [1.0, 2.0, 2.0, 1.0 + math.cos(math.pi / 4), 1.0, 1.0 - math.cos(math.pi / 4), 0.0]
    assert seen == pytest.approx(expected)


def test_scheduler_state_round_trips_the_curve():
    p = torch.nn.Parameter(torch.zeros(1))
    a = make_scheduler(torch.optim.AdamW([p], lr=1.0), 3, 10, 0.2)
    b = make_scheduler(torch.optim.AdamW([p], lr=1.0), 0, 1, 1.0)  # a different curve, replaced by load
    for _ in range(5):
        a.optimizer.step(), a.step()
    b.load_state_dict(a.state_dict())
    assert b.lr_lambdas[0] == a.lr_lambdas[0] and b.get_last_lr() == a.get_last_lr()


# -------------------------------------------------------------------------------------- config
@pytest.mark.parametrize(
    "field, value",
    [
        ("lr", 0.0),
        ("betas", (0.9,)),
        ("warmup_steps", -1),
        ("total_steps", 0),
        ("min_lr_ratio", 1.5),
        ("grad_accum_steps", 0),
        ("max_grad_norm", -1.0),
        ("precision", "fp16"),
        ("backend", "jax"),
        ("zero_stage", 4),
    ],
)
def test_config_rejects_bad_values_naming_the_field(field, value):
    with pytest.raises(TrainerConfigError, match=rf"TrainerConfig\.{field}="):
        TrainerConfig(**{field: value})


def test_config_help_covers_every_field():
    help_ = TrainerConfig.help()
    assert {"lr", "precision", "zero_stage", "offload", "grad_accum_steps"} <= help_.keys()
    assert all(text for text in help_.values())


@pytest.mark.parametrize("weights", [[1.0], [0, 0], [3, -1], []])
def test_micro_batch_scales_reject_bad_weights(weights):
    with pytest.raises(ValueError):
        micro_batch_scales(2, weights)


# ------------------------------------------------------------------------------- torch trainer
def torch_cfg(**kw) -> TrainerConfig:
    base = dict(lr=1e-2, weight_decay=0.1, warmup_steps=1, total_steps=10, min_lr_ratio=0.1, max_grad_norm=0.0)
    return TrainerConfig(**{**base, **kw})


@pytest.mark.parametrize(
    "sizes, weighted",
    [((2, 2), False), ((2, 3), True), ((1, 1, 3), True)],
)
def test_accumulation_equals_one_big_batch(sizes, weighted):
    full = batch(sum(sizes), seed=3)
    parts, start = [], 0
    for n in sizes:
        parts.append({"input_ids": full["input_ids"][start : start + n]})
        start += n
    one = make_trainer(tiny_model(), torch_cfg())
    grads_one = capture_grads(one)
    m_one = one.step([full], lm_loss)
    acc = make_trainer(tiny_model(), torch_cfg())
    grads_acc = capture_grads(acc)
    weights = [p["input_ids"][:, 1:].numel() for p in parts] if weighted else None
    m_acc = acc.step(parts, lm_loss, weights=weights)
    # Gradients, not only weights: Adam's update hardly changes when a gradient is scaled, so a
    # wrong accumulation scale would hide in the parameters.
    for g1, g2 in zip(grads_one[0], grads_acc[0], strict=True):
        torch.testing.assert_close(g2, g1, rtol=1e-4, atol=1e-8)
    assert max_diff(params(one.model), params(acc.model)) < 1e-4
    assert m_acc["loss"] == pytest.approx(m_one["loss"], abs=1e-5)
    assert m_acc["grad_norm"] == pytest.approx(m_one["grad_norm"], rel=1e-4)
    assert m_acc["n_tokens"] == m_one["n_tokens"] == sum(sizes) * 15


def test_unweighted_accumulation_of_unequal_batches_is_a_mean_of_means():
    # Documented choice: without weights each micro-batch counts once, which differs from the
    # token mean when the micro-batches differ in size.
    full = batch(4, seed=5)
    parts = [{"input_ids": full["input_ids"][:1]}, {"input_ids": full["input_ids"][1:]}]
    a = make_trainer(tiny_model(), torch_cfg())
    m = a.step(parts, lm_loss)
    b = make_trainer(tiny_model(), torch_cfg())
    losses = [float(lm_loss(b.model, p)[0].detach()) for p in parts]
    assert m["loss"] == pytest.approx(sum(losses) / 2, abs=1e-5)
    assert m["loss"] != pytest.approx(float(lm_loss(b.model, full)[0].detach()), abs=1e-4)


@pytest.mark.parametrize("max_norm", [0.05, 1e9])
def test_clipping_caps_the_gradient_norm_seen_by_the_optimizer(max_norm):
    trainer = make_trainer(tiny_model(), torch_cfg(max_grad_norm=max_norm))
    seen = []
    trainer.optimizer.register_step_pre_hook(
        lambda opt, args, kwargs: seen.append(
            float(torch.linalg.vector_norm(torch.stack([p.grad.norm() for g in opt.param_groups for p in g["params"]])))
        )
    )
    metrics = trainer.step([batch(2)], lm_loss)
    assert metrics["grad_norm"] > 0.05  # the pre-clip norm is reported
    assert seen[0] == pytest.approx(min(max_norm, metrics["grad_norm"]), rel=1e-4)


def test_step_metrics_follow_the_schedule_and_loss_falls():
    cfg = torch_cfg(warmup_steps=2, total_steps=6, lr=1e-2, weight_decay=0.0)
    trainer = make_trainer(tiny_model(), cfg)
    history = [trainer.step([batch(4)], lm_loss) for _ in range(6)]
    curve = WarmupCosine(2, 6, 0.1)
    assert [h["lr"] for h in history] == pytest.approx([1e-2 * curve(s) for s in range(6)])
    assert [h["step"] for h in history] == [1, 2, 3, 4, 5, 6] and trainer.global_step == 6
    assert history[-1]["loss"] < history[0]["loss"] - 0.5  # memorising one batch
    assert all(h["tokens_per_s"] > 0 and h["n_tokens"] == 60 for h in history)
    assert all(math.isfinite(h["grad_norm"]) and h["grad_norm"] > 0 for h in history)


def test_metrics_combine_counts_and_weighted_means():
    extra = [{"n_tokens": 3, "acc": 1.0, "only_first": 5.0, "skip": "text"}, {"n_tokens": 5, "acc": torch.tensor(0.0)}]

    def loss_with_metrics(model, mb):
        loss, _ = lm_loss(model, mb)
        return loss, extra[int(mb["i"])]

    trainer = make_trainer(tiny_model(), torch_cfg())
    micro = [{**batch(1, seed=i), "i": torch.tensor(i)} for i in range(2)]
    m = trainer.step(micro, loss_with_metrics, weights=[3, 5])
    assert m["n_tokens"] == 8 and m["acc"] == pytest.approx(3 / 8) and m["only_first"] == pytest.approx(5.0)
    assert "skip" not in m and m["tokens_per_s"] == pytest.approx(8 / m["step_time_s"])


def test_non_finite_gradients_raise_without_updating():
    trainer = make_trainer(tiny_model(), torch_cfg())
    before = params(trainer.model)

    def nan_loss(model, mb):
        loss, metrics = lm_loss(model, mb)
        return loss * float("nan"), metrics

    with pytest.raises(FloatingPointError, match="non-finite gradient norm"):
        trainer.step([batch(2)], nan_loss)
    assert max_diff(params(trainer.model), before) == 0.0


def test_bf16_autocast_on_cpu_trains_close_to_fp32():
    fp32 = make_trainer(tiny_model(), torch_cfg())
    bf16 = make_trainer(tiny_model(), torch_cfg(precision="bf16"))
    assert bf16.autocast_dtype == torch.bfloat16
    a, b = fp32.step([batch(2)], lm_loss), bf16.step([batch(2)], lm_loss)
    assert a["loss"] != b["loss"]  # autocast really ran the matmuls in bf16
    assert b["loss"] == pytest.approx(a["loss"], abs=0.05)
    assert next(bf16.model.parameters()).dtype == torch.float32  # master weights stay fp32


def test_state_dict_for_sync_is_the_full_current_model():
    trainer = make_trainer(tiny_model(), torch_cfg())
    trainer.step([batch(2)], lm_loss)
    synced = trainer.state_dict_for_sync()
    assert synced.keys() == trainer.model.state_dict().keys()
    assert all(torch.equal(synced[k], v) for k, v in trainer.model.named_parameters())


# ----------------------------------------------------------------------------------- DeepSpeed
def test_environment_defaults_never_override_a_launcher(monkeypatch):
    from rubricem_core.training.deepspeed_trainer import prepare_environment

    launcher_vars = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
    for var in (*launcher_vars, "OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("MASTER_PORT", "29999")
    prepare_environment()
    import os

    assert (os.environ["RANK"], os.environ["MASTER_PORT"]) == ("3", "29999")  # a launcher's values stay
    assert (os.environ["WORLD_SIZE"], os.environ["LOCAL_RANK"], os.environ["MASTER_ADDR"]) == ("1", "0", "127.0.0.1")


def test_environment_left_to_mpi_discovery(monkeypatch):
    from rubricem_core.training.deepspeed_trainer import prepare_environment

    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("OMPI_COMM_WORLD_SIZE", "4")
    prepare_environment()
    import os

    assert "RANK" not in os.environ and "WORLD_SIZE" not in os.environ


@pytest.mark.parametrize(
    "stage, offload, offload_params", [(1, False, False), (2, True, False), (3, True, True), (3, False, True)]
)
def test_deepspeed_config_follows_trainer_config(stage, offload, offload_params):
    from rubricem_core.training.deepspeed_trainer import build_ds_config

    cfg = TrainerConfig(
        backend="deepspeed",
        zero_stage=stage,
        offload=offload,
        offload_params=offload_params,
        max_grad_norm=0.5,
        grad_accum_steps=4,
        precision="bf16",
        deepspeed_overrides={"zero_optimization": {"reduce_bucket_size": 123}, "steps_per_print": 7},
    )
    ds = build_ds_config(cfg, n_params=10_000)
    zero = ds["zero_optimization"]
    assert zero["stage"] == stage and ds["gradient_clipping"] == 0.5 and ds["gradient_accumulation_steps"] == 4
    assert ds["bf16"]["enabled"] is True and ds["steps_per_print"] == 7
    assert zero["reduce_bucket_size"] == 123 and zero["allgather_bucket_size"] == 2**20  # small model: small buckets
    assert ("offload_optimizer" in zero) == offload and ("offload_param" in zero) == offload_params


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(backend="deepspeed", zero_stage=0, offload=True), "offload"),
        (dict(backend="torch", offload=True), "offload"),
        (dict(backend="deepspeed", zero_stage=2, offload_params=True), "offload_params"),
    ],
)
def test_offload_without_the_zero_stage_it_needs_is_rejected(kwargs, field):
    with pytest.raises(TrainerConfigError, match=f"TrainerConfig.{field}=True needs"):
        TrainerConfig(**kwargs)


def run_steps(cfg: TrainerConfig, n_steps: int = 2):
    trainer = make_trainer(tiny_model(), cfg)
    history = []
    for s in range(n_steps):
        micro = [batch(2, seed=10 * s), batch(3, seed=10 * s + 1)]
        history.append(trainer.step(micro, lm_loss, weights=[30, 45]))
    return trainer, history


EQUIV_CFG = dict(lr=3e-3, weight_decay=0.1, warmup_steps=1, total_steps=5, max_grad_norm=1.0)


@pytest.fixture(scope="module")
def torch_reference():
    trainer, history = run_steps(TrainerConfig(**EQUIV_CFG))
    return params(trainer.model), history


# Measured max |Δparam| after 2-3 steps: ~2e-7 for ZeRO-0/1/2; ~4e-5 for ZeRO-3, whose gradient
# partitions are accumulated and clipped in a different order, and Adam magnifies rounding
# differences on near-zero gradients (the update is ~lr * g / sqrt(v)). Training moves weights ~1e-2.
@pytest.mark.parametrize(
    "stage, offload, tol",
    [(0, False, 1e-6), (1, False, 1e-6), (2, False, 1e-6), (3, False, 1e-4), (2, True, 1e-6), (3, True, 1e-4)],
)
def test_deepspeed_zero_matches_torch(deepspeed_ok, torch_reference, stage, offload, tol):
    # offload at ZeRO-3 moves the parameter partitions to the CPU as well
    # Clipping at 1.0 is active (the grad norms are ~2), weight decay and warm-up are on.
    ref_params, ref_hist = torch_reference
    # grad_accum_steps=2 as a real config would say for 2 micro-batches: DeepSpeed must not divide
    # by it on top of the trainer's own micro-batch weights.
    ds_cfg = TrainerConfig(
        **EQUIV_CFG,
        backend="deepspeed",
        zero_stage=stage,
        offload=offload,
        offload_params=offload and stage == 3,
        grad_accum_steps=2,
    )
    ds, ds_hist = run_steps(ds_cfg)
    assert all(h["grad_norm"] > 1.0 for h in ref_hist)
    assert [h["loss"] for h in ds_hist] == pytest.approx([h["loss"] for h in ref_hist], abs=1e-5)
    assert [h["grad_norm"] for h in ds_hist] == pytest.approx([h["grad_norm"] for h in ref_hist], rel=1e-5)
    assert [h["lr"] for h in ds_hist] == pytest.approx([h["lr"] for h in ref_hist])
    ds_params = {k: v.float() for k, v in ds.state_dict_for_sync().items() if k in ref_params}
    assert max_diff(ref_params, params(tiny_model())) > 1e-3  # training moved the weights
    assert max_diff(ref_params, ds_params) < tol
    assert ds.global_step == 2


def test_deepspeed_bf16_zero1_trains(deepspeed_ok):
    trainer, history = run_steps(
        TrainerConfig(lr=3e-3, total_steps=5, backend="deepspeed", zero_stage=1, precision="bf16")
    )
    assert next(trainer.model.parameters()).dtype == torch.bfloat16
    assert all(math.isfinite(h["loss"]) and math.isfinite(h["grad_norm"]) for h in history)
    assert history[-1]["loss"] != history[0]["loss"]


@pytest.mark.parametrize("backend, stage", [("torch", 0), ("deepspeed", 3)])
def test_gradient_checkpointing_gives_the_same_update(torch_reference, backend, stage, request):
    if backend == "deepspeed":
        request.getfixturevalue("deepspeed_ok")
    ref_params, ref_hist = torch_reference
    cfg = TrainerConfig(**EQUIV_CFG, backend=backend, zero_stage=stage, gradient_checkpointing=True)
    trainer, hist = run_steps(cfg)
    assert trainer.model.is_gradient_checkpointing and trainer.model.config.use_cache is False
    assert [h["loss"] for h in hist] == pytest.approx([h["loss"] for h in ref_hist], abs=1e-6)
    got = {k: v.float() for k, v in trainer.state_dict_for_sync().items() if k in ref_params}
    assert max_diff(ref_params, got) < (1e-6 if backend == "torch" else 1e-4)
