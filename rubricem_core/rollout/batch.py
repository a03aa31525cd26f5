"""What every engine's ``generate`` shares: rows from requests, tool selection, stop ids, progress, output.

An engine builds a :class:`RowBatch` (one :class:`~rubricem_core.rollout.rows.RowState` per sample,
in request order), runs its own loop over ``batch.live``, calls ``batch.report(...)`` whenever rows may
have finished, and returns ``batch.trajectories()``. ``report`` also fires the group hook once per
request, the moment its last row has finished (a streaming judge starts on that group then).
"""

from __future__ import annotations

import itertools
import random
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from rubricem_core.rollout.rows import RowState
from rubricem_core.rollout.types import RolloutError, RolloutRequest
from rubricem_core.tools.base import Tool, ToolEnv
from rubricem_core.trajectory import TokenTrajectory

ProgressHook = Callable[[int, int], None]  # (finished trajectories, all trajectories)
# (index of the request in the generate call, its n trajectories): fired once per request, when its last row ends
GroupHook = Callable[[int, list[TokenTrajectory]], None]


def allowed_tools(tool_names: Sequence[str] | None, tools: ToolEnv) -> dict[str, Tool]:
    """The env's tools the policy may call (None: all of them); a named tool the env lacks is an error."""
    if tool_names is None:
        return dict(tools.tools)
    missing = [name for name in tool_names if name not in tools.tools]
    if missing:
        raise RolloutError(f"tool_names {missing} are not in the ToolEnv (it has {sorted(tools.tools)})")
    return {name: tools.tools[name] for name in tool_names}


def default_stop_ids(tokenizer: Any, generation_eos: int | Iterable[int] | None) -> set[int]:
    """The tokenizer's eos plus the model's generation-config eos id(s)."""
    stops = set()
    eos = getattr(tokenizer, "eos_token_id", None)
    if eos is not None:
        stops.add(int(eos))
    if generation_eos is not None:
        stops.update(int(t) for t in ([generation_eos] if isinstance(generation_eos, int) else generation_eos))
    return stops


def row_rng(request: RolloutRequest, sample_index: int) -> random.Random:
    """A row's own sampler stream, seeded by (seed, request id, sample index): its draws do not
    depend on the other rows of the batch."""
    seed = request.sampling.seed
    return random.Random(f"{seed}:{request.request_id}:{sample_index}") if seed is not None else random.Random()


class RowBatch:
    """Every row of one ``generate`` call. Each sample gets its own ``ToolEnv`` (its own budget) over
    ``tools``; ``rng`` makes a row's sampler stream (None: the engine draws elsewhere)."""

    def __init__(
        self,
        requests: Sequence[RolloutRequest],
        tools: Mapping[str, Tool],
        tokenizer: Any,
        stop_token_ids: frozenset[int],
        *,
        vocab_size: int,
        rng: Callable[[RolloutRequest, int], random.Random] | None = None,
        max_model_len: int | None = None,
    ):
        self.requests = list(requests)
        self.rows: list[RowState] = [
            RowState.start(
                request,
                k,
                ToolEnv(tools, request.max_tool_calls),
                tokenizer,
                stop_token_ids,
                vocab_size=vocab_size,
                rng=rng(request, k) if rng is not None else None,
                max_model_len=max_model_len,
            )
            for request in self.requests
            for k in range(request.n)
        ]
        self.starts = [0, *itertools.accumulate(r.n for r in self.requests)][: len(self.requests)]  # first rows
        self._groups: dict[int, list[TokenTrajectory]] = {}  # finished requests' trajectories, built once
        self._lock = threading.Lock()  # report may come from several threads (rows finishing on their own)

    @property
    def live(self) -> list[RowState]:
        return [row for row in self.rows if not row.finished]

    def report(self, on_progress: ProgressHook | None, on_group_done: GroupHook | None = None) -> None:
        """Progress, then ``on_group_done`` for each request whose rows have all finished since the last
        report (in request order among those), each request once."""
        if on_progress is not None:
            on_progress(sum(row.finished for row in self.rows), len(self.rows))
        if on_group_done is None:
            return
        with self._lock:
            done = [i for i in range(len(self.requests)) if i not in self._groups and self._finished(i)]
            for i in done:
                self._groups[i] = self._group(i)
        for i in done:
            on_group_done(i, list(self._groups[i]))

    def _finished(self, i: int) -> bool:
        start = self.starts[i]
        return all(row.finished for row in self.rows[start : start + self.requests[i].n])

    def _group(self, i: int) -> list[TokenTrajectory]:
        start = self.starts[i]
        return [row.to_trajectory() for row in self.rows[start : start + self.requests[i].n]]

    def trajectories(self) -> list[list[TokenTrajectory]]:
        """``n`` trajectories per request, in request order (those a group hook saw, for its requests)."""
        with self._lock:
            return [list(self._groups[i]) if i in self._groups else self._group(i) for i in range(len(self.requests))]
