"""Prompts, JSON schemas and reply validation of the judge's two calls.

1. Rubric generation — one call per query per step. It sees the question, the rubrics already in
   force, and the whole rollout group split by stage (each rollout's own planning rubric shown as
   a reference, never as ground truth), and returns new positive and negative rubrics per stage.
2. Scoring — one call per trajectory. It sees the question, every active rubric (with its id) and
   the trajectory split by stage, and returns a 0/1/2 score with a justification for each rubric.

The user messages are built from delimited sections (``<<<NAME>>>`` on a line of its own) so that
any model can read them and the built-in judge can parse them back; text from the query or the
trajectory is escaped so it cannot open a section of its own.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Sequence

import jsonschema

from rubricem_core.judge.types import ADAPTIVE_WEIGHTS, POLARITIES, SCORES, JudgeQuery, JudgeRollout, Rubric
from rubricem_core.scaffold import STAGES, TAG_NAMES, extract_plan, parse_segments

MAX_ERROR_CHARS = 600
TITLE_MAX_CHARS = 200
DESCRIPTION_MAX_CHARS = 1000
JUSTIFICATION_MAX_CHARS = 2000

_SECTION_LINE = re.compile(r"^<<<([^<>\n]+)>>>$", re.M)
_LIMIT_LINE = re.compile(r"^Write at most (\d+) new rubrics per stage\.$", re.M)


class ReplyError(ValueError):
    """A judge reply is unusable: not JSON, wrong shape, unknown ids, out-of-range scores."""


# ---- the stage view of a trajectory ---------------------------------------------------------------

STAGE_GUIDE = {
    "plan": "the structured plan written before research (deep analysis, the agent's own rubric, research plan)",
    "research": "tool calls, the tool outputs they returned, state evaluations and plan revisions",
    "review": "the rubric review (criteria mapped to evidence ids, gaps) and the writing plan",
    "answer": "the final long-form report with <cite id=...> citations",
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


def _section(name: str, body: str) -> str:
    return f"<<<{name}>>>\n{body.strip()}"


def _query_sections(query: JudgeQuery) -> list[str]:
    parts = [_section("QUESTION", escape_section_markers(query.question))]
    if query.spec:
        parts.append(_section("QUERY SPEC", json.dumps(query.spec, ensure_ascii=False, sort_keys=True)))
    if query.reference_answer:
        parts.append(_section("REFERENCE ANSWER", escape_section_markers(query.reference_answer)))
    return parts


def rubric_line(rubric: Rubric) -> str:
    record: dict[str, Any] = {"id": rubric.rubric_id, "stage": rubric.stage, "polarity": rubric.polarity,
                              "weight": rubric.weight, "title": rubric.title, "description": rubric.description}
    if rubric.check is not None:
        record["check"] = rubric.check
    return escape_section_markers(json.dumps(record, ensure_ascii=False, sort_keys=True))


def _trajectory_sections(text: str, prefix: str, max_block_chars: int | None) -> list[str]:
    blocks = stage_blocks(text)
    if not blocks:
        return [_section(f"{prefix}STAGE plan", "(empty trajectory)")]
    return [_section(f"{prefix}STAGE {stage}", escape_section_markers(_clip(body, max_block_chars)))
            for stage, body in blocks]


def _planning_rubric(text: str) -> str:
    plan = extract_plan(text)
    if plan is None:
        return "(no plan-stage rubric)"
    lines = []
    for label, items in (("knowledge checklist", plan.knowledge_checklist),
                         ("analytical criteria", plan.analytical_criteria),
                         ("negative constraints", plan.negative_constraints)):
        lines.append(f"{label}:")
        lines += [f"- {item}" for item in items] or ["- (none)"]
    return escape_section_markers("\n".join(lines))


# ---- rubric generation ---------------------------------------------------------------------------

GENERATION_SYSTEM = """You are the rubric writer of a research-agent judge. A group of rollouts of one research agent answered the same question. Each rollout has four stages:
- plan: {plan}
- research: {research}
- review: {review}
- answer: {answer}

Write NEW rubrics that separate better rollouts from worse ones in this group, for every stage, both positive (what good work does) and negative (mistakes to penalise). Principles:
1. Discriminative: a rubric must be met by some rollouts of this group and missed by others. A criterion that every rollout meets or every rollout misses teaches nothing; do not write it.
2. Question-specific: name the entities, facts, sources and reasoning this question needs. Generic advice ("is well written", "is thorough") is not a rubric.
3. Stage-local: judge a stage only by what that stage is responsible for (research rubrics judge searches and evidence, not the prose of the answer).
4. Non-redundant: never repeat or rephrase an existing rubric or another new one.
5. Never write a rubric about the presence, order or syntax of tags or the output format; never a rubric that rewards following the agent's own planning rubric (it is shown only as a reference and may be weak or wrong).
Weight each rubric 1 (minor), 2 (important) or 3 (essential).

Reply with one JSON object and nothing else, following this JSON schema:
{schema}"""


def generation_schema(max_new_per_stage: int) -> dict[str, Any]:
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
    return {
        "type": "object",
        "properties": {stage: {"type": "array", "items": item, "maxItems": max_new_per_stage} for stage in STAGES},
        "required": list(STAGES),
        "additionalProperties": False,
    }


def generation_messages(query: JudgeQuery, rollouts: Sequence[JudgeRollout], existing: Sequence[Rubric],
                        max_new_per_stage: int, max_block_chars: int | None = None) -> list[dict[str, str]]:
    system = GENERATION_SYSTEM.format(**STAGE_GUIDE, schema=json.dumps(generation_schema(max_new_per_stage)))
    parts = ["TASK: write new rubrics for this question from the rollout group below."]
    parts += _query_sections(query)
    parts.append(_section("EXISTING RUBRICS", "\n".join(rubric_line(r) for r in existing) or "(none)"))
    for index, rollout in enumerate(rollouts, 1):
        parts.append(_section(f"ROLLOUT {index} PLANNING RUBRIC (reference only)", _planning_rubric(rollout.text)))
        parts += _trajectory_sections(rollout.text, f"ROLLOUT {index} ", max_block_chars)
    parts.append(_section("END", f"Write at most {max_new_per_stage} new rubrics per stage."))
    return [{"role": "system", "content": system}, {"role": "user", "content": "\n\n".join(parts)}]


# A tag in angle brackets, or a bare tag name that is no ordinary word (review, answer, cite are).
_TAG_WORDS = re.compile(
    rf"<\s*/?\s*(?:{'|'.join(TAG_NAMES)})\b|\b(?:tags?|xml|{'|'.join(n for n in TAG_NAMES if '_' in n)})\b", re.I)
_SELF_RUBRIC = re.compile(
    r"\b(?:its|own|the agent's|the model's)\s+(?:own\s+)?(?:[a-z]+\s+)?(?:rubric|checklist|criteria|"
    r"constraints)\b", re.I)


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


def load_json_reply(text: str | None) -> Any:
    if text is None:
        raise ReplyError("the reply has no text")
    stripped = text.strip()
    fenced = re.fullmatch(r"```(?:json)?\s*(.*?)\s*```", stripped, re.S)  # models often fence JSON
    if fenced:
        stripped = fenced.group(1)
    try:
        return json.loads(stripped)
    except json.JSONDecodeError as exc:
        raise ReplyError(f"the reply is not valid JSON: {exc}") from exc


def _schema_error(data: Any, schema: dict[str, Any]) -> str | None:
    error = jsonschema.exceptions.best_match(jsonschema.Draft202012Validator(schema).iter_errors(data))
    if error is None:
        return None
    where = "/".join(str(part) for part in error.absolute_path) or "(top level)"
    return f"at {where}: {error.message}"[:MAX_ERROR_CHARS]


def parse_generation(text: str | None, max_new_per_stage: int) -> tuple[list[GeneratedRubric], list[str]]:
    """Validated new rubrics, and notes on the ones dropped for breaking the principles."""
    data = load_json_reply(text)
    problem = _schema_error(data, generation_schema(max_new_per_stage))
    if problem:
        raise ReplyError(problem)
    rubrics: list[GeneratedRubric] = []
    dropped: list[str] = []
    for stage in STAGES:
        for item in data[stage]:
            title, description = item["title"].strip(), item["description"].strip()
            if not title:
                raise ReplyError(f"at {stage}: a rubric has an empty title")
            reason = forbidden_rubric(title, description)
            if reason:
                dropped.append(f"{stage}: {title!r} ({reason})")
                continue
            rubrics.append(GeneratedRubric(stage, item["polarity"], title, description, int(item["weight"]),
                                           item.get("check")))
    return rubrics, dropped


# ---- scoring --------------------------------------------------------------------------------------

SCORING_SYSTEM = """You are the judge of a research agent. Score ONE trajectory against every rubric listed. The trajectory is shown split by stage:
- plan: {plan}
- research: {research}
- review: {review}
- answer: {answer}

Judge each rubric only from the stage it names, using only what the trajectory shows (tool outputs are the evidence the agent actually saw). Scores:
- 2: the rubric's criterion fully holds
- 1: it partly holds
- 0: it does not hold
Positive rubrics describe good work; negative rubrics describe a mistake, and their score says how fully the mistake is present (2 = clearly made, 0 = not made). A machine-checkable "check" object, when a rubric has one, states precisely what to verify.
For each rubric write a short justification grounded in the trajectory (quote the claim, the search or the evidence id), then the score. Score every rubric exactly once, using its id.

Reply with one JSON object and nothing else, following this JSON schema:
{schema}"""


def scoring_schema(rubric_ids: Sequence[str]) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": {
            "scores": {
                "type": "array",
                "minItems": len(rubric_ids),
                "maxItems": len(rubric_ids),
                "items": {
                    "type": "object",
                    "properties": {
                        "rubric_id": {"enum": list(rubric_ids)},
                        "justification": {"type": "string", "minLength": 1, "maxLength": JUSTIFICATION_MAX_CHARS},
                        "score": {"type": "integer", "enum": list(SCORES)},
                    },
                    "required": ["rubric_id", "justification", "score"],
                    "additionalProperties": False,
                },
            }
        },
        "required": ["scores"],
        "additionalProperties": False,
    }


def scoring_messages(query: JudgeQuery, rollout: JudgeRollout, rubrics: Sequence[Rubric],
                     max_block_chars: int | None = None) -> list[dict[str, str]]:
    # The exact schema (its id enum) differs per request and travels as response_format; the
    # system prompt shows the shape with a placeholder id so it is identical for every trajectory
    # (providers cache shared prompt prefixes).
    shape = scoring_schema([])
    scores = shape["properties"]["scores"]
    scores.pop("minItems")
    scores.pop("maxItems")
    scores["items"]["properties"]["rubric_id"] = {"type": "string", "description": "the id of a listed rubric"}
    system = SCORING_SYSTEM.format(**STAGE_GUIDE, schema=json.dumps(shape))
    parts = ["TASK: score this trajectory against every rubric."]
    parts += _query_sections(query)
    parts.append(_section("RUBRICS", "\n".join(rubric_line(r) for r in rubrics)))
    parts += _trajectory_sections(rollout.text, "TRAJECTORY ", max_block_chars)
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


def repair_message(error: str) -> dict[str, str]:
    return {"role": "user", "content": (
        f"Your reply could not be used: {error[:MAX_ERROR_CHARS]}\n"
        "Reply again with only the corrected JSON object, following the schema in the instructions.")}


# ---- reading a prompt back (the built-in judge) ----------------------------------------------------


def split_sections(content: str) -> list[tuple[str, str]]:
    """(name, body) of every ``<<<NAME>>>`` section of a user message, in order."""
    marks = list(_SECTION_LINE.finditer(content))
    out = []
    for index, mark in enumerate(marks):
        end = marks[index + 1].start() if index + 1 < len(marks) else len(content)
        out.append((mark.group(1), content[mark.end():end].strip("\n")))
    return out


def unescape_section_markers(text: str) -> str:
    return text.replace("<< <", "<<<")


def generation_limit(content: str) -> int | None:
    match = _LIMIT_LINE.search(content)
    return int(match.group(1)) if match else None
