"""A wrapper that makes any Tool safe to call from rollout threads: timeout, concurrency limit,
cache, output validation and counters.

A rollout must never hang on, or be crashed by, a tool: a hung call returns an error block after
``timeout_s`` and the caller moves on (the call keeps running in its daemon thread and keeps its
concurrency slot until it really ends, so a stuck backend is not flooded with more requests).
Whatever a tool returns is checked before it reaches a trajectory — a non-string text, snippet ids
the scaffold cannot write or that are not in the output, a missing ``<tool_output>`` block — and
output beyond ``max_output_chars`` is cut at snippet boundaries so the block stays well-formed.
"""

from __future__ import annotations

import logging
import re
import threading
from dataclasses import dataclass

from rubricem_core.tools.base import Tool, ToolError, ToolResult, error_result
from rubricem_core.tools.cache import ToolCache

__all__ = ["RobustTool", "ToolStats", "cap_output", "validate_result"]

log = logging.getLogger(__name__)

_SAFE_ID = re.compile(r"^[A-Za-z0-9_.:\-/#]+$")  # scaffold._SAFE_ID_RE: what a snippet tag can carry
_SNIPPET = re.compile(r'<snippet id="([^"]*)">(.*?)</snippet>', re.DOTALL)
_OPEN, _CLOSE = "<tool_output>", "</tool_output>"
_ELLIPSIS = "…"


@dataclass
class ToolStats:
    calls: int = 0
    cache_hits: int = 0
    timeouts: int = 0
    errors: int = 0  # exceptions, garbage output, busy rejections and error results of the tool
    truncated: int = 0

    def as_dict(self) -> dict[str, int]:
        return dict(self.__dict__)


def validate_result(result: object, name: str) -> ToolResult:
    """Return ``result`` if it is a well-formed ToolResult, else an error ToolResult saying why."""
    if not isinstance(result, ToolResult):
        return error_result(f"tool {name!r} returned {type(result).__name__}, not a ToolResult")
    if not isinstance(result.text, str):
        return error_result(f"tool {name!r} returned non-string text ({type(result.text).__name__})")
    if result.error is not None and not isinstance(result.error, str):
        return error_result(f"tool {name!r} returned a non-string error ({type(result.error).__name__})")
    if not (result.text.startswith(_OPEN) and result.text.endswith(_CLOSE)):
        return error_result(f"tool {name!r} returned text that is not a <tool_output> block")
    ids = result.snippet_ids
    if not isinstance(ids, (list, tuple)) or not all(isinstance(i, str) for i in ids):
        return error_result(f"tool {name!r} returned snippet_ids that are not a list of strings")
    bad = [i for i in ids if not _SAFE_ID.match(i)]
    if bad:
        return error_result(f"tool {name!r} returned invalid snippet ids {bad[:3]!r}")
    in_text = {m.group(1) for m in _SNIPPET.finditer(result.text)}
    missing = [i for i in ids if i not in in_text]
    if missing:
        return error_result(f"tool {name!r} listed snippet ids {missing[:3]!r} that are not in its output")
    if not isinstance(ids, list):
        return ToolResult(result.text, list(ids), result.error)
    return result


def _cut(body: str, room: int) -> str:
    """``body`` shortened to ``room`` characters (ellipsis included), preferring a word boundary."""
    if len(body) <= room:
        return body
    keep = max(0, room - len(_ELLIPSIS))
    space = body.rfind(" ", 0, keep)
    if space > keep // 2:
        keep = space
    # a cut inside "&lt;" leaves "&l": harmless text, never a tag, because nothing is added
    return body[:keep] + _ELLIPSIS


def cap_output(result: ToolResult, max_chars: int) -> tuple[ToolResult, bool]:
    """Keep a valid result within ``max_chars``: drop whole trailing snippets, then shorten the first.

    Returns (result, whether it was cut). ``result`` must already have passed ``validate_result``.
    """
    text = result.text
    if len(text) <= max_chars:
        return result, False
    snippets = list(_SNIPPET.finditer(text))
    frame = len(_OPEN) + len(_CLOSE)
    if not snippets:  # an error block: shorten its message
        inner = text[len(_OPEN) : -len(_CLOSE)]
        if inner.startswith("<error>") and inner.endswith("</error>"):
            message = _cut(inner[7:-8], max(1, max_chars - frame - 15))
            return ToolResult(f"{_OPEN}<error>{message}</error>{_CLOSE}", [], result.error), True
        return ToolResult(_OPEN + _cut(inner, max(1, max_chars - frame)) + _CLOSE, [], result.error), True
    kept: list[str] = []
    used = frame
    for match in snippets:
        if used + len(match.group(0)) > max_chars:
            break
        kept.append(match.group(0))
        used += len(match.group(0))
    if not kept:  # even the first snippet is too long: keep its start
        first = snippets[0]
        head = f'<snippet id="{first.group(1)}">'
        room = max(1, max_chars - frame - len(head) - len("</snippet>"))
        kept = [head + _cut(first.group(2), room) + "</snippet>"]
    ids = [m.group(1) for m in _SNIPPET.finditer("".join(kept))]
    listed = [i for i in result.snippet_ids if i in set(ids)]
    return ToolResult(_OPEN + "".join(kept) + _CLOSE, listed, result.error), True


class RobustTool(Tool):
    """Wraps ``inner``: per-call timeout, shared concurrency limit, optional cache, validation, counters.

    ``fingerprint`` identifies the inner tool's version and configuration in cache keys; by default
    the inner tool's ``fingerprint`` attribute (web tools define one) or its class name.
    ``wait_timeout_s`` bounds the wait for a free slot (default: 10 × ``timeout_s``); a caller that
    gets none receives a "tool busy" error instead of queueing forever behind hung calls.
    """

    def __init__(
        self,
        inner: Tool,
        timeout_s: float = 30.0,
        max_concurrency: int = 8,
        cache: ToolCache | None = None,
        max_output_chars: int = 20_000,
        fingerprint: str | None = None,
        wait_timeout_s: float | None = None,
    ):
        if not isinstance(inner, Tool):
            raise ToolError(f"RobustTool wraps a Tool, got {type(inner).__name__}")
        if timeout_s <= 0:
            raise ToolError(f"RobustTool: timeout_s must be positive, got {timeout_s}")
        if max_concurrency < 1:
            raise ToolError(f"RobustTool: max_concurrency must be >= 1, got {max_concurrency}")
        if max_output_chars < 100:
            raise ToolError(f"RobustTool: max_output_chars must be >= 100, got {max_output_chars}")
        self.inner = inner
        self.spec = inner.spec
        self.timeout_s = float(timeout_s)
        self.wait_timeout_s = float(wait_timeout_s) if wait_timeout_s is not None else 10 * self.timeout_s
        self.max_concurrency = int(max_concurrency)
        self.cache = cache
        self.max_output_chars = int(max_output_chars)
        if fingerprint is None:
            own = getattr(inner, "fingerprint", None)
            fingerprint = own if isinstance(own, str) else f"{type(inner).__module__}.{type(inner).__qualname__}"
        self.fingerprint = fingerprint
        self._slots = threading.BoundedSemaphore(self.max_concurrency)
        self._lock = threading.Lock()
        self._stats = ToolStats()
        self._in_flight = 0

    # ---- counters -----------------------------------------------------------------------------
    def _count(self, field: str) -> None:
        with self._lock:
            setattr(self._stats, field, getattr(self._stats, field) + 1)

    def stats(self) -> dict[str, int]:
        """calls, cache_hits, timeouts, errors, truncated, and in_flight (running now, hung ones too)."""
        with self._lock:
            return {**self._stats.as_dict(), "in_flight": self._in_flight}

    # ---- the call -----------------------------------------------------------------------------
    def __call__(self, query: str) -> ToolResult:
        self._count("calls")
        name = self.spec.name
        if self.cache is not None:
            hit = self._cache_get(name, query)
            if hit is not None:
                self._count("cache_hits")
                observe = getattr(self.inner, "observe", None)
                if callable(observe):  # replay side effects a tool keeps (web search's id → URL map)
                    try:
                        observe(hit)
                    except Exception:  # a replay hook must not turn a good hit into a failure
                        log.warning("tool %r: observe() failed on a cached result", name, exc_info=True)
                return self._finish(hit)
        result = self._run(query)
        if self.cache is not None and result.ok:
            self._cache_put(name, query, result)
        return result

    def observe(self, result: ToolResult) -> None:
        """The inner tool's ``observe`` (web search: refill its id → URL book from an earlier output)."""
        observe = getattr(self.inner, "observe", None)
        if callable(observe):
            observe(result)

    def _finish(self, result: ToolResult) -> ToolResult:
        result, cut = cap_output(result, self.max_output_chars)
        if cut:
            self._count("truncated")
        return result

    def _run(self, query: str) -> ToolResult:
        name = self.spec.name
        if not self._slots.acquire(timeout=self.wait_timeout_s):
            self._count("errors")
            return error_result(
                f"tool {name!r} busy: {self.max_concurrency} calls in flight, no slot within {self.wait_timeout_s:g}s"
            )
        box: dict[str, object] = {}
        done = threading.Event()

        def work() -> None:
            try:
                box["result"] = self.inner(query)
            except BaseException as exc:  # noqa: BLE001 — reported to the caller as an error block
                box["exc"] = exc
            finally:
                with self._lock:
                    self._in_flight -= 1
                self._slots.release()  # only now: a hung call keeps its slot until it really ends
                done.set()

        with self._lock:
            self._in_flight += 1
        worker = threading.Thread(target=work, name=f"tool-{name}", daemon=True)
        try:
            worker.start()
        except RuntimeError as exc:  # cannot start a thread (resource limits)
            with self._lock:
                self._in_flight -= 1
            self._slots.release()
            self._count("errors")
            return error_result(f"tool {name!r} failed: {exc}")
        if not done.wait(self.timeout_s):
            self._count("timeouts")
            return error_result(f"tool {name!r} timed out after {self.timeout_s:g}s")
        if "exc" in box:
            raised = box["exc"]
            self._count("errors")
            return error_result(f"tool {name!r} failed: {type(raised).__name__}: {raised}")
        result = validate_result(box.get("result"), name)
        if not result.ok:
            self._count("errors")
        return self._finish(result)

    def _cache_get(self, name: str, query: str) -> ToolResult | None:
        if self.cache is None:
            return None
        try:
            return self.cache.get(name, query, self.fingerprint)
        except Exception:  # a broken cache degrades to calling the tool, never to a failed call
            log.warning("tool %r: cache lookup failed; calling the tool", name, exc_info=True)
            return None

    def _cache_put(self, name: str, query: str, result: ToolResult) -> None:
        if self.cache is None:
            return
        try:
            self.cache.put(name, query, self.fingerprint, result)
        except Exception:
            log.warning("tool %r: cache write failed", name, exc_info=True)

    def close(self) -> None:
        close = getattr(self.inner, "close", None)
        if callable(close):
            close()
