"""SFT from the Prefect task on 2 gloo ranks: the same weights as one rank, rank 0's metrics in MLflow,
a killed rank fails the task, and the rerun resumes to the uninterrupted run's weights."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file

from rubricem_core.config import load_config
from rubricem_core.processes import free_port
from rubricem_core.sft import run_sft, sft_inputs
from rubricem_core.sql import run_sql
from test_sft import SMALL, collected_run  # noqa: F401  (the module's collected run fixture)

pytestmark = pytest.mark.slow  # runs flows end to end; `make test-fast` leaves it out

# Two micro-batches per step, so each of the 2 ranks trains on one.
DIST = {
    **SMALL,
    "sft.max_steps": 4,
    "sft.checkpoint_every": 2,
    "sft.log_every": 1,
    "sft.grad_accum_steps": 2,
    "sft.max_tokens_per_batch": 4096,
}


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

    # one rank, same config, same base policy, uninterrupted
    cfg = load_config("tiny", DIST)
    rows, reflections = sft_inputs(run_dir)  # research trajectories and the teacher's reflections
    ref = run_sft(
        run_dir / "policy" / "base", rows, tmp_path / "one", cfg.policy, cfg.sft, seed=0, reflection_rows=reflections
    )
    assert reflections and ref["reflection_examples"] > 0
    assert result["final_loss"] == pytest.approx(ref["final_loss"], rel=1e-5)
    a = load_file(str(ckpts / "final" / "model.safetensors"))
    b = load_file(str(tmp_path / "one" / "final" / "model.safetensors"))
    base = load_file(str(run_dir / "policy" / "base" / "model.safetensors"))
    assert max(float((b[k] - base[k]).abs().max()) for k in b) > 1e-3  # SFT moved the weights
    assert max(float((a[k] - b[k]).abs().max()) for k in a) < 1e-5

    # rank 0's metric lines reached the flow's MLflow run (and the metrics table)
    losses = json.loads(
        run_sql(str(run_dir), "SELECT step, value FROM metrics WHERE name = 'sft/loss' ORDER BY step", fmt="json")
    )
    assert [r["step"] for r in losses][-2:] == [3, 4]
    assert torch.isfinite(torch.tensor([r["value"] for r in losses])).all()


def test_two_zero3_ranks_load_the_policy_partitioned_and_train_like_one_rank(collected_run, tmp_path):
    """ZeRO-3 over 2 ranks builds the base policy straight into its partitions (zero.Init) and ends
    where one plain rank ends (within ZeRO-3's summation-order rounding)."""
    from flows.sft import sft

    run_dir = tmp_path / "run"
    shutil.copytree(f"{collected_run}/tables", run_dir / "tables")
    zero3 = {**DIST, "sft.backend": "deepspeed", "sft.zero_stage": 3, "distributed.nproc_per_node": 2}
    result = sft(run_dir=str(run_dir), profile="tiny", overrides=zero3)
    cfg = load_config("tiny", DIST)
    rows, reflections = sft_inputs(run_dir)
    ref = run_sft(
        run_dir / "policy" / "base", rows, tmp_path / "one", cfg.policy, cfg.sft, seed=0, reflection_rows=reflections
    )
    assert result["final_loss"] == pytest.approx(ref["final_loss"], rel=1e-4)
    a = load_file(str(run_dir / "checkpoints" / "sft" / "final" / "model.safetensors"))
    b = load_file(str(tmp_path / "one" / "final" / "model.safetensors"))
    assert a.keys() == b.keys()
    assert max(float((a[k] - b[k]).abs().max()) for k in a) < 1e-4


def test_sft_on_two_nodes_joined_by_the_ranks_command(collected_run, tmp_path):
    """Two "nodes" on this machine (1 rank each, static rendezvous): node 0 is the flow, node 1 runs
    `rubricem ranks sft`; the weights are those of one rank on the same batches."""
    import subprocess
    import sys

    from flows.sft import sft

    port = free_port()
    run_dir = tmp_path / "run"
    shutil.copytree(f"{collected_run}/tables", run_dir / "tables")
    node1 = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "flows.cli",
            "ranks",
            "sft",
            "--run-dir",
            str(run_dir),
            "--node-rank",
            "1",
            "--wait-s",
            "300",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        result = sft(
            run_dir=str(run_dir),
            profile="tiny",
            overrides={**DIST, "sft.checkpoint_every": 10, "distributed.nnodes": 2, "distributed.master_port": port},
        )
        out, _ = node1.communicate(timeout=120)
    finally:
        node1.kill()
    assert node1.returncode == 0, out
    assert "Traceback" not in out
    cfg = load_config("tiny", DIST)
    rows, reflections = sft_inputs(run_dir)  # research trajectories and the teacher's reflections
    ref = run_sft(
        run_dir / "policy" / "base", rows, tmp_path / "one", cfg.policy, cfg.sft, seed=0, reflection_rows=reflections
    )
    assert reflections and ref["reflection_examples"] > 0
    assert result["final_loss"] == pytest.approx(ref["final_loss"], rel=1e-5)
    a = load_file(str(run_dir / "checkpoints" / "sft" / "final" / "model.safetensors"))
    b = load_file(str(tmp_path / "one" / "final" / "model.safetensors"))
    assert max(float((a[k] - b[k]).abs().max()) for k in a) < 1e-5
