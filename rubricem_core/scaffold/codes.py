"""Violation codes of the scaffold validator and what each means (the ``reject_reasons`` column)."""

from __future__ import annotations

from collections.abc import Iterable

from rubricem_core.scaffold.records import Violation


class CodeTable(dict[str, str]):
    """One validator's codes, each with what it means: declaring a code adds it to the table.

    ``NAME = TABLE.code("name", "meaning")`` keeps a code and its meaning in one place; the table
    is the documented vocabulary of the ``reject_reasons`` column. The reflection validator
    (``reflection.format``) declares its codes the same way.
    """

    def code(self, name: str, meaning: str) -> str:
        if name in self:
            raise ValueError(f"code {name!r} is declared twice")
        self[name] = meaning
        return name


VIOLATION_CODES = CodeTable()
_code = VIOLATION_CODES.code

MISSING_PLAN = _code("missing_plan", "no <structured_plan> before research starts")
MISSING_RESEARCH = _code("missing_research", "no <call_tool> at all: the answer is not grounded in any retrieval")
MISSING_REVIEW = _code("missing_review", "no <review> element")
MISSING_ANSWER = _code("missing_answer", "no <answer> element")
REPEATED_STAGE = _code(
    "repeated_stage", "a single-use stage element appears twice (two plans before research, two <review>, two <answer>)"
)
STAGE_ORDER = _code(
    "stage_order",
    "a stage element appears after a later stage (e.g. <review> before the plan, <call_tool> after <review>)",
)
MALFORMED_TAG = _code(
    "malformed_tag",
    "unclosed, mismatched or stray closing tag, a tag in the wrong place, "
    "<tool_output> not right after a call, or a <cite> without id or claim",
)
MALFORMED_TOOL_CALL = _code(
    "malformed_tool_call", "<call_tool> without a name attribute, with an empty query, or with tags inside"
)
UNKNOWN_TOOL = _code("unknown_tool", "<call_tool> names a tool that is not available")
TOOL_CALL_WITHOUT_OUTPUT = _code(
    "tool_call_without_output", "a <call_tool> is not followed by the environment's <tool_output>"
)
UNCITED_ANSWER = _code("uncited_answer", "the answer contains no <cite>")
CITATION_NOT_RETRIEVED = _code(
    "citation_not_retrieved", "a <cite> id never appeared as a snippet id in an earlier <tool_output>"
)
EMPTY_ANSWER = _code("empty_answer", "the answer has no text")
TEXT_OUTSIDE_TAGS = _code("text_outside_tags", "non-whitespace text outside every top-level scaffold element")
INCOMPLETE_PLAN = _code(
    "incomplete_plan", "a <structured_plan> lacks deep_analysis, one of the three rubric lists, or research_plan"
)
INCOMPLETE_REVIEW = _code(
    "incomplete_review", "a <review> lacks rubric_review or a writing_plan with thesis and outline"
)
INVALID_STATE_EVALUATION = _code(
    "invalid_state_evaluation", "a <state_evaluation> gives no continue|revise|ready verdict"
)
TOO_MANY_TOOL_CALLS = _code("too_many_tool_calls", "more tool calls than the allowed budget")


def violation_codes(violations: Iterable[Violation]) -> list[str]:
    """Distinct codes in first-seen order (the ``reject_reasons`` column)."""
    return list(dict.fromkeys(violation.code for violation in violations))
