"""Start trainer ranks with torchrun from a running process (a Prefect task), and stream them back.

    spec = LaunchSpec(nproc_per_node=8)
    result = run_ranks(spec, "rubricem_core.distributed.sft_worker", ["--spec", path],
                       on_line=logger.info, on_metrics=tracker.log_metrics)

The ranks' stdout and stderr come back line by line (``on_line``); a line that rank 0 printed with
``emit_metrics`` is parsed and handed to ``on_metrics`` instead, so metrics reach MLflow while the ranks
train. A rank that fails makes torchrun stop the others and exit non-zero; ``run_ranks`` then raises
``RankFailure`` with the end of the output, which holds the failing rank's traceback (the workers wrap
their entry point in torch.distributed.elastic's ``record``). A cancelled task (KeyboardInterrupt,
an exception in a callback) terminates the whole launcher process group, ranks included.
"""

from __future__ import annotations

import atexit
import collections
import json
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

METRICS_PREFIX = "@@rubricem-metrics "
TAIL_LINES = 120


class RankFailure(RuntimeError):
    """The trainer ranks exited non-zero; the message holds the end of their output."""


@dataclass(frozen=True)
class LaunchSpec:
    nproc_per_node: int
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int | None = None  # None: torchrun --standalone picks a free port (one node only)
    rdzv_backend: str = "static"  # static: node_rank 0 holds ranks 0..nproc-1; c10d: elastic rendezvous
    rdzv_id: str = "rubricem"
    devices: tuple[int, ...] | None = None  # CUDA_VISIBLE_DEVICES of the ranks (None: inherited)
    timeout_s: float = 1800.0  # how long a collective may wait for a slow rank

    @property
    def world_size(self) -> int:
        return self.nproc_per_node * self.nnodes


def torchrun_command(spec: LaunchSpec, module: str, args: Sequence[str]) -> list[str]:
    """``python -m torch.distributed.run … -m module args`` for ``spec`` (a ``*.py`` path runs as a script)."""
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc_per_node={spec.nproc_per_node}",
        f"--nnodes={spec.nnodes}",
    ]
    if spec.nnodes == 1 and spec.master_port is None:
        cmd.append("--standalone")
    elif spec.rdzv_backend == "c10d":
        if spec.master_port is None:
            raise ValueError("a c10d rendezvous needs distributed.master_port")
        cmd += [
            "--rdzv_backend=c10d",
            f"--rdzv_endpoint={spec.master_addr}:{spec.master_port}",
            f"--rdzv_id={spec.rdzv_id}",
        ]
    else:
        if spec.master_port is None:
            raise ValueError("several nodes need distributed.master_port (and master_addr: node 0's address)")
        cmd += [
            f"--node_rank={spec.node_rank}",
            f"--master_addr={spec.master_addr}",
            f"--master_port={spec.master_port}",
        ]
    target = [module] if module.endswith(".py") else ["-m", module]
    return [*cmd, *target, *args]


def rank_environment(spec: LaunchSpec, base: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ if base is None else base)
    if spec.devices is not None:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(str(d) for d in spec.devices)
    env.setdefault("OMP_NUM_THREADS", "1")  # torchrun's default too; said here so it is not a warning
    env["RUBRICEM_COLLECTIVE_TIMEOUT_S"] = str(spec.timeout_s)  # read by ranks.init_process_group
    env["PYTHONUNBUFFERED"] = "1"  # lines arrive as they are printed
    return env


def emit_metrics(metrics: dict[str, float], step: int) -> None:
    """Print one metrics line for the launching process (call it on rank 0 only)."""
    print(METRICS_PREFIX + json.dumps({"step": step, "metrics": metrics}), flush=True)


class RankGroup:
    """torchrun and its ranks as a child process group whose output a thread reads line by line."""

    def __init__(
        self,
        spec: LaunchSpec,
        module: str,
        args: Sequence[str],
        env: dict[str, str] | None = None,
        cwd: str | None = None,
    ) -> None:
        self.spec, self.module = spec, module
        self.tail: collections.deque[str] = collections.deque(maxlen=TAIL_LINES)
        self._lines: queue.Queue[str] = queue.Queue()
        self._metrics: queue.Queue[tuple[dict[str, float], int]] = queue.Queue()
        self.proc = subprocess.Popen(
            torchrun_command(spec, module, args),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            bufsize=1,
            env={**rank_environment(spec), **(env or {})},
            cwd=cwd,
            start_new_session=True,
        )
        self._reader = threading.Thread(target=self._read, name=f"ranks-{module}", daemon=True)
        self._reader.start()
        atexit.register(self.stop)  # never leave ranks behind a process that exits

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for raw in self.proc.stdout:
            line = raw.rstrip("\n")
            if line.startswith(METRICS_PREFIX):
                record = json.loads(line[len(METRICS_PREFIX) :])
                self._metrics.put((record["metrics"], int(record["step"])))
                continue
            self.tail.append(line)
            self._lines.put(line)

    def drain(
        self,
        on_line: Callable[[str], None] = lambda line: None,
        on_metrics: Callable[[dict[str, float], int], None] | None = None,
    ) -> None:
        """Hand over what the ranks printed since the last call."""
        while not self._lines.empty():
            on_line(self._lines.get_nowait())
        while not self._metrics.empty():
            metrics, step = self._metrics.get_nowait()
            if on_metrics is not None:
                on_metrics(metrics, step)

    def poll(self) -> int | None:
        return self.proc.poll()

    def failure(self, rc: int) -> RankFailure:
        self._reader.join(timeout=10)  # the last lines hold the traceback
        return RankFailure(
            f"{self.spec.world_size} trainer ranks of `{self.module}` failed (torchrun exit code {rc}); "
            f"last {len(self.tail)} lines of their output:\n" + "\n".join(self.tail)
        )

    def wait(
        self,
        on_line: Callable[[str], None] = lambda line: None,
        on_metrics: Callable[[dict[str, float], int], None] | None = None,
        timeout: float | None = None,
    ) -> None:
        """Until the ranks exit (streaming their output); RankFailure when they exit non-zero."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.proc.poll() is None:
            self.drain(on_line, on_metrics)
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"the ranks of `{self.module}` did not exit within {timeout:.0f}s")
            time.sleep(0.05)
        self._reader.join()
        self.drain(on_line, on_metrics)
        if self.proc.returncode != 0:
            raise self.failure(self.proc.returncode)

    def stop(self) -> None:
        """Terminate torchrun and its ranks (their own process group), then kill what is left."""
        stop_process_group(self.proc)


def free_port() -> int:
    """A TCP port on loopback that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def stop_process_group(proc: subprocess.Popen, grace_s: float = 30.0) -> None:
    """SIGTERM a child started with ``start_new_session=True`` and everything it started, SIGKILL what
    is left after ``grace_s`` (idempotent)."""
    if proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    except ProcessLookupError:
        pass


def end_launch_file(path: Path) -> None:
    """Mark a launch file as ended (its ranks have exited), so no node joins it later."""
    from rubricem_core.store import atomic_write_text

    try:
        data = json.loads(path.read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return
    atomic_write_text(path, json.dumps({**data, "ended": True}))


def wait_for_launch_file(path: Path, newer_than: float, wait_s: float, launch_id: str | None = None) -> dict:
    """The launch file node 0's flow writes for a launch it is starting; TimeoutError naming the file after
    ``wait_s`` seconds. One that has ended is a past launch's. With ``launch_id`` a file counts if and only
    if it carries that id, whatever its age; without, if it is no older than ``newer_than``."""
    deadline = time.monotonic() + wait_s
    while True:
        data = _current_launch(path, newer_than, launch_id)
        if data is not None:
            return data
        if time.monotonic() > deadline:
            which = f"of launch id {launch_id!r}" if launch_id is not None else "newer than this command"
            raise TimeoutError(
                f"no launch file {path} {which} appeared within {wait_s:.0f}s: "
                "start the flow on node 0 (distributed.node_rank 0)"
            )
        time.sleep(0.5)


def _current_launch(path: Path, newer_than: float, launch_id: str | None) -> dict | None:
    """The launch file's content if it is the awaited launch's and has not ended, else None."""
    try:
        # the time rule reads the mtime first: an old file is not even parsed
        if launch_id is None and path.stat().st_mtime < newer_than:
            return None
        data = json.loads(path.read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None  # not written yet
    if launch_id is not None and data.get("launch_id") != launch_id:
        return None  # another Job's launch (or one written without an id)
    return None if data.get("ended") else data


def run_ranks(
    spec: LaunchSpec,
    module: str,
    args: Sequence[str],
    on_line: Callable[[str], None] = lambda line: None,
    on_metrics: Callable[[dict[str, float], int], None] | None = None,
    cwd: str | None = None,
    env: dict[str, str] | None = None,
) -> None:
    """Run the ranks to completion; raise RankFailure (with the output's tail) when they fail."""
    group = RankGroup(spec, module, args, env=env, cwd=cwd)
    try:
        group.wait(on_line, on_metrics)
    except BaseException:
        group.stop()
        raise
