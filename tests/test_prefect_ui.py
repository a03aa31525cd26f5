"""What the Prefect UI shows of a run: progress lines with totals and ETA, Markdown summaries, core
library logs in the run's log, and dead runs of a run directory marked Crashed by the next run."""

from __future__ import annotations

import json
import logging
import time
import uuid

import pytest

from rubricem_core.progress import Progress, eta_seconds, format_seconds
from rubricem_core.report.markdown import cell, collection_markdown, eval_markdown, rl_markdown, table


class _Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def test_progress_lines_have_totals_rate_and_eta():
    clock, lines = _Clock(), []
    progress = Progress("sft step", 10, lines.append, every_s=5.0, clock=clock)
    clock.t = 4.0
    assert progress.update(2, "loss 0.5")  # the first line is never held back
    assert lines[-1] == "sft step 2/10 (20%): loss 0.5 — 4s elapsed, ETA 16s"
    clock.t = 6.0
    assert not progress.update(3)  # within every_s of the last line
    clock.t = 9.5
    assert progress.update(4) and lines[-1].endswith("ETA 14s")  # 9.5 s / 4 × 6 left
    clock.t = 30.0
    assert progress.update(10) and lines[-1] == "sft step 10/10 (100%) — 30s elapsed"  # the end always writes


def test_progress_of_a_resumed_loop_rates_only_the_new_items():
    clock, lines = _Clock(), []
    progress = Progress("RL step", 8, lines.append, every_s=0.0, start_done=4, clock=clock)
    clock.t = 100.0
    progress.update(6)  # 2 new steps in 100 s: 2 left take 100 s more
    assert lines[-1] == "RL step 6/8 (75%) — 1m 40s elapsed, ETA 1m 40s"


def test_progress_tick_counts_results_from_callbacks():
    lines = []
    progress = Progress("round 0: teacher responses", 3, lines.append, every_s=1e9)
    for _ in range(3):
        progress.tick(object())
    assert lines[0].startswith("round 0: teacher responses 1/3") and lines[-1].startswith(
        "round 0: teacher responses 3/3 (100%)"
    )


@pytest.mark.parametrize("seconds, text", [(4.2, "4s"), (190, "3m 10s"), (3725, "1h 2m"), (float("nan"), "?")])
def test_format_seconds(seconds, text):
    assert format_seconds(seconds) == text


def test_eta_before_the_first_item_is_unknown():
    assert eta_seconds(0, 10, 5.0) != eta_seconds(0, 10, 5.0)  # NaN
    assert format_seconds(eta_seconds(0, 10, 5.0)) == "?"


def test_markdown_tables_and_summaries():
    assert cell(float("nan")) == "–" and cell(None) == "–" and cell(0.123456) == "0.1235" and cell("a|b") == "a\\|b"
    assert table(["a", "b"], [[1, 2.5]]) == "| a | b |\n|---|---|\n| 1 | 2.5 |"
    stats = {
        "trajectories": 6,
        "accepted": 4,
        "acceptance_rate": 4 / 6,
        "mean_tool_calls": 2.0,
        "cost_usd": 0.0,
        "reject_reasons": {"missing_plan": 1, "uncited_answer": 2},
    }
    text = collection_markdown(
        stats,
        3,
        {"requests": 12, "failed": 1},
        "runs/x",
        "http://127.0.0.1:5000/#/experiments/1/runs/abc",
        "sqlite:///runs/x/mlflow/mlflow.db",
    )
    assert text.startswith("# SFT data collection: 4 of 6 trajectories accepted")
    assert text.index("uncited_answer") < text.index("missing_plan")  # most frequent code first
    assert "| failed requests | 1 |" in text and "(http://127.0.0.1:5000/#/experiments/1/runs/abc)" in text
    steps = [
        {"step": 0, "phase": "new", "retrieval": "cross", "rl/loss": 0.25, "reward/R/answer_mean": 0.5},
        {"step": 1, "phase": "repeat", "retrieval": "within", "rl/loss": 0.125},
    ]
    text = rl_markdown(steps, "full", 4, "runs/x")
    assert text.startswith("# RL (full): 2 of 4 steps done")
    assert "| step | phase | retrieval | R answer | loss |" in text and "| 1 | repeat | within | – | 0.125 |" in text
    text = eval_markdown("rl-step-3", "/ck", "none", {"synthetic": {"score_mean": 0.5, "n_samples": 8.0}}, "runs/x")
    assert "| synthetic | 0.5 | 8 | no |" in text


def _client():
    from prefect import get_client

    return get_client(sync_client=True)


@pytest.mark.slow
def test_core_logs_reach_the_flow_run_log(prefect_harness, tmp_path):
    from prefect import flow
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId

    from flows.common import writes_run_dir

    marker = f"core line {uuid.uuid4().hex}"

    @flow(name="core-log-probe")
    @writes_run_dir
    def probe(run_dir: str) -> str:
        from prefect.runtime import flow_run

        logging.getLogger("rubricem_core.sft").info(marker)
        return str(flow_run.id)

    run_id = probe(run_dir=str(tmp_path / "run"))
    deadline = time.monotonic() + 20  # logs reach the API in batches (PREFECT_LOGGING_TO_API_BATCH_INTERVAL)
    while True:
        with _client() as client:
            logs = client.read_logs(log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=[uuid.UUID(run_id)])))
        if any(marker in log.message for log in logs) or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert any(marker in log.message for log in logs), [log.message for log in logs]


@pytest.mark.slow
def test_a_dead_run_of_the_run_directory_is_marked_crashed(prefect_harness, tmp_path):
    """A flow run (and its task run) left Running by a killed process is Crashed once the next run of
    the same run directory starts; runs of other run directories are left alone."""
    from prefect import flow
    from prefect.client.schemas.objects import StateType
    from prefect.states import Completed, Running

    from flows.common import writes_run_dir

    run_dir, other = tmp_path / "run", tmp_path / "other"

    @flow(name="stale-probe")
    @writes_run_dir
    def probe(run_dir: str) -> None:
        return None

    with _client() as client:
        dead = client.create_flow_run(flow=probe, parameters={"run_dir": str(run_dir)}, name="killed")
        alive = client.create_flow_run(flow=probe, parameters={"run_dir": str(other)}, name="elsewhere")
        for run in (dead, alive):
            client.set_flow_run_state(run.id, Running(), force=True)
        task_run = client.create_task_run(task=_a_task(), flow_run_id=dead.id, dynamic_key="0", name="rollout-step-0")
        client.set_task_run_state(task_run.id, Running(), force=True)

    probe(run_dir=str(run_dir))

    with _client() as client:
        assert client.read_flow_run(dead.id).state.type == StateType.CRASHED
        assert "process died" in client.read_flow_run(dead.id).state.message
        assert client.read_task_run(task_run.id).state.type == StateType.CRASHED
        assert client.read_flow_run(alive.id).state.type == StateType.RUNNING
        client.set_flow_run_state(alive.id, Completed(), force=True)  # not left Running for other tests


def _a_task():
    from prefect import task

    @task(name="rollout")
    def rollout() -> None:
        return None

    return rollout


def test_end_of_run_printout_explains_the_profile():
    from rubricem_core.report.summary import pipeline_summary

    result = {
        "collect_sft_data": {"accepted": 30, "trajectories": 36, "rounds": 5},
        "sft": {"final_dir": "runs/t/checkpoints/sft/final", "steps": 40, "final_loss": 0.5, "cached": False},
        "rl": {
            "steps": 4,
            "recipe": "full",
            "final_checkpoint": "runs/t/checkpoints/rl/step-000003",
            "last_metrics": {"rl/loss": 0.01},
        },
        "evaluate": {
            "tag": "rl-step-000003",
            "retrieval": "none",
            "benchmarks": {"synthetic": {"score_mean": 0.0, "valid_scaffold_rate": 0.0, "n_samples": 8.0}},
        },
        "report": "runs/t/report/report.html",
    }
    text = pipeline_summary(result, "tiny", "runs/t")
    assert "30 of 36 teacher trajectories accepted" in text and "synthetic: score_mean 0, valid_scaffold_rate 0" in text
    assert "plumbing check" in text and "next:\n  rubricem run --run-dir runs/small --profile small" in text
    assert "report:     runs/t/report/report.html" in text
    assert "what these figures mean" not in pipeline_summary(result, "my-profile", "runs/t")


@pytest.mark.parametrize(
    "message, signal_name",
    [
        ("Process exited with status code: -9. Process was terminated due to a signal.", "signal SIGKILL (9)"),
        ("Process exited with status code: -15.", "signal SIGTERM (15)"),
        ("Process exited with status code: 137", "signal SIGKILL (9)"),  # a shell's 128 + N
        ("Process exited with status code: 1", None),  # an exit, not a signal
        ("Execution was aborted by a termination signal.", "signal SIGTERM (15)"),  # Prefect, in-process
        ("Flow run encountered an exception: ValueError: x", None),
        (None, None),
    ],
)
def test_killed_by_reads_the_signal_from_the_crash_message(message, signal_name):
    from flows.common import killed_by

    assert killed_by(message) == signal_name


@pytest.mark.slow
@pytest.mark.parametrize("ending", ["crashed", "cancelling"])
def test_a_crashed_or_cancelled_run_ends_its_subflows_and_task_runs(prefect_harness, ending):
    """The flows' crash / cancellation hook (the worker runs it when it finds the process dead): live
    subflow runs at any depth and live task runs under the run end with it; finished ones stay."""
    from prefect import flow
    from prefect.client.schemas.objects import StateType
    from prefect.states import Cancelling, Completed, Crashed, Running

    from flows.common import end_subruns

    @flow(name="hook-probe")
    def probe(run_dir: str) -> None:
        return None

    rollout = _a_task()
    with _client() as client:
        top = client.create_flow_run(flow=probe, parameters={"run_dir": "x"}, name="pipeline · x")
        mid_task = client.create_task_run(task=rollout, flow_run_id=top.id, dynamic_key="0", name="rl-subflow")
        mid = client.create_flow_run(flow=probe, parameters={}, name="rl · x", parent_task_run_id=mid_task.id)
        leaf_task = client.create_task_run(task=rollout, flow_run_id=mid.id, dynamic_key="1", name="rl_step-0")
        leaf = client.create_flow_run(flow=probe, parameters={}, name="step-0-new", parent_task_run_id=leaf_task.id)
        running = client.create_task_run(task=rollout, flow_run_id=leaf.id, dynamic_key="2", name="rollout-step-0")
        done = client.create_task_run(task=rollout, flow_run_id=leaf.id, dynamic_key="3", name="judge-step-0")
        for run in (top, mid, leaf):
            client.set_flow_run_state(run.id, Running(), force=True)
        for task_run in (mid_task, leaf_task, running):
            client.set_task_run_state(task_run.id, Running(), force=True)
        client.set_task_run_state(done.id, Completed(), force=True)
        final = Crashed(message="Process exited with status code: -9.") if ending == "crashed" else Cancelling()
        client.set_flow_run_state(top.id, final, force=True)
        top = client.read_flow_run(top.id)

    end_subruns(probe, top, final)

    expected = StateType.CRASHED if ending == "crashed" else StateType.CANCELLED
    with _client() as client:
        for run in (mid, leaf):
            assert client.read_flow_run(run.id).state.type == expected, run.name
        for task_run in (mid_task, leaf_task, running):
            assert client.read_task_run(task_run.id).state.type == expected, task_run.name
        assert client.read_task_run(done.id).state.type == StateType.COMPLETED
        assert client.read_flow_run(top.id).state.type == final.type  # its own engine ends it
        message = client.read_flow_run(leaf.id).state.message
    assert "pipeline · x" in message and ("SIGKILL" in message if ending == "crashed" else "cancelled" in message)


def test_pipeline_markdown_has_a_row_per_stage_and_the_links():
    from rubricem_core.report.markdown import pipeline_markdown

    result = {
        "collect_sft_data": {"accepted": 30, "trajectories": 36},
        "sft": {"final_dir": "runs/t/checkpoints/sft/final", "cached": True},
        "rl": {"steps": 4, "recipe": "full", "final_checkpoint": "runs/t/checkpoints/rl/step-000003"},
        "evaluate": {"tag": "rl-step-000003", "retrieval": "none", "benchmarks": {"synthetic": {"score_mean": 0.25}}},
        "report": "runs/t/report/report.html",
    }
    text = pipeline_markdown(result, "tiny", "runs/t", "http://127.0.0.1:5000/#/experiments/1", "sqlite:///m.db")
    assert text.startswith("# Pipeline of `runs/t` (tiny profile)")
    assert "| sft | `runs/t/checkpoints/sft/final` (read back) |" in text
    assert "30 of 36 trajectories accepted" in text and "synthetic 0.25" in text
    assert "- MLflow experiment: [http://127.0.0.1:5000/#/experiments/1]" in text
    assert "- report: `runs/t/report/report.html`" in text
    assert "MLflow" not in pipeline_markdown(result, "tiny", "runs/t")


@pytest.mark.slow
def test_the_pipeline_run_logs_stage_progress_and_a_summary_and_publishes_an_artifact(tiny_pipeline_run):
    from prefect.client.schemas.filters import (
        ArtifactFilter,
        ArtifactFilterKey,
        FlowRunFilter,
        FlowRunFilterName,
        LogFilter,
        LogFilterFlowRunId,
    )

    from flows.common import artifact_key

    run_dir = str(tiny_pipeline_run)
    with _client() as client:
        (run,) = client.read_flow_runs(
            flow_run_filter=FlowRunFilter(name=FlowRunFilterName(any_=[f"pipeline · {run_dir}"]))
        )
        # each stage's run is named after its flow and the run directory; an evaluation also names its
        # checkpoint (rl.eval_every=1: the SFT policy and both RL steps, the final one last)
        evaluations = [f"evaluate · {run_dir} · {tag}" for tag in ("sft", "rl-step-000000", "rl-step-000001")]
        stages = [f"{f} · {run_dir}" for f in ("collect_sft_data", "sft", "rl")]
        subflows = client.read_flow_runs(
            flow_run_filter=FlowRunFilter(name=FlowRunFilterName(any_=stages + evaluations))
        )
        (artifact,) = client.read_artifacts(
            artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=[artifact_key("pipeline", run_dir)]))
        )
        deadline = time.monotonic() + 20
        while True:
            logs = [
                log.message
                for log in client.read_logs(log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=[run.id])))
            ]
            if any("pipeline finished" in m for m in logs) or time.monotonic() > deadline:
                break
            time.sleep(0.5)
    assert sorted(r.name for r in subflows) == sorted(stages + evaluations)
    assert any(m.startswith("pipeline stage 1/5 (20%): collect_sft_data:") for m in logs), logs
    assert any(m.startswith("pipeline stage 5/5 (100%): report:") for m in logs), logs
    (summary,) = [m for m in logs if "pipeline finished" in m]
    assert "report:" in summary and "MLflow:" in summary and "workflowType=machine_learning" in summary
    assert artifact.flow_run_id == run.id and artifact.data.startswith(f"# Pipeline of `{run_dir}`")


@pytest.mark.slow
def test_a_flow_run_holding_its_run_directory_is_named_in_the_lock(prefect_harness, tmp_path):
    """A second run on the directory is refused with the holder's info (rubricem_core.runlock): for a
    flow, that names its Prefect flow run, so the UI user sees which run holds it."""
    from prefect import flow

    from flows.common import writes_run_dir
    from rubricem_core.runlock import lock_holder

    @flow(name="holder-probe", flow_run_name="holder · {run_dir}")
    @writes_run_dir
    def probe(run_dir: str) -> str:
        return lock_holder(run_dir)["command"]

    run_dir = tmp_path / "run"
    assert probe(run_dir=str(run_dir)) == f"probe (Prefect flow run 'holder · {run_dir}')"


@pytest.mark.slow
def test_a_flow_run_refused_by_a_bad_override_leaves_nothing_behind(prefect_harness, tmp_path):
    """What a deployment run from the UI form with a misspelt override key does: fails naming the
    nearest valid key, and leaves no run directory (not even its lock file)."""
    from flows.collect_sft_data import collect_sft_data
    from rubricem_core.config import ConfigError

    run_dir = tmp_path / "runs" / "ui"
    with pytest.raises(ConfigError, match="teacher.max_round: unknown key; did you mean teacher.max_rounds"):
        collect_sft_data(run_dir=str(run_dir), profile="tiny", overrides={"teacher.max_round": 3})
    assert not (tmp_path / "runs").exists()


def test_a_weighted_progress_estimates_from_measured_stage_costs():
    """The pipeline's stages cost what they cost (SFT is most of tiny's time): after a 30 s collection
    measured at 30 s, the ETA is the other stages' measured seconds, not 4 × 30 s."""
    clock = _Clock()
    lines = []
    costs = [30.0, 600.0, 240.0, 100.0, 10.0]
    progress = Progress("pipeline stage", 5, lines.append, every_s=0.0, clock=clock, costs=costs)
    clock.t = 30.0
    progress.update(1, "collect_sft_data: done")
    assert lines[-1] == "pipeline stage 1/5 (20%): collect_sft_data: done — 30s elapsed, ETA 15m 50s"
    clock.t = 1260.0  # SFT took twice its measure: the rest is expected to be twice as slow as well
    progress.update(2, "sft: done")
    assert lines[-1].endswith("21m 00s elapsed, ETA 11m 40s")
    with pytest.raises(ValueError, match="2 costs for 5 items"):
        Progress("pipeline stage", 5, lines.append, costs=[1.0, 2.0])


def test_stage_costs_come_from_the_run_directory_then_the_profile(tmp_path):
    from rubricem_core.stage_costs import PROFILE_COSTS, expected_costs, record_stage_seconds

    stages = ("collect_sft_data", "sft", "rl", "evaluate", "report")
    costs, source = expected_costs(tmp_path, "no-such-profile", stages)
    assert costs is None and source == "no measured stage costs"
    record_stage_seconds(tmp_path, dict(zip(stages, [1.0, 2.0, 3.0, 4.0, 5.0])))
    assert expected_costs(tmp_path, "tiny", stages) == ([1.0, 2.0, 3.0, 4.0, 5.0], "this run directory's last pipeline")
    measured = json.loads(PROFILE_COSTS.read_text())  # tiny's: a measured `make run`
    assert measured["tiny"]["sft"] > 10 * measured["tiny"]["collect_sft_data"]
    costs, source = expected_costs(tmp_path / "new", "tiny", stages)
    assert costs == [measured["tiny"][s] for s in stages] and source == "tiny's measured run"
