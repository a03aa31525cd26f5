"""SIGKILL at chosen points of a tiny run, then a rerun: it completes with the tables of an
uninterrupted run (no duplicate, no missing rows), loadable checkpoints and no temp file read as data.

The kills are real: the `rubricem` CLI runs in its own process group and ``RUBRICEM_FAULT_POINT``
(rubricem_core/faults.py) makes it SIGKILL itself at the named point — no cleanup handler runs, as
with the OOM killer or a preempted node. The subprocesses talk to the session's test Prefect server
(no temporary server per call). One uninterrupted reference run per module, in process, with the same
config and seed; its snapshots after collection and after SFT are the starting points of the kills.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from rubricem_core.schemas import row_keys
from rubricem_core.sql import run_sql
from rubricem_core.store import RunStore
from rubricem_core.testing import MICRO_PROFILE
from rubricem_core.training.checkpoint import load_checkpoint, read_meta

pytestmark = pytest.mark.slow  # runs flows end to end; `make test-fast` leaves it out

REPO = Path(__file__).resolve().parents[1]
CLI = [sys.executable, "-m", "flows.cli"]

SMALL = {"sft.max_steps": 4, "sft.checkpoint_every": 2, "sft.log_every": 1}  # over MICRO_PROFILE
SETS = [a for k, v in SMALL.items() for a in ("--set", f"{k}={v}")]
# columns that legitimately differ between two runs of the same config (wall-clock times)
VOLATILE = {"latency_s", "submitted_at", "logged_at"}


@pytest.fixture(scope="module")
def reference(tmp_path_factory, prefect_harness) -> dict[str, Path]:
    """An uninterrupted run, with snapshots after collection and after SFT."""
    from flows.collect_sft_data import collect_sft_data
    from flows.rl import rl
    from flows.sft import sft

    root = tmp_path_factory.mktemp("fault_kill")
    run = root / "reference"
    collect_sft_data(run_dir=str(run), profile=MICRO_PROFILE, overrides=SMALL)
    shutil.copytree(run, root / "collected")
    sft(run_dir=str(run), profile=MICRO_PROFILE, overrides=SMALL)
    shutil.copytree(run, root / "trained")
    rl(run_dir=str(run), profile=MICRO_PROFILE, overrides=SMALL)
    return {"collected": root / "collected", "trained": root / "trained", "final": run}


def _api_env() -> dict[str, str]:
    from prefect.settings import PREFECT_API_URL

    env = {k: v for k, v in os.environ.items() if k != "RUBRICEM_FAULT_POINT"}
    env["PREFECT_API_URL"] = str(PREFECT_API_URL.value())  # the session's test server
    env["PYTHONPATH"] = str(REPO)
    return env


def kill_at(
    command: str, run_dir: Path, point: str, timeout: float = 240.0, extra: list[str] = (), tag: str = ""
) -> str:
    """Run ``rubricem <command>`` until it SIGKILLs itself at ``point``; returns its output."""
    env = {**_api_env(), "RUBRICEM_FAULT_POINT": point}
    log_path = run_dir.parent / f"{run_dir.name}-{command}-{tag}{point.replace(':', '_')}.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [*CLI, command, "--run-dir", str(run_dir), "--profile", MICRO_PROFILE, *SETS, *extra],
            cwd=REPO,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            raise
    output = log_path.read_text(errors="replace")
    assert rc == -signal.SIGKILL, f"expected SIGKILL at {point}, got rc={rc}:\n{output[-3000:]}"
    return output


def _rows(run_dir: Path, table: str) -> list[dict]:
    return RunStore(run_dir).read_rows(table)


def _canonical(rows: list[dict], key: tuple[str, ...]) -> list[dict]:
    return sorted(
        ({k: v for k, v in r.items() if k not in VOLATILE} for r in rows), key=lambda r: tuple(r[k] for k in key)
    )


def assert_same_table(run_dir: Path, ref_dir: Path, table: str, key: tuple[str, ...]) -> None:
    """Same rows as the reference (order-free), and ``key`` unique: no duplicate, no missing rows."""
    rows, ref = _rows(run_dir, table), _rows(ref_dir, table)
    keys = [tuple(r[k] for k in key) for r in rows]
    assert len(keys) == len(set(keys)), f"{table}: duplicate {key}"
    # the same count through SQL: a leftover temp file is never part of a view
    n_sql = int(run_sql(str(run_dir), f"SELECT count(*) AS n FROM {table}", fmt="csv").splitlines()[1])
    assert n_sql == len(rows) == len(ref), (
        f"{table}: {n_sql} rows via SQL, {len(rows)} via the store, {len(ref)} in the reference"
    )
    got, want = _canonical(rows, key), _canonical(ref, key)
    for a, b in zip(got, want):
        assert a == b, f"{table}: row {tuple(a[k] for k in key)} differs from the uninterrupted run"


# wall-clock figures differ between any two runs; sft/padding_fraction is accumulated since the
# process started, so after a resume it covers the resumed steps only
UNCOMPARABLE_METRIC = re.compile(r"(seconds|_per_s|step_time_s|padding_fraction)$")


def assert_same_metrics(run_dir: Path, ref_dir: Path, flow: str, names: str = "") -> None:
    """The `metrics` mirror: one row per (step, name) of the flow (names matching the ``names``
    regex), the same as the uninterrupted run's."""

    def table(d: Path) -> dict[tuple[int, str], float]:
        rows = [r for r in _rows(d, "metrics") if r["flow"] == flow and re.match(names, r["name"])]
        keys = [(r["step"], r["name"]) for r in rows]
        dupes = sorted({k for k in keys if keys.count(k) > 1})
        assert not dupes, f"{d.name}: duplicate {flow} metrics {dupes[:5]}"
        return {(r["step"], r["name"]): r["value"] for r in rows}

    got, want = table(run_dir), table(ref_dir)
    assert sorted(got) == sorted(want), (
        f"{flow} metrics: missing {sorted(set(want) - set(got))[:5]}, extra {sorted(set(got) - set(want))[:5]}"
    )
    for key, value in want.items():
        if not UNCOMPARABLE_METRIC.search(key[1]):
            assert got[key] == pytest.approx(value, rel=1e-5, abs=1e-7), key


def temp_files(run_dir: Path) -> list[Path]:
    return [p for p in (run_dir / "tables").rglob(".*") if p.is_file()]


def assert_same_weights(a: Path, b: Path) -> None:
    from safetensors.torch import load_file

    wa, wb = load_file(str(a / "model.safetensors")), load_file(str(b / "model.safetensors"))
    assert wa.keys() == wb.keys()
    for k in wa:
        torch.testing.assert_close(wa[k], wb[k], rtol=0, atol=1e-6, msg=f"{k} differs from the uninterrupted run")


COLLECT_TABLES = row_keys(
    "teacher_requests", "teacher_responses", "teacher_state", "sft_trajectories", "queries", "corpus"
)


def test_collection_killed_mid_write_and_after_a_round_resumes(reference, tmp_path):
    from flows.collect_sft_data import collect_sft_data

    run = tmp_path / "run"
    # 1) killed inside RunStore's atomic write (temp file written, not renamed): writes 1-2 are the
    #    inputs, 3 round 0's requests, 4 its responses, so the kill lands mid-round
    kill_at("collect-sft-data", run, "store.before_rename:4")
    leftovers = temp_files(run)
    assert [p.parent.name for p in leftovers] == ["round=0000"] and leftovers[
        0
    ].parent.parent.name == "teacher_responses"
    store = RunStore(run)
    for table in store.tables():  # what exists is whole; the temp file is not data
        store.read_table(table)
    assert all(not p.name.endswith(".parquet") for p in leftovers)
    assert store.has("teacher_requests", {"round": 0}) and not store.has("teacher_state", {"round": 0})
    # 2) killed right after a round's state (the round marker) is written
    kill_at("collect-sft-data", run, "collect.round_written:1")
    assert not store.has("sft_trajectories")
    # 3) the rerun completes with exactly the uninterrupted run's tables
    collect_sft_data(run_dir=str(run), profile=MICRO_PROFILE, overrides=SMALL)
    for table, key in COLLECT_TABLES.items():
        assert_same_table(run, reference["collected"], table, key)
    assert_same_metrics(run, reference["collected"], "collect_sft_data")
    ids = [r["trajectory_id"] for r in _rows(run, "sft_trajectories")]
    assert len(ids) == len(set(ids)) == 6  # 6 train queries × 1 trajectory


def test_sft_killed_mid_checkpoint_resumes_to_the_same_weights(reference, tmp_path):
    from flows.sft import sft

    run = tmp_path / "run"
    shutil.copytree(reference["collected"], run)
    # the 2nd checkpoint of SFT is the final one (step-2 is the first): killed after its weights
    # are written, before the trainer state, meta and rename
    kill_at("sft", run, "checkpoint.weights_written:2")
    ckpts = run / "checkpoints" / "sft"
    assert (ckpts / ".final.tmp" / "model.safetensors").exists(), "the kill must land inside the final save"
    assert not (ckpts / "final").exists()
    read_meta(ckpts / "step-000002")  # the earlier checkpoint is whole
    sft(run_dir=str(run), profile=MICRO_PROFILE, overrides=SMALL)
    assert sorted(p.name for p in ckpts.iterdir()) == ["final", "step-000002"], "a staging directory was left behind"
    loaded = load_checkpoint(ckpts / "final")
    # the tokenizer is part of the atomic save (it used to be written after the rename)
    assert "tokenizer_config.json" in loaded.meta["files"]
    assert loaded.trainer_state["global_step"] == 4
    assert_same_weights(ckpts / "final", reference["trained"] / "checkpoints" / "sft" / "final")
    assert_same_metrics(run, reference["trained"], "sft")
    from transformers import AutoTokenizer

    assert AutoTokenizer.from_pretrained(str(ckpts / "final")).chat_template


RL_TABLES = row_keys("rollouts", "judge_scores", "judge_rubrics", "stage_rewards", "reflections", "bank")

# Every write boundary of the two RL steps (window 1: step 0 new queries with reflections, step 1 their
# replay with the deferred reflection update), in the order a run reaches them under
# `reflection.schedule: sync` (the deferred schedule runs reflect and the update concurrently, so the
# order of their boundaries is not fixed; both schedules give the same numbers). Each kill happens in a
# fresh process resumed from the previous kill, so one chain visits them all.
RL_BOUNDARIES = [
    "rl.rollouts_written:1",  # step 0: rollouts
    "rl.judge_failures_written:1",  # judge: failed judgments marked in rollouts (none here: nothing written)
    "rl.judge_rubrics_written:1",  # judge: buffers as judge_rubrics
    "rl.judge_done:1",  # judge: scores, stage_rewards (R, G, A): the judge task is done
    "checkpoint.weights_written:1",  # update: inside the checkpoint save
    "rl.checkpoint_saved:1",  # update: checkpoint in place, the step not yet marked done
    "rl.step_done:1",  # update: step marked done, its metrics not logged, no reflections
    "rl.bank_table_written:1",  # reflect: candidates judged, bank table written, FAISS index not yet
    "rl.reflections_written:1",  # reflect: bank saved and `reflections` written: the task is done
    "rl.rollouts_written:1",  # step 1: rollouts (replay with within-episode guidance)
    "rl.reflection_update_done:1",  # the deferred reflection update applied in memory only
    "rl.judge_done:1",
    "checkpoint.weights_written:1",
    "rl.step_done:1",
]
SYNC = ["--set", "reflection.schedule=sync"]


def test_rl_killed_at_every_write_boundary_reproduces_the_uninterrupted_run(reference, tmp_path):
    from flows.rl import rl
    from rubricem_core.rl.progress import completed_step
    from rubricem_core.store import RunStore

    run = tmp_path / "run"
    shutil.copytree(reference["trained"], run)
    ref_ckpts = reference["final"] / "checkpoints" / "rl"
    for i, point in enumerate(RL_BOUNDARIES):
        kill_at("rl", run, point, extra=SYNC, tag=str(i))
        for table in RunStore(run).tables():  # whatever exists after a kill is whole
            RunStore(run).read_table(table)
    assert completed_step(RunStore(run)) == 1  # the last kill: step 1 done, its metrics not logged
    result = rl(run_dir=str(run), profile=MICRO_PROFILE, overrides={**SMALL, "reflection.schedule": "sync"})
    assert result["steps"] == 2
    assert json.loads((run / "state" / "rl_progress.json").read_text()) == {"completed_step": 1}
    for table, key in RL_TABLES.items():
        assert_same_table(run, reference["final"], table, key)
    assert_same_metrics(run, reference["final"], "rl")
    names = sorted(p.name for p in (run / "checkpoints" / "rl").iterdir())
    assert names == ["step-000000", "step-000001"], names
    for name in names:
        got, want = load_checkpoint(run / "checkpoints" / "rl" / name), load_checkpoint(ref_ckpts / name)
        # the buffers saved with each checkpoint are the judge's, whichever task a resume skipped
        assert (
            json.loads(got.trainer_state["extra"]["buffers"])
            == json.loads(want.trainer_state["extra"]["buffers"])
            != {}
        )
        assert_same_weights(run / "checkpoints" / "rl" / name, ref_ckpts / name)
    from rubricem_core.embedders import HashingEmbedder
    from rubricem_core.reflection.bank import ReflectionBank

    def saved_bank(d: Path) -> list[dict]:  # the FAISS bank RL saved beside its tables
        return ReflectionBank.load(d / "state" / "bank", HashingEmbedder()).rows()

    assert saved_bank(run) == saved_bank(reference["final"])


# One-step async RL (window 1) run one task after another (reflection.schedule: sync fixes the order):
# step 0's rollouts, judge and update, then the engine's work during that update (K = 1: step 0's
# reflections before step 1's rollouts, sampled with the SFT weights), then step 1.
ASYNC = {"rl.async_steps": 1, "rl.importance_correction": "tis"}
ASYNC_SETS = [a for k, v in ASYNC.items() for a in ("--set", f"{k}={v}")]
ASYNC_BOUNDARIES = [
    "rl.rollouts_written:1",  # step 0's rollouts (SFT weights)
    "rl.judge_done:1",
    "rl.step_done:1",  # step 0's update done, the engine's work beside it not
    "rl.reflections_written:1",  # step 0's reflections, step 1's rollouts not yet sampled
    "rl.rollouts_written:1",  # step 1's rollouts, sampled with the weights before step 0's update
    "rl.reflection_update_done:1",  # step 1: the reflection update of step 0 in memory only
    "rl.step_done:1",
]


def test_async_rl_killed_at_its_boundaries_resumes_to_the_uninterrupted_async_run(reference, tmp_path):
    from flows.rl import rl
    from rubricem_core.rl.progress import completed_step

    straight = tmp_path / "straight"
    shutil.copytree(reference["trained"], straight)
    rl(run_dir=str(straight), profile=MICRO_PROFILE, overrides={**SMALL, **ASYNC})
    run = tmp_path / "run"
    shutil.copytree(reference["trained"], run)
    for i, point in enumerate(ASYNC_BOUNDARIES):
        kill_at("rl", run, point, extra=[*SYNC, *ASYNC_SETS], tag=str(i))
    assert completed_step(RunStore(run)) == 1
    rl(run_dir=str(run), profile=MICRO_PROFILE, overrides={**SMALL, **ASYNC, "reflection.schedule": "sync"})
    for table, key in RL_TABLES.items():
        assert_same_table(run, straight, table, key)
    assert_same_metrics(run, straight, "rl")
    for name in ("step-000000", "step-000001"):
        assert_same_weights(run / "checkpoints" / "rl" / name, straight / "checkpoints" / "rl" / name)
    lag = {r["step"]: r["value"] for r in _rows(run, "metrics") if r["name"] == "rollout/policy_lag"}
    assert lag == {0: 0.0, 1: 1.0}  # step 1 sampled with the weights before step 0's update


# rl.checkpoint_every=3 over two windows (steps 0 new, 1 repeat with the reflection update of step 0,
# 2 new with the first checkpoint, 3 repeat, the last step, checkpointed): kills where no checkpoint
# holds the weights, each resumed by a fresh process that replays the updates from the tables.
SPARSE = {"rl.n_windows": 2, "rl.checkpoint_every": 3, "rl.keep_checkpoints": 1}
SPARSE_SETS = [a for k, v in SPARSE.items() for a in ("--set", f"{k}={v}")]
SPARSE_BOUNDARIES = [
    "rl.step_done:2",  # step 1 done, no checkpoint written yet: a resume replays steps 0 and 1 from SFT
    "rl.update_replayed:2",  # killed inside that replay (it writes nothing)
    "rl.update_applied:1",  # step 2's update applied, its checkpoint not yet written
    "rl.step_done:1",  # step 2 done and checkpointed, its reflections not written (sync: after the update)
    "rl.reflection_update_done:1",  # step 3: the reflection update of step 2 in memory only
]


def _trainer_state(ckpt: Path) -> dict:
    return torch.load(ckpt / "trainer_state.pt", weights_only=False)


def test_rl_with_sparse_checkpoints_killed_between_them_resumes_exactly(reference, tmp_path):
    """A run with a checkpoint every 3 steps, killed where only the tables hold the last updates,
    ends with the tables, metrics, weights and trainer state (optimizer, schedule, step counter, RNG)
    of an uninterrupted run that checkpointed every step."""
    from flows.rl import rl
    from rubricem_core.rl.progress import completed_step
    from rubricem_core.store import RunStore

    # the uninterrupted run: the module's reference (2 steps, deferred schedule) extended to two windows
    straight = tmp_path / "straight"
    shutil.copytree(reference["final"], straight)
    rl(run_dir=str(straight), profile=MICRO_PROFILE, overrides={**SMALL, "rl.n_windows": 2})

    run = tmp_path / "run"
    shutil.copytree(reference["trained"], run)
    for i, point in enumerate(SPARSE_BOUNDARIES):
        kill_at("rl", run, point, extra=[*SYNC, *SPARSE_SETS], tag=str(i))
        if i < 2:  # nothing but the tables holds steps 0 and 1
            assert completed_step(RunStore(run)) == 1 and not (run / "checkpoints" / "rl").exists()
    assert completed_step(RunStore(run)) == 2
    result = rl(run_dir=str(run), profile=MICRO_PROFILE, overrides={**SMALL, **SPARSE, "reflection.schedule": "sync"})
    assert result["steps"] == 4 and result["final_checkpoint"].endswith("step-000003")
    for table, key in RL_TABLES.items():
        assert_same_table(run, straight, table, key)
    assert_same_metrics(run, straight, "rl")
    ckpts = run / "checkpoints" / "rl"
    assert sorted(p.name for p in ckpts.iterdir()) == ["step-000003"]  # rl.keep_checkpoints=1
    final, want = ckpts / "step-000003", straight / "checkpoints" / "rl" / "step-000003"
    assert_same_weights(final, want)
    got, ref = _trainer_state(final), _trainer_state(want)
    assert got["global_step"] == ref["global_step"] == 6  # 4 task updates + 2 reflection updates
    assert got["scheduler"] == ref["scheduler"]
    for a, b in zip(got["optimizer"]["state"].values(), ref["optimizer"]["state"].values()):
        for k in a:
            torch.testing.assert_close(a[k], b[k], rtol=0, atol=1e-6)
    # torch's generator is the trainer's (dropout, sampling in this process): it must end where the
    # uninterrupted run's did. Python's global `random` is drawn by no computation of the run (the tables,
    # weights and optimizer above are equal) but by library code on the sampling and judging paths, which
    # a replayed step skips: its state differs after a replay and is not compared (see docs/checkpointing.md).
    assert torch.equal(got["rng"]["torch"], ref["rng"]["torch"])


def test_a_judge_outage_fails_the_step_and_the_rerun_reproduces_the_run(reference, tmp_path, monkeypatch):
    """The judge endpoint is down for a whole step: the flow fails naming the errors, writes no
    rewards, checkpoint or progress; with the endpoint back, the rerun re-judges and ends with the
    tables and weights of the run that never saw the outage."""
    import litellm

    import rubricem_core.llm.concurrent as concurrent
    from flows.rl import rl
    from rubricem_core.judge.step import JudgeStepError
    from rubricem_core.rl.progress import completed_step
    from rubricem_core.sim.judge import MODEL as JUDGE_MODEL
    from rubricem_core.store import RunStore

    run = tmp_path / "run"
    shutil.copytree(reference["trained"], run)
    real = concurrent.litellm.acompletion
    calls = {"judge": 0}

    async def endpoint_down(**kwargs):
        if kwargs["model"] == JUDGE_MODEL:
            calls["judge"] += 1
            raise litellm.APIConnectionError(message="Connection refused", llm_provider="openai", model=kwargs["model"])
        return await real(**kwargs)

    overrides = {**SMALL, "judge.max_retries": 1}  # operational: recorded as a config revision
    monkeypatch.setattr(concurrent.litellm, "acompletion", endpoint_down)
    with pytest.raises(JudgeStepError, match=r"step 0: 4 of 4 judgments failed.*Connection refused"):
        rl(run_dir=str(run), profile=MICRO_PROFILE, overrides=overrides)
    assert calls["judge"] >= 4
    store = RunStore(run)
    assert not store.partitions("stage_rewards", "step") and not store.partitions("judge_scores", "step")
    assert completed_step(RunStore(run)) == -1 and not (run / "checkpoints" / "rl").exists()
    failed = store.read_rows("rollouts", {"step": 0})
    assert all(r["judge_failed"] and "Connection refused" in r["judge_error"] for r in failed)  # why, per rollout

    monkeypatch.setattr(concurrent.litellm, "acompletion", real)  # the endpoint is back
    rl(run_dir=str(run), profile=MICRO_PROFILE, overrides=overrides)
    for table, key in RL_TABLES.items():
        assert_same_table(run, reference["final"], table, key)
    assert not any(r["judge_failed"] or r["judge_error"] for r in store.read_rows("rollouts"))
    assert_same_metrics(run, reference["final"], "rl")
    assert_same_weights(
        run / "checkpoints" / "rl" / "step-000001", reference["final"] / "checkpoints" / "rl" / "step-000001"
    )
    revisions = (run / "state" / "config_revisions.jsonl").read_text().splitlines()
    assert json.loads(revisions[0])["changes"] == {"judge.max_retries": {"old": 4, "new": 1}}


def test_a_second_writer_is_refused_at_once_and_the_first_run_is_intact(reference, tmp_path):
    """Two `rubricem rl` on one run directory: the second exits 2 within seconds naming the first's
    pid (before starting any server), the first finishes with the uninterrupted run's tables."""
    import time

    from rubricem_core.runlock import lock_holder

    run = tmp_path / "run"
    shutil.copytree(reference["trained"], run)
    log = open(tmp_path / "first.log", "wb")
    first = subprocess.Popen(
        [*CLI, "rl", "--run-dir", str(run), *SETS],
        cwd=REPO,
        env=_api_env(),
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 120
        while not (lock_holder(run) or {}).get("pid"):
            assert first.poll() is None and time.monotonic() < deadline, "the first writer never took the lock"
            time.sleep(0.1)
        assert lock_holder(run)["pid"] == first.pid
        t0 = time.monotonic()
        second = subprocess.run(
            [*CLI, "rl", "--run-dir", str(run), *SETS],
            cwd=REPO,
            env=_api_env(),
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert second.returncode == 2, second.stderr
        assert f"pid {first.pid}" in second.stderr and "rubricem rl" in second.stderr, second.stderr
        assert time.monotonic() - t0 < 30  # refused before any flow, model or server starts
        # a flow started in another process (e.g. a Prefect worker) is refused the same way
        from flows.rl import rl
        from rubricem_core.runlock import RunDirLocked

        with pytest.raises(RunDirLocked, match=f"pid {first.pid}"):
            rl.fn(run_dir=str(run), profile=MICRO_PROFILE, overrides=SMALL)
        assert first.wait(timeout=300) == 0, (tmp_path / "first.log").read_text()[-3000:]
    finally:
        if first.poll() is None:
            os.killpg(first.pid, signal.SIGKILL)
        log.close()
    assert lock_holder(run) is None
    for table, key in RL_TABLES.items():
        assert_same_table(run, reference["final"], table, key)
    assert_same_metrics(run, reference["final"], "rl")


def test_a_changed_config_is_refused_once_its_stage_has_written(reference, tmp_path):
    """A rerun with another seed (collection written) or another recipe (RL written) is refused naming
    the fields; nothing in the run directory changes."""
    from flows.collect_sft_data import collect_sft_data
    from rubricem_core.config import ConfigError

    run = tmp_path / "run"
    shutil.copytree(reference["final"], run)
    before = (run / "config.yaml").read_text()
    with pytest.raises(ConfigError, match=r"seed: 0 → 1.*collect-sft-data"):
        collect_sft_data(run_dir=str(run), profile=MICRO_PROFILE, overrides={**SMALL, "seed": 1})
    out = subprocess.run(
        [*CLI, "rl", "--run-dir", str(run), *SETS, "--set", "rl.recipe=baseline", "--set", "data.world.n_documents=61"],
        cwd=REPO,
        env=_api_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 2
    assert "rl.recipe: 'full' → 'baseline'" in out.stderr and "data.world.n_documents: 60 → 61" in out.stderr, (
        out.stderr
    )
    assert (run / "config.yaml").read_text() == before and not (run / "state" / "config_revisions.jsonl").exists()


def test_a_later_command_reads_the_run_directorys_own_config(reference, tmp_path):
    """No --profile and no --set: the run directory's config.yaml is the config (nothing to retype);
    naming another profile is refused with the fields it would change."""
    run = tmp_path / "run"
    shutil.copytree(reference["final"], run)
    same = subprocess.run(
        [*CLI, "rl", "--run-dir", str(run)], cwd=REPO, env=_api_env(), capture_output=True, text=True, timeout=180
    )
    assert same.returncode == 0 and "finished 2 steps" in same.stdout, same.stdout[-2000:] + same.stderr[-2000:]
    assert not (run / "state" / "config_revisions.jsonl").exists()
    other = subprocess.run(
        [*CLI, "rl", "--run-dir", str(run), "--profile", "tiny"],
        cwd=REPO,
        env=_api_env(),
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert other.returncode == 2 and "data.world.n_documents: 60 → 400" in other.stderr, other.stderr


def test_a_missing_endpoint_key_fails_before_any_work(reference, tmp_path, monkeypatch):
    from flows.rl import rl
    from rubricem_core.config import MissingSecretError

    run = tmp_path / "run"
    shutil.copytree(reference["trained"], run)
    monkeypatch.delenv("RUBRICEM_TEST_JUDGE_KEY", raising=False)
    with pytest.raises(MissingSecretError, match="RUBRICEM_TEST_JUDGE_KEY"):
        rl(run_dir=str(run), profile=MICRO_PROFILE, overrides={**SMALL, "judge.api_key_env": "RUBRICEM_TEST_JUDGE_KEY"})
    assert not RunStore(run).files("rollouts"), "the key is checked before the first rollouts"


# LoRA on (policy.lora): SFT and RL train adapters, checkpoints hold them (the base by reference); the
# same kills at the SFT save and across RL's write boundaries resume to the uninterrupted run's adapters.
LORA = {"policy.lora.rank": 4, "policy.lora.alpha": 8, "sft.lr": 3e-3, "rl.lr": 1e-4}
LORA_SETS = [a for k, v in LORA.items() for a in ("--set", f"{k}={v}")]
LORA_BOUNDARIES = [
    "checkpoint.weights_written:1",  # step 0: inside the adapter checkpoint's save
    "rl.step_done:1",  # step 0 marked done, no reflections
    "rl.reflection_update_done:1",  # step 1: the deferred reflection update applied in memory only
    "rl.judge_done:1",  # step 1 judged (the first judgment of this process), not updated
]


def assert_same_adapter(a: Path, b: Path) -> None:
    from safetensors.torch import load_file

    name = "adapter_model.safetensors"
    wa, wb = load_file(str(a / name)), load_file(str(b / name))
    assert wa.keys() == wb.keys() and wa
    for k in wa:
        torch.testing.assert_close(wa[k], wb[k], rtol=0, atol=1e-6, msg=f"{k} differs from the uninterrupted run")


def test_lora_runs_killed_in_sft_and_across_rl_resume_to_the_uninterrupted_adapters(reference, tmp_path):
    from flows.rl import rl
    from flows.sft import sft

    overrides = {**SMALL, **LORA, "reflection.schedule": "sync"}
    want = tmp_path / "uninterrupted"
    shutil.copytree(reference["collected"], want)
    sft(run_dir=str(want), profile=MICRO_PROFILE, overrides=overrides)
    rl(run_dir=str(want), profile=MICRO_PROFILE, overrides=overrides)

    run = tmp_path / "run"
    shutil.copytree(reference["collected"], run)
    kill_at("sft", run, "checkpoint.weights_written:2", extra=LORA_SETS + SYNC, tag="lora")
    assert (run / "checkpoints" / "sft" / ".final.tmp" / "adapter_model.safetensors").exists()
    sft(run_dir=str(run), profile=MICRO_PROFILE, overrides=overrides)  # resumes from the step-2 adapter checkpoint
    for i, point in enumerate(LORA_BOUNDARIES):
        kill_at("rl", run, point, extra=LORA_SETS + SYNC, tag=f"lora{i}")
    result = rl(run_dir=str(run), profile=MICRO_PROFILE, overrides=overrides)
    assert result["steps"] == 2
    sft_final = run / "checkpoints" / "sft" / "final"
    assert not (sft_final / "model.safetensors").exists()  # an adapter, its base by reference
    assert_same_adapter(sft_final, want / "checkpoints" / "sft" / "final")
    for name in ("step-000000", "step-000001"):
        got, ref = run / "checkpoints" / "rl" / name, want / "checkpoints" / "rl" / name
        assert json.loads((got / "checkpoint.json").read_text())["adapter"]["base"] == "../../sft/final"
        assert_same_adapter(got, ref)
    for table, key in RL_TABLES.items():
        assert_same_table(run, want, table, key)
    # evaluation samples the adapter checkpoint as a plain (merged) model
    from flows.evaluate import evaluate

    out = evaluate(
        run_dir=str(run),
        profile=MICRO_PROFILE,
        overrides={**overrides, "eval.max_queries": 2},
        benchmarks=["synthetic"],
    )
    assert out["checkpoint"].endswith("step-000001")
    assert any(r["checkpoint"] == out["tag"] for r in RunStore(run).read_rows("eval_results"))
