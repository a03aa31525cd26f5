"""The owned ephemeral Prefect server: serves flows, stops on exit, dies when its owner is SIGKILLed.

The end-to-end cases run in subprocesses with PREFECT_API_URL removed and PREFECT_HOME in a tmp
dir, so they never touch the session's prefect_test_harness server.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest

import flows.prefect_server as ps
from flows.prefect_server import owned_ephemeral_server

REPO_ROOT = Path(__file__).resolve().parents[1]

# prefect (and the flow) are imported BEFORE the server starts, as in the CLI: settings are
# already loaded, so the URL must reach Prefect's settings contexts, not only os.environ.
RUN_FLOW = textwrap.dedent(
    """
    import os
    from prefect import flow, get_run_logger
    from prefect.server.api.server import SubprocessASGIServer
    from prefect.settings import PREFECT_API_URL
    from flows.prefect_server import owned_ephemeral_server

    @flow
    def tiny(x: int) -> dict:
        get_run_logger().info("hello from tiny")
        return {"y": x + 1, "url": PREFECT_API_URL.value()}

    with owned_ephemeral_server() as server:
        print("SERVER", server.pid, flush=True)
        assert os.environ["PREFECT_API_URL"] == server.api_url
        result = tiny(1)
        assert result == {"y": 2, "url": server.api_url}, result
        assert not SubprocessASGIServer._instances, "Prefect started its own ephemeral server"
        # only this process (and its children) holds the server's basic-auth string: another client is refused
        import base64
        import httpx
        assert os.environ["PREFECT_API_AUTH_STRING"] == server.auth_string
        stranger = httpx.post(server.api_url + "/flow_runs/filter", json={})
        assert stranger.status_code == 401, stranger.status_code
        token = base64.b64encode(server.auth_string.encode()).decode()
        own = httpx.post(server.api_url + "/flow_runs/filter", json={}, headers={"Authorization": "Basic " + token})
        assert own.status_code == 200 and len(own.json()) == 1, own.status_code
    assert "PREFECT_API_URL" not in os.environ and "PREFECT_API_AUTH_STRING" not in os.environ
    assert PREFECT_API_URL.value() is None
    assert server.process.poll() is not None
    print("DONE", flush=True)
    """
)

START_AND_WAIT = textwrap.dedent(
    """
    import time
    from flows.prefect_server import owned_ephemeral_server
    with owned_ephemeral_server() as server:
        print("SERVER", server.pid, flush=True)
        time.sleep(120)
    """
)


def _clean_env(tmp_path: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"}
    env["PREFECT_HOME"] = str(tmp_path / "prefect-home")
    env["PYTHONPATH"] = str(REPO_ROOT)
    env["PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS"] = "40"
    return env


def _python(tmp_path: Path, *args: str, **env: str) -> dict[str, Any]:
    """subprocess.run/Popen's arguments for a fresh interpreter in the checkout, with the clean environment
    (and ``env``)."""
    return {"args": [sys.executable, *args], "cwd": REPO_ROOT, "env": {**_clean_env(tmp_path), **env}}


def _alive(pid: int) -> bool:
    """Running (not exited, not a zombie waiting for PID 1 to reap it)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return False
    return stat.rsplit(")", 1)[1].split()[0] not in ("Z", "X")


def _wait_gone(pid: int, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if not _alive(pid):
            return True
        time.sleep(0.2)
    return False


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_flow_runs_against_owned_server_and_server_stops(tmp_path):
    proc = subprocess.run(**_python(tmp_path, "-c", RUN_FLOW), capture_output=True, text=True, timeout=80)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "DONE" in proc.stdout, proc.stdout + proc.stderr
    pid = int(next(line for line in proc.stdout.splitlines() if line.startswith("SERVER")).split()[1])
    assert _wait_gone(pid, 5)


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_server_dies_when_owner_is_sigkilled(tmp_path):
    owner = subprocess.Popen(
        **_python(tmp_path, "-c", START_AND_WAIT), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    pid = None
    try:
        line = owner.stdout.readline()
        assert line.startswith("SERVER"), line + owner.stderr.read()
        pid = int(line.split()[1])
        assert _alive(pid)
        owner.kill()  # SIGKILL: no finally, no atexit in the owner
        owner.wait(10)
        assert _wait_gone(pid, 15), f"Prefect server {pid} outlived its SIGKILLed owner"
    finally:
        owner.kill()
        owner.wait()
        if pid is not None and _alive(pid):
            os.kill(pid, signal.SIGKILL)


def test_existing_api_url_starts_nothing(monkeypatch):
    monkeypatch.setenv("PREFECT_API_URL", "http://127.0.0.1:9/api")
    monkeypatch.setattr(ps, "_spawn", _must_not_spawn)
    with owned_ephemeral_server() as server:
        assert server is None
        assert os.environ["PREFECT_API_URL"] == "http://127.0.0.1:9/api"
    assert os.environ["PREFECT_API_URL"] == "http://127.0.0.1:9/api"


def test_api_url_from_prefect_settings_starts_nothing(monkeypatch):
    from prefect.settings import PREFECT_API_URL, temporary_settings

    monkeypatch.delenv("PREFECT_API_URL", raising=False)
    monkeypatch.setattr(ps, "_spawn", _must_not_spawn)
    with temporary_settings(updates={PREFECT_API_URL: "http://127.0.0.1:9/api"}):
        with owned_ephemeral_server() as server:
            assert server is None
    assert "PREFECT_API_URL" not in os.environ


def test_early_exit_raises_with_output_tail(monkeypatch):
    _fake_server(monkeypatch, "import sys; sys.stderr.write('boom: bad database url'); sys.exit(1)")
    with pytest.raises(RuntimeError, match="(?s)exited with code 1.*boom: bad database url"):
        with owned_ephemeral_server():
            pass
    assert "PREFECT_API_URL" not in os.environ


def test_startup_failure_code_retries_new_ports_then_raises(monkeypatch):
    ports = []
    _fake_server(monkeypatch, "import sys; sys.stderr.write('address already in use'); sys.exit(3)", ports)
    with pytest.raises(RuntimeError, match="(?s)failed to start on 5 ports.*address already in use"):
        with owned_ephemeral_server():
            pass
    assert len(ports) == 5


def test_timeout_raises_and_stops_the_server(monkeypatch, tmp_path):
    monkeypatch.setenv("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "1")
    spawned = []
    _fake_server(monkeypatch, "import sys, time; print('starting...', flush=True); time.sleep(60)", spawned=spawned)
    log = tmp_path / "logs" / "server.log"
    with pytest.raises(RuntimeError, match="(?s)did not become healthy.*starting"):
        with owned_ephemeral_server(log_path=log):
            pass
    assert spawned[0].poll() is not None  # stopped, not left running
    assert "starting..." in log.read_text()


def test_startup_timeout_default_and_bad_value(monkeypatch):
    monkeypatch.delenv("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", raising=False)
    assert ps.startup_timeout() == 120.0
    monkeypatch.setenv("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "soon")
    with pytest.raises(ValueError, match="PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS"):
        ps.startup_timeout()


def _must_not_spawn(*args, **kwargs):
    raise AssertionError("a server was started although an API URL is configured")


def _fake_server(monkeypatch, code: str, ports: list | None = None, spawned: list | None = None) -> None:
    """Replace uvicorn by ``python -c code`` (still spawned by the real _spawn)."""
    real_spawn = ps._spawn
    monkeypatch.delenv("PREFECT_API_URL", raising=False)
    monkeypatch.setattr(ps, "_configured_api_url", lambda: None)

    def args(port):
        if ports is not None:
            ports.append(port)
        return [sys.executable, "-c", code]

    monkeypatch.setattr(ps, "_uvicorn_args", args)

    def spawn(port, env, log):
        process = real_spawn(port, env, log)
        if spawned is not None:
            spawned.append(process)
        return process

    monkeypatch.setattr(ps, "_spawn", spawn)


def _servers_with_home(home: Path) -> list[int]:
    """Running Prefect API servers started with PREFECT_HOME=home (found through /proc)."""
    out = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cmdline = (proc / "cmdline").read_bytes()
            environ = (proc / "environ").read_bytes()
        except OSError:
            continue
        if b"prefect.server.api.server:create_app" in cmdline and f"PREFECT_HOME={home}".encode() in environ.split(
            b"\0"
        ):
            if _alive(int(proc.name)):
                out.append(int(proc.name))
    return out


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_a_killed_cli_leaves_no_prefect_server(tmp_path):
    """`rubricem collect-sft-data` with no PREFECT_API_URL, SIGKILLed mid-run (its fault point): the
    server it started is gone within seconds (it used to be re-parented to PID 1 and live on)."""
    sets = [
        "--set",
        "data.world.n_documents=60",
        "--set",
        "data.world.n_queries=8",
        "--set",
        "teacher.trajectories_per_query=1",
    ]
    command = ["-m", "flows.cli", "collect-sft-data", "--run-dir", str(tmp_path / "run"), *sets]
    cli = subprocess.Popen(
        **_python(tmp_path, *command, RUBRICEM_FAULT_POINT="collect.round_written:1"),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    seen: set[int] = set()
    while cli.poll() is None:  # note the server while the CLI runs
        seen.update(_servers_with_home(tmp_path / "prefect-home"))
        time.sleep(0.2)
    output = cli.stdout.read().decode(errors="replace")
    assert cli.returncode == -signal.SIGKILL, output[-2000:]
    assert seen, "the CLI never started its own Prefect server"
    try:
        assert all(_wait_gone(pid, 15) for pid in seen), f"Prefect servers {seen} outlived the killed CLI"
    finally:
        for pid in _servers_with_home(tmp_path / "prefect-home"):
            os.kill(pid, signal.SIGKILL)


def test_an_unknown_override_key_is_refused_with_a_suggestion_and_leaves_nothing(tmp_path, capsys):
    """A bad --set fails before Prefect starts, names the nearest valid key, and leaves no run directory."""
    from flows.cli import main

    run_dir = tmp_path / "runs" / "new"
    assert main(["run", "--run-dir", str(run_dir), "--set", "teacher.max_round=3"]) == 2
    err = capsys.readouterr().err
    assert "teacher.max_round: unknown key; did you mean teacher.max_rounds?" in err
    assert not (tmp_path / "runs").exists()


def test_the_terminal_shows_the_pipeline_summary_once_and_no_tracebacks():
    """`rubricem run` prints the end summary itself; the flow's copy of it (for the Prefect UI's log) and
    records with tracebacks stay off the console handler."""
    import logging
    import sys

    from flows.cli import _NoTracebacks
    from rubricem_core.report.summary import pipeline_summary

    result = {
        "collect_sft_data": {"accepted": 1, "trajectories": 2, "rounds": 1},
        "sft": {"final_dir": "f", "steps": 1, "final_loss": 0.5},
        "rl": {"steps": 1, "recipe": "full", "final_checkpoint": "c"},
        "evaluate": {"tag": "rl-step-000000", "retrieval": "none", "benchmarks": {}},
    }

    def record(msg: str, args: tuple = (), exc_info=None) -> logging.LogRecord:
        return logging.LogRecord("prefect.flow_runs", logging.INFO, __file__, 1, msg, args, exc_info)

    keep = _NoTracebacks().filter
    assert not keep(record("%s", (pipeline_summary(result, "tiny", "runs/t"),)))
    try:
        raise RuntimeError("boom")
    except RuntimeError:
        assert not keep(record("task failed", exc_info=sys.exc_info()))
    assert keep(record("pipeline stage 5/5 (100%%): report: %s", ("runs/t/report/report.html",)))
    assert keep(record("%s", ("pipeline finished: not the summary's form",)))
