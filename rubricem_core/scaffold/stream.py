"""The streaming scanner: scaffold parsing of text that arrives token by token (rollouts)."""

from __future__ import annotations

import re

from rubricem_core.scaffold.records import ToolCall
from rubricem_core.scaffold.stages import _StageMachine
from rubricem_core.scaffold.tags import (
    _ATTR_SPACE,
    _TAG_NAME_SET,
    _TAG_RE,
    MAX_ATTR_CHARS,
    STAGE_IDS,
    TAG_NAMES,
    TOOL_OUTPUT_CLOSE,
    _attributes,
)

_NAME_CHARS_RE = re.compile(r"[a-z_]*")


def _could_become_tag(s: str) -> bool:
    """True when ``s`` (starting with '<', not itself a full tag) may still grow into one."""
    body = s[1:]
    closing = body.startswith("/")
    if closing:
        body = body[1:]
    match = _NAME_CHARS_RE.match(body)
    assert match is not None  # [a-z_]* matches at the start of any string (maybe empty)
    name = match.group()
    rest = body[len(name) :]
    if not rest:
        return any(tag.startswith(name) for tag in TAG_NAMES)
    if closing or name not in _TAG_NAME_SET or rest[0] not in _ATTR_SPACE:
        return False
    return "<" not in rest and ">" not in rest and len(rest) <= MAX_ATTR_CHARS + 1


def _partial_suffix_len(buffer: str, target: str) -> int:
    """Length of the longest suffix of ``buffer`` that is a proper prefix of ``target``."""
    for length in range(min(len(buffer), len(target) - 1), 0, -1):
        if buffer.endswith(target[:length]):
            return length
    return 0


class StreamParser:
    """Incremental scaffold parser for text that arrives in arbitrary chunks (e.g. per token).

    ``feed`` returns the pieces it can label for sure; a possible tag split across chunks stays
    buffered (at most one tag's length) until it resolves. ``flush`` releases what is left when the
    text ends. Joining all pieces with :func:`merge_pieces` gives exactly :func:`parse_segments`.
    """

    def __init__(self) -> None:
        self._machine = _StageMachine()
        self._buffer = ""
        self._call_name: str | None = None  # name of the open call_tool, while one is open
        self._call_parts: list[str] = []
        self._pending: list[ToolCall] = []  # a queue: one chunk may hold several finished calls
        self._consumed = 0

    # -- state --
    @property
    def stage(self) -> str:
        return self._machine.stage

    @property
    def stage_id(self) -> int:
        return STAGE_IDS[self._machine.stage]

    @property
    def in_tool_output(self) -> bool:
        return self._machine.in_tool_output

    @property
    def finished(self) -> bool:
        return self._machine.finished

    @property
    def pending_tool_call(self) -> ToolCall | None:
        """The oldest finished tool call not yet taken."""
        return self._pending[0] if self._pending else None

    @property
    def buffered(self) -> str:
        """Text held back because it may be the start of a tag."""
        return self._buffer

    @property
    def position(self) -> int:
        """Characters already emitted as pieces."""
        return self._consumed

    def take_tool_call(self) -> ToolCall | None:
        return self._pending.pop(0) if self._pending else None

    # -- scanning --
    def feed(self, chunk: str) -> list[tuple[str, str, bool]]:
        self._buffer += chunk
        return self._scan(final=False)

    def flush(self) -> list[tuple[str, str, bool]]:
        return self._scan(final=True)

    def _emit(self, out: list[tuple[str, str, bool]], piece: str, stage: str, is_tool: bool) -> None:
        if not piece:
            return
        out.append((piece, stage, is_tool))
        self._consumed += len(piece)
        if self._call_name is not None:
            self._call_parts.append(piece)

    def _scan(self, final: bool) -> list[tuple[str, str, bool]]:
        out: list[tuple[str, str, bool]] = []
        buf = self._buffer
        pos = 0
        machine = self._machine
        while pos < len(buf):
            if machine.in_tool_output:
                close_at = buf.find(TOOL_OUTPUT_CLOSE, pos)
                if close_at < 0:
                    keep = 0 if final else _partial_suffix_len(buf[pos:], TOOL_OUTPUT_CLOSE)
                    self._emit(out, buf[pos : len(buf) - keep], machine.stage, True)
                    pos = len(buf) - keep
                    break
                self._emit(out, buf[pos:close_at], machine.stage, True)
                stage, is_tool = machine.close_tag("tool_output")
                self._emit(out, TOOL_OUTPUT_CLOSE, stage, is_tool)
                pos = close_at + len(TOOL_OUTPUT_CLOSE)
                continue
            lt = buf.find("<", pos)
            if lt < 0:
                self._emit(out, buf[pos:], machine.stage, False)
                pos = len(buf)
                break
            self._emit(out, buf[pos:lt], machine.stage, False)
            pos = lt
            match = _TAG_RE.match(buf, lt)
            if match is not None:
                self._on_tag(out, match)
                pos = match.end()
                continue
            if not final and _could_become_tag(buf[lt:]):
                break  # keep the possible tag start for the next chunk
            self._emit(out, "<", machine.stage, False)
            pos = lt + 1
        self._buffer = buf[pos:]
        return out

    def _on_tag(self, out: list[tuple[str, str, bool]], match: re.Match[str]) -> None:
        machine = self._machine
        if match.group("close"):
            name = match.group("close")
            stage, is_tool = machine.close_tag(name)
            if name == "call_tool" and self._call_name is not None:
                query = "".join(self._call_parts).strip()
                self._pending.append(ToolCall(self._call_name, query))
                self._call_name, self._call_parts = None, []
            self._emit(out, match.group(), stage, is_tool)
            return
        name = match.group("open")
        stage, is_tool = machine.open_tag(name)
        self._emit(out, match.group(), stage, is_tool)
        if name == "call_tool":
            # Started after emitting the tag so that only the query text is collected.
            self._call_name = _attributes(match.group("attrs") or "").get("name", "")
            self._call_parts = []
