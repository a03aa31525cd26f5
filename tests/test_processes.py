"""Child processes do not outlive what started them: a server's process group is stopped whole, also after
its leader died, and a server started from a short-lived thread is signalled when its parent dies."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from rubricem_core.processes import stop_process_group
from rubricem_core.rollout.server_guard import group_members

REPO = Path(__file__).resolve().parents[1]


def _wait_until(condition, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.05)
    return condition()


@pytest.fixture
def fake_server(tmp_path: Path) -> Path:
    """A stand-in for `vllm serve`: a leader with two workers in its group (like the API server with its
    EngineCore), which on SIGTERM stops its workers and exits, as vLLM shuts its engine down. It signals its
    whole group (`kill 0`): with `kill $(jobs -p)` the trap left both workers running in every pytest run on
    this machine in session 27 (not pinned down; with a log line added to the trap it passed)."""
    script = tmp_path / "fake-serve"
    script.write_text(
        textwrap.dedent(
            """\
            #!/bin/bash
            sleep 300 &
            sleep 300 &
            trap 'trap - TERM; kill -TERM 0; exit 0' TERM
            echo ready
            wait
            """
        )
    )
    script.chmod(0o755)
    return script


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_a_group_whose_leader_was_killed_is_stopped_whole(fake_server: Path) -> None:
    proc = subprocess.Popen([str(fake_server)], stdout=subprocess.PIPE, text=True, start_new_session=True)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
    assert _wait_until(lambda: len(group_members(proc.pid)) == 3)
    os.kill(proc.pid, signal.SIGKILL)  # the leader only: its workers live on, orphaned
    proc.wait()
    assert len(group_members(proc.pid)) == 2
    stop_process_group(proc, grace_s=5)
    assert group_members(proc.pid) == []
    stop_process_group(proc, grace_s=5)  # idempotent


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG and /proc")
def test_a_server_started_from_a_finished_thread_stops_when_its_parent_is_killed(
    fake_server: Path, tmp_path: Path
) -> None:
    parent = textwrap.dedent(
        f"""\
        import os, signal, time
        from concurrent.futures import ThreadPoolExecutor
        from rubricem_core.rollout.vllm_server import ServerProcess

        with ThreadPoolExecutor(1) as pool:  # the thread that starts it ends right after
            server = pool.submit(ServerProcess, {str(tmp_path)!r}, api_key="k", python={str(fake_server)!r}).result()
        while "ready" not in server.tail():
            time.sleep(0.05)
        time.sleep(1.0)  # a thread that had forked it would have ended by now
        print(server.proc.pid, server.proc.poll(), flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", parent], cwd=REPO, capture_output=True, text=True, timeout=120, check=False
    )
    assert out.returncode == -signal.SIGKILL, out.stderr[-2000:]
    pid, alive = out.stdout.split()
    assert alive == "None", "the server outlived its parent's pool thread only until that thread ended"
    assert _wait_until(lambda: group_members(int(pid)) == []), "the server outlived the process that started it"


@pytest.fixture
def leaky_server(tmp_path: Path) -> Path:
    """A stand-in for vLLM's API server where it leaks: it starts an engine that ignores SIGTERM and dies on
    SIGTERM itself without stopping it (``--exit N``: exits with N by itself once the engine runs)."""
    (tmp_path / "leaky_server.py").write_text(
        textwrap.dedent(
            """\
            import subprocess, sys, time
            engine = subprocess.Popen(["bash", "-c", "trap '' TERM; exec sleep 300"])
            print("ready", engine.pid, flush=True)
            if sys.argv[1:2] == ["--exit"]:
                sys.exit(int(sys.argv[2]))
            time.sleep(300)
            """
        )
    )
    return tmp_path


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG and /proc")
@pytest.mark.parametrize("guarded", [True, False])
def test_the_server_guard_stops_the_engine_when_the_starter_is_killed(leaky_server: Path, guarded: bool) -> None:
    starter = textwrap.dedent(
        f"""\
        import os, signal, subprocess, sys, threading
        from rubricem_core.processes import popen_until_released
        from rubricem_core.rollout.server_guard import guarded_command

        cmd = [sys.executable, "-m", "leaky_server"]
        if {guarded!r}:
            cmd = guarded_command(sys.executable, "leaky_server", [])
        # stderr not ours: an orphaned engine holding the pipe would keep the test waiting on it
        proc = popen_until_released(cmd, threading.Event(), signal.SIGTERM, stdout=subprocess.PIPE, text=True,
                                    stderr=subprocess.DEVNULL, start_new_session=True)
        print(proc.pid, proc.stdout.readline().split()[1], flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
        """
    )
    env = {**os.environ, "PYTHONPATH": f"{leaky_server}{os.pathsep}{REPO}"}
    out = subprocess.run([sys.executable, "-c", starter], cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == -signal.SIGKILL, out.stderr[-2000:]
    group, engine = (int(x) for x in out.stdout.split())
    try:
        if guarded:
            assert _wait_until(lambda: group_members(group) == [], timeout_s=30), "the engine outlived the guard"
        else:  # what the guard is for: the server died of its SIGTERM and left its engine running
            assert _wait_until(lambda: group_members(group) == [engine], timeout_s=30)
            time.sleep(0.5)
            assert _alive(engine)
    finally:
        for pid in group_members(group):
            os.kill(pid, signal.SIGKILL)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_the_server_guard_exits_with_the_servers_code_and_takes_its_engine_along(leaky_server: Path) -> None:
    from rubricem_core.rollout.server_guard import guarded_command

    env = {**os.environ, "PYTHONPATH": str(leaky_server)}
    cmd = guarded_command(sys.executable, "leaky_server", ["--exit", "3"])
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        assert proc.stdout is not None
        engine = int(proc.stdout.readline().split()[1])
        assert proc.wait(timeout=60) == 3
        assert not _alive(engine) and group_members(proc.pid) == []
    finally:
        stop_process_group(proc, grace_s=5)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG and /proc")
def test_a_guard_killed_with_sigkill_leaves_its_server_a_sigterm(tmp_path: Path) -> None:
    """Ray kills a killed actor's children with SIGKILL: the guard cannot clean up, but its server gets
    SIGTERM, on which vLLM's server stops its engine (here: a server that stops its engine on SIGTERM)."""
    (tmp_path / "polite_server.py").write_text(
        textwrap.dedent(
            """\
            import signal, subprocess, sys, time
            engine = subprocess.Popen(["bash", "-c", "trap '' TERM; exec sleep 300"])
            def stop(*_):
                engine.kill()
                engine.wait()
                sys.exit(0)
            signal.signal(signal.SIGTERM, stop)
            print("ready", engine.pid, flush=True)
            time.sleep(300)
            """
        )
    )
    proc, engine = _start_guarded(tmp_path, "polite_server")
    try:
        os.kill(proc.pid, signal.SIGKILL)  # the guard alone
        proc.wait()
        assert _wait_until(lambda: group_members(proc.pid) == [], timeout_s=30), "the server outlived its guard"
        assert not _alive(engine)
    finally:
        stop_process_group(proc, grace_s=5)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG and /proc")
def test_a_server_stuck_in_its_shutdown_is_killed_after_its_grace_when_its_guard_was_sigkilled(tmp_path: Path) -> None:
    """vLLM's server can hang in its own shutdown (engine gone, requests in flight never answered): with its
    guard SIGKILLed nobody escalated, and the driver's calls to it waited out their timeout. The guard's reaper
    gives the group its grace, then SIGKILLs it."""
    (tmp_path / "stuck_server.py").write_text(
        textwrap.dedent(
            """\
            import signal, subprocess, time
            engine = subprocess.Popen(["bash", "-c", "trap '' TERM; exec sleep 300"])
            signal.signal(signal.SIGTERM, lambda *_: None)  # "shutting down", forever
            print("ready", engine.pid, flush=True)
            while True:
                time.sleep(1)
            """
        )
    )
    proc, engine = _start_guarded(tmp_path, "stuck_server", {"RUBRICEM_SERVER_GRACE_S": "3"})
    try:
        assert _wait_until(lambda: len(group_members(proc.pid)) == 4)  # guard, server, engine, reaper
        os.kill(proc.pid, signal.SIGKILL)  # the guard alone, as Ray kills a killed actor's children
        proc.wait()
        killed = time.monotonic()
        time.sleep(1.0)
        assert _alive(engine), "the group was killed before its grace"
        assert _wait_until(lambda: group_members(proc.pid) == [], timeout_s=30), "the stuck server outlived its guard"
        assert time.monotonic() - killed >= 2.5
        assert not _alive(engine)
    finally:
        stop_process_group(proc, grace_s=5)


def _start_guarded(tmp_path: Path, module: str, env: dict[str, str] | None = None) -> tuple[subprocess.Popen, int]:
    """``tmp_path/<module>.py`` under the server guard, as the leader of a new group; the guard's process and
    the pid its stand-in engine printed."""
    from rubricem_core.rollout.server_guard import guarded_command

    proc = subprocess.Popen(
        guarded_command(sys.executable, module, []),
        env={**os.environ, "PYTHONPATH": str(tmp_path), **(env or {})},
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    assert proc.stdout is not None
    return proc, int(proc.stdout.readline().split()[1])
