"""Small records the scaffold helpers return, the default tool specs, and the scaffold's error type."""

from __future__ import annotations

from dataclasses import dataclass


class ScaffoldError(ValueError):
    """Input to a scaffold helper is unusable (e.g. a snippet id that cannot be written in a tag)."""


@dataclass(frozen=True)
class ToolSpec:
    name: str
    description: str


DEFAULT_TOOLS: tuple[ToolSpec, ...] = (
    ToolSpec(
        "search",
        "the argument is a search query; returns a list of snippets, each with a document id "
        "such as D12, from the document collection.",
    ),
    ToolSpec(
        "browse",
        "the argument is one document id returned by an earlier search (for example D12); "
        "returns the full text of that document.",
    ),
)


@dataclass(frozen=True)
class ToolCall:
    name: str
    query: str


@dataclass(frozen=True)
class Citation:
    doc_id: str
    claim: str


@dataclass(frozen=True)
class Segment:
    """A maximal run of text with one (stage, is_tool_output) label; ``start`` is its char offset."""

    stage: str
    text: str
    is_tool_output: bool
    start: int = 0

    @property
    def end(self) -> int:
        return self.start + len(self.text)


@dataclass(frozen=True)
class Plan:
    deep_analysis: str
    knowledge_checklist: list[str]
    analytical_criteria: list[str]
    negative_constraints: list[str]
    research_plan: list[str]


@dataclass(frozen=True)
class Violation:
    code: str
    message: str
    position: int | None = None
