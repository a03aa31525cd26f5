"""The run-dir lock: re-entrant in-process, exclusive across processes, never stale after a kill."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from rubricem_core.config import ConfigError
from rubricem_core.runlock import LOCK_NAME, RunDirLocked, lock_holder, run_dir_lock

REPO_ROOT = Path(__file__).resolve().parents[1]

# A second process trying to take the lock; prints OK or the refusal message.
TRY_LOCK = textwrap.dedent(
    """
    import sys
    from rubricem_core.runlock import RunDirLocked, run_dir_lock
    try:
        with run_dir_lock(sys.argv[1], "other-command"):
            print("OK")
    except RunDirLocked as exc:
        print("LOCKED", exc)
    """
)

# Holds the lock and reports; optionally spawns a long-lived child first (inherits fds unless CLOEXEC).
HOLD_LOCK = textwrap.dedent(
    """
    import subprocess, sys, time
    from rubricem_core.runlock import run_dir_lock
    with run_dir_lock(sys.argv[1], "holder-command"):
        if len(sys.argv) > 2:
            child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], close_fds=False)
            print("CHILD", child.pid, flush=True)
        print("HELD", flush=True)
        if len(sys.argv) > 2:
            sys.stdin.readline()  # release when told, leaving the child running
        else:
            time.sleep(60)
    print("RELEASED", flush=True)
    sys.stdin.readline()
    """
)


def _python(script: str, *args: str, **kwargs) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-c", script, *args],
        cwd=REPO_ROOT,
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        **kwargs,
    )


def _try_other_process(run_dir: Path) -> str:
    proc = _python(TRY_LOCK, str(run_dir))
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err
    return out.strip()


def _wait_line(proc: subprocess.Popen, prefix: str) -> str:
    line = proc.stdout.readline()
    assert line.startswith(prefix), (line, proc.stderr.read() if proc.poll() is not None else "")
    return line.strip()


def test_reentrant_in_process_and_released_by_outermost(tmp_path):
    run_dir = tmp_path / "run"
    with run_dir_lock(run_dir, "pipeline") as resolved:
        assert resolved == run_dir.resolve() and run_dir.is_dir()
        with run_dir_lock(run_dir, "sft"):  # a sub-flow of the same process
            pass
        holder = lock_holder(run_dir)  # still held after the inner exit
        assert holder["pid"] == os.getpid() and holder["command"] == "pipeline"
        assert holder["started_at"] and holder["host"] and holder["program"] == os.path.basename(sys.argv[0])
        assert "argv" not in holder  # the command line's values (overrides, URLs with credentials) stay off disk

        seen = []

        def task_thread():  # another thread of the holder nests too instead of being refused
            with run_dir_lock(run_dir, "rl"):
                seen.append(lock_holder(run_dir)["command"])

        worker = threading.Thread(target=task_thread)
        worker.start()
        worker.join(10)
        assert seen == ["pipeline"]
        assert lock_holder(run_dir) is not None
        (run_dir / "config.yaml").write_text("seed: 0\n")  # the run wrote something: the directory stays
    assert lock_holder(run_dir) is None
    assert (run_dir / LOCK_NAME).read_text() == ""  # no stale holder info left behind


@pytest.mark.parametrize("existed", [False, True])
def test_a_run_that_writes_nothing_leaves_nothing_behind(tmp_path, existed):
    """A run refused before writing (a bad --set, an unknown profile) removes the run directory it
    created, and the parents it created with it; a directory that was there before stays."""
    run_dir = tmp_path / "runs" / "new"
    if existed:
        run_dir.mkdir(parents=True)
    with pytest.raises(ValueError, match="bad override"):
        with run_dir_lock(run_dir, "rubricem run"):
            assert (run_dir / LOCK_NAME).is_file()
            raise ValueError("bad override")
    assert run_dir.is_dir() == existed
    assert (tmp_path / "runs").is_dir() == existed
    if existed:  # its own lock file (empty: no holder) is all it keeps
        assert [p.name for p in run_dir.iterdir()] == [LOCK_NAME] and lock_holder(run_dir) is None


def test_other_process_refused_while_held_then_succeeds(tmp_path):
    run_dir = tmp_path / "run"
    with run_dir_lock(run_dir, "rubricem rl"):
        started = time.monotonic()
        message = _try_other_process(run_dir)
        assert message.startswith("LOCKED"), message
        assert f"pid {os.getpid()}" in message and "'rubricem rl'" in message
        assert str(run_dir.resolve()) in message and "rubricem sql" in message
        assert time.monotonic() - started < 20  # refused, not waiting for the holder
        info = json.loads((run_dir / LOCK_NAME).read_text())
        assert info["pid"] == os.getpid()
    assert _try_other_process(run_dir) == "OK"


def test_refusal_in_process_names_holder_process(tmp_path):
    run_dir = tmp_path / "run"
    holder = _python(HOLD_LOCK, str(run_dir), stdin=subprocess.PIPE)
    try:
        _wait_line(holder, "HELD")
        with pytest.raises(RunDirLocked) as info:
            with run_dir_lock(run_dir, "mine"):
                pass
        assert f"pid {holder.pid}" in str(info.value) and "holder-command" in str(info.value)
        assert info.value.holder["command"] == "holder-command"
        assert lock_holder(run_dir)["pid"] == holder.pid
    finally:
        holder.kill()
        holder.wait()


def test_sigkilled_holder_leaves_no_stale_lock(tmp_path):
    run_dir = tmp_path / "run"
    holder = _python(HOLD_LOCK, str(run_dir), stdin=subprocess.PIPE)
    _wait_line(holder, "HELD")
    assert lock_holder(run_dir)["pid"] == holder.pid
    os.kill(holder.pid, signal.SIGKILL)
    holder.wait(10)
    assert (run_dir / LOCK_NAME).read_text()  # the dead holder's info is still in the file ...
    assert lock_holder(run_dir) is None  # ... but the kernel dropped the lock
    with run_dir_lock(run_dir, "rerun"):
        assert lock_holder(run_dir)["command"] == "rerun"


def test_child_spawned_while_held_does_not_keep_lock(tmp_path):
    run_dir = tmp_path / "run"
    holder = _python(HOLD_LOCK, str(run_dir), "spawn-child", stdin=subprocess.PIPE)
    child_pid = None
    try:
        child_pid = int(_wait_line(holder, "CHILD").split()[1])
        _wait_line(holder, "HELD")
        holder.stdin.write("\n")
        holder.stdin.flush()
        _wait_line(holder, "RELEASED")  # parent released; its child (close_fds=False) still runs
        os.kill(child_pid, 0)
        assert lock_holder(run_dir) is None
        assert _try_other_process(run_dir) == "OK"
    finally:
        if child_pid is not None:
            os.kill(child_pid, signal.SIGKILL)
        holder.kill()
        holder.wait()


def test_run_dir_that_is_a_file_is_a_clear_error(tmp_path):
    path = tmp_path / "run"
    path.write_text("not a dir")
    with pytest.raises(ConfigError, match="is an existing file"):
        with run_dir_lock(path, "sft"):
            pass
    with pytest.raises(ConfigError, match="cannot be created"):
        with run_dir_lock(path / "sub", "sft"):
            pass
    assert lock_holder(path) is None


def test_lock_holder_of_missing_or_never_locked_dir(tmp_path):
    assert lock_holder(tmp_path / "nope") is None
    (tmp_path / LOCK_NAME).write_text('{"pid": 1}')  # a leftover file is not a lock
    assert lock_holder(tmp_path) is None


def test_the_lock_file_holds_no_argument_of_the_command_line(tmp_path, monkeypatch):
    canary = "https://user:canary-pw-7731@judge.example/v1"
    monkeypatch.setattr(sys, "argv", ["rubricem", "rl", "--set", f"judge.api_base={canary}"])
    with run_dir_lock(tmp_path / "run", "rubricem rl"):
        text = (tmp_path / "run" / ".rubricem.lock").read_text()
    assert "canary-pw-7731" not in text and "judge.api_base" not in text
    assert json.loads(text)["command"] == "rubricem rl"
