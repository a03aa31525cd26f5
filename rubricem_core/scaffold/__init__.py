"""The stage-structured research scaffold: format, system prompt, parsers and validator.

One format is shared by the teacher prompt, SFT filtering, streaming rollouts and the judge::

    <structured_plan> <deep_analysis/> <rubric> three lists </rubric> <research_plan/> </structured_plan>
    ( <call_tool name="search">query</call_tool> <tool_output>…</tool_output> | <state_evaluation/> )*
    <review> <rubric_review/> <writing_plan> <thesis/> <outline/> </writing_plan> </review>
    <answer> report with <cite id="D12">claim</cite> </answer>

Modules, each one concern (everything public is re-exported here, so ``from rubricem_core.scaffold
import X`` is the import to use):

- ``tags``: stages, tag names, nesting rules, the tag regex; ``records``: small result records;
- ``codes``: validator violation codes; ``prompt``: the system prompt; ``markup``: tool-output
  blocks and tag neutralising/stripping for untrusted text;
- ``stages``: the stage machine both scanners share; ``segments``: the whole-text scanner
  (:func:`parse_segments`); ``stream``: the incremental :class:`StreamParser` (rollouts);
- ``tree``: the element tree; ``extract``: reading calls, citations, plans and verdicts from a
  trace; ``validator``: :func:`validate`.
"""

from rubricem_core.scaffold.codes import (
    CITATION_NOT_RETRIEVED,
    EMPTY_ANSWER,
    INCOMPLETE_PLAN,
    INCOMPLETE_REVIEW,
    INVALID_STATE_EVALUATION,
    MALFORMED_TAG,
    MALFORMED_TOOL_CALL,
    MISSING_ANSWER,
    MISSING_PLAN,
    MISSING_RESEARCH,
    MISSING_REVIEW,
    REPEATED_STAGE,
    STAGE_ORDER,
    TEXT_OUTSIDE_TAGS,
    TOO_MANY_TOOL_CALLS,
    TOOL_CALL_WITHOUT_OUTPUT,
    UNCITED_ANSWER,
    UNKNOWN_TOOL,
    VIOLATION_CODES,
    CodeTable,
    violation_codes,
)
from rubricem_core.scaffold.extract import (
    extract_answer,
    extract_citations,
    extract_plan,
    extract_plans,
    extract_snippet_ids,
    extract_tool_calls,
    extract_verdicts,
    state_verdict,
)
from rubricem_core.scaffold.markup import format_tool_output, neutralize_tags, strip_tags
from rubricem_core.scaffold.prompt import (
    EXAMPLE_TRACE,
    PLAIN_PROMPT_OPENING,
    plain_system_prompt,
    prompt_guidance,
    system_prompt,
)
from rubricem_core.scaffold.records import (
    DEFAULT_TOOLS,
    Citation,
    Plan,
    ScaffoldError,
    Segment,
    ToolCall,
    ToolSpec,
    Violation,
)
from rubricem_core.scaffold.segments import merge_pieces, parse_segments, stage_at, stage_texts, violation_stages
from rubricem_core.scaffold.stream import StreamParser
from rubricem_core.scaffold.tags import (
    ALLOWED_CHILDREN,
    MAX_ATTR_CHARS,
    STAGE_IDS,
    STAGES,
    STOP_STRINGS,
    TAG_NAMES,
    TAG_STAGE,
    TOOL_CALL_CLOSE,
    TOOL_OUTPUT_CLOSE,
    TOP_LEVEL_TAGS,
    VERDICTS,
)
from rubricem_core.scaffold.validator import validate

__all__ = [
    "PLAIN_PROMPT_OPENING",
    "plain_system_prompt",
    "prompt_guidance",
    "ALLOWED_CHILDREN",
    "CITATION_NOT_RETRIEVED",
    "DEFAULT_TOOLS",
    "EMPTY_ANSWER",
    "EXAMPLE_TRACE",
    "INCOMPLETE_PLAN",
    "INCOMPLETE_REVIEW",
    "INVALID_STATE_EVALUATION",
    "MALFORMED_TAG",
    "MALFORMED_TOOL_CALL",
    "MAX_ATTR_CHARS",
    "MISSING_ANSWER",
    "MISSING_PLAN",
    "MISSING_RESEARCH",
    "MISSING_REVIEW",
    "REPEATED_STAGE",
    "STAGES",
    "STAGE_IDS",
    "STAGE_ORDER",
    "STOP_STRINGS",
    "TAG_NAMES",
    "TAG_STAGE",
    "TEXT_OUTSIDE_TAGS",
    "TOOL_CALL_CLOSE",
    "TOOL_CALL_WITHOUT_OUTPUT",
    "TOOL_OUTPUT_CLOSE",
    "TOO_MANY_TOOL_CALLS",
    "TOP_LEVEL_TAGS",
    "UNCITED_ANSWER",
    "UNKNOWN_TOOL",
    "VERDICTS",
    "VIOLATION_CODES",
    "Citation",
    "CodeTable",
    "Plan",
    "ScaffoldError",
    "Segment",
    "StreamParser",
    "ToolCall",
    "ToolSpec",
    "Violation",
    "extract_answer",
    "extract_citations",
    "extract_plan",
    "extract_plans",
    "extract_snippet_ids",
    "extract_tool_calls",
    "extract_verdicts",
    "format_tool_output",
    "merge_pieces",
    "neutralize_tags",
    "parse_segments",
    "stage_at",
    "stage_texts",
    "violation_stages",
    "state_verdict",
    "strip_tags",
    "system_prompt",
    "validate",
    "violation_codes",
]
