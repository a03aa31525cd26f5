"""Child processes that do not outlive the process that started them."""

from __future__ import annotations

import ctypes
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import Any

PR_SET_PDEATHSIG = 1  # from <linux/prctl.h>


def die_with_parent(sig: int = signal.SIGTERM) -> Callable[[], None]:
    """A ``preexec_fn`` for ``subprocess.Popen`` that makes the child receive ``sig`` when we die.

    Uses Linux ``prctl(PR_SET_PDEATHSIG)``, so a helper process (an API server, a worker) is not
    orphaned when its parent is SIGKILLed. If the parent already died between fork and prctl,
    the child exits at once. A no-op on other systems.

    Call it in the process that will spawn the child (it records this pid), and spawn from a
    thread that lives as long as the child: the kernel sends the signal when the *thread* that
    forked the child exits, so the main thread is the safe choice.
    """
    if not sys.platform.startswith("linux"):
        return _noop
    # Resolve prctl here, in the parent: dlopen/dlsym in a child forked from a threaded
    # parent can deadlock on a loader lock held by another thread at fork time.
    prctl = ctypes.CDLL(None, use_errno=True).prctl
    prctl.restype = ctypes.c_int
    prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
    parent = os.getpid()
    signum = int(sig)

    def _preexec() -> None:
        if prctl(PR_SET_PDEATHSIG, signum, 0, 0, 0) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"prctl(PR_SET_PDEATHSIG) failed: {os.strerror(err)}")
        if os.getppid() != parent:  # parent died before prctl took effect: nobody will signal us
            os._exit(128 + signum)

    return _preexec


def _noop() -> None:
    return None


def free_port() -> int:
    """A TCP port on loopback that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def popen_until_released(
    args: list[str], released: threading.Event, death_signal: int, **popen_kwargs: Any
) -> subprocess.Popen:
    """``subprocess.Popen(args, ...)`` whose child gets ``death_signal`` when this process dies
    (die_with_parent), forked from a thread that lives until ``released`` is set: the kernel signals
    the child when the *thread* that forked it ends, so a pool thread finishing its task must not be it."""
    started: Future[subprocess.Popen] = Future()

    def keep() -> None:
        try:
            started.set_result(subprocess.Popen(args, preexec_fn=die_with_parent(death_signal), **popen_kwargs))
        except BaseException as exc:
            started.set_exception(exc)
            return
        released.wait()

    threading.Thread(target=keep, name=f"keeps-{Path(args[0]).name}", daemon=True).start()
    return started.result()


def stop_process_group(proc: subprocess.Popen, grace_s: float = 30.0) -> None:
    """SIGTERM a child started with ``start_new_session=True`` and everything it started, SIGKILL what
    is left after ``grace_s`` (idempotent). Also when the child itself has already exited: what it
    started lives on in its process group (vLLM's EngineCore behind a killed `vllm serve`)."""
    deadline = time.monotonic() + grace_s
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:  # nobody left in the group
            proc.poll()
            return
        except PermissionError:  # the group id was taken by another user's process: ours are gone
            return
        while time.monotonic() < deadline and _group_alive(proc):
            time.sleep(0.05)
        deadline = time.monotonic() + 5.0
    proc.wait()


def _group_alive(proc: subprocess.Popen) -> bool:
    proc.poll()  # reap the leader, or it stays in the group as a zombie
    try:
        os.killpg(proc.pid, 0)
    except (ProcessLookupError, PermissionError):
        return False
    return True
