"""Where policies sample and train: the same code on the CPU and, when there is one, a CUDA GPU.

Batches are collated on the CPU while the trainer's, the reference and the engine's models sit on the
trainer's device (a GPU when there is one). These tests pin that boundary: rollouts, the recomputed old
and reference logprobs, one SS-GRPO step, and where the RL session and evaluation put their models.
CI has no GPU, so the CUDA cases skip there; on a GPU node run ``pytest tests/test_devices.py``.
"""

from __future__ import annotations

import copy

import pytest
import torch

from rubricem_core.policy.loading import auto_device
from rubricem_core.rl.update import UpdateConfig, ss_grpo_update
from rubricem_core.rollout import HFRolloutEngine, RolloutRequest, SamplingParams
from rubricem_core.sim.world import WorldConfig, generate_world
from rubricem_core.testing.tiny_models import tool_policy, world_tokenizer
from rubricem_core.tools import LocalBrowseTool, LocalSearchTool, ToolEnv
from rubricem_core.training.config import TrainerConfig
from rubricem_core.training.torch_trainer import TorchTrainer
from tests.tiny_models import one_thread  # noqa: F401 (an autouse fixture)

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
DEVICES = ["cpu", pytest.param("cuda", marks=needs_cuda)]


@pytest.fixture(scope="module")
def world():
    return generate_world(WorldConfig(seed=5, n_documents=60, n_queries=4))


@pytest.fixture(scope="module")
def tok(world):
    return world_tokenizer(world)


@pytest.fixture(scope="module")
def env(world):
    table = world.corpus_table()
    return ToolEnv({"search": LocalSearchTool(table), "browse": LocalBrowseTool(table)}, max_calls=3)


def _model(tok, seed: int = 0):
    return tool_policy(tok, seed=seed, max_positions=2048)


def _requests(tok, world, temperature: float, n: int = 2) -> list[RolloutRequest]:
    sampling = SamplingParams(temperature=temperature, max_new_tokens=48, max_total_tokens=1200, seed=11)
    out = []
    for q in world.queries[:2]:
        text = tok.apply_chat_template(
            [{"role": "user", "content": q.question}], add_generation_prompt=True, tokenize=False
        )
        out.append(RolloutRequest(q.query_id, tok.encode(text, add_special_tokens=False), n=n, sampling=sampling))
    return out


def _advantages(trajs) -> list[list[float]]:
    # +1 / -1 by position in the group: a fixed, non-trivial signal on every policy token
    return [[(1.0 if i % 2 == 0 else -1.0) * m for m in t.loss_mask] for i, t in enumerate(trajs)]


def _update(trainer: TorchTrainer, ref_model, trajs, tok) -> dict[str, float]:
    return ss_grpo_update(
        trainer,
        ref_model,
        trajs,
        _advantages(trajs),
        tok.pad_token_id,
        UpdateConfig(kl_coef=0.01, max_tokens_per_batch=1024),
    )


@pytest.mark.parametrize("device", DEVICES)
def test_ss_grpo_step_with_models_on_the_device_and_cpu_batches(device, tok, world, env):
    trainer = TorchTrainer(_model(tok), TrainerConfig(lr=1e-3, weight_decay=0.0, total_steps=2, device=device))
    ref_model = copy.deepcopy(trainer.model).eval().requires_grad_(False)
    engine = HFRolloutEngine(trainer.model, tok)
    trajs = [t for group in engine.generate(_requests(tok, world, temperature=1.0), env) for t in group]
    before = [p.detach().clone() for p in trainer.model.parameters()]

    metrics = _update(trainer, ref_model, trajs, tok)

    assert metrics["policy_tokens"] == sum(sum(t.loss_mask) for t in trajs) > 0
    # the trainer recomputes the old logprobs with the weights that sampled: the gap is numerical only
    assert metrics["logprob_gap_mean"] < 1e-3
    assert torch.isfinite(torch.tensor(metrics["loss"]))
    after = list(trainer.model.parameters())
    assert all(p.device.type == device for p in after)
    assert any(not torch.equal(b, a.detach()) for b, a in zip(before, after))


@needs_cuda
def test_greedy_rollouts_agree_between_cpu_and_cuda(tok, world, env):
    cpu_model = _model(tok)
    cuda_model = copy.deepcopy(cpu_model).to("cuda")
    requests = _requests(tok, world, temperature=0.0, n=1)
    on_cpu = HFRolloutEngine(cpu_model, tok).generate(requests, env)
    on_cuda = HFRolloutEngine(cuda_model, tok).generate(requests, env)
    for group_cpu, group_cuda in zip(on_cpu, on_cuda):
        a, b = group_cpu[0], group_cuda[0]
        assert a.token_ids == b.token_ids
        policy = [i for i, m in enumerate(a.loss_mask) if m]
        assert max(abs(a.logprobs[i] - b.logprobs[i]) for i in policy) < 1e-3


@needs_cuda
def test_ss_grpo_step_gives_the_same_numbers_on_cpu_and_cuda(tok, world, env):
    start = _model(tok)
    trajs = [
        t for group in HFRolloutEngine(start, tok).generate(_requests(tok, world, temperature=1.0), env) for t in group
    ]
    results = {}
    for device in ("cpu", "cuda"):
        trainer = TorchTrainer(
            copy.deepcopy(start), TrainerConfig(lr=1e-3, weight_decay=0.0, total_steps=2, device=device)
        )
        ref_model = copy.deepcopy(start).to(device).requires_grad_(False)
        results[device] = _update(trainer, ref_model, trajs, tok)
    for key in ("loss", "grad_norm", "kl", "clip_fraction"):
        assert results["cuda"][key] == pytest.approx(results["cpu"][key], rel=1e-3, abs=1e-5), key


def test_rl_session_keeps_every_model_on_the_trainer_device(tmp_path):
    pytest.importorskip("prefect")
    from rubricem_core.config import load_config
    from rubricem_core.rl.session import SessionManager
    from rubricem_core.store import RunStore
    from tests.untrained_run import UNTRAINED_TINY, write_untrained_run

    cfg = load_config("tiny", {**UNTRAINED_TINY, "rl.recipe": "full"})
    write_untrained_run(cfg, tmp_path / "run")
    sessions = SessionManager(RunStore(tmp_path / "run"), cfg)
    try:
        session = sessions.at(-1)
        device = auto_device()
        assert session.policy.device.type == device.type
        for model in (session.policy.trainer.model, session.policy.ref_model, session.engine.model):
            assert {p.device.type for p in model.parameters()} == {device.type}
    finally:
        sessions.close()


def test_evaluation_engine_sits_on_the_auto_device(tmp_path):
    pytest.importorskip("prefect")
    from rubricem_core.config import load_config
    from tasks.evaluate import _engine, drop_engines
    from tests.untrained_run import UNTRAINED_TINY, write_untrained_run

    cfg = load_config("tiny", UNTRAINED_TINY)
    write_untrained_run(cfg, tmp_path / "run")
    try:
        engine, _ = _engine(str(tmp_path / "run" / "checkpoints" / "sft" / "final"), cfg)
        assert {p.device.type for p in engine.model.parameters()} == {auto_device().type}
    finally:
        drop_engines()
