"""Tool interface shared by local and remote research tools, plus the per-trajectory environment.

A tool turns a query string into a ``ToolResult`` whose ``text`` is already the exact
``<tool_output>…</tool_output>`` block that gets appended to the trajectory (and tokenized once).
``ToolEnv.execute`` never raises: whatever goes wrong becomes an error block the policy can read.
"""

from __future__ import annotations

import re
import threading
from abc import ABC, abstractmethod
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from rubricem_core import scaffold
from rubricem_core.scaffold import ToolCall, ToolSpec

__all__ = [
    "Tool",
    "ToolBudget",
    "ToolCall",
    "ToolEnv",
    "ToolError",
    "ToolResult",
    "ToolSpec",
    "error_result",
    "format_search_results",
    "neutralize_tags",
    "no_results",
    "search_result",
    "snippets_result",
]


class ToolError(RuntimeError):
    """A tool was configured with bad inputs (e.g. a corpus missing a required column)."""


@dataclass(frozen=True)
class ToolResult:
    text: str
    snippet_ids: list[str] = field(default_factory=list)
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None


class Tool(ABC):
    spec: ToolSpec

    @abstractmethod
    def __call__(self, query: str) -> ToolResult: ...


# ---- output formatting (the scaffold owns the format; tools add chat-template guards) -----------
# Chat-template control tokens (<|im_end|>) and the think tag are not scaffold tags, but a tokenizer
# may map them to special ids, so document text must not carry them into a trajectory either.
_CONTROL_PATTERN = re.compile(r"<(\|[^<>|]{0,64}\||\s*/?\s*think\b[^<>]*)(>?)", re.IGNORECASE)


def _escape_control(text: str) -> str:
    return _CONTROL_PATTERN.sub(lambda m: "&lt;" + m.group(1) + ("&gt;" if m.group(2) else ""), text)


def neutralize_tags(text: str) -> str:
    """Escape scaffold tags (scaffold.neutralize_tags) and chat control tokens in untrusted text."""
    return scaffold.neutralize_tags(_escape_control(text))


def format_search_results(snippets: Iterable[tuple[str, str, str]]) -> str:
    """``(doc_id, title, text)`` triples → ``<tool_output><snippet id="D12">Title: text</snippet>…</tool_output>``."""
    pairs = []
    for doc_id, title, text in snippets:
        body = f"{title}: {text}" if title else text
        pairs.append((doc_id, _escape_control(body)))  # scaffold escapes its own tags
    if not pairs:
        raise ToolError("format_search_results needs at least one snippet; use no_results()")
    try:
        return scaffold.format_tool_output(pairs)
    except scaffold.ScaffoldError as exc:
        raise ToolError(str(exc)) from exc


def no_results(message: str) -> ToolResult:
    """An empty search: not a failure of the call, but the scaffold writes it as an error element."""
    return ToolResult(text=scaffold.format_tool_output(error=_escape_control(message)), snippet_ids=[], error=None)


def error_result(message: str) -> ToolResult:
    return ToolResult(text=scaffold.format_tool_output(error=_escape_control(message)), snippet_ids=[], error=message)


def snippets_result(snippets: Sequence[tuple[str, str, str]]) -> ToolResult:
    """Non-empty ``(doc_id, title, text)`` snippets → their tool output, citing each id in order."""
    return ToolResult(text=format_search_results(snippets), snippet_ids=[doc_id for doc_id, _, _ in snippets])


def search_result(query: str, snippets: Sequence[tuple[str, str, str]]) -> ToolResult:
    """A search's answer: its snippets, or, where it found none, the one "no results" every search tool writes."""
    if not snippets:
        return no_results(f"no results for {query!r}")
    return snippets_result(snippets)


# ---- budget and environment ----------------------------------------------------------------
class ToolBudget:
    """Counts tool calls of one trajectory; thread-safe because rollouts may share an env across threads."""

    def __init__(self, max_calls: int):
        if max_calls < 0:
            raise ValueError(f"max_calls must be >= 0, got {max_calls}")
        self.max_calls = int(max_calls)
        self.used = 0
        self._lock = threading.Lock()

    def try_consume(self) -> bool:
        with self._lock:
            if self.used >= self.max_calls:
                return False
            self.used += 1
            return True

    @property
    def remaining(self) -> int:
        return max(0, self.max_calls - self.used)

    @property
    def exhausted(self) -> bool:
        return self.used >= self.max_calls


class ToolEnv:
    """The tools one trajectory may call and its call budget. Tools are shared; ``fork`` gives the
    next trajectory a fresh budget without rebuilding indexes."""

    def __init__(self, tools: Mapping[str, Tool], max_calls: int):
        self.tools = dict(tools)
        self.budget = ToolBudget(max_calls)

    def fork(self) -> ToolEnv:
        return ToolEnv(self.tools, self.budget.max_calls)

    def specs(self) -> list[ToolSpec]:
        return [tool.spec for tool in self.tools.values()]

    @property
    def calls_made(self) -> int:
        return self.budget.used

    def observe(self, text: str) -> None:
        """Replay what earlier tool outputs in ``text`` taught the tools (a web search's id → URL book), so
        a trajectory continued in another process (a resumed teacher round) can still browse an id an
        earlier round's search returned. Tools without state ignore it; it never calls a tool."""
        result = ToolResult(text=text, snippet_ids=[])
        for tool in self.tools.values():
            observe = getattr(tool, "observe", None)
            if callable(observe):
                observe(result)

    def execute(self, call: ToolCall) -> ToolResult:
        # Every attempt counts, even an invalid one: the budget bounds the rounds a policy can spend.
        try:
            if not self.budget.try_consume():
                return error_result(f"tool call budget exhausted ({self.budget.max_calls} calls)")
            name = str(getattr(call, "name", "") or "").strip()
            query = str(getattr(call, "query", "") or "").strip()
            tool = self.tools.get(name)
            if tool is None:
                known = ", ".join(sorted(self.tools)) or "none"
                return error_result(f"unknown tool {name!r} (available: {known})")
            if not query:
                return error_result(f"empty query for tool {name!r}")
            result = tool(query)
            if not isinstance(result, ToolResult):
                return error_result(f"tool {name!r} returned {type(result).__name__}, not a ToolResult")
            return result
        except Exception as exc:  # a tool bug must not kill the rollout; the policy sees the error
            return error_result(f"tool failed: {type(exc).__name__}: {exc}")
