"""No API key in anything a run leaves behind.

The whole pipeline (`rubricem run`, a subprocess) uses a teacher (Batch API) and a judge that are
both fake OpenAI-compatible servers on 127.0.0.1 demanding their own random key, with retried
failures on both so the error and retry paths log too; the built-in grader's ``api_base`` carries a
random password (``http://rubricem:<password>@…/v1``: its calls pass the URL through litellm to the
built-in provider). Then a second command crashes: one more RL window on two Ray trainer ranks (their logs
under the run), whose judge, now gone, answers nothing. Every file of the run directory (Parquet,
MLflow's SQLite DB, params, tags and artifacts, the HTML report, state, the ranks' logs, checkpoints,
config.yaml and its revisions), Prefect's
result storage (persisted for the test), both processes' stdout/stderr and the Prefect server's database
(artifacts, flow-run parameters, shipped logs, events) are searched for the keys and the password.
(tests/test_collect_flow.py checks the Parquet tables of the collection flow alone; this covers every
sink of a full run.)
"""

from __future__ import annotations

import os
import secrets
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

from rubricem_core.sim.judge import respond as builtin_judge_reply
from rubricem_core.sim.teacher import ScriptedTeacher, TeacherRates
from rubricem_core.store import RunStore
from rubricem_core.testing import MICRO_PROFILE

pytestmark = pytest.mark.slow  # runs flows end to end; `make test-fast` leaves it out

REPO = Path(__file__).resolve().parents[1]


def _prefect_db_files() -> list[Path]:
    from prefect.settings import PREFECT_SERVER_DATABASE_CONNECTION_URL

    url = str(PREFECT_SERVER_DATABASE_CONNECTION_URL.value())
    if not url.startswith("sqlite"):
        return []
    db = Path(url.split(":///", 1)[1])
    return [p for p in db.parent.glob(db.name + "*") if p.is_file()]  # the DB and its -wal/-shm


def _prefect_rows(db: Path, table: str) -> int:
    with sqlite3.connect(f"file:{db}?mode=ro", uri=True) as con:
        return con.execute(f"SELECT count(*) FROM {table}").fetchone()[0]


def _rubricem(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run(
        [sys.executable, "-m", "flows.cli", *args], cwd=REPO, env=env, capture_output=True, timeout=600
    )


def _sets(overrides: dict[str, object]) -> list[str]:
    return [a for k, v in overrides.items() for a in ("--set", f"{k}={v}")]


def test_no_key_in_tables_mlflow_logs_or_prefect(tmp_path, prefect_harness):
    from prefect.settings import PREFECT_API_URL

    from rubricem_core.testing.openai_server import FakeOpenAIServer

    # random per test run, so nothing else in the session can contain them by chance
    teacher_key = f"sk-teacher-{secrets.token_hex(16)}"
    judge_key = f"sk-judge-{secrets.token_hex(16)}"
    password = f"pw-{secrets.token_hex(16)}"  # in the grader's api_base
    teacher = ScriptedTeacher(TeacherRates(max_tool_calls=2))
    with (
        FakeOpenAIServer(
            lambda body: teacher.respond(body["messages"], body),
            api_key=teacher_key,
            polls_in_progress=1,
            fail_times={"syn-00000-t0:r01": 1},
        ) as tserver,
        FakeOpenAIServer(
            lambda body: builtin_judge_reply(body["messages"], body),
            api_key=judge_key,
            http_errors=[429, 500],
        ) as jserver,
    ):
        credentialed = jserver.base_url.replace("http://", f"http://rubricem:{password}@")
        overrides = {
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
            "eval.grader.api_base": credentialed,
        }
        env = {
            **os.environ,
            "RUBRICEM_FT_TEACHER_KEY": teacher_key,
            "RUBRICEM_FT_JUDGE_KEY": judge_key,
            "PREFECT_API_URL": str(PREFECT_API_URL.value()),
            "PYTHONPATH": str(REPO),
            # Prefect result storage, which a user may turn on, is searched too
            "PREFECT_RESULTS_PERSIST_BY_DEFAULT": "true",
            "PREFECT_LOCAL_STORAGE_PATH": str(tmp_path / "prefect-results"),
        }
        env.pop("RUBRICEM_FAULT_POINT", None)
        run = tmp_path / "run"
        proc = _rubricem(["run", "--profile", MICRO_PROFILE, "--run-dir", str(run), *_sets(overrides)], env)
        output = proc.stdout + proc.stderr
        assert proc.returncode == 0, output.decode(errors="replace")[-4000:]
        # the keys were really used (each server rejects calls without its key) ...
        assert tserver.uploaded_lines and ["syn-00000-t0:r01"] in tserver.batch_custom_ids()
        assert len(jserver.chat_calls) >= 2 + 2 * 2  # ≥ one generation per query, one score per rollout
        assert not jserver.http_errors, "the injected 429/500 were consumed and retried"

    # a crash: one more RL window on two trainer ranks (each writes its log under state/ranks), its judge gone; the
    # grader's URL is given again, as a new process must (config.yaml holds it masked)
    more = {"rl.n_windows": 2, "distributed.nproc_per_node": 2, "judge.max_retries": 0}
    more["eval.grader.api_base"] = credentialed
    crashed = _rubricem(["rl", "--debug", "--run-dir", str(run), *_sets(more)], env)
    assert crashed.returncode != 0, crashed.stdout.decode(errors="replace")[-2000:]
    assert b"judgments failed" in crashed.stderr, crashed.stderr.decode(errors="replace")[-2000:]

    store = RunStore(run)
    assert store.read_rows("sft_trajectories") and store.read_rows("judge_scores")
    assert (run / "mlflow" / "mlflow.db").is_file() and any((run / "mlflow" / "artifacts").rglob("*"))
    # `rubricem run` ends with the report and its summary printout
    assert (run / "report" / "report.html").is_file()
    text = proc.stdout.decode()
    assert "pipeline finished (micro profile" in text  # the summary itself: tests/test_prefect_ui.py

    # ... and they appear nowhere: not whole, not as the random part a masked key would show
    canaries = (teacher_key, judge_key, password)
    needles = [k.encode() for k in canaries] + [k[-16:].encode() for k in canaries]
    sinks: dict[str, bytes] = {"stdout/stderr": output, "crash stdout/stderr": crashed.stdout + crashed.stderr}
    for root in (run, tmp_path / "prefect-results"):
        for path in sorted(root.rglob("*")):
            if path.is_file():
                sinks[str(path.relative_to(tmp_path))] = path.read_bytes()
    prefect_db = _prefect_db_files()
    assert prefect_db, "the test Prefect server's SQLite database was not found"
    for path in prefect_db:
        sinks[f"prefect:{path.name}"] = path.read_bytes()
    leaks = [(name, n.decode()) for name, data in sinks.items() for n in needles if n in data]
    assert not leaks, f"API key or URL password found in {leaks}"

    # every surface searched was really written
    assert list((run / "state" / "ranks").glob("rl-rank*.log")), "no rank log: the crashed RL did not start its ranks"
    assert any(name.startswith("prefect-results") for name in sinks), "Prefect result storage is empty"
    db = next(p for p in prefect_db if p.suffix == ".db")
    for table in ("artifact", "flow_run", "log", "events"):
        assert _prefect_rows(db, table) > 0, f"Prefect table {table} is empty"
    # the config, MLflow params and Prefect's flow-run parameters show the URL with its password masked
    masked = credentialed.replace(password, "***").encode()
    assert masked in sinks["run/config.yaml"] and masked in sinks["run/mlflow/mlflow.db"]
    assert any(masked in data for name, data in sinks.items() if name.startswith("prefect:"))
    # the config written into the run names the variables, never the values
    config = (run / "config.yaml").read_text()
    assert "RUBRICEM_FT_TEACHER_KEY" in config and "RUBRICEM_FT_JUDGE_KEY" in config
