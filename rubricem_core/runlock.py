"""One writer per run directory: an OS file lock on ``<run_dir>/.rubricem.lock``.

The lock is ``fcntl.flock(LOCK_EX | LOCK_NB)`` on a file descriptor opened with ``O_CLOEXEC``:

* the kernel drops it when the holding process dies (even by SIGKILL), so a killed run never
  leaves a stale lock behind and no PID-file clean-up is needed;
* ``O_CLOEXEC`` keeps it out of exec'd children (inference servers, Ray workers), which would
  otherwise keep the run dir locked after the parent has finished;
* flock conflicts between *open file descriptions*, even inside one process, so nested use (the
  pipeline flow calls sub-flows that each lock the same run dir) is a per-process refcount on the
  one descriptor rather than a second ``open`` + ``flock``.

A second process is refused at once with :class:`RunDirLocked`, whose message names the holder
(pid, host, command, start time) as written into the lock file after acquiring. Readers such as
``rubricem sql`` and ``rubricem report`` never take the lock.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from rubricem_core.config import ConfigError
from rubricem_core.layout import LOCK_FILE, RunLayout

LOCK_NAME = LOCK_FILE  # the name tests and callers have always imported from here
# A concurrent lock_holder() probe holds the lock for microseconds; retrying this long before
# refusing keeps such a probe from being mistaken for a running writer.
_CONTENTION_RETRY_S = 0.2


class RunDirLocked(RuntimeError):
    """Another process holds the run directory; the message names it and what to do."""

    def __init__(self, run_dir: Path, holder: dict[str, Any]):
        self.run_dir = run_dir
        self.holder = holder
        super().__init__(_locked_message(run_dir, holder))


@dataclass
class _Held:
    fd: int
    count: int
    created: Path | None = None  # the topmost directory this acquisition created (None: it existed)


_held: dict[Path, _Held] = {}
_guard = threading.Lock()  # protects _held and serialises open+flock between threads


def _forget_after_fork() -> None:
    # A forked child is not the holder: its inherited descriptors must not make it think it is.
    global _guard
    _held.clear()
    _guard = threading.Lock()


os.register_at_fork(after_in_child=_forget_after_fork)


def lock_path(run_dir: str | os.PathLike[str]) -> Path:
    """The lock file of ``run_dir`` (it may not exist yet)."""
    return RunLayout(run_dir).lock_file


@contextmanager
def run_dir_lock(run_dir: str | os.PathLike[str], command: str) -> Iterator[Path]:
    """Hold the run-dir lock for the ``with`` block; yields the resolved run dir.

    Creates the run dir if missing. Re-entrant within this process (from any thread): nested
    entries only count, and the lock is released when the outermost one exits. Raises
    :class:`RunDirLocked` at once if another process holds it, and ``ConfigError`` if the
    run-dir path is an existing file.
    """
    path, created = _prepare_dir(run_dir)
    _acquire(path, command, created)
    try:
        yield path
    finally:
        _release(path)


def lock_holder(run_dir: str | os.PathLike[str]) -> dict[str, Any] | None:
    """Who holds the run-dir lock now: the info its holder wrote, or None when it is free.

    Tests the lock with a non-blocking shared flock on a separate descriptor, so a lock left
    by a dead process (file present, no kernel lock) reads as free. Returns ``{}`` when the
    lock is held but the holder has not written its info yet. A holder in this very process
    is reported too.
    """
    path = lock_path(run_dir)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except (FileNotFoundError, NotADirectoryError):
        return None
    try:
        if _try_flock(fd, fcntl.LOCK_SH):
            fcntl.flock(fd, fcntl.LOCK_UN)
            return None
        return _read_info(fd)
    finally:
        os.close(fd)


def _prepare_dir(run_dir: str | os.PathLike[str]) -> tuple[Path, Path | None]:
    """Create the run dir if needed and resolve it; a file in its place is a ConfigError. Returns it and
    the topmost directory created here (None when it existed), removed again if nothing is written."""
    path = Path(run_dir)
    if path.exists() and not path.is_dir():
        raise ConfigError(f"run dir {str(path)!r} is an existing file, not a directory; pass a directory path")
    absolute = path.absolute()
    missing = [d for d in (absolute, *absolute.parents) if not d.exists()]
    try:
        path.mkdir(parents=True, exist_ok=True)
    except (FileExistsError, NotADirectoryError) as exc:
        raise ConfigError(f"run dir {str(path)!r} cannot be created: {exc}") from None
    return path.resolve(), (missing[-1].resolve() if missing else None)


def _acquire(path: Path, command: str, created: Path | None = None) -> None:
    with _guard:
        held = _held.get(path)
        if held is not None:
            held.count += 1
            return
        fd = _lock_fd(path)
        try:
            _write_info(fd, _holder_info(command))
        except BaseException:
            _unlock_and_close(fd)
            _remove_if_unused(path, created)
            raise
        _held[path] = _Held(fd=fd, count=1, created=created)


def _release(path: Path) -> None:
    with _guard:
        held = _held.get(path)
        if held is None:  # forked child, or already gone: nothing of ours to release
            return
        held.count -= 1
        if held.count > 0:
            return
        del _held[path]
        # Clear the info first so a reader never sees a finished run named as the holder.
        try:
            os.ftruncate(held.fd, 0)
        except OSError:
            pass
        if held.created is not None:  # a run refused before writing anything leaves no directory behind
            _remove_if_unused(path, held.created)
        _unlock_and_close(held.fd)


def _remove_if_unused(path: Path, created: Path | None) -> None:
    """Remove the run dir this process created, and the parents it created with it, when it holds
    nothing but its lock file (the run was refused, e.g. by a bad override, before writing anything).
    The lock file goes while still locked, so no other process can be holding it."""
    if created is None:
        return
    lock = RunLayout(path).lock_file
    try:
        if {p.name for p in path.iterdir()} - {lock.name}:
            return
        lock.unlink(missing_ok=True)
        for directory in (path, *path.parents):
            directory.rmdir()  # fails (and stops) at the first one that is not empty
            if directory == created:
                break
    except OSError:
        pass


def _lock_fd(path: Path) -> int:
    """Open and exclusively lock the lock file of ``path``, or raise RunDirLocked."""
    fd = os.open(RunLayout(path).lock_file, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    deadline = time.monotonic() + _CONTENTION_RETRY_S
    while True:
        try:
            if _try_flock(fd, fcntl.LOCK_EX):
                return fd
        except BaseException:
            os.close(fd)
            raise
        if time.monotonic() >= deadline:
            holder = _read_info(fd)
            os.close(fd)
            raise RunDirLocked(path, holder)
        time.sleep(0.02)


def _try_flock(fd: int, mode: int) -> bool:
    """Non-blocking flock: True if taken, False if someone else holds a conflicting lock."""
    try:
        fcntl.flock(fd, mode | fcntl.LOCK_NB)
    except OSError as exc:
        if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            return False
        raise
    return True


def _unlock_and_close(fd: int) -> None:
    # Explicit LOCK_UN: a forked (not exec'd) child shares the open file description, and
    # close() alone would leave the lock held until that child exits too.
    try:
        fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)


def _holder_info(command: str) -> dict[str, Any]:
    return {
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "command": command,
        # the program's name, never its arguments: `--set judge.api_base=https://user:pw@…` stays off disk
        "program": os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else "python",
        "started_at": datetime.now(UTC).isoformat(timespec="seconds"),
    }


def _write_info(fd: int, info: dict[str, Any]) -> None:
    data = (json.dumps(info) + "\n").encode()
    os.ftruncate(fd, 0)
    os.pwrite(fd, data, 0)
    os.fsync(fd)


def _read_info(fd: int) -> dict[str, Any]:
    """The holder info in the lock file; {} if it is empty or half-written."""
    try:
        size = os.fstat(fd).st_size
        info = json.loads(os.pread(fd, max(size, 1), 0).decode() or "{}")
    except (OSError, ValueError):
        return {}
    return info if isinstance(info, dict) else {}


def _locked_message(run_dir: Path, holder: dict[str, Any]) -> str:
    if holder:
        who = (
            f"pid {holder.get('pid', '?')} on host {holder.get('host', '?')} "
            f"(command {holder.get('command', '?')!r}, started {holder.get('started_at', '?')})"
        )
        stop = f"stop that process (kill {holder.get('pid', '<pid>')} on {holder.get('host', 'its host')})"
    else:
        who = "another process (it has not written its pid yet)"
        stop = "stop that process"
    return (
        f"run dir {str(run_dir)!r} is in use by {who}. "
        f"Wait for it to finish or {stop}, then rerun; "
        f"`rubricem sql` and `rubricem report` read a run dir without the lock and work meanwhile."
    )
