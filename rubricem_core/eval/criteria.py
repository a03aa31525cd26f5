"""Rubric criteria graded one call each, by each benchmark's own protocol (prompts in ``grader_prompts/``).

- HealthBench (``per_criterion``), as simple-evals' grader: the conversation with the response as its last
  assistant turn, the rubric item as ``[points] criterion``; the reply is met / not met with an explanation.
- ResearchRubrics, as its release's grader (scaleapi/researchrubrics ``evaluate_single_report``): the
  document, the criterion (title, category = its axis, weight); the reply is a verdict with its score,
  confidence, reasoning, evidence quotes and missing elements. ``binary`` (the current release: Satisfied
  1.0 / Not Satisfied 0.0) or ``ternary`` (the paper-era pipeline: Partially Satisfied 0.5 too). A report
  longer than the grader's context is cut at blank lines into chunks; each chunk's evidence for the
  criterion is collected, and one synthesis call gives the verdict from all of it (the chunks' own
  satisfied / not flags are advisory, as in the release). The release reads chunks in sequence with a
  placeholder for the previous ones; here they are read in parallel, which gives the same prompts.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from rubricem_core.eval.prompts import (
    JUSTIFICATION_MAX_CHARS,
    TASK_LINE,
    TEXT_FIELD,
    GradeItem,
    grader_prompt,
    object_schema,
    section,
)
from rubricem_core.eval.types import EvalError
from rubricem_core.judge.prompts import escape_section_markers
from rubricem_core.llm.replies import ReplyError, checked_reply
from rubricem_core.schemas import Query

# Task-line markers (the built-in grader dispatches on them).
CRITERION_KIND = "rubric_criterion"  # HealthBench: one criterion, met or not
VERDICT_KIND = "rubric_verdict"  # ResearchRubrics: one criterion's verdict, from the document or chunk evidence
CHUNK_KIND = "rubric_chunk"  # ResearchRubrics: one chunk's evidence for one criterion

VERDICT_SCORES: dict[str, dict[str, float]] = {
    "binary": {"Satisfied": 1.0, "Not Satisfied": 0.0},
    "ternary": {"Satisfied": 1.0, "Partially Satisfied": 0.5, "Not Satisfied": 0.0},
}
RESEARCHRUBRICS_GRADING: tuple[str, ...] = tuple(VERDICT_SCORES)


@dataclass(frozen=True)
class CriterionGrade:
    """One criterion's grade: its score (0/1, or 0.5 for Partially Satisfied), the grader's reasoning, and
    what the protocol adds (verdict, confidence)."""

    score: float
    justification: str
    details: dict[str, Any] = field(default_factory=dict)


# ---- HealthBench: simple-evals' grader -------------------------------------------------------------


def healthbench_conversation(query: Query, response: str) -> str:
    """The conversation as simple-evals renders it: ``role: content`` turns, the response as the last one."""
    turns = [m for m in query.messages if m.get("role") in ("system", "user", "assistant")]
    if not turns:
        turns = [{"role": "user", "content": query.question}]
    turns = [*turns, {"role": "assistant", "content": response}]
    return "\n\n".join(f"{m['role']}: {m['content']}" for m in turns)


def rubric_item_line(item: GradeItem) -> str:
    """A HealthBench rubric item as simple-evals shows it: ``[points] criterion``."""
    points = item.data["points"]
    return f"[{int(points) if float(points).is_integer() else points}] {item.criterion}"


def criterion_schema() -> dict[str, Any]:
    return object_schema({"explanation": TEXT_FIELD, "criteria_met": {"type": "boolean"}})


def criterion_messages(benchmark: str, query: Query, response: str, item: GradeItem) -> list[dict[str, str]]:
    """One HealthBench criterion: the conversation ending with the response, and the rubric item."""
    system = grader_prompt("criterion_healthbench").format(schema=json.dumps(criterion_schema()))
    parts = [
        f"{TASK_LINE} against one rubric criterion ({CRITERION_KIND}).",
        section("BENCHMARK", benchmark),
        section("CONVERSATION", escape_section_markers(healthbench_conversation(query, response))),
        section("RUBRIC ITEM", escape_section_markers(rubric_item_line(item))),
        section("END", "Is the rubric item met by the last assistant turn?"),
    ]
    return [{"role": "system", "content": system}, {"role": "user", "content": "\n\n".join(parts)}]


def parse_criterion(text: str | None) -> CriterionGrade:
    data = checked_reply(text, criterion_schema())
    return CriterionGrade(1.0 if data["criteria_met"] else 0.0, data["explanation"].strip() or "-")


# ---- ResearchRubrics: its release's grader ---------------------------------------------------------


def _check_grading(grading: str) -> dict[str, float]:
    if grading not in VERDICT_SCORES:
        raise EvalError(f"researchrubrics_grading must be one of {RESEARCHRUBRICS_GRADING}, got {grading!r}")
    return VERDICT_SCORES[grading]


def verdict_schema(grading: str) -> dict[str, Any]:
    scores = _check_grading(grading)
    texts = {"type": "array", "items": {"type": "string", "maxLength": JUSTIFICATION_MAX_CHARS}}
    return object_schema(
        {
            "verdict": {"enum": list(scores)},
            "score": {"type": "number", "enum": sorted(set(scores.values()))},
            "confidence": {"type": "number", "minimum": 0, "maximum": 1},
            "reasoning": TEXT_FIELD,
            "evidence_quotes": texts,
            "missing_elements": texts,
        }
    )


def criterion_block(item: GradeItem) -> str:
    """The criterion as the release's user prompt gives it: title, category (its axis) and weight."""
    lines = [f"Title: {item.criterion}"]
    if item.data.get("axis"):
        lines.append(f"Category: {item.data['axis']}")
    lines.append(f"Weight: {item.data['points']:g}")
    return escape_section_markers("\n".join(lines))


def verdict_messages(
    item: GradeItem, grading: str, document: str | None = None, evidence: list[str] | None = None
) -> list[dict[str, str]]:
    """One ResearchRubrics criterion against the ``document``, or (a chunked report's synthesis call)
    against the ``evidence`` collected from its chunks."""
    _check_grading(grading)
    system = grader_prompt("criterion_researchrubrics").format(
        scale=grader_prompt(f"scale_researchrubrics_{grading}"), schema=json.dumps(verdict_schema(grading))
    )
    if evidence is None:  # a report read whole; a chunked one is judged from its chunks' evidence only
        shown = section("DOCUMENT", escape_section_markers(document or ""))
        end = "Give the verdict of this criterion on the document."
    else:
        shown = section("CHUNK EVIDENCE", escape_section_markers(json.dumps(evidence, ensure_ascii=False)))
        end = "The document was read in chunks; give the verdict from the evidence of all of them."
    parts = [
        f"{TASK_LINE} against one rubric criterion ({VERDICT_KIND}).",
        section("BENCHMARK", "researchrubrics"),
        shown,
        section("CRITERION", criterion_block(item)),
        section("END", end),
    ]
    return [{"role": "system", "content": system}, {"role": "user", "content": "\n\n".join(parts)}]


def verdict_parser(grading: str) -> Callable[[str | None], CriterionGrade]:
    scores = _check_grading(grading)
    schema = verdict_schema(grading)

    def parse(text: str | None) -> CriterionGrade:
        data = checked_reply(text, schema)
        if float(data["score"]) != scores[data["verdict"]]:  # the release scores by the number: they must agree
            raise ReplyError(f"score {data['score']} does not match verdict {data['verdict']!r} ({scores})")
        details = {"verdict": data["verdict"], "confidence": float(data["confidence"])}
        return CriterionGrade(scores[data["verdict"]], data["reasoning"].strip() or "-", details)

    return parse


def chunk_schema() -> dict[str, Any]:
    return object_schema(
        {
            "relevant_evidence": {"type": "array", "items": {"type": "string", "maxLength": JUSTIFICATION_MAX_CHARS}},
            "satisfaction": {"type": "boolean"},
            "confidence_for_chunk": {"type": "number", "minimum": 0, "maximum": 1},
            "notes": {"type": "string", "maxLength": JUSTIFICATION_MAX_CHARS},
        }
    )


def chunk_messages(item: GradeItem, chunk: str, number: int, total: int) -> list[dict[str, str]]:
    """One chunk of a long report, read for one criterion's evidence (chunk ``number`` of ``total``, from 1)."""
    system = grader_prompt("criterion_researchrubrics_chunk").format(schema=json.dumps(chunk_schema()))
    parts = [
        f"{TASK_LINE} against one rubric criterion ({CHUNK_KIND}).",
        section("BENCHMARK", "researchrubrics"),
        section("CHUNK", f"{number} of {total}"),
        section("CHUNK TEXT", escape_section_markers(chunk)),
        section("CRITERION", criterion_block(item)),
        section("END", "Collect this chunk's evidence for the criterion."),
    ]
    return [{"role": "system", "content": system}, {"role": "user", "content": "\n\n".join(parts)}]


def parse_chunk(text: str | None) -> list[str]:
    """The chunk's evidence passages, or ReplyError."""
    data = checked_reply(text, chunk_schema())
    return [e.strip() for e in data["relevant_evidence"] if e.strip()]


def split_report(text: str, max_chars: int) -> list[str]:
    """The release's chunking: paragraphs (split at blank lines) packed in order while a chunk stays under
    ``max_chars``; no overlap; a paragraph longer than that is a chunk of its own."""
    if max_chars < 1:
        raise EvalError(f"chunk size must be at least 1 character, got {max_chars}")
    chunks: list[str] = []
    current: list[str] = []
    size = 0
    for paragraph in text.split("\n\n"):
        added = len(paragraph) + (2 if current else 0)
        if current and size + added >= max_chars:
            chunks.append("\n\n".join(current))
            current, size = [], 0
            added = len(paragraph)
        current.append(paragraph)
        size += added
    if current:
        chunks.append("\n\n".join(current))
    return chunks
