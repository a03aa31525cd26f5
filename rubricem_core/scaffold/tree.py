"""The element tree of a whole trace (nesting, attributes, structural problems) that extraction and validation read."""

from __future__ import annotations

from dataclasses import dataclass, field

from rubricem_core.scaffold.codes import MALFORMED_TAG
from rubricem_core.scaffold.records import Violation
from rubricem_core.scaffold.segments import _Token, _tokenize
from rubricem_core.scaffold.tags import _TAG_RE, ALLOWED_CHILDREN, TAG_STAGE, _attributes


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
    return tree.text[element.content_start : element.content_end]


def _strip_scaffold_tags(text: str) -> str:
    return _TAG_RE.sub("", text)


def _child(element: _Element, name: str) -> _Element | None:
    return next((child for child in element.children if child.name == name), None)
