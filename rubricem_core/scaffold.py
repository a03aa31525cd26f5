"""The stage-structured research scaffold: format, system prompt, parsers and validator.

One format is shared by the teacher prompt, SFT filtering, streaming rollouts and the judge::

    <structured_plan> <deep_analysis/> <rubric> three lists </rubric> <research_plan/> </structured_plan>
    ( <call_tool name="search">query</call_tool> <tool_output>…</tool_output> | <state_evaluation/> )*
    <review> <rubric_review/> <writing_plan> <thesis/> <outline/> </writing_plan> </review>
    <answer> report with <cite id="D12">claim</cite> </answer>

Tags are recognised only for the scaffold's own tag names (``<b>`` or ``<think>`` is plain text),
opening tags may carry attributes, closing tags are exactly ``</name>``. Inside ``<tool_output>``
only ``</tool_output>`` is a tag: the environment writes that block and neutralises scaffold tags in
document text (:func:`format_tool_output`), so a document cannot close it early or fake stages.

Two scanners produce the same labelled view of a trace: :func:`parse_segments` (regex over the
whole text) and :class:`StreamParser` (incremental, for token-by-token rollouts). They share only
the stage machine, so tests comparing them check the incremental tag scanning for real.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Iterable, Sequence

# ---- stages and tags ----------------------------------------------------------------------------

STAGES: tuple[str, ...] = ("plan", "research", "review", "answer")
STAGE_IDS: dict[str, int] = {stage: index for index, stage in enumerate(STAGES)}

# Tags that open a stage element; ``structured_plan`` maps to plan only before research begins.
TAG_STAGE: dict[str, str] = {
    "structured_plan": "plan",
    "call_tool": "research",
    "tool_output": "research",
    "state_evaluation": "research",
    "review": "review",
    "answer": "answer",
}
TOP_LEVEL_TAGS: tuple[str, ...] = tuple(TAG_STAGE)

# Which scaffold tags may appear directly inside which; any tag not listed here is a leaf.
ALLOWED_CHILDREN: dict[str, frozenset[str]] = {
    "structured_plan": frozenset({"deep_analysis", "rubric", "research_plan"}),
    "rubric": frozenset({"knowledge_checklist", "analytical_criteria", "negative_constraints"}),
    "review": frozenset({"rubric_review", "writing_plan"}),
    "writing_plan": frozenset({"thesis", "outline"}),
    "answer": frozenset({"cite"}),
}

# ``snippet`` and ``error`` only belong inside tool output; they are listed so that the model
# writing them elsewhere is recognised (and flagged) and so documents cannot inject them.
TAG_NAMES: tuple[str, ...] = (
    "structured_plan", "deep_analysis", "rubric", "knowledge_checklist", "analytical_criteria",
    "negative_constraints", "research_plan", "call_tool", "tool_output", "snippet", "error",
    "state_evaluation", "review", "rubric_review", "writing_plan", "thesis", "outline",
    "answer", "cite",
)
_TAG_NAME_SET = frozenset(TAG_NAMES)

VERDICTS: tuple[str, ...] = ("continue", "revise", "ready")
TOOL_OUTPUT_CLOSE = "</tool_output>"
TOOL_CALL_CLOSE = "</call_tool>"
# Generation stops at a finished tool call (the environment answers) or a finished answer.
STOP_STRINGS: tuple[str, ...] = (TOOL_CALL_CLOSE, "</answer>")

# Attribute text of one opening tag is bounded so a stray "<answer ..." cannot make the streaming
# parser buffer without limit; both scanners use the same bound.
MAX_ATTR_CHARS = 200
_ATTR_SPACE = " \t\n\r"
_NAMES_ALT = "|".join(sorted(TAG_NAMES, key=len, reverse=True))
_TAG_RE = re.compile(
    rf"<(?:/(?P<close>{_NAMES_ALT})>|(?P<open>{_NAMES_ALT})(?P<attrs>[{_ATTR_SPACE}][^<>]{{0,{MAX_ATTR_CHARS}}})?>)"
)
_NAME_CHARS_RE = re.compile(r"[a-z_]*")
_ATTR_RE = re.compile(r"""([A-Za-z_][\w-]*)\s*=\s*(?:"([^"]*)"|'([^']*)')""")
_SNIPPET_ID_RE = re.compile(r"""<snippet[ \t\n\r]+id\s*=\s*(?:"([^"]*)"|'([^']*)')[^<>]*>""")
_VERDICT_LABELLED_RE = re.compile(r"verdict\s*[:=\-]\s*\**\s*(continue|revise|ready)\b", re.IGNORECASE)
_VERDICT_RE = re.compile(r"\b(continue|revise|ready)\b", re.IGNORECASE)
# Any scaffold tag in document text, in any letter case and with stray spaces, is neutralised.
_INJECTED_TAG_RE = re.compile(rf"<(\s*/?\s*(?:{_NAMES_ALT})\b[^<>]*)(>?)", re.IGNORECASE)
_BULLET_RE = re.compile(r"^\s*(?:[-*\u2022]|\d+[.)]|[a-zA-Z][.)](?=\s))\s*")
_SAFE_ID_RE = re.compile(r"^[A-Za-z0-9_.:\-/#]+$")
_ANY_TAG_RE = re.compile(r"</?[a-z_]+(?:\s[^<>]*)?>")  # any tag-like markup, known name or not


class ScaffoldError(ValueError):
    """Input to a scaffold helper is unusable (e.g. a snippet id that cannot be written in a tag)."""


# ---- small records ------------------------------------------------------------------------------


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


# ---- violation codes ----------------------------------------------------------------------------

MISSING_PLAN = "missing_plan"
MISSING_RESEARCH = "missing_research"
MISSING_REVIEW = "missing_review"
MISSING_ANSWER = "missing_answer"
REPEATED_STAGE = "repeated_stage"
STAGE_ORDER = "stage_order"
MALFORMED_TAG = "malformed_tag"
MALFORMED_TOOL_CALL = "malformed_tool_call"
UNKNOWN_TOOL = "unknown_tool"
TOOL_CALL_WITHOUT_OUTPUT = "tool_call_without_output"
UNCITED_ANSWER = "uncited_answer"
CITATION_NOT_RETRIEVED = "citation_not_retrieved"
EMPTY_ANSWER = "empty_answer"
TEXT_OUTSIDE_TAGS = "text_outside_tags"
INCOMPLETE_PLAN = "incomplete_plan"
INCOMPLETE_REVIEW = "incomplete_review"
INVALID_STATE_EVALUATION = "invalid_state_evaluation"
TOO_MANY_TOOL_CALLS = "too_many_tool_calls"

VIOLATION_CODES: dict[str, str] = {
    MISSING_PLAN: "no <structured_plan> before research starts",
    MISSING_RESEARCH: "no <call_tool> at all: the answer is not grounded in any retrieval",
    MISSING_REVIEW: "no <review> element",
    MISSING_ANSWER: "no <answer> element",
    REPEATED_STAGE: "a single-use stage element appears twice (two plans before research, two <review>, two <answer>)",
    STAGE_ORDER: "a stage element appears after a later stage (e.g. <review> before the plan, <call_tool> after <review>)",
    MALFORMED_TAG: "unclosed, mismatched or stray closing tag, a tag in the wrong place, "
    "<tool_output> not right after a call, or a <cite> without id or claim",
    MALFORMED_TOOL_CALL: "<call_tool> without a name attribute, with an empty query, or with tags inside",
    UNKNOWN_TOOL: "<call_tool> names a tool that is not available",
    TOOL_CALL_WITHOUT_OUTPUT: "a <call_tool> is not followed by the environment's <tool_output>",
    UNCITED_ANSWER: "the answer contains no <cite>",
    CITATION_NOT_RETRIEVED: "a <cite> id never appeared as a snippet id in an earlier <tool_output>",
    EMPTY_ANSWER: "the answer has no text",
    TEXT_OUTSIDE_TAGS: "non-whitespace text outside every top-level scaffold element",
    INCOMPLETE_PLAN: "a <structured_plan> lacks deep_analysis, one of the three rubric lists, or research_plan",
    INCOMPLETE_REVIEW: "a <review> lacks rubric_review or a writing_plan with thesis and outline",
    INVALID_STATE_EVALUATION: "a <state_evaluation> gives no continue|revise|ready verdict",
    TOO_MANY_TOOL_CALLS: "more tool calls than the allowed budget",
}


# ---- system prompt and tool output --------------------------------------------------------------

EXAMPLE_TRACE = """<structured_plan>
<deep_analysis>The user asks when the Varn bridge opened and why it matters. Explicit need: the opening year. Implicit need: its effect on regional trade.</deep_analysis>
<rubric>
<knowledge_checklist>
- The opening year of the Varn bridge
- The trade route the bridge connected
</knowledge_checklist>
<analytical_criteria>
- Explains the causal link between the bridge and trade growth
</analytical_criteria>
<negative_constraints>
- Does not state facts that no retrieved document supports
</negative_constraints>
</rubric>
<research_plan>
1. Search for the opening of the Varn bridge.
2. Search for its effect on trade.
</research_plan>
</structured_plan>
<call_tool name="search">Varn bridge opening year</call_tool>
<tool_output><snippet id="D3">The Varn bridge opened in 1871 and joined the river port to the northern road.</snippet></tool_output>
<state_evaluation>D3 covers the opening year and the route; the trade effect is still missing. Verdict: continue</state_evaluation>
<call_tool name="search">Varn bridge effect on trade</call_tool>
<tool_output><snippet id="D8">After the Varn bridge opened, grain shipments through the port doubled within a decade.</snippet></tool_output>
<state_evaluation>Every checklist item now has evidence (D3, D8). Verdict: ready</state_evaluation>
<review>
<rubric_review>Opening year -> D3. Trade route -> D3. Causal link -> D8. Gaps: none.</rubric_review>
<writing_plan><thesis>The 1871 Varn bridge made the port a trade hub.</thesis><outline>1. Opening. 2. Route. 3. Trade effect.</outline></writing_plan>
</review>
<answer>The Varn bridge opened in 1871 <cite id="D3">and joined the river port to the northern road</cite>. Its effect on trade was large: <cite id="D8">grain shipments through the port doubled within a decade</cite>.</answer>"""

_GUIDANCE_BEGIN = "=== BEGIN GUIDANCE FROM PAST RESEARCH (advice only: not evidence, never cite it) ==="
_GUIDANCE_END = "=== END GUIDANCE ==="


def system_prompt(tools: Sequence[ToolSpec] | None = None, guidance: str | None = None) -> str:
    """The system prompt that teaches the scaffold; ``guidance`` is retrieved reflection text."""
    tool_specs = list(DEFAULT_TOOLS if tools is None else tools)
    if not tool_specs:
        raise ScaffoldError("system_prompt needs at least one tool: research without tools cannot be grounded")
    for spec in tool_specs:
        if not re.fullmatch(r"[A-Za-z_][\w\-]*", spec.name):
            raise ScaffoldError(f"tool name {spec.name!r} cannot be written in a call_tool name attribute")
    tool_lines = "\n".join(
        f'- {spec.name}: {spec.description.strip()} Call it as <call_tool name="{spec.name}">argument</call_tool>'
        for spec in tool_specs
    )
    parts = [
        "You are a deep-research agent. You answer the user's question with a long-form, well-cited report, "
        "working in four stages: plan, research, review, answer. Write every part of your response inside the "
        "tags below, in this order, and write nothing outside them.",
        "",
        "1. PLAN (exactly once, first):",
        "<structured_plan>",
        "<deep_analysis>the explicit and implicit needs of the question</deep_analysis>",
        "<rubric>",
        "<knowledge_checklist>- facts the answer must contain, one per line</knowledge_checklist>",
        "<analytical_criteria>- analysis the answer must do well, one per line</analytical_criteria>",
        "<negative_constraints>- mistakes the answer must avoid, one per line</negative_constraints>",
        "</rubric>",
        "<research_plan>1. numbered research steps</research_plan>",
        "</structured_plan>",
        "All three rubric lists and the research plan must be non-empty.",
        "",
        "2. RESEARCH (one or more tool calls):",
        "Make exactly one tool call at a time: <call_tool name=\"TOOL\">argument</call_tool>. "
        "Nothing else goes inside call_tool. Your turn stops right after </call_tool>; the environment then writes "
        "<tool_output>...</tool_output> with results as <snippet id=\"D12\">text</snippet>, or an <error>. "
        "Never write <tool_output> yourself.",
        "Available tools:",
        tool_lines,
        "After a tool output, judge the evidence against your plan and rubric in "
        "<state_evaluation>...</state_evaluation>, ending with one verdict: \"Verdict: continue\" (search more), "
        "\"Verdict: revise\" (the plan needs changing: write a revised <structured_plan> next, in the same format), "
        "or \"Verdict: ready\" (enough evidence to write).",
        "",
        "3. REVIEW (exactly once, after research):",
        "<review>",
        "<rubric_review>each rubric criterion -> the evidence ids that satisfy it, and the remaining gaps</rubric_review>",
        "<writing_plan><thesis>the main claim</thesis><outline>the report's sections</outline></writing_plan>",
        "</review>",
        "",
        "4. ANSWER (exactly once, last):",
        "<answer>the long-form report, with every supported claim wrapped as <cite id=\"D12\">claim</cite></answer>",
        "Cite only ids that appeared in a <snippet id=\"...\"> of a tool output above; one id per cite. "
        "Never invent ids. Stop after </answer>.",
        "",
        "Example of the complete format (a short one; real questions need more research and a longer report):",
        EXAMPLE_TRACE,
    ]
    if guidance is not None and guidance.strip():
        parts += ["", _GUIDANCE_BEGIN, guidance.strip(), _GUIDANCE_END]
    return "\n".join(parts)


def neutralize_tags(text: str) -> str:
    """Escape the angle brackets of scaffold tags so untrusted text cannot open or close elements."""

    def escape(match: re.Match[str]) -> str:
        return "&lt;" + match.group(1) + ("&gt;" if match.group(2) else "")

    return _INJECTED_TAG_RE.sub(escape, text)


def format_tool_output(snippets: Sequence[tuple[str, str]] | None = None, error: str | None = None) -> str:
    """The environment's reply to one tool call: snippets ``(doc_id, text)`` or an error message."""
    if error is not None:
        if snippets:
            raise ScaffoldError("format_tool_output takes snippets or an error, not both")
        return f"<tool_output><error>{neutralize_tags(error)}</error></tool_output>"
    if not snippets:
        return "<tool_output><error>no results</error></tool_output>"
    pieces = []
    for doc_id, text in snippets:
        if not _SAFE_ID_RE.match(doc_id):
            raise ScaffoldError(f"snippet id {doc_id!r} must match {_SAFE_ID_RE.pattern} to be written in a tag")
        pieces.append(f'<snippet id="{doc_id}">{neutralize_tags(text)}</snippet>')
    return "<tool_output>" + "".join(pieces) + "</tool_output>"


# ---- the stage machine shared by both scanners ------------------------------------------------


class _StageMachine:
    """Labels each tag and text run with (stage, is_tool_output) as tags arrive in order."""

    __slots__ = ("stage", "research_started", "in_tool_output", "finished")

    def __init__(self) -> None:
        self.stage = "plan"  # text before the first tag belongs to the plan
        self.research_started = False
        self.in_tool_output = False
        self.finished = False

    def open_tag(self, name: str) -> tuple[str, bool]:
        if name == "structured_plan":
            # A plan written once research is under way is a revision, trained as research.
            self.stage = "research" if self.research_started else "plan"
        elif name in ("call_tool", "state_evaluation", "tool_output"):
            self.stage = "research"
            self.research_started = True
            if name == "tool_output":
                self.in_tool_output = True
                return self.stage, True
        elif name in ("review", "answer"):
            self.stage = name
        return self.stage, False

    def close_tag(self, name: str) -> tuple[str, bool]:
        if name == "tool_output" and self.in_tool_output:
            self.in_tool_output = False
            return self.stage, True
        if name == "answer":
            self.finished = True
        return self.stage, False


# ---- whole-text scanner -------------------------------------------------------------------------


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
            tokens.append(_Token("text", text[pos:match.start()], pos, machine.stage, False))
        if match.group("close"):
            name = match.group("close")
            stage, is_tool = machine.close_tag(name)
            tokens.append(_Token("close", match.group(), match.start(), stage, is_tool, name=name))
        else:
            name = match.group("open")
            stage, is_tool = machine.open_tag(name)
            tokens.append(
                _Token("open", match.group(), match.start(), stage, is_tool,
                       name=name, attrs=match.group("attrs") or "")
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


# ---- streaming scanner --------------------------------------------------------------------------


def _could_become_tag(s: str) -> bool:
    """True when ``s`` (starting with '<', not itself a full tag) may still grow into one."""
    body = s[1:]
    closing = body.startswith("/")
    if closing:
        body = body[1:]
    name = _NAME_CHARS_RE.match(body).group()  # type: ignore[union-attr]
    rest = body[len(name):]
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
                    self._emit(out, buf[pos:len(buf) - keep], machine.stage, True)
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


# ---- element tree --------------------------------------------------------------------------------


@dataclass
class _Element:
    name: str
    attrs: dict[str, str]
    start: int  # offset of the opening tag
    content_start: int
    stage: str
    parent: _Element | None = None
    content_end: int = -1
    closed: bool = False
    children: list[_Element] = field(default_factory=list)
    nested_tag_at: int | None = None  # first scaffold tag inside a call_tool


def _attributes(attr_text: str) -> dict[str, str]:
    return {m.group(1): (m.group(2) if m.group(2) is not None else m.group(3)) for m in _ATTR_RE.finditer(attr_text)}


@dataclass
class _Tree:
    text: str
    top: list[_Element]
    elements: list[_Element]  # every element, document order
    outside_text: list[_Token]  # non-whitespace text at top level
    problems: list[Violation]  # structural problems found while building


def _build_tree(text: str) -> _Tree:
    tokens = _tokenize(text)
    top: list[_Element] = []
    elements: list[_Element] = []
    outside: list[_Token] = []
    problems: list[Violation] = []
    stack: list[_Element] = []
    for token in tokens:
        if token.kind == "text":
            if not stack and token.text.strip():
                outside.append(token)
            continue
        if stack and stack[-1].name == "call_tool" and not (token.kind == "close" and token.name == "call_tool"):
            # A call's content is opaque up to </call_tool> (as in StreamParser): tags inside it
            # only make the call malformed; a new <call_tool> abandons the unfinished one.
            call = stack[-1]
            if token.kind == "open" and token.name == "call_tool":
                stack.pop()
                call.content_end = token.start
                problems.append(Violation(MALFORMED_TAG, "<call_tool> is not closed before the next one", call.start))
            else:
                if call.nested_tag_at is None:
                    call.nested_tag_at = token.start
                continue
        if token.kind == "open":
            parent = stack[-1] if stack else None
            element = _Element(token.name, _attributes(token.attrs), token.start, token.end, token.stage, parent)
            if parent is None:
                if token.name not in TAG_STAGE:
                    message = f"<{token.name}> must be inside another element"
                    problems.append(Violation(MALFORMED_TAG, message, token.start))
                top.append(element)
            else:
                if token.name not in ALLOWED_CHILDREN.get(parent.name, ()):
                    message = f"<{token.name}> is not allowed inside <{parent.name}>"
                    problems.append(Violation(MALFORMED_TAG, message, token.start))
                parent.children.append(element)
            elements.append(element)
            stack.append(element)
            continue
        # closing tag
        if any(open_element.name == token.name for open_element in stack):
            while stack:
                element = stack.pop()
                if element.name == token.name:
                    element.content_end, element.closed = token.start, True
                    break
                element.content_end = token.start
                message = f"<{element.name}> is not closed before </{token.name}>"
                problems.append(Violation(MALFORMED_TAG, message, element.start))
        else:
            problems.append(Violation(MALFORMED_TAG, f"</{token.name}> closes nothing", token.start))
    for element in stack:
        element.content_end = len(text)
        problems.append(Violation(MALFORMED_TAG, f"<{element.name}> is never closed", element.start))
    return _Tree(text, top, elements, outside, problems)


def _content(tree: _Tree, element: _Element) -> str:
    return tree.text[element.content_start:element.content_end]


def _strip_scaffold_tags(text: str) -> str:
    return _TAG_RE.sub("", text)


def _child(element: _Element, name: str) -> _Element | None:
    return next((child for child in element.children if child.name == name), None)


# ---- extraction -----------------------------------------------------------------------------------


def extract_tool_calls(text: str) -> list[ToolCall]:
    """Every completed ``<call_tool>`` in order; the name is '' when the attribute is missing."""
    tree = _build_tree(text)
    return [
        ToolCall(element.attrs.get("name", ""), _content(tree, element).strip())
        for element in tree.elements
        if element.name == "call_tool" and element.closed
    ]


def _tool_outputs(tree: _Tree) -> list[_Element]:
    return [element for element in tree.elements if element.name == "tool_output"]


def _snippet_ids_in(content: str) -> set[str]:
    return {m.group(1) if m.group(1) is not None else m.group(2) for m in _SNIPPET_ID_RE.finditer(content)}


def extract_snippet_ids(text: str) -> set[str]:
    """Ids of the snippets that appeared inside tool outputs (what may be cited)."""
    tree = _build_tree(text)
    ids: set[str] = set()
    for element in _tool_outputs(tree):
        ids |= _snippet_ids_in(_content(tree, element))
    return ids


def _cite_ids(element: _Element) -> list[str]:
    # A model sometimes writes several ids in one cite ("D1, D2"); each is checked on its own.
    return [part for part in re.split(r"[\s,;]+", element.attrs.get("id", "")) if part]


def _answers(tree: _Tree) -> list[_Element]:
    return [element for element in tree.elements if element.name == "answer"]


def strip_tags(text: str) -> str:
    """``text`` without its tags (any ``<name ...>`` or ``</name>``), their contents kept."""
    return _ANY_TAG_RE.sub("", text)


def extract_citations(text: str) -> list[Citation]:
    """Citations of the (first) answer, one per cited id, in order."""
    tree = _build_tree(text)
    answers = _answers(tree)
    if not answers:
        return []
    citations = []
    for child in answers[0].children:
        if child.name == "cite":
            claim = _strip_scaffold_tags(_content(tree, child)).strip()
            citations.extend(Citation(doc_id, claim) for doc_id in _cite_ids(child))
    return citations


def extract_answer(text: str) -> str | None:
    """Inner text of the first ``<answer>`` (cite tags kept), or None when there is none."""
    tree = _build_tree(text)
    answers = _answers(tree)
    return _content(tree, answers[0]).strip() if answers else None


def _list_items(text: str) -> list[str]:
    items: list[str] = []
    any_bullet = False
    for line in text.splitlines():
        if not line.strip():
            continue
        bullet = _BULLET_RE.match(line)
        body = line[bullet.end():].strip() if bullet else line.strip()
        if bullet:
            any_bullet = True
            if body:
                items.append(body)
        elif any_bullet and items:
            items[-1] = f"{items[-1]} {body}"  # continuation of a wrapped item
        else:
            items.append(body)
    return items


def _plan_from(tree: _Tree, element: _Element) -> Plan:
    def part(parent: _Element | None, name: str) -> str:
        child = _child(parent, name) if parent is not None else None
        return _strip_scaffold_tags(_content(tree, child)).strip() if child is not None else ""

    rubric = _child(element, "rubric")
    return Plan(
        deep_analysis=part(element, "deep_analysis"),
        knowledge_checklist=_list_items(part(rubric, "knowledge_checklist")),
        analytical_criteria=_list_items(part(rubric, "analytical_criteria")),
        negative_constraints=_list_items(part(rubric, "negative_constraints")),
        research_plan=_list_items(part(element, "research_plan")),
    )


def extract_plans(text: str) -> list[Plan]:
    """Every ``<structured_plan>`` in order: the initial plan, then revisions."""
    tree = _build_tree(text)
    return [_plan_from(tree, element) for element in tree.elements if element.name == "structured_plan"]


def extract_plan(text: str) -> Plan | None:
    """The plan-stage plan (the first one written before research), or None."""
    tree = _build_tree(text)
    for element in tree.elements:
        if element.name == "structured_plan" and element.stage == "plan":
            return _plan_from(tree, element)
    return None


def state_verdict(evaluation: str) -> str | None:
    """The verdict of one state evaluation: the labelled one ("Verdict: ready"), else the last verdict word."""
    labelled = _VERDICT_LABELLED_RE.findall(evaluation)
    if labelled:
        return labelled[-1].lower()
    words = _VERDICT_RE.findall(evaluation)
    return words[-1].lower() if words else None


def extract_verdicts(text: str) -> list[str | None]:
    """The verdict of each ``<state_evaluation>``, in order (None where it gives none)."""
    tree = _build_tree(text)
    return [state_verdict(_content(tree, e)) for e in tree.elements if e.name == "state_evaluation"]


# ---- validation ---------------------------------------------------------------------------------


def _plan_gaps(plan: Plan) -> list[str]:
    fields = {
        "deep_analysis": bool(plan.deep_analysis),
        "knowledge_checklist": bool(plan.knowledge_checklist),
        "analytical_criteria": bool(plan.analytical_criteria),
        "negative_constraints": bool(plan.negative_constraints),
        "research_plan": bool(plan.research_plan),
    }
    return [name for name, present in fields.items() if not present]


def _review_gaps(tree: _Tree, review: _Element) -> list[str]:
    def filled(element: _Element | None) -> bool:
        return element is not None and bool(_strip_scaffold_tags(_content(tree, element)).strip())

    writing_plan = _child(review, "writing_plan")
    needed = {
        "rubric_review": filled(_child(review, "rubric_review")),
        "writing_plan": writing_plan is not None,
        "thesis": writing_plan is not None and filled(_child(writing_plan, "thesis")),
        "outline": writing_plan is not None and filled(_child(writing_plan, "outline")),
    }
    return [name for name, present in needed.items() if not present]


def validate(
    text: str,
    tool_names: Sequence[str] = ("search", "browse"),
    max_tool_calls: int | None = None,
) -> list[Violation]:
    """Every way ``text`` breaks the scaffold, in a stable order; ``[]`` for a valid trace."""
    tree = _build_tree(text)
    violations: list[Violation] = list(tree.problems)
    violations += [
        Violation(TEXT_OUTSIDE_TAGS, f"text outside scaffold elements: {token.text.strip()[:40]!r}", token.start)
        for token in tree.outside_text
    ]
    violations += _check_stages(tree)
    violations += _check_tool_calls(tree, tuple(tool_names), max_tool_calls)
    violations += _check_contents(tree)
    return violations


def _check_stages(tree: _Tree) -> list[Violation]:
    out: list[Violation] = []
    stage_elements = [e for e in tree.elements if e.name in TAG_STAGE]
    plans = [e for e in stage_elements if e.name == "structured_plan" and e.stage == "plan"]
    if not plans:
        out.append(Violation(MISSING_PLAN, "no <structured_plan> before research", None))
    if not any(e.name == "call_tool" for e in stage_elements):
        out.append(Violation(MISSING_RESEARCH, "no <call_tool>: nothing was researched", None))
    for name, missing_code in (("review", MISSING_REVIEW), ("answer", MISSING_ANSWER)):
        if not any(e.name == name for e in stage_elements):
            out.append(Violation(missing_code, f"no <{name}>", None))
    for label, group in (
        ("structured_plan (plan stage)", plans),
        ("review", [e for e in stage_elements if e.name == "review"]),
        ("answer", [e for e in stage_elements if e.name == "answer"]),
    ):
        for extra in group[1:]:
            out.append(Violation(REPEATED_STAGE, f"a second <{label.split()[0]}> ({label})", extra.start))
    latest = 0
    for element in stage_elements:
        rank = STAGE_IDS[element.stage]
        # A tool output follows its call; the call already carries any ordering problem.
        if rank < latest and element.name != "tool_output":
            out.append(Violation(
                STAGE_ORDER, f"<{element.name}> ({element.stage}) comes after the {STAGES[latest]} stage", element.start
            ))
        latest = max(latest, rank)
    return out


def _check_tool_calls(tree: _Tree, tool_names: tuple[str, ...], max_tool_calls: int | None) -> list[Violation]:
    out: list[Violation] = []
    completed = 0
    for element in tree.elements:
        if element.name != "call_tool":
            continue
        name = element.attrs.get("name", "").strip()
        if not name:
            out.append(Violation(MALFORMED_TOOL_CALL, "<call_tool> has no name attribute", element.start))
        elif name not in tool_names:
            out.append(Violation(UNKNOWN_TOOL, f"tool {name!r} is not one of {list(tool_names)}", element.start))
        if element.nested_tag_at is not None:
            out.append(Violation(MALFORMED_TOOL_CALL, "tags inside <call_tool>", element.nested_tag_at))
        elif element.closed and not _content(tree, element).strip():
            out.append(Violation(MALFORMED_TOOL_CALL, "<call_tool> has an empty query", element.start))
        if element.closed:
            completed += 1
    if max_tool_calls is not None and completed > max_tool_calls:
        out.append(Violation(TOO_MANY_TOOL_CALLS, f"{completed} tool calls, budget {max_tool_calls}", None))
    # Calls and outputs pair up in the top-level sequence: each call is answered right after it.
    for index, element in enumerate(tree.top):
        following = tree.top[index + 1] if index + 1 < len(tree.top) else None
        previous = tree.top[index - 1] if index > 0 else None
        if element.name == "call_tool" and element.closed and (following is None or following.name != "tool_output"):
            message = "<call_tool> is not followed by <tool_output>"
            out.append(Violation(TOOL_CALL_WITHOUT_OUTPUT, message, element.start))
        if element.name == "tool_output" and (previous is None or previous.name != "call_tool"):
            out.append(Violation(MALFORMED_TAG, "<tool_output> without a tool call right before it", element.start))
    return out


def _check_contents(tree: _Tree) -> list[Violation]:
    out: list[Violation] = []
    retrieved: list[tuple[int, set[str]]] = [
        (element.content_end, _snippet_ids_in(_content(tree, element))) for element in _tool_outputs(tree)
    ]
    for element in tree.elements:
        if element.name == "structured_plan":
            gaps = _plan_gaps(_plan_from(tree, element))
            if gaps:
                out.append(Violation(INCOMPLETE_PLAN, f"<structured_plan> lacks {', '.join(gaps)}", element.start))
        elif element.name == "state_evaluation":
            if state_verdict(_content(tree, element)) is None:
                out.append(Violation(INVALID_STATE_EVALUATION, "no continue|revise|ready verdict", element.start))
        elif element.name == "review":
            gaps = _review_gaps(tree, element)
            if gaps:
                out.append(Violation(INCOMPLETE_REVIEW, f"<review> lacks {', '.join(gaps)}", element.start))
        elif element.name == "answer":
            out += _check_answer(tree, element, retrieved)
    return out


def _check_answer(tree: _Tree, answer: _Element, retrieved: list[tuple[int, set[str]]]) -> list[Violation]:
    if not _strip_scaffold_tags(_content(tree, answer)).strip():
        return [Violation(EMPTY_ANSWER, "<answer> has no text", answer.start)]
    cites = [child for child in answer.children if child.name == "cite"]
    if not cites:
        return [Violation(UNCITED_ANSWER, "<answer> has no <cite>", answer.start)]
    out: list[Violation] = []
    for cite in cites:
        ids = _cite_ids(cite)
        if not ids:
            out.append(Violation(MALFORMED_TAG, "<cite> has no id attribute", cite.start))
        if not _strip_scaffold_tags(_content(tree, cite)).strip():
            out.append(Violation(MALFORMED_TAG, "<cite> has no claim text", cite.start))
        seen = set().union(*(found for end, found in retrieved if end <= cite.start))
        for doc_id in ids:
            if doc_id not in seen:
                out.append(Violation(CITATION_NOT_RETRIEVED, f"cited id {doc_id!r} was never retrieved", cite.start))
    return out


def violation_codes(violations: Iterable[Violation]) -> list[str]:
    """Distinct codes in first-seen order (the ``reject_reasons`` column)."""
    return list(dict.fromkeys(violation.code for violation in violations))
