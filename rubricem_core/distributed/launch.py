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

import collections
import json
import os
import signal
import subprocess
import sys
from dataclasses import dataclass
from typing import Callable, Sequence

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

    @property
    def world_size(self) -> int:
        return self.nproc_per_node * self.nnodes


def torchrun_command(spec: LaunchSpec, module: str, args: Sequence[str]) -> list[str]:
    """``python -m torch.distributed.run … -m module args`` for ``spec`` (a ``*.py`` path runs as a script)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={spec.nproc_per_node}",
           f"--nnodes={spec.nnodes}"]
    if spec.nnodes == 1 and spec.master_port is None:
        cmd.append("--standalone")
    elif spec.rdzv_backend == "c10d":
        if spec.master_port is None:
            raise ValueError("a c10d rendezvous needs distributed.master_port")
        cmd += ["--rdzv_backend=c10d", f"--rdzv_endpoint={spec.master_addr}:{spec.master_port}",
                f"--rdzv_id={spec.rdzv_id}"]
    else:
        if spec.master_port is None:
            raise ValueError("several nodes need distributed.master_port (and master_addr: node 0's address)")
        cmd += [f"--node_rank={spec.node_rank}", f"--master_addr={spec.master_addr}",
                f"--master_port={spec.master_port}"]
    target = [module] if module.endswith(".py") else ["-m", module]
    return [*cmd, *target, *args]


def rank_environment(spec: LaunchSpec, base: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ if base is None else base)
    if spec.devices is not None:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(str(d) for d in spec.devices)
    env.setdefault("OMP_NUM_THREADS", "1")  # torchrun's default too; said here so it is not a warning
    env["PYTHONUNBUFFERED"] = "1"  # lines arrive as they are printed
    return env


def emit_metrics(metrics: dict[str, float], step: int) -> None:
    """Print one metrics line for the launching process (call it on rank 0 only)."""
    print(METRICS_PREFIX + json.dumps({"step": step, "metrics": metrics}), flush=True)


def run_ranks(
    spec: LaunchSpec,
    module: str,
    args: Sequence[str],
    on_line: Callable[[str], None] = lambda line: None,
    on_metrics: Callable[[dict[str, float], int], None] | None = None,
    cwd: str | None = None,
) -> None:
    """Run the ranks to completion; raise RankFailure (with the output's tail) when they fail."""
    cmd = torchrun_command(spec, module, args)
    tail: collections.deque[str] = collections.deque(maxlen=TAIL_LINES)
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1,
                            env=rank_environment(spec), cwd=cwd, start_new_session=True)
    try:
        assert proc.stdout is not None
        for raw in proc.stdout:
            line = raw.rstrip("\n")
            if line.startswith(METRICS_PREFIX):
                if on_metrics is not None:
                    record = json.loads(line[len(METRICS_PREFIX):])
                    on_metrics(record["metrics"], int(record["step"]))
                continue
            tail.append(line)
            on_line(line)
        rc = proc.wait()
    except BaseException:
        _stop(proc)
        raise
    if rc != 0:
        raise RankFailure(
            f"{spec.world_size} trainer ranks of `{module}` failed (torchrun exit code {rc}); "
            f"last {len(tail)} lines of their output:\n" + "\n".join(tail)
        )


def _stop(proc: subprocess.Popen) -> None:
    """Terminate torchrun and its ranks (their own process group), then kill what is left."""
    if proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    except ProcessLookupError:
        pass
