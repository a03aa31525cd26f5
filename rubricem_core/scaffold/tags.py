"""Stages and tags of the scaffold, and the one tag regex both scanners use.

Tags are recognised only for the scaffold's own tag names (``<b>`` or ``<think>`` is plain text),
opening tags may carry attributes, closing tags are exactly ``</name>``.
"""

from __future__ import annotations

import re

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
    "structured_plan",
    "deep_analysis",
    "rubric",
    "knowledge_checklist",
    "analytical_criteria",
    "negative_constraints",
    "research_plan",
    "call_tool",
    "tool_output",
    "snippet",
    "error",
    "state_evaluation",
    "review",
    "rubric_review",
    "writing_plan",
    "thesis",
    "outline",
    "answer",
    "cite",
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
_ATTR_RE = re.compile(r"""([A-Za-z_][\w-]*)\s*=\s*(?:"([^"]*)"|'([^']*)')""")


def _attributes(attr_text: str) -> dict[str, str]:
    return {m.group(1): (m.group(2) if m.group(2) is not None else m.group(3)) for m in _ATTR_RE.finditer(attr_text)}
