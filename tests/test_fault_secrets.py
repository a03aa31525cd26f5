"""No API key in anything a run leaves behind.

The whole pipeline (`rubricem run`, a subprocess) uses a teacher (Batch API) and a judge that are
both fake OpenAI-compatible servers on 127.0.0.1 demanding their own random key, with retried
failures on both so the error and retry paths log too. Then every file of the run directory
(Parquet, MLflow's SQLite DB and artifacts, state, checkpoints, config), the process's
stdout/stderr and the Prefect server's database (flow/task parameters and shipped logs) are
searched for the keys. (tests/test_collect_flow.py checks the Parquet tables of the collection
flow alone; this covers every sink of a full run.)
"""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
from pathlib import Path

import pytest

from rubricem_core.judge.builtin import respond as builtin_judge_reply
from rubricem_core.store import RunStore
from rubricem_core.teacher.builtin import ScriptedTeacher, TeacherRates

pytestmark = pytest.mark.slow  # runs flows end to end; `make test-fast` leaves it out

REPO = Path(__file__).resolve().parents[1]

SMALL = {
    "data.world.n_documents": 60,
    "data.world.n_queries": 8,
    "data.world.eval_fraction": 0.25,
    "teacher.trajectories_per_query": 1,
    "policy.vocab_size": 1024,
    "policy.hidden_size": 64,
    "policy.n_layers": 2,
    "policy.intermediate_size": 128,
    "sft.max_steps": 2,
    "sft.warmup_steps": 1,
    "rl.window": 1,
    "rl.n_windows": 1,
    "rl.queries_per_step": 2,
    "rollout.group_size": 2,
    "rollout.max_new_tokens": 48,
    "rollout.max_total_tokens": 1200,
    "tools.max_tool_calls": 2,
}


def _prefect_db_files() -> list[Path]:
    from prefect.settings import PREFECT_SERVER_DATABASE_CONNECTION_URL

    url = str(PREFECT_SERVER_DATABASE_CONNECTION_URL.value())
    if not url.startswith("sqlite"):
        return []
    db = Path(url.split(":///", 1)[1])
    return [p for p in db.parent.glob(db.name + "*") if p.is_file()]  # the DB and its -wal/-shm


def test_no_key_in_tables_mlflow_logs_or_prefect(tmp_path, prefect_harness):
    from prefect.settings import PREFECT_API_URL

    from fakes.openai_server import FakeOpenAIServer

    # random per test run, so nothing else in the session can contain them by chance
    teacher_key = f"sk-teacher-{secrets.token_hex(16)}"
    judge_key = f"sk-judge-{secrets.token_hex(16)}"
    teacher = ScriptedTeacher(TeacherRates(max_tool_calls=2))
    with (
        FakeOpenAIServer(
            lambda body: teacher.respond(body["messages"], body),
            api_key=teacher_key,
            polls_in_progress=1,
            fail_times={"syn-00000-t0:r01": 1},
        ) as tserver,
        FakeOpenAIServer(
            lambda body: builtin_judge_reply(body["messages"], body), api_key=judge_key, http_errors=[429, 500]
        ) as jserver,
    ):
        overrides = {
            **SMALL,
            "teacher.model": "openai/frontier-teacher",
            "teacher.mode": "batch",
            "teacher.api_base": tserver.base_url,
            "teacher.api_key_env": "RUBRICEM_FT_TEACHER_KEY",
            "teacher.batch_poll_interval_s": 0.05,
            "teacher.batch_poll_max_interval_s": 0.1,
            "judge.model": "openai/judge-model",
            "judge.api_base": jserver.base_url,
            "judge.api_key_env": "RUBRICEM_FT_JUDGE_KEY",
            "judge.max_retries": 3,
        }
        env = {
            **os.environ,
            "RUBRICEM_FT_TEACHER_KEY": teacher_key,
            "RUBRICEM_FT_JUDGE_KEY": judge_key,
            "PREFECT_API_URL": str(PREFECT_API_URL.value()),
            "PYTHONPATH": str(REPO),
        }
        env.pop("RUBRICEM_FAULT_POINT", None)
        run = tmp_path / "run"
        cmd = [sys.executable, "-m", "flows.cli", "run", "--run-dir", str(run)]
        cmd += [a for k, v in overrides.items() for a in ("--set", f"{k}={v}")]
        proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, timeout=600)
        output = proc.stdout + proc.stderr
        assert proc.returncode == 0, output.decode(errors="replace")[-4000:]
        # the keys were really used (each server rejects calls without its key) ...
        assert tserver.uploaded_lines and ["syn-00000-t0:r01"] in tserver.batch_custom_ids()
        assert len(jserver.chat_calls) >= 2 + 2 * 2  # ≥ one generation per query, one score per rollout
        assert not jserver.http_errors, "the injected 429/500 were consumed and retried"

    store = RunStore(run)
    assert store.read_rows("sft_trajectories") and store.read_rows("judge_scores")
    assert (run / "mlflow" / "mlflow.db").is_file() and any((run / "mlflow" / "artifacts").rglob("*"))
    # `rubricem run` ends with the report and a printout of what the figures mean for the profile
    assert (run / "report" / "report.html").is_file()
    text = proc.stdout.decode()
    assert "pipeline finished (tiny profile" in text and "what these figures mean:" in text and "next:" in text

    # ... and they appear nowhere: not whole, not as the random part a masked key would show
    needles = [k.encode() for k in (teacher_key, judge_key)] + [k[-16:].encode() for k in (teacher_key, judge_key)]
    sinks: dict[str, bytes] = {"stdout/stderr": output}
    for path in sorted(run.rglob("*")):
        if path.is_file():
            sinks[str(path.relative_to(run))] = path.read_bytes()
    prefect_db = _prefect_db_files()
    assert prefect_db, "the test Prefect server's SQLite database was not found"
    for path in prefect_db:
        sinks[f"prefect:{path.name}"] = path.read_bytes()
    assert len(sinks) > 20
    leaks = [(name, n.decode()) for name, data in sinks.items() for n in needles if n in data]
    assert not leaks, f"API key found in {leaks}"
    # the config written into the run names the variables, never the values
    config = (run / "config.yaml").read_text()
    assert "RUBRICEM_FT_TEACHER_KEY" in config and "RUBRICEM_FT_JUDGE_KEY" in config
