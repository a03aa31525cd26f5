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

REPO = Path(__file__).resolve().parents[1]


def _group_members(pgid: int) -> list[int]:
    members = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[2]) == pgid and fields[0] != "Z":  # state, ppid, pgrp
                members.append(int(entry.name))
    return members


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
    EngineCore), which on SIGTERM stops its workers and exits, as vLLM shuts its engine down."""
    script = tmp_path / "fake-serve"
    script.write_text(
        textwrap.dedent(
            """\
            #!/bin/bash
            sleep 300 &
            sleep 300 &
            trap 'trap - TERM; kill $(jobs -p); exit 0' TERM
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
    assert _wait_until(lambda: len(_group_members(proc.pid)) == 3)
    os.kill(proc.pid, signal.SIGKILL)  # the leader only: its workers live on, orphaned
    proc.wait()
    assert len(_group_members(proc.pid)) == 2
    stop_process_group(proc, grace_s=5)
    assert _group_members(proc.pid) == []
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
    assert _wait_until(lambda: _group_members(int(pid)) == []), "the server outlived the process that started it"
