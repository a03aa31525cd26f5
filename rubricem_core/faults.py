"""Test-only fault injection: kill the process at a named point in the code.

``RUBRICEM_FAULT_POINT=<name>[:<count>]`` makes the ``count``-th call (default 1st) of
``fault_point(name)`` in this process send SIGKILL to itself — no cleanup, no ``finally``, no atexit,
exactly what an OOM killer or a preempted node does. Without the variable a call is one dict lookup.
``RUBRICEM_FAULT_ACTION=hang`` makes that call print ``fault point <name>: hanging (pid <pid>)`` and sleep
instead, until something outside kills the process (a test that kills a trainer rank mid-update).
The fault-tolerance tests (tests/test_fault_kill.py) use it to stop a run at a chosen point
deterministically and then check that a rerun completes with the same tables.
"""

from __future__ import annotations

import os
import signal
import threading
import time

ENV_VAR = "RUBRICEM_FAULT_POINT"
ACTION_VAR = "RUBRICEM_FAULT_ACTION"
ACTIONS = ("kill", "hang")

_counts: dict[str, int] = {}
_lock = threading.Lock()  # several task threads may pass the same point


def parse_spec(spec: str) -> tuple[str, int]:
    """``"name"`` → (name, 1); ``"name:3"`` → (name, 3). A malformed count is a ValueError naming the variable."""
    name, _, count = spec.strip().partition(":")
    if not name:
        raise ValueError(f"{ENV_VAR}={spec!r}: expected <name>[:<count>]")
    if not count:
        return name, 1
    try:
        n = int(count)
    except ValueError:
        raise ValueError(f"{ENV_VAR}={spec!r}: count {count!r} is not an integer") from None
    if n < 1:
        raise ValueError(f"{ENV_VAR}={spec!r}: count must be ≥ 1")
    return name, n


def fault_point(name: str) -> None:
    """SIGKILL this process (or hang it) when ``RUBRICEM_FAULT_POINT`` names ``name`` and this is the chosen
    call."""
    spec = os.environ.get(ENV_VAR)
    if not spec:
        return
    target, count = parse_spec(spec)
    if target != name:
        return
    with _lock:
        _counts[name] = _counts.get(name, 0) + 1
        hit = _counts[name] == count
    if not hit:
        return
    action = os.environ.get(ACTION_VAR) or "kill"
    if action not in ACTIONS:
        raise ValueError(f"{ACTION_VAR}={action!r}: expected one of {', '.join(ACTIONS)}")
    if action == "hang":
        print(f"fault point {name}: hanging (pid {os.getpid()})", flush=True)
        while True:
            time.sleep(3600)
    os.kill(os.getpid(), signal.SIGKILL)
