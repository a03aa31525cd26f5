"""Tool interface shared by local and remote research tools, plus the per-trajectory environment.

A tool turns a query string into a ``ToolResult`` whose ``text`` is already the exact
``<tool_output>…</tool_output>`` block that gets appended to the trajectory (and tokenized once).
``ToolEnv.execute`` never raises: whatever goes wrong becomes an error block the policy can read.
"""
from __future__ import annotations

import re
import threading
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Iterable, Mapping

try:  # the scaffold module owns the canonical ToolCall once it exists
    from rubricem_core.scaffold import ToolCall  # type: ignore[attr-defined]
except ImportError:

    @dataclass(frozen=True)
    class ToolCall:  # type: ignore[no-redef]
        """One ``<call_tool name="…">query</call_tool>`` parsed from a trajectory."""

        name: str
        query: str


class ToolError(RuntimeError):
    """A tool was configured with bad inputs (e.g. a corpus missing a required column)."""


@dataclass(frozen=True)
class ToolSpec:
    name: str
    description: str


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


# ---- output formatting ---------------------------------------------------------------------
# Every tag the scaffold parser reacts to, plus the chat-template think tag; a document containing
# one of these could otherwise end the tool output early or forge a stage.
SCAFFOLD_TAGS = (
    "structured_plan", "deep_analysis", "rubric", "knowledge_checklist", "analytical_criteria",
    "negative_constraints", "research_plan", "call_tool", "tool_output", "snippet", "state_evaluation",
    "review", "rubric_review", "writing_plan", "thesis", "outline", "answer", "cite", "think",
)
_TAG_PATTERN = re.compile(
    r"<(\s*/?\s*(?:" + "|".join(sorted(SCAFFOLD_TAGS, key=len, reverse=True)) + r")\b[^<>]*)(>?)",
    re.IGNORECASE,
)
# chat-template control tokens such as <|im_end|>
_SPECIAL_TOKEN_PATTERN = re.compile(r"<\|([^<>|]{0,64})\|>")
_OPEN_GUARD, _CLOSE_GUARD = "\u2039", "\u203a"  # ‹ › : look like brackets, never parse as tags


def neutralize_tags(text: str) -> str:
    """Replace the angle brackets of scaffold tags and chat control tokens inside untrusted text."""
    text = _TAG_PATTERN.sub(lambda m: _OPEN_GUARD + m.group(1) + (_CLOSE_GUARD if m.group(2) else ""), text)
    return _SPECIAL_TOKEN_PATTERN.sub(lambda m: f"{_OPEN_GUARD}|{m.group(1)}|{_CLOSE_GUARD}", text)


_SNIPPET_ID = re.compile(r"^[A-Za-z0-9_.:\-]+$")


def format_snippet(snippet_id: str, title: str, text: str) -> str:
    if not _SNIPPET_ID.match(snippet_id):
        raise ToolError(f"snippet id {snippet_id!r} must match {_SNIPPET_ID.pattern}")
    body = neutralize_tags(f"{title}: {text}" if title else text)
    return f'<snippet id="{snippet_id}">{body}</snippet>'


def format_tool_output(snippets: Iterable[tuple[str, str, str]]) -> str:
    """``(id, title, text)`` triples → ``<tool_output><snippet id="…">Title: text</snippet>…</tool_output>``."""
    return "<tool_output>" + "".join(format_snippet(*s) for s in snippets) + "</tool_output>"


def format_tool_message(message: str) -> str:
    """A plain (non-snippet) tool message, e.g. "no results"."""
    return f"<tool_output>{neutralize_tags(message)}</tool_output>"


def error_result(message: str) -> ToolResult:
    return ToolResult(text=format_tool_message(f"error: {message}"), snippet_ids=[], error=message)


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

    def fork(self) -> "ToolEnv":
        return ToolEnv(self.tools, self.budget.max_calls)

    def specs(self) -> list[ToolSpec]:
        return [tool.spec for tool in self.tools.values()]

    @property
    def calls_made(self) -> int:
        return self.budget.used

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
