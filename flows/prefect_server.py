"""A local Prefect API server that dies with the `rubricem` process that started it.

With no ``PREFECT_API_URL``, Prefect 3 starts an ephemeral API server itself
(``prefect.server.api.server.SubprocessASGIServer``: a ``uvicorn`` subprocess). If the CLI is
then SIGKILLed (OOM killer, preempted node, ``kill -9``) that uvicorn is orphaned for good,
holding its port and ~200 MB. :func:`owned_ephemeral_server` starts the same uvicorn command
itself, with ``PR_SET_PDEATHSIG`` so the kernel sends it SIGTERM when we die, and points this
process at it.

Prefect reads its settings once, at ``import prefect`` (``prefect.context.GLOBAL_SETTINGS_CONTEXT``),
so setting ``os.environ`` afterwards is not enough: the URL is also applied to the current and the
process-global settings context (as ``prefect.testing.utilities.prefect_test_harness`` does), and
to the environment for child processes (torchrun ranks) that import prefect themselves.
"""

from __future__ import annotations

import contextlib
import inspect
import os
import secrets
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from rubricem_core.processes import die_with_parent

API_URL_ENV = "PREFECT_API_URL"
CLIENT_AUTH_ENV = "PREFECT_API_AUTH_STRING"  # what a client sends (basic auth)
SERVER_AUTH_ENV = "PREFECT_SERVER_API_AUTH_STRING"  # what the server demands
STARTUP_TIMEOUT_ENV = "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS"
DEFAULT_STARTUP_TIMEOUT_S = 120.0
_STARTUP_FAILURE = 3  # uvicorn's exit code when it could not start, e.g. the port was taken meanwhile
_PORT_ATTEMPTS = 5
_STOP_GRACE_S = 5.0
_TAIL_BYTES = 4000
# What SubprocessASGIServer._run_uvicorn_command adds: no UI, ephemeral + final server settings.
_SERVER_ENV = {"PREFECT_UI_ENABLED": "0", "PREFECT__SERVER_EPHEMERAL": "1", "PREFECT__SERVER_FINAL": "1"}


@dataclass
class OwnedServer:
    """A running uvicorn serving the Prefect API on 127.0.0.1."""

    process: subprocess.Popen[bytes]
    port: int
    log: IO[bytes]
    auth_string: str | None = None  # basic auth the server demands ("rubricem:<random>"), held in memory only

    @property
    def pid(self) -> int:
        return self.process.pid

    @property
    def api_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/api"


@contextmanager
def owned_ephemeral_server(log_path: str | os.PathLike[str] | None = None) -> Iterator[OwnedServer | None]:
    """Run the block against a Prefect API server owned by (and dying with) this process.

    Does nothing and yields None when an API URL is configured (``PREFECT_API_URL`` in the
    environment, or a Prefect profile/settings context that sets one). Otherwise starts the
    server, sets ``PREFECT_API_URL`` for this process and its children, yields the
    :class:`OwnedServer`, and on exit drains Prefect's log/event workers, stops the server
    (SIGTERM, then SIGKILL after 5 s) and restores the environment and settings.

    The server's stdout/stderr go to ``log_path`` (appended) or to an anonymous temp file, so
    they never block it; a failed start raises RuntimeError with the tail of that output.
    Enter it from the main thread: the death signal follows the thread that spawned the server.
    """
    if os.environ.get(API_URL_ENV) or _configured_api_url():
        yield None
        return
    with _open_log(log_path) as log:
        server = start_server(log, startup_timeout())
        try:
            with _api_url_in_process(server.api_url, server.auth_string):
                try:
                    yield server
                finally:
                    _drain_prefect_workers()  # before the server goes, or pending logs hit a closed port
        finally:
            stop_server(server.process)


def startup_timeout() -> float:
    """Seconds to wait for the server's health check: the Prefect env setting, else 120."""
    raw = os.environ.get(STARTUP_TIMEOUT_ENV, "").strip()
    try:
        return float(raw) if raw else DEFAULT_STARTUP_TIMEOUT_S
    except ValueError:
        raise ValueError(f"{STARTUP_TIMEOUT_ENV}={raw!r} is not a number of seconds") from None


def start_server(log: IO[bytes], timeout: float) -> OwnedServer:
    """Start uvicorn on a free port and wait until ``/api/health`` answers 200.

    Retries on a new port when uvicorn exits with its startup-failure code (port taken between
    choosing and binding); raises RuntimeError with the server's output tail on any other early
    exit or after ``timeout`` seconds.
    """
    # Another local user (or a web page's request to 127.0.0.1) must not read the flow runs' parameters or
    # start runs: the server demands a random basic-auth string, which only this process and its children hold.
    auth = f"rubricem:{secrets.token_urlsafe(24)}"
    env = {**_server_env(), SERVER_AUTH_ENV: auth}
    deadline = time.monotonic() + timeout
    for _ in range(_PORT_ATTEMPTS):
        port = _free_port()
        process = _spawn(port, env, log)
        try:
            if _wait_healthy(process, port, deadline, log):
                return OwnedServer(process=process, port=port, log=log, auth_string=auth)
        except BaseException:
            stop_server(process)
            raise
    raise RuntimeError(
        f"Prefect API server failed to start on {_PORT_ATTEMPTS} ports in a row "
        f"(uvicorn exit code {_STARTUP_FAILURE}); output:\n{_tail(log)}"
    )


def stop_server(process: subprocess.Popen[bytes]) -> None:
    """SIGTERM, wait up to 5 s for uvicorn's graceful shutdown, then SIGKILL; always reaps."""
    if process.poll() is not None:
        return
    process.terminate()
    try:
        process.wait(timeout=_STOP_GRACE_S)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def _configured_api_url() -> str | None:
    """The API URL Prefect's settings hold without the env var (a profile, a settings context)."""
    from prefect.settings import get_current_settings

    return get_current_settings().api.url or None


def _server_env() -> dict[str, str]:
    # Same environment Prefect gives its own ephemeral server, so the database and other
    # settings (PREFECT_HOME, profile values) are the ones this process would have used.
    from prefect.settings import get_current_settings

    env = {**os.environ, **_SERVER_ENV, **get_current_settings().to_environment_variables(exclude_unset=True)}
    env.pop(API_URL_ENV, None)  # an empty value: the server itself needs none
    return env


def _uvicorn_args(port: int) -> list[str]:
    import prefect

    return [
        sys.executable, "-m", "uvicorn",
        "--app-dir", str(prefect.__module_path__.parent),
        "--factory", "prefect.server.api.server:create_app",
        "--host", "127.0.0.1",
        "--port", str(port),
        "--log-level", "error",
        "--lifespan", "on",
    ]  # fmt: skip


def _spawn(port: int, env: dict[str, str], log: IO[bytes]) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        _uvicorn_args(port),
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=log,
        stderr=log,
        preexec_fn=die_with_parent(),
        # Own session: a Ctrl-C in the terminal reaches only the CLI, which can still report the
        # interrupted flow run to this server before stopping it.
        start_new_session=True,
    )


def _free_port() -> int:
    with contextlib.closing(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _wait_healthy(process: subprocess.Popen[bytes], port: int, deadline: float, log: IO[bytes]) -> bool:
    """True once healthy; False if uvicorn exited with its startup-failure code (retry)."""
    url = f"http://127.0.0.1:{port}/api/health"
    while True:
        code = process.poll()
        if code == _STARTUP_FAILURE:
            return False
        if code is not None:
            raise RuntimeError(f"Prefect API server exited with code {code} while starting; output:\n{_tail(log)}")
        if _health_ok(url):
            return True
        if time.monotonic() >= deadline:
            raise RuntimeError(
                f"Prefect API server on port {port} did not become healthy in time "
                f"(raise {STARTUP_TIMEOUT_ENV}); output:\n{_tail(log)}"
            )
        time.sleep(0.1)


def _health_ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            return response.status == 200
    except (urllib.error.URLError, OSError, ValueError):
        return False


@contextmanager
def _open_log(log_path: str | os.PathLike[str] | None) -> Iterator[IO[bytes]]:
    if log_path is None:
        log: IO[bytes] = tempfile.TemporaryFile(prefix="rubricem-prefect-server-")
    else:
        Path(log_path).parent.mkdir(parents=True, exist_ok=True)
        log = open(log_path, "a+b")
    with log:
        yield log


def _tail(log: IO[bytes]) -> str:
    try:
        log.flush()
        size = log.seek(0, os.SEEK_END)
        log.seek(max(0, size - _TAIL_BYTES))
        text = log.read().decode(errors="replace").strip()
    except (OSError, ValueError):
        return "(server output unavailable)"
    return text or "(no output)"


@contextmanager
def _api_url_in_process(url: str, auth_string: str | None = None) -> Iterator[None]:
    """Point this process (env, current and global Prefect settings) at ``url``, with the basic-auth string
    the server demands; restore after."""
    import prefect.context
    from prefect.settings import PREFECT_API_AUTH_STRING, PREFECT_API_URL, temporary_settings

    previous = {name: os.environ.get(name) for name in (API_URL_ENV, CLIENT_AUTH_ENV)}
    os.environ[API_URL_ENV] = url  # for children that import prefect afresh
    updates: dict[Any, Any] = {PREFECT_API_URL: url}
    if auth_string is not None:
        os.environ[CLIENT_AUTH_ENV] = auth_string
        updates[PREFECT_API_AUTH_STRING] = auth_string
    swap = getattr(prefect.context, "_temporary_global_settings_context", None)
    try:
        with temporary_settings(updates=updates):
            # Threads Prefect starts itself (log and event workers) read the process-global
            # context, not this thread's; prefect_test_harness swaps it the same way.
            with swap(prefect.context.get_settings_context()) if swap else _refreshed_global(prefect.context):
                yield
    finally:
        for name, value in previous.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        if swap is None:
            prefect.context.refresh_global_settings_context()


@contextmanager
def _refreshed_global(context_module) -> Iterator[None]:
    # Prefect versions without the private swap: rebuild the global context from the env
    # (now holding the URL); the caller rebuilds it again after restoring the env.
    context_module.refresh_global_settings_context()
    yield


def _drain_prefect_workers() -> None:
    """Flush Prefect's pending API logs and events (as prefect_test_harness does)."""
    try:
        from prefect.events.worker import EventsWorker
        from prefect.logging.handlers import APILogWorker
        from prefect.utilities.asyncutils import run_coro_as_sync
    except ImportError:
        return

    async def drain() -> None:
        for call in (APILogWorker.instance().drain, EventsWorker.drain_all):
            try:
                result = call()
                if inspect.isawaitable(result):
                    await result
            except RuntimeError:  # worker never started
                pass

    try:
        run_coro_as_sync(drain())
    except Exception:  # noqa: BLE001 - best effort: never mask the flow's own outcome
        pass
