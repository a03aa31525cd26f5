"""A two-"node" Ray cluster on this machine, and a flow run as its driver in a process of its own.

    with two_node_cluster(tmp_dir) as env:          # `ray start --head` + `ray start --address`
        result, out = run_flow_driver("flows.rl:rl", env, run_dir=..., profile="tiny", overrides={...})

The nodes are the bare-metal recipe of docs/distributed.md shrunk onto one machine: a head and a worker
node of 1 CPU each (so 2 trainer ranks' placement group must span both), token authentication with a token
of their own, never ~/.ray's, and every file of Ray's under ``--temp-dir`` (a short directory in /tmp: Ray's
socket paths have at most 107 bytes). They listen on two loopback addresses, 127.0.0.2 and 127.0.0.3 (Ray's
CLI turns 127.0.0.1 into the machine's routable address, and two addresses tell the nodes apart in the
ranks' placement). Teardown kills the two ``ray start --block`` process groups this fixture started (never
``ray stop``, which stops every Ray on the machine). The nodes' logs are in ``root``.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from rubricem_core.processes import free_port

REPO = Path(__file__).resolve().parents[1]
RAY = Path(sys.executable).parent / "ray"
HEAD_IP, WORKER_IP = "127.0.0.2", "127.0.0.3"
STARTED = "Ray runtime started"
RESULT = "@@flow-result "


def _wait_for(log: Path, proc: subprocess.Popen, timeout_s: float = 180.0) -> None:
    deadline = time.monotonic() + timeout_s
    while STARTED not in (log.read_text() if log.exists() else ""):
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"`ray start` did not come up (exit {proc.poll()}):\n{log.read_text()[-3000:]}")
        time.sleep(0.5)


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # the node's gcs/raylet/agents; its workers die with the raylet
    except ProcessLookupError:
        pass
    proc.wait(timeout=30)


@contextmanager
def two_node_cluster(root: Path) -> Iterator[dict[str, str]]:
    """Start the cluster; yield the environment of a driver that joins it (``RAY_ADDRESS``, the token)."""
    root.mkdir(parents=True, exist_ok=True)
    # Ray's sockets live under --temp-dir, and a socket path has at most 107 bytes: pytest's are too deep
    short = Path(tempfile.mkdtemp(prefix="ray-", dir="/tmp"))
    token = short / "auth_token"
    token.write_text(secrets.token_hex(32))
    token.chmod(0o600)
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RAY_AUTH_TOKEN")}
    env.update(
        {
            "RAY_AUTH_MODE": "token",
            "RAY_AUTH_TOKEN_PATH": str(token),
            "RAY_USAGE_STATS_ENABLED": "0",
            "OMP_NUM_THREADS": "1",
            # no Ray OOM killer: on a shared test machine it kills the ranks for other processes' memory
            "RAY_memory_monitor_refresh_ms": "0",
            # every node runs this checkout's code (the workers' imports), as an installed package would
            "PYTHONPATH": os.pathsep.join([str(REPO), *filter(None, env.get("PYTHONPATH", "").split(os.pathsep))]),
        }
    )
    port = free_port()
    common = ["--num-cpus", "1", "--num-gpus", "0", "--temp-dir", str(short), "--block"]
    nodes: list[subprocess.Popen] = []
    try:
        for name, args in (
            (
                "head",
                [
                    *("--head", "--node-ip-address", HEAD_IP, "--port", str(port), "--resources", '{"node_a": 1}'),
                    *("--disable-usage-stats", "--include-dashboard", "false"),
                ],
            ),
            (
                "worker",
                ["--address", f"{HEAD_IP}:{port}", "--node-ip-address", WORKER_IP, "--resources", '{"node_b": 1}'],
            ),
        ):
            log = root / f"{name}.log"
            with log.open("w") as out:
                nodes.append(
                    subprocess.Popen(
                        [str(RAY), "start", *args, *common],
                        stdout=out,
                        stderr=subprocess.STDOUT,
                        env=env,
                        cwd=REPO,
                        start_new_session=True,  # its own process group: teardown kills exactly this node
                    )
                )
            _wait_for(log, nodes[-1])
        yield {**env, "RAY_ADDRESS": f"{HEAD_IP}:{port}"}
    finally:
        for proc in reversed(nodes):
            _kill_group(proc)
        shutil.rmtree(short, ignore_errors=True)


def run_flow_driver(target: str, env: dict[str, str], timeout_s: float = 600, **kwargs: Any) -> tuple[Any, str]:
    """``target(**kwargs)`` (``"module:flow"``) in a fresh interpreter with ``env`` (the cluster's driver, not
    this process, whose own local Ray other tests may have started): its result (through JSON) and its
    output, with the INFO log of rubricem_core. Raises with that output when the flow fails."""
    from prefect.settings import PREFECT_API_URL

    module, _, name = target.partition(":")
    script = (
        f"import json, logging, sys\nRESULT = {RESULT!r}\n"
        "logging.basicConfig(level=logging.WARNING, stream=sys.stderr)\n"
        "logging.getLogger('rubricem_core').setLevel(logging.INFO)\n"
        f"from {module} import {name}\n"
        f"print(RESULT + json.dumps({name}(**json.loads(sys.argv[1])), default=str))\n"
    )
    api = PREFECT_API_URL.value()  # the test's Prefect server, where the flow run is recorded
    proc = subprocess.run(
        [sys.executable, "-c", script, json.dumps(kwargs)],
        env={**env, **({"PREFECT_API_URL": api} if api else {})},
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )
    out = proc.stdout + proc.stderr
    if proc.returncode != 0:
        raise RuntimeError(f"{target} failed (exit {proc.returncode}):\n{out[-6000:]}")
    results = [line[len(RESULT) :] for line in proc.stdout.splitlines() if line.startswith(RESULT)]
    return json.loads(results[-1]), out
