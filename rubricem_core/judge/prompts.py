"""Prompts, JSON schemas and reply validation of the judge's two calls.

1. Rubric generation — one call per query per step. It sees the question, the rubrics already in
   force, and the whole rollout group split by stage (each rollout's own planning rubric shown as
   a reference, never as ground truth), and returns new positive and negative rubrics per stage:
   the paper's 1–4 for plan, research and review and 2–5 for the answer, each stage framed by a
   central question.
2. Scoring — one call per trajectory. It sees the question, every active rubric (with its id) and
   the trajectory split by stage, and returns a 0/1/2 score with a justification for each rubric.

Two switches change what the judge is shown: ``view="answer"`` shows the question and each
rollout's final answer only (Baseline-RL, DR Tulu's evolving-answer objective), and
``show_reference=False`` leaves out the query's reference answer and spec (an answer key the
paper's judge never sees).

The user messages are built from delimited sections (``<<<NAME>>>`` on a line of its own) so that
any model can read them and the built-in judge can parse them back; text from the query or the
trajectory is escaped so it cannot open a section of its own.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from rubricem_core.judge.types import ADAPTIVE_WEIGHTS, POLARITIES, SCORES, JudgeQuery, JudgeRollout, Rubric
from rubricem_core.llm.replies import (  # ReplyError stays importable from here
    ReplyError,
    entries_shape,
    load_json_reply,
    one_entry_per_id,
)
from rubricem_core.llm.replies import (
    schema_error as _schema_error,
)
from rubricem_core.scaffold import STAGES, TAG_NAMES, extract_plan, parse_segments

TITLE_MAX_CHARS = 200
DESCRIPTION_MAX_CHARS = 1000
JUSTIFICATION_MAX_CHARS = 2000

# What the judge sees of a rollout: every stage (tool outputs included), or the final answer only.
TRAJECTORY_VIEW = "trajectory"
ANSWER_VIEW = "answer"
VIEWS: tuple[str, ...] = (TRAJECTORY_VIEW, ANSWER_VIEW)

# (fewest, most) new rubrics one generation call writes per stage, from the paper.
RUBRIC_COUNTS: dict[str, tuple[int, int]] = {"plan": (1, 4), "research": (1, 4), "review": (1, 4), "answer": (2, 5)}

_SECTION_LINE = re.compile(r"^<<<([^<>\n]+)>>>$", re.M)
_COUNTS_LINE = re.compile(r"^New rubrics per stage: (.+)\.$", re.M)
_COUNT_ITEM = re.compile(r"(\w+) (\d+)-(\d+)")


# ---- the stage view of a trajectory ---------------------------------------------------------------

STAGE_GUIDE = {
    "plan": "the structured plan written before research (deep analysis, the agent's own rubric, research plan)",
    "research": "tool calls, the tool outputs they returned, state evaluations and plan revisions",
    "review": "the rubric review (criteria mapped to evidence ids, gaps) and the writing plan",
    "answer": "the final long-form report with <cite id=...> citations",
}

# The paper frames each stage's rubrics by one central question, made specific to the query.
CENTRAL_QUESTIONS = {
    "plan": "Does the plan pin down what this question needs (entities, facts, comparisons) and a sound way to "
    "find it?",
    "research": "Did the research find, read correctly and verify the evidence this question needs, adapting "
    "when the results called for it?",
    "review": "Does the review map each criterion of this question to evidence actually retrieved, and name "
    "what is still missing?",
    "answer": "Does the report answer this question correctly and completely, every claim backed by a cited source?",
}


def escape_section_markers(text: str) -> str:
    """Untrusted text must not be able to start a ``<<<SECTION>>>`` of the prompt."""
    return text.replace("<<<", "<< <")


def _clip(text: str, max_chars: int | None) -> str:
    if max_chars is None or len(text) <= max_chars:
        return text
    head = max_chars // 2
    tail = max_chars - head
    return f"{text[:head]}\n[... {len(text) - max_chars} characters omitted ...]\n{text[-tail:]}"


def stage_blocks(text: str) -> list[tuple[str, str]]:
    """The trajectory as consecutive (stage, text) runs, tool outputs kept inside research.

    A well-formed trace gives exactly plan, research, review, answer; a disordered one gives more
    runs, in the order written, so nothing is hidden from the judge.
    """
    blocks: list[tuple[str, str]] = []
    for segment in parse_segments(text):
        if blocks and blocks[-1][0] == segment.stage:
            blocks[-1] = (segment.stage, blocks[-1][1] + segment.text)
        else:
            blocks.append((segment.stage, segment.text))
    return blocks


def answer_text(text: str) -> str:
    """What the answer stage wrote (the report with its citations); never a tool output."""
    return "".join(s.text for s in parse_segments(text) if s.stage == "answer" and not s.is_tool_output)


def _check_view(view: str) -> None:
    if view not in VIEWS:
        raise ValueError(f"judge view must be one of {VIEWS}, got {view!r}")


def _section(name: str, body: str) -> str:
    return f"<<<{name}>>>\n{body.strip()}"


def _query_sections(query: JudgeQuery, show_reference: bool = True) -> list[str]:
    parts = [_section("QUESTION", escape_section_markers(query.question))]
    if not show_reference:  # the paper's judge: query, rollouts and rubrics, no answer key
        return parts
    if query.spec:
        parts.append(_section("QUERY SPEC", json.dumps(query.spec, ensure_ascii=False, sort_keys=True)))
    if query.reference_answer:
        parts.append(_section("REFERENCE ANSWER", escape_section_markers(query.reference_answer)))
    return parts


def rubric_line(rubric: Rubric) -> str:
    record = rubric.shown()
    if rubric.check is not None:
        record["check"] = rubric.check
    return escape_section_markers(json.dumps(record, ensure_ascii=False, sort_keys=True))


def _trajectory_sections(text: str, prefix: str, max_block_chars: int | None) -> list[str]:
    blocks = stage_blocks(text)
    if not blocks:
        return [_section(f"{prefix}STAGE plan", "(empty trajectory)")]
    return [
        _section(f"{prefix}STAGE {stage}", escape_section_markers(_clip(body, max_block_chars)))
        for stage, body in blocks
    ]


def _rollout_sections(text: str, prefix: str, max_block_chars: int | None, view: str) -> list[str]:
    if view == TRAJECTORY_VIEW:
        return _trajectory_sections(text, prefix, max_block_chars)
    answer = answer_text(text)
    body = escape_section_markers(_clip(answer, max_block_chars)) if answer.strip() else "(no answer)"
    return [_section(f"{prefix}STAGE answer", body)]


def _shown_stages(view: str) -> str:
    """The system prompt's lines on what each shown stage holds."""
    if view == ANSWER_VIEW:
        return f"Only the final answer of each rollout is shown: {STAGE_GUIDE['answer']}."
    lines = "\n".join(f"- {stage}: {STAGE_GUIDE[stage]}" for stage in STAGES)
    return f"Each rollout is shown split into its four stages:\n{lines}"


def _planning_rubric(text: str) -> str:
    plan = extract_plan(text)
    if plan is None:
        return "(no plan-stage rubric)"
    lines = []
    for label, items in (
        ("knowledge checklist", plan.knowledge_checklist),
        ("analytical criteria", plan.analytical_criteria),
        ("negative constraints", plan.negative_constraints),
    ):
        lines.append(f"{label}:")
        lines += [f"- {item}" for item in items] or ["- (none)"]
    return escape_section_markers("\n".join(lines))


# ---- rubric generation ---------------------------------------------------------------------------

GENERATION_SYSTEM = """You are the rubric writer of a research-agent judge. A group of rollouts of one research agent answered the same question. {shown}

Write NEW rubrics that separate better rollouts from worse ones in this group: positive ones (what good work does) and negative ones (mistakes to penalise). Each stage has a central question; make it specific to this question and write rubrics that answer it:
{central}

How many new rubrics to write, most important first (any beyond the most are cut):
{counts}
These counts are targets, not quotas: when fewer criteria truly separate this group, write fewer rather than pad the list with weak or redundant rubrics.

Principles:
1. Discriminative: a rubric must be met by some rollouts of this group and missed by others. A criterion that every rollout meets or every rollout misses teaches nothing.
2. Question-specific: name the entities, facts, sources and reasoning this question needs. Generic advice ("is well written", "is thorough") is not a rubric.
3. Stage-local: judge a stage only by what that stage is responsible for (research rubrics judge searches and evidence, not the prose of the answer).
4. Non-redundant: never repeat or rephrase an existing rubric or another new one.
5. No mirror pairs: a negative rubric names a distinct mistake (a wrong value, a look-alike source, a claim its source does not support), never a positive rubric restated negated ("does not state X" beside "states X").
6. Evidence over plan: a plan is a hypothesis. Never penalise research or an answer that goes beyond the plan because the evidence warranted it (a new search, a revised plan, a finding the plan did not foresee).
7. Never write a rubric about the presence, order or syntax of tags or the output format; never a rubric that rewards following the agent's own planning rubric (it is shown only as a reference and may be weak or wrong).
8. No overfitting to one rollout: state the property of the work this question needs, in your own words, so that any rollout can meet it however it phrases things; never make one rollout's wording, structure or particular phrasing the criterion.
9. Quality, not self-consistency: a trajectory that agrees with itself (an answer that matches its own plan, review or earlier claims) is not thereby correct or complete; judge against the question and the evidence actually retrieved.
Weight each rubric 1 (minor), 2 (important) or 3 (essential).

Reply with one JSON object and nothing else, following this JSON schema:
{schema}"""


def rubric_counts(max_new_per_stage: int, stages: Sequence[str] = STAGES) -> dict[str, tuple[int, int]]:
    """(fewest, most) new rubrics per stage: the paper's range capped by ``max_new_per_stage``, and
    (0, 0) for stages that get no rubrics (in every stage order)."""
    out: dict[str, tuple[int, int]] = {}
    for stage in STAGES:
        if stage not in stages:
            out[stage] = (0, 0)
            continue
        low, high = RUBRIC_COUNTS[stage]
        high = min(high, max_new_per_stage)
        out[stage] = (min(low, high), high)
    return out


def _count_lines(counts: Mapping[str, tuple[int, int]]) -> str:
    lines = []
    for stage, (low, high) in counts.items():
        if high:
            lines.append(f"- {stage}: {high if low == high else f'{low} to {high}'}")
    empty = [stage for stage, (_, high) in counts.items() if not high]
    if empty:
        lines.append(f"- {', '.join(empty)}: none (leave the list empty)")
    return "\n".join(lines)


def _counts_line(counts: Mapping[str, tuple[int, int]]) -> str:
    """The END line (machine-readable: the built-in judge reads its limits from it)."""
    return "New rubrics per stage: " + ", ".join(f"{s} {low}-{high}" for s, (low, high) in counts.items()) + "."


def generation_schema(counts: Mapping[str, tuple[int, int]] | None = None) -> dict[str, Any]:
    """The reply's JSON schema; with ``counts`` it also caps each stage's list (sent to the provider; no
    minimum: the counts are targets), without them it is the shape that replies are validated against."""
    item = {
        "type": "object",
        "properties": {
            "polarity": {"enum": list(POLARITIES)},
            "title": {"type": "string", "minLength": 3, "maxLength": TITLE_MAX_CHARS},
            "description": {"type": "string", "maxLength": DESCRIPTION_MAX_CHARS},
            "weight": {"type": "integer", "enum": list(ADAPTIVE_WEIGHTS)},
            # Optional machine-checkable criterion: the built-in judge fills it, LLM judges omit it.
            "check": {"type": ["object", "null"]},
        },
        "required": ["polarity", "title", "description", "weight"],
        "additionalProperties": False,
    }
    properties: dict[str, Any] = {}
    for stage in STAGES:
        bounded: dict[str, Any] = {"type": "array", "items": item}
        if counts is not None:
            bounded["maxItems"] = counts[stage][1]
        properties[stage] = bounded
    return {"type": "object", "properties": properties, "required": list(STAGES), "additionalProperties": False}


def generation_messages(
    query: JudgeQuery,
    rollouts: Sequence[JudgeRollout],
    existing: Sequence[Rubric],
    max_new_per_stage: int,
    max_block_chars: int | None = None,
    *,
    stages: Sequence[str] = STAGES,
    view: str = TRAJECTORY_VIEW,
    show_reference: bool = True,
) -> list[dict[str, str]]:
    _check_view(view)
    counts = rubric_counts(max_new_per_stage, stages)
    system = GENERATION_SYSTEM.format(
        shown=_shown_stages(view),
        central="\n".join(f"- {stage}: {CENTRAL_QUESTIONS[stage]}" for stage in STAGES if counts[stage][1]),
        counts=_count_lines(counts),
        schema=json.dumps(generation_schema(counts)),
    )
    parts = ["TASK: write new rubrics for this question from the rollout group below."]
    parts += _query_sections(query, show_reference)
    parts.append(_section("EXISTING RUBRICS", "\n".join(rubric_line(r) for r in existing) or "(none)"))
    for index, rollout in enumerate(rollouts, 1):
        if view == TRAJECTORY_VIEW:
            parts.append(_section(f"ROLLOUT {index} PLANNING RUBRIC (reference only)", _planning_rubric(rollout.text)))
        parts += _rollout_sections(rollout.text, f"ROLLOUT {index} ", max_block_chars, view)
    parts.append(_section("END", _counts_line(counts)))
    return [{"role": "system", "content": system}, {"role": "user", "content": "\n\n".join(parts)}]


# A tag in angle brackets, or a bare tag name that is no ordinary word (review, answer, cite are).
_TAG_WORDS = re.compile(
    rf"<\s*/?\s*(?:{'|'.join(TAG_NAMES)})\b|\b(?:tags?|xml|{'|'.join(n for n in TAG_NAMES if '_' in n)})\b", re.I
)
_SELF_RUBRIC = re.compile(
    r"\b(?:its|own|the agent's|the model's)\s+(?:own\s+)?(?:[a-z]+\s+)?(?:rubric|checklist|criteria|"
    r"constraints)\b",
    re.I,
)


def forbidden_rubric(title: str, description: str) -> str | None:
    """Why a generated rubric breaks the writing principles in a way we can detect, or None."""
    text = f"{title} {description}"
    if _TAG_WORDS.search(text):
        return "checks tags or output format"
    if _SELF_RUBRIC.search(text):
        return "rewards following the agent's own rubric"
    return None


@dataclass(frozen=True)
class GeneratedRubric:
    stage: str
    polarity: str
    title: str
    description: str
    weight: int
    check: dict[str, Any] | None = None


def parse_generation(
    text: str | None, max_new_per_stage: int, *, stages: Sequence[str] = STAGES
) -> tuple[list[GeneratedRubric], list[str]]:
    """Validated new rubrics, and notes on the ones dropped.

    Counts follow ``rubric_counts``: a stage's rubrics beyond its most are cut (the first ones
    kept: the prompt asks for the most important first); fewer than the fewest is kept (the counts are
    targets, not quotas, as in the paper). Rubrics of stages not in ``stages`` and rubrics that break a
    detectable writing principle are dropped.
    """
    data = load_json_reply(text)
    problem = _schema_error(data, generation_schema())  # the shape; the counts are enforced below
    if problem:
        raise ReplyError(problem)
    counts = rubric_counts(max_new_per_stage, stages)
    rubrics: list[GeneratedRubric] = []
    dropped: list[str] = []
    for stage in STAGES:
        kept = 0
        for item in data[stage]:
            title, description = item["title"].strip(), item["description"].strip()
            if not title:
                raise ReplyError(f"at {stage}: a rubric has an empty title")
            if stage not in stages:
                dropped.append(f"{stage}: {title!r} (stage not judged)")
                continue
            reason = forbidden_rubric(title, description)
            if reason:
                dropped.append(f"{stage}: {title!r} ({reason})")
                continue
            if kept == counts[stage][1]:
                dropped.append(f"{stage}: {title!r} (beyond the stage's {counts[stage][1]} new rubrics)")
                continue
            rubrics.append(
                GeneratedRubric(stage, item["polarity"], title, description, int(item["weight"]), item.get("check"))
            )
            kept += 1
    return rubrics, dropped


# ---- scoring --------------------------------------------------------------------------------------

SCORING_SYSTEM = """You are the judge of a research agent. Score ONE {what} against every rubric listed. {shown}

{judge_from} Scores:
- 2: the rubric's criterion fully holds
- 1: it partly holds
- 0: it does not hold
Positive rubrics describe good work; negative rubrics describe a mistake, and their score says how fully the mistake is present (2 = clearly made, 0 = not made). A machine-checkable "check" object, when a rubric has one, states precisely what to verify.
For each rubric write a short justification grounded in {grounded}, then the score. Score every rubric exactly once, using its id.

Reply with one JSON object and nothing else, following this JSON schema:
{schema}"""

_SCORING_VIEW = {
    TRAJECTORY_VIEW: dict(
        what="trajectory",
        judge_from="Judge each rubric only from the stage it names, using only what the trajectory shows (tool "
        "outputs are the evidence the agent actually saw). A plan is a hypothesis: never take points "
        "away because the research or the answer went beyond the plan when the evidence warranted it.",
        grounded="the trajectory (quote the claim, the search or the evidence id)",
    ),
    ANSWER_VIEW: dict(
        what="answer",
        judge_from="Judge every rubric from the answer alone, using only what it states and cites.",
        grounded="the answer (quote the claim or the cited id)",
    ),
}


# A scored rubric: its justification, then the 0/1/2 score.
_SCORE_FIELDS = {
    "justification": {"type": "string", "minLength": 1, "maxLength": JUSTIFICATION_MAX_CHARS},
    "score": {"type": "integer", "enum": list(SCORES)},
}


def scoring_schema(rubric_ids: Sequence[str]) -> dict[str, Any]:
    return one_entry_per_id("scores", "rubric_id", rubric_ids, _SCORE_FIELDS)


def scoring_messages(
    query: JudgeQuery,
    rollout: JudgeRollout,
    rubrics: Sequence[Rubric],
    max_block_chars: int | None = None,
    *,
    view: str = TRAJECTORY_VIEW,
    show_reference: bool = True,
) -> list[dict[str, str]]:
    _check_view(view)
    # The exact schema (its id enum) differs per request and travels as response_format; the
    # system prompt shows the shape with a placeholder id so it is identical for every trajectory
    # (providers cache shared prompt prefixes).
    shape = entries_shape(
        "scores", "rubric_id", {"type": "string", "description": "the id of a listed rubric"}, _SCORE_FIELDS
    )
    shown = (
        f"The question and the agent's final answer are shown: {STAGE_GUIDE['answer']}."
        if view == ANSWER_VIEW
        else "The trajectory is shown split by stage:\n"
        + "\n".join(f"- {stage}: {STAGE_GUIDE[stage]}" for stage in STAGES)
    )
    system = SCORING_SYSTEM.format(shown=shown, schema=json.dumps(shape), **_SCORING_VIEW[view])
    parts = [f"TASK: score this {_SCORING_VIEW[view]['what']} against every rubric."]
    parts += _query_sections(query, show_reference)
    parts.append(_section("RUBRICS", "\n".join(rubric_line(r) for r in rubrics)))
    parts += _rollout_sections(rollout.text, "TRAJECTORY ", max_block_chars, view)
    parts.append(_section("END", f"Score all {len(rubrics)} rubrics."))
    return [{"role": "system", "content": system}, {"role": "user", "content": "\n\n".join(parts)}]


def parse_scores(text: str | None, rubric_ids: Sequence[str]) -> dict[str, tuple[int, str]]:
    """{rubric_id: (score, justification)} with every asked id exactly once, or ReplyError."""
    data = load_json_reply(text)
    problem = _schema_error(data, scoring_schema(list(rubric_ids)))
    if problem:
        raise ReplyError(problem)
    out: dict[str, tuple[int, str]] = {}
    for item in data["scores"]:
        rubric_id = item["rubric_id"]
        if rubric_id in out:
            raise ReplyError(f"rubric id {rubric_id!r} is scored twice")
        out[rubric_id] = (int(item["score"]), item["justification"].strip() or "-")
    missing = [rubric_id for rubric_id in rubric_ids if rubric_id not in out]
    if missing:
        raise ReplyError(f"rubric ids not scored: {missing}")
    return out


# ---- reading a prompt back (the built-in judge) ----------------------------------------------------


def split_sections(content: str) -> list[tuple[str, str]]:
    """(name, body) of every ``<<<NAME>>>`` section of a user message, in order."""
    marks = list(_SECTION_LINE.finditer(content))
    out = []
    for index, mark in enumerate(marks):
        end = marks[index + 1].start() if index + 1 < len(marks) else len(content)
        out.append((mark.group(1), content[mark.end() : end].strip("\n")))
    return out


def unescape_section_markers(text: str) -> str:
    return text.replace("<< <", "<<<")


def generation_limits(content: str) -> dict[str, int] | None:
    """{stage: most new rubrics} from a generation prompt's END line, or None."""
    match = _COUNTS_LINE.search(content)
    if not match:
        return None
    return {stage: int(high) for stage, _, high in _COUNT_ITEM.findall(match.group(1))}
