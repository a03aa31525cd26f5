"""The whole-text scanner: a trace as tokens (text, opening and closing tags) and labelled segments."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from rubricem_core.scaffold.records import Segment, Violation
from rubricem_core.scaffold.stages import _StageMachine
from rubricem_core.scaffold.tags import _TAG_RE, STAGES, TOOL_OUTPUT_CLOSE


@dataclass
class _Token:
    kind: str  # "text" | "open" | "close"
    text: str
    start: int
    stage: str
    is_tool_output: bool
    name: str = ""
    attrs: str = ""

    @property
    def end(self) -> int:
        return self.start + len(self.text)


def _tokenize(text: str) -> list[_Token]:
    machine = _StageMachine()
    tokens: list[_Token] = []
    pos = 0
    n = len(text)
    while pos < n:
        if machine.in_tool_output:
            close_at = text.find(TOOL_OUTPUT_CLOSE, pos)
            if close_at < 0:
                tokens.append(_Token("text", text[pos:], pos, machine.stage, True))
                break
            if close_at > pos:
                tokens.append(_Token("text", text[pos:close_at], pos, machine.stage, True))
            stage, is_tool = machine.close_tag("tool_output")
            tokens.append(_Token("close", TOOL_OUTPUT_CLOSE, close_at, stage, is_tool, name="tool_output"))
            pos = close_at + len(TOOL_OUTPUT_CLOSE)
            continue
        match = _TAG_RE.search(text, pos)
        if match is None:
            tokens.append(_Token("text", text[pos:], pos, machine.stage, False))
            break
        if match.start() > pos:
            tokens.append(_Token("text", text[pos : match.start()], pos, machine.stage, False))
        if match.group("close"):
            name = match.group("close")
            stage, is_tool = machine.close_tag(name)
            tokens.append(_Token("close", match.group(), match.start(), stage, is_tool, name=name))
        else:
            name = match.group("open")
            stage, is_tool = machine.open_tag(name)
            tokens.append(
                _Token(
                    "open", match.group(), match.start(), stage, is_tool, name=name, attrs=match.group("attrs") or ""
                )
            )
        pos = match.end()
    return tokens


def _merge(pieces: Iterable[tuple[str, str, bool]]) -> list[Segment]:
    segments: list[Segment] = []
    offset = 0
    for piece_text, stage, is_tool in pieces:
        if not piece_text:
            continue
        last = segments[-1] if segments else None
        if last is not None and last.stage == stage and last.is_tool_output == is_tool:
            segments[-1] = Segment(stage, last.text + piece_text, is_tool, last.start)
        else:
            segments.append(Segment(stage, piece_text, is_tool, offset))
        offset += len(piece_text)
    return segments


def merge_pieces(pieces: Iterable[tuple[str, str, bool]]) -> list[Segment]:
    """Join StreamParser pieces into maximal segments (the same view :func:`parse_segments` gives)."""
    return _merge(pieces)


def parse_segments(text: str) -> list[Segment]:
    """The labelled view of a whole trace: maximal runs of (stage, is_tool_output) in text order."""
    return _merge((token.text, token.stage, token.is_tool_output) for token in _tokenize(text))


def stage_texts(text: str, include_tool_output: bool = False) -> dict[str, str]:
    """Text written in each stage (tool outputs left out unless asked), for judges and metrics."""
    out = {stage: "" for stage in STAGES}
    for segment in parse_segments(text):
        if include_tool_output or not segment.is_tool_output:
            out[segment.stage] += segment.text
    return out


# violations that name no place in the text, and the stage each one belongs to
_UNPLACED_STAGE = {
    "missing_plan": "plan",
    "missing_research": "research",
    "too_many_tool_calls": "research",
    "missing_review": "review",
    "missing_answer": "answer",
}


def _stage_of(tokens: list[_Token], position: int) -> str:
    for token in tokens:
        if token.start <= position < token.end:
            return token.stage
    return tokens[-1].stage if tokens else "plan"


def stage_at(text: str, position: int) -> str:
    """The stage of the character at ``position`` (an opening tag belongs to the stage it opens)."""
    return _stage_of(_tokenize(text), position)


def violation_stages(text: str, violations: Iterable[Violation]) -> set[str]:
    """The stages in which ``text`` breaks the scaffold: where each violation sits, or for one with no
    position (a missing stage, the tool budget) the stage it is about."""
    tokens = _tokenize(text)
    stages: set[str] = set()
    for violation in violations:
        if violation.position is not None:
            stages.add(_stage_of(tokens, violation.position))
        elif violation.code in _UNPLACED_STAGE:
            stages.add(_UNPLACED_STAGE[violation.code])
        else:
            raise ValueError(f"violation {violation.code!r} has no position and no stage of its own")
    return stages
