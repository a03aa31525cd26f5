"""Threads for the tests of thread safety and concurrency limits: run a body in N threads at once, and
count how many calls run at the same time."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager


def run_in_threads(work: Callable[[int], object], n: int) -> None:
    """``work(0)`` … ``work(n - 1)``, each in its own thread, all started before any is joined."""
    threads = [threading.Thread(target=work, args=(i,)) for i in range(n)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()


class PeakGauge:
    """The most calls inside ``running()`` at once: what a concurrency limit must bound."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._now = 0
        self.peak = 0

    @contextmanager
    def running(self) -> Iterator[None]:
        with self._lock:
            self._now += 1
            self.peak = max(self.peak, self._now)
        try:
            yield
        finally:
            with self._lock:
                self._now -= 1
