"""What the Prefect UI shows of a run: progress lines with totals and ETA, Markdown summaries, core
library logs in the run's log, and dead runs of a run directory marked Crashed by the next run."""

from __future__ import annotations

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
