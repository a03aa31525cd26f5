"""Reading a trace: its tool calls, retrieved snippet ids, citations, answer, plans and verdicts."""

from __future__ import annotations

import re

from rubricem_core.scaffold.records import Citation, Plan, ToolCall
from rubricem_core.scaffold.tree import _build_tree, _child, _content, _Element, _strip_scaffold_tags, _Tree

_SNIPPET_ID_RE = re.compile(r"""<snippet[ \t\n\r]+id\s*=\s*(?:"([^"]*)"|'([^']*)')[^<>]*>""")
_VERDICT_LABELLED_RE = re.compile(r"verdict\s*[:=\-]\s*\**\s*(continue|revise|ready)\b", re.IGNORECASE)
_VERDICT_RE = re.compile(r"\b(continue|revise|ready)\b", re.IGNORECASE)
_BULLET_RE = re.compile(r"^\s*(?:[-*\u2022]|\d+[.)]|[a-zA-Z][.)](?=\s))\s*")


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


def extract_citations(text: str) -> list[Citation]:
    """Citations of the (first) answer, one per cited id, in order."""
    tree = _build_tree(text)
    answers = _answers(tree)
    if not answers:
        return []
    citations: list[Citation] = []
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
        body = line[bullet.end() :].strip() if bullet else line.strip()
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
