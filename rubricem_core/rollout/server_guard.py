"""Runs `python -m <module> <args>` as a child and takes its whole process group down with it.

    python -c "import runpy; runpy.run_path('<this file>', run_name='__main__')" vllm.entrypoints.openai.api_server ...

(``guarded_command`` builds that line: run_path, unlike ``python <this file>``, puts no directory of ours on
sys.path, where rollout/types.py would shadow the standard library's ``types``.)

vLLM's API server starts its EngineCore as a child process and stops it on SIGTERM; a server that is
SIGKILLed outright cannot, and its engine lives on as an orphan holding its memory and cores. Ray kills a
killed actor's child processes with SIGKILL, so a replica whose actor was killed leaked its engine so. This
guard is what the server's starter launches (as the leader of a new process group) and what a SIGKILL of
the starter's children hits: the server then gets SIGTERM (its PR_SET_PDEATHSIG) and stops its engine.
When the guard is asked to stop (SIGTERM or SIGINT), when its own parent dies, or when the server exits by
itself, it SIGTERMs the group, waits ``GRACE_S`` for the server, then SIGKILLs whatever of the group is
left, and exits with the server's code (128 + signal when it was told to stop).

A SIGKILLed guard escalates nothing, and vLLM's server can hang in its own shutdown (seen under load: engine
exited, server idle in epoll, its requests in flight never answered, so the driver's calls waited out their
timeout). So the guard also starts a reaper in the group (``--reap-group``): once the guard is gone it gives
the group ``GRACE_S`` to stop by itself, then SIGKILLs what is left. The guard's own stop ends the reaper with
the rest of the group. ``RUBRICEM_SERVER_GRACE_S`` overrides ``GRACE_S`` (tests).

It is run by path with the server's interpreter (which need not have rubricem_core installed), so it
imports only the standard library.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

GRACE_S = float(os.environ.get("RUBRICEM_SERVER_GRACE_S", "20"))  # the server's own shutdown before SIGKILL
POLL_S = 0.5
REAP_FLAG = "--reap-group"


def guarded_command(python: str, module: str, args: list[str]) -> list[str]:
    """The command line that runs ``python -m module args`` under this guard."""
    return [python, "-c", _RUN_THIS_FILE, module, *args]


_RUN_THIS_FILE = f"import runpy; runpy.run_path({str(Path(__file__).resolve())!r}, run_name='__main__')"


def group_members(pgid: int) -> list[int]:
    """The pids of process group ``pgid`` other than this process (Linux /proc; empty elsewhere)."""
    me, out = os.getpid(), list[int]()
    try:
        names = os.listdir("/proc")
    except OSError:
        return out
    for name in names:
        if not name.isdigit() or int(name) == me:
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                # pid (comm) state ppid pgrp ...: comm may hold spaces and parentheses, so split after the last ')'
                fields = f.read().rsplit(b")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if len(fields) > 2 and int(fields[2]) == pgid and fields[0] != b"Z":
            out.append(int(name))
    return out


def end_group(server: subprocess.Popen, grace_s: float = GRACE_S) -> None:
    """SIGTERM this process group, give ``server`` ``grace_s`` to exit, then SIGKILL every other member
    that is left and wait for them to be gone."""
    pgid = os.getpgid(0)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # the group's SIGTERM is for the others
    for pid in [server.pid, *group_members(pgid)]:
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    try:
        server.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        pass
    deadline = time.monotonic() + 10.0
    while (left := group_members(pgid)) and time.monotonic() < deadline:
        for pid in left:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        server.poll()  # reap the server, or it stays in the group as a zombie
        time.sleep(0.05)
    server.poll()


def term_when_parent_dies() -> Callable[[], None] | None:
    """A ``preexec_fn`` that makes the server get SIGTERM when this guard dies, SIGKILLed too (Ray kills
    a killed actor's child processes with SIGKILL, which is this guard; vLLM's server still stops its
    engine on SIGTERM). prctl is resolved here, before the fork. None off Linux."""
    if not sys.platform.startswith("linux"):
        return None
    import ctypes

    prctl = ctypes.CDLL(None, use_errno=True).prctl
    return lambda: prctl(1, int(signal.SIGTERM), 0, 0, 0)  # PR_SET_PDEATHSIG


def reap_group(guard: int, grace_s: float) -> int:
    """The reaper: wait while ``guard`` is this process's parent; once it is gone (SIGKILLed: a guard that
    stops normally SIGTERMs the reaper first), give the rest of the group ``grace_s`` to exit, then SIGKILL
    whatever is left."""
    while os.getppid() == guard:
        time.sleep(POLL_S)
    pgid = os.getpgid(0)
    deadline = time.monotonic() + grace_s
    while group_members(pgid) and time.monotonic() < deadline:
        time.sleep(POLL_S)
    for pid in group_members(pgid):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return 0


def main(argv: list[str]) -> int:
    if argv[:1] == [REAP_FLAG]:
        return reap_group(int(argv[1]), float(argv[2]))
    if not argv:
        print(
            "usage: python -c \"import runpy; runpy.run_path('server_guard.py', run_name='__main__')\" MODULE [ARGS...]",
            file=sys.stderr,
        )
        return 2
    parent = os.getppid()
    stop = threading.Event()
    told: list[int] = []

    def on_signal(signum: int, _frame: object) -> None:
        told.append(signum)
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    # the reaper first, so no moment has a server without one; its stdout not on the server's pipe, which
    # the starter reads until every holder of it is gone
    reaper = subprocess.Popen(
        [sys.executable, "-c", _RUN_THIS_FILE, REAP_FLAG, str(os.getpid()), str(GRACE_S)],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
    )
    server = subprocess.Popen([sys.executable, "-m", *argv], preexec_fn=term_when_parent_dies())
    while not stop.is_set() and server.poll() is None:
        if os.getppid() != parent:  # our starter died without signalling us: nobody will stop the server
            told.append(signal.SIGTERM)
            break
        stop.wait(POLL_S)
    end_group(server)
    try:  # SIGTERMed with the group: reaped, not left a zombie
        reaper.wait(timeout=5)
    except subprocess.TimeoutExpired:
        reaper.kill()
    if told:
        return 128 + told[0]
    return server.returncode if server.returncode >= 0 else 128 - server.returncode


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
