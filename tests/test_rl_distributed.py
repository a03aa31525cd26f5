"""RL with trainer ranks that live for the flow run (2 gloo ranks): one SS-GRPO update on 2 ranks equals
one rank, under ZeRO-3 the engine samples with the trainer's gathered weights, and the rl flow runs with
rl.backend=deepspeed, rl.zero_stage=3 on 2 ranks with the 1-rank logprob gap (its engine fed by transfer
from rank 0, with no checkpoint between, rl.checkpoint_every=2). The ranks are Ray actors: one killed from
outside mid-update fails the flow within seconds naming it, and the reruns resume to a 1-process run's
tables; on a two-node Ray cluster (tests/two_node_ray.py) the ranks span both nodes with the same tables."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from rubricem_core.config import load_config
from rubricem_core.rl import progress as rl_progress
from rubricem_core.rl import session as rl_session
from rubricem_core.rl.learner import WeightsVersion, update_settings
from rubricem_core.sql import run_sql
from rubricem_core.store import RunStore
from rubricem_core.testing import MICRO_PROFILE
from rubricem_core.trajectory import TokenTrajectory
from tests.rl_runs import RL_RUN, sft_run  # noqa: F401  (module fixture: the collected and SFT-trained micro run)
from tests.two_node_ray import run_flow_driver, two_node_cluster
from tests.untrained_run import UNTRAINED_TINY, write_untrained_run
from tests.vllm_cpu import NO_VLLM_VENV, VLLM_PYTHON

pytestmark = pytest.mark.slow  # runs flows end to end; `make test-fast` leaves it out

TINY = {
    **UNTRAINED_TINY,
    "rl.recipe": "ss_grpo",
    "rl.lr": 1e-2,
    "rl.max_tokens_per_batch": 256,
    "rollout.max_total_tokens": 256,  # the config refuses a budget below the longest rollout; these tests sample none
}


@pytest.fixture(scope="module")
def untrained(tmp_path_factory):
    run = tmp_path_factory.mktemp("rl-dist") / "base"
    write_untrained_run(load_config("tiny", TINY), run)
    return run


def synthetic_batch(vocab: int, n: int = 6, seed: int = 0) -> tuple[list[TokenTrajectory], list[list[float]]]:
    """Trajectories of mixed lengths (several micro-batches at 256 padded tokens) with signed advantages."""
    rng = np.random.default_rng(seed)
    trajs, advs = [], []
    for _ in range(n):
        length = int(rng.integers(40, 120))
        mask = [0] * 8 + [1] * (length - 8)
        trajs.append(
            TokenTrajectory(
                token_ids=rng.integers(3, vocab, length).tolist(),
                loss_mask=mask,
                stage_ids=[-1] * 8 + [3] * (length - 8),
                logprobs=[float("nan")] * 8 + [-3.0] * (length - 8),
            )
        )
        advs.append([0.0] * 8 + [float(rng.normal())] * (length - 8))
    return trajs, advs


@pytest.fixture
def closed_sessions(monkeypatch) -> list:
    """The RL sessions closed (trainer ranks, engine and fleet stopped) while the test runs."""
    closed: list = []
    real = rl_session.RLSession.close

    def close(self) -> None:
        closed.append(self)
        real(self)

    monkeypatch.setattr(rl_session.RLSession, "close", close)
    return closed


def update_and_sync(run, tmp_path, overrides: dict) -> tuple[dict, dict[str, torch.Tensor]]:
    """Copy the run, build its session, two updates (the second with a KL term: the policy has moved from
    the reference), then the engine's weights (taken from the trainer, no checkpoint)."""
    run_dir = str(tmp_path / "run")
    shutil.copytree(run, run_dir)
    cfg = load_config("tiny", {**TINY, **overrides})
    sessions = rl_session.SessionManager(RunStore(run_dir), cfg)
    session = sessions.at(-1)
    try:
        trajs, advs = synthetic_batch(len(session.tokenizer))
        session.policy.update(trajs, advs, update_settings(cfg, 1.0))
        trajs, advs = synthetic_batch(len(session.tokenizer), seed=1)
        metrics = session.policy.update(trajs, advs, update_settings(cfg, 1.0))
        rl_session.applied(session, WeightsVersion(0))  # as update_step records its update
        rl_session.ensure_engine_weights(session, 0, cfg)  # by transfer: no checkpoint is written
        assert not rl_progress.rl_dir(RunStore(run_dir)).exists()
        engine = {k: v.detach().clone() for k, v in session.engine.model.state_dict().items()}
    finally:
        sessions.close()
    return metrics, engine


@pytest.fixture(scope="module")
def one_process(untrained, tmp_path_factory):
    return update_and_sync(untrained, tmp_path_factory.mktemp("one"), {})


@pytest.mark.parametrize(
    "overrides",
    [
        {"rl.backend": "deepspeed", "rl.zero_stage": 3},  # one process: the engine must not get 0-size placeholders
        {"distributed.nproc_per_node": 2},
        {"distributed.nproc_per_node": 2, "rl.backend": "deepspeed", "rl.zero_stage": 3},
        {"distributed.nproc_per_node": 2, "rl.backend": "deepspeed", "rl.zero_stage": 3, "rl.reference": "sharded"},
        {"rl.reference": "cpu"},
    ],
    ids=["zero3-1rank", "torch-2ranks", "zero3-2ranks", "zero3-2ranks-sharded-ref", "cpu-ref"],
)
def test_engine_samples_with_the_trainers_gathered_weights_after_an_update(untrained, one_process, tmp_path, overrides):
    ref_metrics, ref_engine = one_process
    metrics, engine = update_and_sync(untrained, tmp_path, overrides)
    from safetensors.torch import load_file

    sft = load_file(str(untrained / "checkpoints" / "sft" / "final" / "model.safetensors"))
    assert engine.keys() == ref_engine.keys()
    assert all(engine[k].numel() > 0 for k in engine)  # no ZeRO-3 placeholder reached the engine
    moved = max(float((ref_engine[k] - sft[k]).abs().max()) for k in sft)
    assert moved > 1e-3  # the update changed the weights the engine samples with
    assert max(float((engine[k] - ref_engine[k]).abs().max()) for k in ref_engine) < 1e-4
    assert ref_metrics["kl"] > 1e-6  # the reference takes part in the second update
    for key in ("loss", "grad_norm", "kl", "policy_tokens", "n_tokens", "ratio_max"):
        assert metrics[key] == pytest.approx(ref_metrics[key], rel=1e-4, abs=1e-6), key


# ---- the rl flow on 2 ranks ----------------------------------------------------------------------
FLOW = RL_RUN  # the rl flow test's tiny run: ss_grpo, 2 steps of 2 queries x 2 rollouts


def _gaps(run_dir: str) -> dict[int, float]:
    rows = json.loads(
        run_sql(run_dir, "SELECT step, value FROM metrics WHERE name = 'rl/logprob_gap_mean'", fmt="json")
    )
    return {r["step"]: r["value"] for r in rows}


def test_rl_flow_on_two_zero3_ranks(sft_run, tmp_path, closed_sessions):
    from flows.rl import rl

    zero3 = {**FLOW, "rl.backend": "deepspeed", "rl.zero_stage": 3}
    one = str(tmp_path / "one")
    two = str(tmp_path / "two")
    shutil.copytree(sft_run, one)
    shutil.copytree(sft_run, two)
    rl(run_dir=one, profile=MICRO_PROFILE, overrides=zero3)
    # no checkpoint of step 0 (rl.checkpoint_every=2): step 1's engine gets the ranks' weights by the
    # gloo transfer from rank 0 (the only road left: a missing checkpoint would raise)
    result = rl(
        run_dir=two,
        profile=MICRO_PROFILE,
        overrides={**zero3, "distributed.nproc_per_node": 2, "rl.checkpoint_every": 2},
    )
    assert result["steps"] == 2
    assert closed_sessions  # the ranks ended with the flow run

    a, b = RunStore(one).read_rows("rollouts"), RunStore(two).read_rows("rollouts")
    assert sum(r["n_policy_tokens"] for r in b) > 0  # the engine generated (ZeRO-3 once gave it no weights)
    assert [r["token_ids"] for r in a] == [r["token_ids"] for r in b]  # same weights, same seeds
    gap_one, gap_two = _gaps(one), _gaps(two)
    assert sorted(gap_two) == [0, 1]
    for step, gap in gap_two.items():
        assert gap < 1e-5 and gap == pytest.approx(gap_one[step], abs=1e-6)
    assert sorted(p.name for p in (tmp_path / "two" / "checkpoints" / "rl").iterdir()) == ["step-000001"]
    assert (tmp_path / "one" / "checkpoints" / "rl" / "step-000000" / "checkpoint.json").exists()


@pytest.fixture(scope="module")
def one_process_flow(sft_run, tmp_path_factory) -> str:
    """The rl flow on FLOW in the flow's own process, uninterrupted: the tables the Ray runs must reproduce."""
    from flows.rl import rl

    run_dir = str(tmp_path_factory.mktemp("rl-one") / "run")
    shutil.copytree(sft_run, run_dir)
    rl(run_dir=run_dir, profile=MICRO_PROFILE, overrides=FLOW)
    return run_dir


def _same_tables(run_dir: str, reference: str) -> None:
    """The run's rollouts, stage rewards and logprob gaps are the reference run's."""
    a, b = RunStore(reference), RunStore(run_dir)
    key = ("step", "rollout_id")
    rollouts = [sorted(s.read_rows("rollouts"), key=lambda r: tuple(r[k] for k in key)) for s in (a, b)]
    assert [r["token_ids"] for r in rollouts[0]] == [r["token_ids"] for r in rollouts[1]]
    rewards = [
        sorted(
            ((r["step"], r["rollout_id"], r["stage"]), [r["R"], r["G"], r["A"]]) for r in s.read_rows("stage_rewards")
        )
        for s in (a, b)
    ]
    assert [k for k, _ in rewards[0]] == [k for k, _ in rewards[1]]
    assert [v for _, v in rewards[1]] == [pytest.approx(v, abs=1e-6, nan_ok=True) for _, v in rewards[0]]
    assert _gaps(run_dir) == pytest.approx(_gaps(reference), abs=1e-6)


def _wait_for_line(path: Path, pattern: str, timeout_s: float = 600) -> re.Match:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        found = re.search(pattern, path.read_text(errors="replace")) if path.exists() else None
        if found:
            return found
        time.sleep(0.2)
    raise AssertionError(f"no {pattern!r} in {path} within {timeout_s}s")


def test_a_trainer_rank_killed_mid_update_fails_the_rl_flow_and_the_reruns_resume(
    one_process_flow, sft_run, tmp_path, monkeypatch, closed_sessions
):
    """Rank 1's actor SIGKILLed from outside while it is in step 1's update: the flow fails within 30 s
    naming rank 1; the rerun's ranks then kill themselves while writing step 1's checkpoint; the third run
    resumes from step 0's checkpoint to the tables of the uninterrupted 1-process run."""
    from flows.rl import rl
    from rubricem_core.distributed.actors import RankFailure

    run_dir = str(tmp_path / "run")
    shutil.copytree(sft_run, run_dir)
    overrides = {**FLOW, "distributed.nproc_per_node": 2}
    # each rank's 2nd update (step 1's) hangs there, printing its pid, until it is killed
    monkeypatch.setenv("RUBRICEM_FAULT_POINT", "rl.rank_update:2")
    monkeypatch.setenv("RUBRICEM_FAULT_ACTION", "hang")
    failed: dict = {}

    def run() -> None:
        try:
            rl(run_dir=run_dir, profile=MICRO_PROFILE, overrides=overrides)
        except BaseException as exc:  # noqa: BLE001  (what the flow raised, checked below)
            failed.update(exc=exc, at=time.monotonic())

    flow = threading.Thread(target=run)
    flow.start()
    try:
        log = Path(run_dir) / "state" / "ranks" / "rl-rank1.log"
        pid = int(_wait_for_line(log, r"fault point rl\.rank_update: hanging \(pid (\d+)\)").group(1))
        killed_at = time.monotonic()
        os.kill(pid, signal.SIGKILL)
        flow.join(timeout=120)
    finally:
        if flow.is_alive():  # rank 0 would hang until distributed.timeout_s: end it with the test
            rank0 = Path(run_dir) / "state" / "ranks" / "rl-rank0.log"
            os.kill(int(_wait_for_line(rank0, r"hanging \(pid (\d+)\)", 10).group(1)), signal.SIGKILL)
            flow.join(timeout=60)
    detected_s = failed["at"] - killed_at
    print(f"rank 1 killed mid-update: the flow failed {detected_s:.1f}s later")
    assert isinstance(failed["exc"], RankFailure), failed
    message = str(failed["exc"])
    assert re.search(rf"rl trainer rank 1 of 2 on node \S+ \(pid {pid}\) died", message), message
    assert detected_s < 30
    assert rl_progress.completed_step(RunStore(run_dir)) == 0 and closed_sessions
    closed_sessions.clear()

    # the ranks kill themselves while writing step 1's checkpoint (the flow process writes none)
    monkeypatch.setenv("RUBRICEM_FAULT_POINT", "checkpoint.weights_written:1")
    monkeypatch.delenv("RUBRICEM_FAULT_ACTION")
    with pytest.raises(RankFailure, match=r"trainer rank \d of 2 .*(died|raised)"):
        rl(run_dir=run_dir, profile=MICRO_PROFILE, overrides=overrides)
    assert rl_progress.completed_step(RunStore(run_dir)) == 0 and closed_sessions
    monkeypatch.delenv("RUBRICEM_FAULT_POINT")
    rl(run_dir=run_dir, profile=MICRO_PROFILE, overrides=overrides)
    assert rl_progress.completed_step(RunStore(run_dir)) == 1
    assert RunStore(run_dir).partitions("stage_rewards", "step") == [0, 1]
    _same_tables(run_dir, one_process_flow)


# ---- the rl flow with vLLM as its own process --------------------------------------------------
# head_dim 64 (128 / 2 heads): a size every vLLM attention backend supports
SERVER_FLOW = {**FLOW, "policy.hidden_size": 128, "policy.n_heads": 2, "policy.n_kv_heads": 1}
# 2 ZeRO-3 trainer ranks pushing their weights over gloo into `vllm serve`
RANKS_PUSH_TO_SERVER = {
    "rl.backend": "deepspeed",
    "rl.zero_stage": 3,
    "distributed.nproc_per_node": 2,
    "rollout.engine": "vllm_server",
    "rollout.server_python": str(VLLM_PYTHON),
    "rollout.weight_transfer": "gloo",
}


@pytest.mark.skipif(not VLLM_PYTHON.exists(), reason=NO_VLLM_VENV)
def test_rl_flow_with_a_vllm_server_and_two_zero3_ranks(
    tmp_path_factory, prefect_harness, monkeypatch, closed_sessions
):
    """The rl flow with `vllm serve` as its own process beside 2 ZeRO-3 trainer ranks, the weights reaching
    it both ways: reloaded from the checkpoint rank 0 wrote, and pushed by the ranks through vLLM's
    weight-transfer API (gloo: each rank gathers every parameter in turn, rank 0 broadcasts it) into a
    colocated server that sleeps through each update, and pushed by one trainer in the flow process; and a
    fleet of two servers (rollout.replicas: 2) that one push from the ranks reaches. Same weights, so the
    five runs (the last: two replicas reloading checkpoints) sample the same rollouts token for token."""
    from flows.collect_sft_data import collect_sft_data
    from flows.rl import rl
    from flows.sft import sft

    root = tmp_path_factory.mktemp("rl-server")
    sft_dir = str(root / "sft")
    collect_sft_data(run_dir=sft_dir, profile=MICRO_PROFILE, overrides=SERVER_FLOW)
    sft(run_dir=sft_dir, profile=MICRO_PROFILE, overrides=SERVER_FLOW)
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB of KV cache for the CPU build
    monkeypatch.setenv("VLLM_HOST_IP", "127.0.0.1")
    rollouts = {}
    # (name, weight transfer, trainer ranks, colocated): 2 ranks push through the `push` command of the
    # ranks' channel, 1 rank from the flow process itself (a ZeRO-3 engine of one rank: gathered all the same)
    # the last: a fleet of 2 replicas, rows async (the default), one push from the 2 ranks into both
    runs = [
        ("checkpoint", "checkpoint", 2, False, 1),
        ("gloo", "gloo", 2, True, 1),
        ("gloo-1-rank", "gloo", 1, False, 1),
        ("gloo-2-replicas", "gloo", 2, False, 2),
        ("checkpoint-2-replicas", "checkpoint", 1, False, 2),  # both reload one side directory, built once
    ]
    for name, transfer, ranks, colocate, replicas in runs:
        run_dir = str(root / name)
        shutil.copytree(sft_dir, run_dir)
        rl(
            run_dir=run_dir,
            profile=MICRO_PROFILE,
            overrides={
                **SERVER_FLOW,
                "rl.backend": "deepspeed",
                "rl.zero_stage": 3,
                "distributed.nproc_per_node": ranks,
                "rollout.engine": "vllm_server",
                "rollout.server_python": str(VLLM_PYTHON),
                "rollout.weight_transfer": transfer,
                "rollout.colocate": colocate,  # asleep during each update (vLLM on a CPU accepts it, frees nothing)
                "rollout.replicas": replicas,
            },
        )
        assert closed_sessions  # ranks and server ended with the flow run
        closed_sessions.clear()
        rows = RunStore(run_dir).read_rows("rollouts")
        assert {r["step"] for r in rows} == {0, 1} and sum(r["n_policy_tokens"] for r in rows) > 0
        rollouts[name] = sorted((r["rollout_id"], list(r["token_ids"])) for r in rows)
        gaps = _gaps(run_dir)
        # the server samples (step 1: after step 0's weights reached it) with the trainer's logprobs;
        # that new weights change the server's exactly is tests/test_rollout_vllm.py's server tests
        assert sorted(gaps) == [0, 1] and all(g < 1e-4 for g in gaps.values()), (name, gaps)
        log = (Path(run_dir) / "state" / "vllm-server.log").read_text()
        calls = {
            path: log.count(f'"POST {path} HTTP/1.1" 200')
            for path in ("/update_weights", "/collective_rpc", "/sleep?level=1", "/wake_up")
        }
        # step 1's rollouts: the server (woken from the sleep of step 0's update) gets step 0's weights
        pushed, reloaded = (1, 0) if transfer == "gloo" else (0, 1)
        assert list(calls.values()) == [pushed, reloaded, 2 * colocate, 1 * colocate], (name, calls)
        if replicas == 2:  # the second replica got the same push or reload
            other = (Path(run_dir) / "state" / "vllm-server-1.log").read_text()
            assert (
                other.count(f'"POST {"/update_weights" if transfer == "gloo" else "/collective_rpc"} HTTP/1.1" 200')
                == 1
            )
    assert all(r == rollouts["checkpoint"] for r in rollouts.values()), "the runs sampled different rollouts"

    # evaluation samples through the same fleet: 2 replicas serving the final checkpoint's own weights
    from flows.evaluate import evaluate

    fleet = {
        **SERVER_FLOW,
        **RANKS_PUSH_TO_SERVER,
        "rollout.replicas": 2,
        "eval.max_queries": 2,
    }
    run_dir = str(root / "gloo-2-replicas")
    out = evaluate(run_dir=run_dir, profile=MICRO_PROFILE, overrides=fleet, benchmarks=["synthetic"])
    ckpt = Path(out["checkpoint"])
    served = [
        (ckpt.parent / f".{ckpt.name}.vllm-eval{suffix}.log").read_text().count('"POST /v1/completions HTTP/1.1" 200')
        for suffix in ("", "-1")
    ]
    assert sum(served) > 0, served  # the fleet sampled the evaluation, not an in-process engine
    assert any(r["checkpoint"] == out["tag"] for r in RunStore(run_dir).read_rows("eval_results"))


@pytest.mark.skipif(not VLLM_PYTHON.exists(), reason=NO_VLLM_VENV)
def test_lora_rl_flow_with_a_vllm_server_loading_each_steps_adapter(
    tmp_path_factory, prefect_harness, monkeypatch, closed_sessions
):
    """policy.lora: SFT and RL train adapters; the server serves SFT's merged copy and gets RL's weights as
    merged tensors (gloo, one process) or as each step's adapter loaded at run time (adapter, from 2 ranks:
    rank 0 writes it), and samples with the trainer's logprobs either way."""
    pytest.importorskip("peft")
    from flows.collect_sft_data import collect_sft_data
    from flows.rl import rl
    from flows.sft import sft

    lora = {**SERVER_FLOW, "policy.lora.rank": 8, "policy.lora.alpha": 16, "sft.lr": 3e-3, "rl.lr": 1e-4}
    root = tmp_path_factory.mktemp("rl-lora-server")
    sft_dir = str(root / "sft")
    collect_sft_data(run_dir=sft_dir, profile=MICRO_PROFILE, overrides=lora)
    sft(run_dir=sft_dir, profile=MICRO_PROFILE, overrides=lora)
    assert (Path(sft_dir) / "checkpoints" / "sft" / "final" / "adapter_model.safetensors").is_file()
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
    monkeypatch.setenv("VLLM_HOST_IP", "127.0.0.1")
    for transfer, ranks in (("gloo", 1), ("adapter", 2)):
        run_dir = str(root / transfer)
        shutil.copytree(sft_dir, run_dir)
        rl(
            run_dir=run_dir,
            profile=MICRO_PROFILE,
            overrides={
                **lora,
                "distributed.nproc_per_node": ranks,
                "rollout.engine": "vllm_server",
                "rollout.server_python": str(VLLM_PYTHON),
                "rollout.weight_transfer": transfer,
            },
        )
        closed_sessions.clear()
        gaps = _gaps(run_dir)
        assert sorted(gaps) == [0, 1] and all(g < 1e-4 for g in gaps.values()), (transfer, gaps)
        log = (Path(run_dir) / "state" / "vllm-server.log").read_text()
        calls = {
            path: log.count(f'"POST {path} HTTP/1.1" 200') for path in ("/update_weights", "/v1/load_lora_adapter")
        }
        assert calls == ({"/update_weights": 1, "/v1/load_lora_adapter": 0} if transfer == "gloo" else
                         {"/update_weights": 0, "/v1/load_lora_adapter": 1}), (transfer, calls)  # fmt: skip
        pushed = list((Path(run_dir) / "state" / "adapter-push").glob("step-*"))
        assert len(pushed) == (transfer == "adapter")  # the last one kept, the earlier removed


@pytest.mark.skipif(not VLLM_PYTHON.exists(), reason=NO_VLLM_VENV)
def test_async_rl_flow_pushes_each_lagged_step_from_two_ranks_into_a_vllm_server(
    tmp_path_factory, prefect_harness, monkeypatch, closed_sessions
):
    """rl.async_steps: 1 with `vllm serve` and 2 ZeRO-3 trainer ranks: the server samples step t+1 while the
    ranks train step t, with the weights from before that update, pushed over gloo once a step from step 2
    on (steps 0 and 1 both sample the SFT policy); each sampled logprob is the lagged checkpoint's."""
    from flows.collect_sft_data import collect_sft_data
    from flows.rl import rl
    from flows.sft import sft
    from rubricem_core.logprobs import token_logprobs
    from rubricem_core.policy.loading import load_policy

    root = tmp_path_factory.mktemp("rl-async-server")
    run_dir = str(root / "run")
    collect_sft_data(run_dir=run_dir, profile=MICRO_PROFILE, overrides=SERVER_FLOW)
    sft(run_dir=run_dir, profile=MICRO_PROFILE, overrides=SERVER_FLOW)
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
    monkeypatch.setenv("VLLM_HOST_IP", "127.0.0.1")
    rl(
        run_dir=run_dir,
        profile=MICRO_PROFILE,
        overrides={
            **SERVER_FLOW,
            "rl.n_windows": 2,  # 4 steps: steps 2 and 3 sample weights pushed while the next update runs
            "rl.lr": 3e-3,
            "rl.keep_checkpoints": 4,
            "rl.async_steps": 1,
            "rl.importance_correction": "tis",
            **RANKS_PUSH_TO_SERVER,
        },
    )
    assert closed_sessions
    lags = json.loads(run_sql(run_dir, "SELECT step, value FROM metrics WHERE name = 'rollout/policy_lag'", fmt="json"))
    assert sorted((r["step"], r["value"]) for r in lags) == [(0, 0.0), (1, 1.0), (2, 1.0), (3, 1.0)]
    log = (Path(run_dir) / "state" / "vllm-server.log").read_text()
    assert log.count('"POST /update_weights HTTP/1.1" 200') == 2  # the weights after steps 0 and 1
    ckpts = Path(run_dir) / "checkpoints" / "rl"
    temperature = yaml.safe_load((Path(run_dir) / "config.yaml").read_text())["rollout"]["temperature"]
    # the server's logprobs are the lagged checkpoint's (that they are not the trainer's newer weights when
    # an update moved them is tests/test_rl_async.py's, on a run with signal in every step)
    for step, lagged in ((2, "step-000000"), (3, "step-000001")):
        model, _ = load_policy(str(ckpts / lagged))
        worst = 0.0
        for row in RunStore(run_dir).read_rows("rollouts", {"step": step}):
            ids = torch.tensor([row["token_ids"]])
            with torch.no_grad():
                ours = token_logprobs(model.eval(), ids, torch.ones_like(ids), temperature=temperature)[0]
            known = [(t, lp) for t, lp in enumerate(row["logprobs"]) if lp is not None]
            worst = max([worst, *(abs(float(ours[t]) - lp) for t, lp in known)])
        assert worst < 1e-3, (step, lagged, worst)


@pytest.fixture(scope="module")
def two_nodes(tmp_path_factory):
    """A head and a worker Ray node on this machine, 1 CPU each (tests/two_node_ray.py)."""
    with two_node_cluster(tmp_path_factory.mktemp("ray-nodes")) as env:
        yield env


def test_rl_flow_on_two_ray_nodes(one_process_flow, sft_run, two_nodes, tmp_path):
    """The rl flow as the driver of a two-node Ray cluster (joined through RAY_ADDRESS, token auth): its 2
    trainer ranks are placed one per node (each has 1 CPU) and the tables equal a 1-process run's."""
    run_dir = str(tmp_path / "run")
    shutil.copytree(sft_run, run_dir)
    _, out = run_flow_driver(
        "flows.rl:rl", two_nodes, run_dir=run_dir, profile=MICRO_PROFILE, overrides={**FLOW, "distributed.nnodes": 2}
    )
    assert re.search(r"2 rl ranks on 2 node\(s\) \['127\.0\.0\.2', '127\.0\.0\.3'\]", out), out[-4000:]
    assert "joining the Ray cluster at 127.0.0.2:" in out
    _same_tables(run_dir, one_process_flow)
