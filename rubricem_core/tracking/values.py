"""Params, tags and keys in the shapes MLflow accepts (clipped, cleaned, never a secret), retries on a busy
SQLite store, and which child runs this process holds open."""

from __future__ import annotations

import json
import logging
import re
import threading
import time
from collections import Counter
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

from rubricem_core.redact import is_secret_name, redact_text

if TYPE_CHECKING:
    from mlflow.entities import Run

from rubricem_core.tracking.links import _KEY_CHARS, ATTEMPT_TAG, MAX_KEY_CHARS

log = logging.getLogger(__name__)
T = TypeVar("T")


def _clip(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _param_text(value: Any) -> str:
    """A param or tag value as MLflow stores it, credentials of any URL in it masked."""
    if isinstance(value, str):
        return redact_text(value)
    if isinstance(value, (list, tuple, dict)):
        try:
            return redact_text(json.dumps(value, sort_keys=True, default=str))
        except (TypeError, ValueError):
            return redact_text(str(value))
    return str(value)


def _clean_key(name: str, kind: str) -> str:
    key = _KEY_CHARS.sub("_", str(name)).strip()
    if not key:
        raise ValueError(f"{kind} name {name!r} is empty")
    if len(key) > MAX_KEY_CHARS:
        raise ValueError(f"{kind} name {name[:60]!r}… is longer than MLflow's {MAX_KEY_CHARS} characters")
    return key


def _refuse_secrets(names: list[str], kind: str) -> None:
    secret = [n for n in names if is_secret_name(n)]
    if secret:
        raise ValueError(
            f"refusing to log {kind} {secret}: the name looks like a secret (key/token/secret/password); "
            "secrets come from the environment and are never tracked"
        )


def _is_locked_error(exc: Exception) -> bool:
    return "database is locked" in str(exc).lower() or "database table is locked" in str(exc).lower()


def _retry(fn: Callable[..., T], *args: Any, attempts: int = 10, **kwargs: Any) -> T:
    """SQLite allows one writer; concurrent tasks get "database is locked" and simply try again."""
    delay = 0.05
    for attempt in range(attempts):
        try:
            return fn(*args, **kwargs)
        except Exception as exc:
            if not _is_locked_error(exc) or attempt == attempts - 1:
                raise
            time.sleep(delay)
            delay = min(delay * 2, 1.0)
    raise AssertionError("unreachable")


def _safe_part_name(flow: str) -> str:
    return re.sub(r"[^A-Za-z0-9_\-]+", "_", flow).strip("_") or "flow"


_LIVE_RUNS: Counter[str] = Counter()  # child runs inside a child_run() block of this process
_LIVE_LOCK = threading.Lock()


def _claim_live(run_id: str) -> None:
    """Marks ``run_id`` as run by this process, so its RUNNING status is not taken for a crash."""
    with _LIVE_LOCK:
        _LIVE_RUNS[run_id] += 1


def _release_live(run_id: str) -> None:
    with _LIVE_LOCK:
        _LIVE_RUNS[run_id] -= 1
        if _LIVE_RUNS[run_id] <= 0:
            del _LIVE_RUNS[run_id]


def _is_live(run_id: str) -> bool:
    with _LIVE_LOCK:
        return _LIVE_RUNS[run_id] > 0


def _attempt_of(run: Run) -> int:
    try:
        return max(1, int(run.data.tags.get(ATTEMPT_TAG, "1")))
    except ValueError:
        return 1
