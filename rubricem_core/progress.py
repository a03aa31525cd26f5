"""Progress lines with totals, rate and time left, for the run log of long loops (teacher rounds, SFT
steps, rollouts, RL steps): "sft step 20/74 (27%), 3m 10s elapsed, ETA 8m 33s".

The ETA is linear in the work done so far: (elapsed / done) × (total − done); items of unequal cost (the
pipeline's stages) carry ``costs``, measured seconds of each, and the ETA is then the remaining items'
costs scaled by how fast the done ones went (before the first is done: the costs as they are). Lines are throttled
(`every_s`) so a loop of thousands of items writes a few lines, and the last item always writes one.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable


def format_seconds(seconds: float) -> str:
    """3725 → "1h 2m", 190 → "3m 10s", 4.2 → "4s"."""
    if not math.isfinite(seconds) or seconds < 0:
        return "?"
    s = int(round(seconds))
    if s >= 3600:
        return f"{s // 3600}h {s % 3600 // 60}m"
    if s >= 60:
        return f"{s // 60}m {s % 60:02d}s"
    return f"{s}s"


def eta_seconds(done: int, total: int, elapsed: float) -> float:
    """Time left if the remaining items take as long as the done ones did (NaN before the first)."""
    if done <= 0 or total <= 0:
        return float("nan")
    return elapsed / done * max(0, total - done)


def weighted_eta(costs: list[float], start: int, done: int, elapsed: float) -> float:
    """Seconds left when item i costs ``costs[i]``: the rest's costs × (elapsed / the done items' costs)."""
    spent = sum(costs[start:done])
    rest = sum(costs[done:])
    if spent <= 0:
        return rest if done == start else float("nan")
    return rest * elapsed / spent


class Progress:
    """Counts ``done`` of ``total`` items of one loop and says so through ``emit`` (a logger's info).

    ``update(done, detail)`` may be called from several threads (concurrent LLM calls)."""

    def __init__(
        self,
        what: str,
        total: int,
        emit: Callable[[str], None],
        every_s: float = 10.0,
        start_done: int = 0,
        clock: Callable[[], float] = time.monotonic,
        costs: list[float] | None = None,
    ) -> None:
        if costs is not None and len(costs) != int(total):
            raise ValueError(f"Progress: {len(costs)} costs for {total} items")
        self.costs = costs
        self.what = what
        self.total = int(total)
        self.emit = emit
        self.every_s = every_s
        self.clock = clock
        self.start_done = start_done  # resumed items are not part of the rate
        self.t0 = clock()
        self._last = -math.inf
        self.done = start_done
        self._lock = threading.Lock()

    def line(self, done: int, detail: str = "") -> str:
        elapsed = self.clock() - self.t0
        pct = f" ({100 * done / self.total:.0f}%)" if self.total > 0 else ""
        left = eta_seconds(done - self.start_done, self.total - self.start_done, elapsed)
        if self.costs is not None:
            left = weighted_eta(self.costs, self.start_done, done, elapsed)
        timing = f"{format_seconds(elapsed)} elapsed"
        if done < self.total:
            timing += f", ETA {format_seconds(left)}"
        return f"{self.what} {done}/{self.total}{pct}{': ' + detail if detail else ''} — {timing}"

    def tick(self, *_: object) -> None:
        """One more item done (usable directly as a per-result callback)."""
        with self._lock:
            self.done += 1
            done = self.done
        self.update(done)

    def update(self, done: int, detail: str = "", force: bool = False) -> bool:
        """Emit a line when ``every_s`` has passed since the last one, at the end, or when forced;
        returns whether it emitted."""
        with self._lock:
            now = self.clock()
            if not (force or done >= self.total or now - self._last >= self.every_s):
                return False
            self._last = now
            text = self.line(done, detail)
        self.emit(text)
        return True
