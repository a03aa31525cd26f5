"""A judge that streams: each query's group is judged as soon as it has finished sampling.

    stream = StreamingJudge(judge, buffers, step)
    engine.on_group_done = lambda i, trajs: stream.submit(query_of(i), rollouts_of(i, trajs), index=i, offset=i * n)
    engine.generate(requests, tools)                  # groups are judged while the others still sample
    groups = stream.collect(plan.query_ids)           # GroupJudgment per query, in plan order

Every group runs ``judge_group`` (rubric generation, buffer update, scoring, stage rewards, pruning) as
its own task on one event loop in a background thread, so one group's scoring calls follow its own
generation call without waiting for the other groups. All calls of the step share one limit
(``judge.settings.max_concurrency``), as in ``judge_step``. A group changes only its own query's buffer
and its call ids are those of the batch judge (``index``: the query's place in the step, ``offset``:
the step-wide index of its first rollout), so the results, the buffers and the usage (added to
``judge.usage`` in plan order by ``collect``) are the batch judge's whatever order the groups finish in.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import time
from collections.abc import Sequence
from typing import Any

from rubricem_core.judge.buffer import RubricBuffer
from rubricem_core.judge.llm_judge import GroupJudgment, LLMJudge, collect_usage, judge_group
from rubricem_core.judge.types import JudgeError, JudgeQuery, JudgeRollout


class StreamingJudge:
    """Judges the groups of one step as they are submitted; ``collect`` waits for them, ``close`` stops."""

    def __init__(self, judge: LLMJudge, buffers: dict[str, RubricBuffer], step: int, generate: bool = True) -> None:
        self.judge = judge
        self.buffers = buffers  # changed in place, one query per group
        self.step = step
        self.generate = generate
        self.futures: dict[str, concurrent.futures.Future[GroupJudgment]] = {}
        self.started: float | None = None  # perf_counter of the first submit
        self.finished: float | None = None  # perf_counter when the last submitted group was done
        self._lock = threading.Lock()
        self._collected = False
        self._limit = asyncio.Semaphore(judge.settings.max_concurrency)  # bound to the loop on first use
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name=f"judge-stream-{step}", daemon=True)
        self._thread.start()

    def submit(
        self, query: JudgeQuery, rollouts: Sequence[JudgeRollout], *, index: int, offset: int
    ) -> concurrent.futures.Future[GroupJudgment]:
        """Start judging one query's finished group; returns the future of its ``GroupJudgment``."""
        qid = query.query_id
        with self._lock:
            if self._collected or self._loop.is_closed():
                raise JudgeError(f"StreamingJudge of step {self.step}: submit of {qid!r} after collect or close")
            if qid in self.futures:
                raise JudgeError(f"StreamingJudge of step {self.step}: group of {qid!r} submitted twice")
            if qid not in self.buffers:
                raise JudgeError(f"no RubricBuffer for query {qid!r}")
            if self.started is None:
                self.started = time.perf_counter()
            coroutine = judge_group(
                self.judge,
                query,
                list(rollouts),
                self.buffers[qid],
                self.step,
                index=index,
                offset=offset,
                generate=self.generate,
                limit=self._limit,
            )
            future = asyncio.run_coroutine_threadsafe(coroutine, self._loop)
            self.futures[qid] = future
        future.add_done_callback(self._done)
        return future

    def _done(self, _: Any) -> None:
        with self._lock:
            if all(f.done() for f in self.futures.values()):
                self.finished = time.perf_counter()

    @property
    def seconds(self) -> float:
        """Wall time from the first submit until the last submitted group was judged (0 before)."""
        if self.started is None or self.finished is None:
            return 0.0
        return self.finished - self.started

    def collect(self, query_ids: Sequence[str], timeout_s: float | None = None) -> list[GroupJudgment]:
        """Every group's judgment in ``query_ids`` order (waiting for those still running), their calls
        added to ``judge.usage`` in that order; the stream is closed. A group's exception is raised here."""
        with self._lock:
            if self._collected:
                raise JudgeError(f"StreamingJudge of step {self.step}: collected twice")
            missing = [qid for qid in query_ids if qid not in self.futures]
            extra = sorted(set(self.futures) - set(query_ids))
        if missing or extra:
            self.close()
            raise JudgeError(
                f"StreamingJudge of step {self.step}: groups not submitted {missing[:5]}, not asked for {extra[:5]}"
            )
        try:
            out = [self.futures[qid].result(timeout=timeout_s) for qid in query_ids]
        finally:
            self.close()
        self._collected = True
        collect_usage(self.judge, out)
        return out

    def close(self) -> None:
        """Cancel what still runs and stop the loop thread (idempotent); buffers of cancelled groups may be
        half changed, so their owner must rebuild them."""
        if self._loop.is_closed():
            return

        async def cancel_all() -> None:
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        if self._thread.is_alive():
            asyncio.run_coroutine_threadsafe(cancel_all(), self._loop).result()
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join()
        with self._lock:
            self._loop.close()

    def __enter__(self) -> StreamingJudge:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
