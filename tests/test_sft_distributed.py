"""SFT from the Prefect task on 2 gloo ranks: the same weights as one rank, rank 0's metrics in MLflow,
a killed rank fails the task, and the rerun resumes to the uninterrupted run's weights; the ranks are Ray
actors, on a two-node Ray cluster one per node (tests/two_node_ray.py)."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from rubricem_core.config import load_config
from rubricem_core.sft import SFTRun, run_sft, sft_inputs
from rubricem_core.sql import run_sql
from tests.sft_runs import SFT_RUN, collected_run  # noqa: F401  (module fixture)
from tests.two_node_ray import run_flow_driver, two_node_cluster

pytestmark = pytest.mark.slow  # runs flows end to end; `make test-fast` leaves it out

# Two micro-batches per step, so each of the 2 ranks trains on one.
DIST = {
    **SFT_RUN,
    "sft.max_steps": 4,
    "sft.checkpoint_every": 2,
    "sft.log_every": 1,
    "sft.grad_accum_steps": 2,
    "sft.max_tokens_per_batch": 4096,
}


def assert_equals_one_rank(run_dir: Path, result: dict, one: Path) -> None:
    """The run's final SFT weights and loss are one rank's on the same config, base policy and rows,
    uninterrupted (trained into ``one``), and SFT moved the weights."""
    cfg = load_config("tiny", DIST)
    rows, reflections = sft_inputs(run_dir)  # research trajectories and the teacher's reflections
    ref = run_sft(
        SFTRun(run_dir / "policy" / "base", rows, one, cfg.policy, cfg.sft, seed=0, reflection_rows=reflections)
    )
    assert reflections and ref["reflection_examples"] > 0
    assert result["final_loss"] == pytest.approx(ref["final_loss"], rel=1e-5)
    a = load_file(str(run_dir / "checkpoints" / "sft" / "final" / "model.safetensors"))
    b = load_file(str(one / "final" / "model.safetensors"))
    base = load_file(str(run_dir / "policy" / "base" / "model.safetensors"))
    assert max(float((b[k] - base[k]).abs().max()) for k in b) > 1e-3  # SFT moved the weights
    assert max(float((a[k] - b[k]).abs().max()) for k in a) < 1e-5


def test_two_rank_sft_from_the_task_equals_one_rank_and_resumes(collected_run, tmp_path, monkeypatch):
    from flows.sft import sft

    run_dir = tmp_path / "run"
    shutil.copytree(f"{collected_run}/tables", run_dir / "tables")
    overrides = {**DIST, "distributed.nproc_per_node": 2}

    # every rank kills itself after its 3rd step (after the step-2 checkpoint): the task must fail
    monkeypatch.setenv("RUBRICEM_FAULT_POINT", "sft.step_done:3")
    with pytest.raises(Exception, match=r"trainer rank \d of 2 .*(died|raised)"):
        sft(run_dir=str(run_dir), profile="tiny", overrides=overrides)
    ckpts = run_dir / "checkpoints" / "sft"
    assert (ckpts / "step-000002" / "checkpoint.json").exists() and not (ckpts / "final").exists()

    monkeypatch.delenv("RUBRICEM_FAULT_POINT")
    result = sft(run_dir=str(run_dir), profile="tiny", overrides=overrides)
    assert result["steps"] == 4 and not result["cached"]

    assert_equals_one_rank(run_dir, result, tmp_path / "one")

    # rank 0's metric lines reached the flow's MLflow run (and the metrics table)
    losses = json.loads(
        run_sql(str(run_dir), "SELECT step, value FROM metrics WHERE name = 'sft/loss' ORDER BY step", fmt="json")
    )
    assert [r["step"] for r in losses][-2:] == [3, 4]
    assert torch.isfinite(torch.tensor([r["value"] for r in losses])).all()


def zero3_and_one_rank(collected_run, tmp_path, overrides: dict):
    """The sft flow on 2 ZeRO-3 ranks (the base loaded partitioned) and run_sft on one plain rank, same config and
    base: (the flow's run dir, its result, the one rank's result; its checkpoints under tmp_path/one)."""
    from flows.sft import sft

    run_dir = tmp_path / "run"
    shutil.copytree(f"{collected_run}/tables", run_dir / "tables")
    zero3 = {**overrides, "sft.backend": "deepspeed", "sft.zero_stage": 3, "distributed.nproc_per_node": 2}
    result = sft(run_dir=str(run_dir), profile="tiny", overrides=zero3)
    cfg = load_config("tiny", overrides)
    rows, reflections = sft_inputs(run_dir)
    ref = run_sft(
        SFTRun(
            run_dir / "policy" / "base",
            rows,
            tmp_path / "one",
            cfg.policy,
            cfg.sft,
            seed=0,
            reflection_rows=reflections,
        )
    )
    return run_dir, result, ref


def test_two_zero3_ranks_load_the_policy_partitioned_and_train_like_one_rank(collected_run, tmp_path):
    """ZeRO-3 over 2 ranks builds the base policy straight into its partitions (zero.Init) and ends
    where one plain rank ends (within ZeRO-3's summation-order rounding)."""
    run_dir, result, ref = zero3_and_one_rank(collected_run, tmp_path, DIST)
    assert result["final_loss"] == pytest.approx(ref["final_loss"], rel=1e-4)
    a = load_file(str(run_dir / "checkpoints" / "sft" / "final" / "model.safetensors"))
    b = load_file(str(tmp_path / "one" / "final" / "model.safetensors"))
    assert a.keys() == b.keys()
    assert max(float((a[k] - b[k]).abs().max()) for k in a) < 1e-4


def test_lora_sft_on_two_zero3_ranks_loaded_partitioned_equals_one_rank(collected_run, tmp_path):
    """policy.lora with the base built straight into ZeRO-3 partitions on 2 ranks: the adapters added over the
    partitioned base train like one plain rank's, and the final checkpoint is the adapter (its base named)."""
    pytest.importorskip("peft")
    lora = {**DIST, "policy.lora.rank": 4, "policy.lora.alpha": 8, "sft.lr": 3e-3}
    run_dir, result, ref = zero3_and_one_rank(collected_run, tmp_path, lora)
    assert result["final_loss"] == pytest.approx(ref["final_loss"], rel=1e-4)
    final = run_dir / "checkpoints" / "sft" / "final"
    assert not (final / "model.safetensors").exists()
    a = load_file(str(final / "adapter_model.safetensors"))
    b = load_file(str(tmp_path / "one" / "final" / "adapter_model.safetensors"))
    assert a.keys() == b.keys() and any("lora_B" in k for k in a)
    assert max(float(b[k].abs().max()) for k in b if "lora_B" in k) > 1e-4  # SFT moved the adapters
    assert max(float((a[k] - b[k]).abs().max()) for k in a) < 1e-4
    meta = json.loads((final / "checkpoint.json").read_text())["adapter"]
    assert (final / meta["base"]).resolve() == (run_dir / "policy" / "base").resolve()


@pytest.fixture(scope="module")
def two_nodes(tmp_path_factory):
    """A head and a worker Ray node on this machine, 1 CPU each (tests/two_node_ray.py)."""
    with two_node_cluster(tmp_path_factory.mktemp("ray-nodes")) as env:
        yield env


def test_sft_on_two_ray_nodes(collected_run, two_nodes, tmp_path):
    """The sft flow as the driver of a two-node Ray cluster (joined through RAY_ADDRESS, token auth): one
    rank on each node (each has 1 CPU); the weights are those of one rank on the same batches."""
    run_dir = tmp_path / "run"
    shutil.copytree(f"{collected_run}/tables", run_dir / "tables")
    result, out = run_flow_driver(
        "flows.sft:sft",
        two_nodes,
        run_dir=str(run_dir),
        profile="tiny",
        overrides={**DIST, "sft.checkpoint_every": 10, "distributed.nnodes": 2},
    )
    assert re.search(r"2 sft ranks on 2 node\(s\) \['127\.0\.0\.2', '127\.0\.0\.3'\]", out), out[-4000:]
    assert_equals_one_rank(run_dir, result, tmp_path / "one")
