"""The scaffold validator: every way a trace breaks the format, as ``Violation`` records with codes."""

from __future__ import annotations

from collections.abc import Sequence

from rubricem_core.scaffold import codes
from rubricem_core.scaffold.extract import _cite_ids, _plan_from, _snippet_ids_in, _tool_outputs, state_verdict
from rubricem_core.scaffold.records import Plan, Violation
from rubricem_core.scaffold.tags import STAGE_IDS, STAGES, TAG_STAGE
from rubricem_core.scaffold.tree import _build_tree, _child, _content, _Element, _strip_scaffold_tags, _Tree


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


TRACE_FORMATS: tuple[str, ...] = ("scaffold", "react")


def validate(
    text: str,
    tool_names: Sequence[str] = ("search", "browse"),
    max_tool_calls: int | None = None,
    trace_format: str = "scaffold",
) -> list[Violation]:
    """Every way ``text`` breaks its format, in a stable order; ``[]`` for a valid trace. ``scaffold``: the four
    tagged stages; ``react``: the unstructured format (free text between well-formed tool calls, then one
    cited <answer>; the paper's Fig. 6 ReAct comparison)."""
    if trace_format not in TRACE_FORMATS:
        raise ValueError(f"unknown trace format {trace_format!r}; expected one of {TRACE_FORMATS}")
    tree = _build_tree(text)
    violations: list[Violation] = list(tree.problems)
    if trace_format == "react":
        return (
            violations
            + _check_react(tree)
            + _check_tool_calls(tree, tuple(tool_names), max_tool_calls)
            + (_check_contents(tree))
        )
    violations += [
        Violation(codes.TEXT_OUTSIDE_TAGS, f"text outside scaffold elements: {token.text.strip()[:40]!r}", token.start)
        for token in tree.outside_text
    ]
    violations += _check_stages(tree)
    violations += _check_tool_calls(tree, tuple(tool_names), max_tool_calls)
    violations += _check_contents(tree)
    return violations


def _check_react(tree: _Tree) -> list[Violation]:
    """An unstructured trace: at least one tool call, then exactly one answer, and nothing called after it."""
    out: list[Violation] = []
    if not any(e.name == "call_tool" for e in tree.elements):
        out.append(Violation(codes.MISSING_RESEARCH, "no <call_tool>: nothing was researched", None))
    answers = [e for e in tree.top if e.name == "answer"]
    if not answers:
        out.append(Violation(codes.MISSING_ANSWER, "no <answer>", None))
    for extra in answers[1:]:
        out.append(Violation(codes.REPEATED_STAGE, "a second <answer>", extra.start))
    if answers and any(e.name == "call_tool" and e.start > answers[0].start for e in tree.top):
        out.append(Violation(codes.STAGE_ORDER, "a tool call after the <answer>", answers[0].start))
    return out


def _check_stages(tree: _Tree) -> list[Violation]:
    out: list[Violation] = []
    stage_elements = [e for e in tree.elements if e.name in TAG_STAGE]
    plans = [e for e in stage_elements if e.name == "structured_plan" and e.stage == "plan"]
    if not plans:
        out.append(Violation(codes.MISSING_PLAN, "no <structured_plan> before research", None))
    if not any(e.name == "call_tool" for e in stage_elements):
        out.append(Violation(codes.MISSING_RESEARCH, "no <call_tool>: nothing was researched", None))
    for name, missing_code in (("review", codes.MISSING_REVIEW), ("answer", codes.MISSING_ANSWER)):
        if not any(e.name == name for e in stage_elements):
            out.append(Violation(missing_code, f"no <{name}>", None))
    for label, group in (
        ("structured_plan (plan stage)", plans),
        ("review", [e for e in stage_elements if e.name == "review"]),
        ("answer", [e for e in stage_elements if e.name == "answer"]),
    ):
        for extra in group[1:]:
            out.append(Violation(codes.REPEATED_STAGE, f"a second <{label.split()[0]}> ({label})", extra.start))
    latest = 0
    for element in stage_elements:
        rank = STAGE_IDS[element.stage]
        # A tool output follows its call; the call already carries any ordering problem.
        if rank < latest and element.name != "tool_output":
            out.append(
                Violation(
                    codes.STAGE_ORDER,
                    f"<{element.name}> ({element.stage}) comes after the {STAGES[latest]} stage",
                    element.start,
                )
            )
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
            out.append(Violation(codes.MALFORMED_TOOL_CALL, "<call_tool> has no name attribute", element.start))
        elif name not in tool_names:
            out.append(Violation(codes.UNKNOWN_TOOL, f"tool {name!r} is not one of {list(tool_names)}", element.start))
        if element.nested_tag_at is not None:
            out.append(Violation(codes.MALFORMED_TOOL_CALL, "tags inside <call_tool>", element.nested_tag_at))
        elif element.closed and not _content(tree, element).strip():
            out.append(Violation(codes.MALFORMED_TOOL_CALL, "<call_tool> has an empty query", element.start))
        if element.closed:
            completed += 1
    if max_tool_calls is not None and completed > max_tool_calls:
        out.append(Violation(codes.TOO_MANY_TOOL_CALLS, f"{completed} tool calls, budget {max_tool_calls}", None))
    # Calls and outputs pair up in the top-level sequence: each call is answered right after it.
    for index, element in enumerate(tree.top):
        following = tree.top[index + 1] if index + 1 < len(tree.top) else None
        previous = tree.top[index - 1] if index > 0 else None
        if element.name == "call_tool" and element.closed and (following is None or following.name != "tool_output"):
            message = "<call_tool> is not followed by <tool_output>"
            out.append(Violation(codes.TOOL_CALL_WITHOUT_OUTPUT, message, element.start))
        if element.name == "tool_output" and (previous is None or previous.name != "call_tool"):
            message = "<tool_output> without a tool call right before it"
            out.append(Violation(codes.MALFORMED_TAG, message, element.start))
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
                message = f"<structured_plan> lacks {', '.join(gaps)}"
                out.append(Violation(codes.INCOMPLETE_PLAN, message, element.start))
        elif element.name == "state_evaluation":
            if state_verdict(_content(tree, element)) is None:
                out.append(Violation(codes.INVALID_STATE_EVALUATION, "no continue|revise|ready verdict", element.start))
        elif element.name == "review":
            gaps = _review_gaps(tree, element)
            if gaps:
                out.append(Violation(codes.INCOMPLETE_REVIEW, f"<review> lacks {', '.join(gaps)}", element.start))
        elif element.name == "answer":
            out += _check_answer(tree, element, retrieved)
    return out


def _check_answer(tree: _Tree, answer: _Element, retrieved: list[tuple[int, set[str]]]) -> list[Violation]:
    if not _strip_scaffold_tags(_content(tree, answer)).strip():
        return [Violation(codes.EMPTY_ANSWER, "<answer> has no text", answer.start)]
    cites = [child for child in answer.children if child.name == "cite"]
    if not cites:
        return [Violation(codes.UNCITED_ANSWER, "<answer> has no <cite>", answer.start)]
    out: list[Violation] = []
    for cite in cites:
        ids = _cite_ids(cite)
        if not ids:
            out.append(Violation(codes.MALFORMED_TAG, "<cite> has no id attribute", cite.start))
        if not _strip_scaffold_tags(_content(tree, cite)).strip():
            out.append(Violation(codes.MALFORMED_TAG, "<cite> has no claim text", cite.start))
        seen = set().union(*(found for end, found in retrieved if end <= cite.start))
        for doc_id in ids:
            if doc_id not in seen:
                message = f"cited id {doc_id!r} was never retrieved"
                out.append(Violation(codes.CITATION_NOT_RETRIEVED, message, cite.start))
    return out
