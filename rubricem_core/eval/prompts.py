"""Prompts, JSON schemas, reply validation and aggregation of the benchmark graders.

One structured-JSON call per answer, except in two benchmark-faithful modes (``GraderOptions``):
HealthBench ``per_criterion`` (one met / not-met call per rubric criterion, as the official grader)
and DeepResearchBench ``race`` (one call scoring the target report and a reference report on the
same criteria; RACE's relative score). The user message is built from ``<<<NAME>>>`` sections (the
judge's convention, so any model reads it and the built-in grader can parse it back); text from
the benchmark or the policy is escaped so it cannot open a section of its own.

Families (``types.FAMILIES``):
  rubric_points        HealthBench: each criterion met (1) or not (0);
                       score = Σ points of met criteria / Σ positive points, clipped to [0, 1]
  dimension_criteria   DeepResearchBench: each criterion 0..10; a dimension's score is the
                       criterion-weighted mean / 10, the total the dimension-weighted mean
                       (``absolute``); or RACE (``race``): target t and reference r each scored
                       0..10 per criterion, T = Σ_d W_d·mean_w(t), R likewise,
                       score = T / (T + R) (per dimension t_d / (t_d + r_d) in the details)
  rubric_properties    ScholarQA-CS: each property 0/1/2; score = Σ w·s′ / (2 Σ w), s′ = 2 − s for
                       negative properties
  short_form           SimpleQA, 2Wiki, WebWalkerQA: correct / incorrect / not_attempted; score 1 only if
                       correct (WebWalkerQA's own check, LangChain cot_qa, says CORRECT / INCORRECT: the
                       same score)
  rubric_coverage      ResearchQA (compute_coverage.py of realliyifei/ResearchQA, commit 3ed036d): each
                       rubric item rated 1 Not at all .. 5 Completely, ITEMS_PER_CALL items per grader call;
                       score = mean of (x − 1) / 4 over the items, unweighted
  answer_set           DeepSearchQA (the grader prompt of the benchmark's paper, Appendix A, and its
                       starter code): each part of the gold answer found or not, plus the response's
                       excessive answers; P = found / (found + excessive), R = found / parts, F1; score 1
                       only if fully correct (every part found, nothing excessive), P/R/F1 in the details
ResearchRubrics grades as rubric_points, one call per criterion (``types.PER_CRITERION_BENCHMARKS``), with
its compliance score Σ w·s / Σ positive w (scaleapi/researchrubrics calculate_compliance_score.py, commit
e0c361f): the HealthBench formula, clipped to [0, 1] here (the raw value stays in the details).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

from rubricem_core.eval.types import EvalError
from rubricem_core.judge.prompts import escape_section_markers
from rubricem_core.llm.replies import ReplyError, checked_reply, one_entry_per_id
from rubricem_core.readers import DRB_REFERENCE_KEY
from rubricem_core.schemas import Query

JUSTIFICATION_MAX_CHARS = 2000
TEXT_FIELD: dict[str, Any] = {"type": "string", "minLength": 1, "maxLength": JUSTIFICATION_MAX_CHARS}


def object_schema(properties: dict[str, Any]) -> dict[str, Any]:
    """A reply object with exactly ``properties``, every one required (the graders' JSON replies)."""
    return {"type": "object", "properties": properties, "required": list(properties), "additionalProperties": False}


TASK_LINE = "TASK: grade this response"

# Task-line marker of the RACE prompt (the built-in grader dispatches on it).
RACE_KIND = "dimension_race"  # DeepResearchBench race: target and reference report on the same criteria


PROMPT_DIR = Path(__file__).with_name("grader_prompts")


@cache
def grader_prompt(name: str) -> str:
    """The grader prompt ``grader_prompts/<name>.txt``: the prose lives in files beside the code that fills
    them, so a protocol's wording is read and diffed as text."""
    path = PROMPT_DIR / f"{name}.txt"
    if not path.is_file():
        raise EvalError(f"grader prompt file missing: {path}")
    return path.read_text(encoding="utf-8").rstrip("\n")


SCALES: dict[str, list[int]] = {
    "rubric_points": [0, 1],
    "rubric_coverage": [1, 2, 3, 4, 5],
    "dimension_criteria": list(range(11)),
    "rubric_properties": [0, 1, 2],
}

# Rubric items per grader call (None: all of an answer's items in one call). ResearchQA's own grader rates
# its items in batches of 8 (compute_coverage.py --batch_size default).
ITEMS_PER_CALL: dict[str, int] = {"rubric_coverage": 8}


def section(name: str, body: str) -> str:
    return f"<<<{name}>>>\n{body.strip() or '(empty)'}"


def conversation_text(query: Query) -> str:
    """The question as the grader sees it: a multi-turn conversation is shown turn by turn."""
    turns = [m for m in query.messages if m.get("role") in ("user", "assistant")]
    if len(turns) <= 1:
        return query.question
    return "\n\n".join(f"{m['role']}: {m['content']}" for m in turns)


# ---- rubric items ------------------------------------------------------------------------------


@dataclass(frozen=True)
class GradeItem:
    """One rubric item as the grader sees it; ``data`` keeps the benchmark's own numbers."""

    item_id: str
    criterion: str
    polarity: str
    weight: float
    data: dict[str, Any]

    def line(self, family: str) -> str:
        record: dict[str, Any] = {"id": self.item_id, "criterion": self.criterion}
        if family == "rubric_points":
            record["points"] = self.data["points"]
            if self.data.get("axis"):
                record["axis"] = self.data["axis"]  # ResearchRubrics shows the criterion's axis to its grader
        elif family == "rubric_coverage":
            pass  # ResearchQA's items are unweighted questions
        elif family == "dimension_criteria":
            record["dimension"] = self.data["dimension"]
        else:
            record["polarity"] = self.polarity
            record["weight"] = self.weight
        if self.data.get("check") is not None:
            record["check"] = self.data["check"]  # a machine-checkable criterion, when the data has one
        return escape_section_markers(json.dumps(record, ensure_ascii=False, sort_keys=True))


def grade_items(query: Query, family: str) -> list[GradeItem]:
    """The query's rubrics as grader items, with the numbers each family aggregates."""
    if family not in SCALES:
        raise EvalError(f"family {family!r} does not grade rubric items")
    items = []
    for index, rubric in enumerate(query.rubrics):
        check = rubric.get("check") or {}
        criterion = str(check.get("criterion") or rubric.get("description") or rubric.get("title") or "").strip()
        if not criterion:
            raise EvalError(f"query {query.query_id!r} rubric {index}: no criterion text")
        sign = -1.0 if rubric["polarity"] == "negative" else 1.0
        data: dict[str, Any] = {}
        if family == "rubric_points":
            data["points"] = float(check.get("points", sign * float(rubric["weight"])))
            if check.get("axis"):
                data["axis"] = str(check["axis"])
        elif family == "dimension_criteria":
            data["dimension"] = str(check.get("dimension", "overall"))
            data["dimension_weight"] = float(check.get("dimension_weight", 1.0))
            data["criterion_weight"] = float(check.get("criterion_weight", rubric["weight"]))
            explanation = str(rubric.get("description") or "").strip()
            if explanation and explanation != criterion:  # RACE shows the benchmark's explanation too
                data["explanation"] = explanation
        if check and check.get("type") != "benchmark":
            data["check"] = check
        items.append(GradeItem(f"i{index + 1}", criterion, rubric["polarity"], float(rubric["weight"]), data))
    if not items:
        raise EvalError(f"query {query.query_id!r} has no rubric items to grade")
    return items


def per_item_schema(ids: Sequence[str], scores: dict[str, Any]) -> dict[str, Any]:
    """``{"items": [...]}`` with exactly one entry per id: its justification and the ``scores`` fields."""
    justification = {"type": "string", "minLength": 1, "maxLength": JUSTIFICATION_MAX_CHARS}
    return one_entry_per_id("items", "id", ids, {"justification": justification, **scores})


def items_schema(family: str, ids: Sequence[str]) -> dict[str, Any]:
    return per_item_schema(ids, {"score": {"type": "integer", "enum": SCALES[family]}})


def items_messages(
    benchmark: str, family: str, query: Query, response: str, items: Sequence[GradeItem]
) -> list[dict[str, str]]:
    system = grader_prompt("items").format(
        scale=grader_prompt(f"scale_{family}"), schema=json.dumps(items_schema(family, ["<item id>"]))
    )
    parts = [
        f"{TASK_LINE} against every rubric item ({family}).",
        section("BENCHMARK", benchmark),
        section("QUESTION", escape_section_markers(conversation_text(query))),
        section("RUBRIC ITEMS", "\n".join(item.line(family) for item in items)),
        section("RESPONSE", escape_section_markers(response)),
        section("END", f"Grade all {len(items)} items."),
    ]
    return [{"role": "system", "content": system}, {"role": "user", "content": "\n\n".join(parts)}]


def parse_items(text: str | None, family: str, ids: Sequence[str]) -> dict[str, tuple[int, str]]:
    """{item id: (score, justification)} with every id exactly once, or ReplyError."""
    data = checked_reply(text, items_schema(family, list(ids)))
    out: dict[str, tuple[int, str]] = {}
    for item in data["items"]:
        if item["id"] in out:
            raise ReplyError(f"item id {item['id']!r} is graded twice")
        out[item["id"]] = (int(item["score"]), item["justification"].strip() or "-")
    missing = [i for i in ids if i not in out]
    if missing:
        raise ReplyError(f"item ids not graded: {missing}")
    return out


def aggregate_items(family: str, items: Sequence[GradeItem], scores: dict[str, float]) -> tuple[float, dict[str, Any]]:
    """The family's score in [0, 1] and its intermediate numbers."""
    if family == "rubric_points":
        positive = sum(i.data["points"] for i in items if i.data["points"] > 0)
        achieved = sum(i.data["points"] * scores[i.item_id] for i in items)  # 0/1, or ½ when partly met
        if positive <= 0:
            raise EvalError("HealthBench-style grading needs at least one criterion with positive points")
        raw = achieved / positive
        return min(1.0, max(0.0, raw)), {"achieved_points": achieved, "positive_points": positive, "raw": raw}
    if family == "dimension_criteria":
        dims: dict[str, list[GradeItem]] = {}
        for item in items:
            dims.setdefault(item.data["dimension"], []).append(item)
        per_dim, total, weights = {}, 0.0, 0.0
        for name, group in dims.items():
            w = sum(i.data["criterion_weight"] for i in group)
            per_dim[name] = (
                sum(i.data["criterion_weight"] * scores[i.item_id] for i in group) / (10.0 * w) if w > 0 else 0.0
            )
            total += group[0].data["dimension_weight"] * per_dim[name]
            weights += group[0].data["dimension_weight"]
        if weights <= 0:
            raise EvalError("DeepResearchBench-style grading needs a positive dimension weight")
        return total / weights, {"dimensions": per_dim}
    if family == "rubric_coverage":
        coverage = [(scores[i.item_id] - 1) / 4.0 for i in items]
        return sum(coverage) / len(coverage), {"item_coverage": coverage}
    if family == "rubric_properties":
        numerator = sum(
            i.weight * (scores[i.item_id] if i.polarity == "positive" else 2 - scores[i.item_id]) for i in items
        )
        denominator = sum(2 * i.weight for i in items)
        if denominator <= 0:
            raise EvalError("property grading needs a positive total weight")
        return numerator / denominator, {}
    raise EvalError(f"family {family!r} does not grade rubric items")


# ---- DeepResearchBench: RACE (target vs reference) ----------------------------------------------


def reference_article(query: Query) -> str | None:
    """The query's DeepResearchBench reference report (attached by ``eval.run.load_benchmark_queries``)."""
    text = query.metadata.get(DRB_REFERENCE_KEY)
    return text if isinstance(text, str) and text.strip() else None


def race_line(item: GradeItem) -> str:
    record: dict[str, Any] = {"id": item.item_id, "criterion": item.criterion, "dimension": item.data["dimension"]}
    if item.data.get("explanation"):
        record["explanation"] = item.data["explanation"]
    return escape_section_markers(json.dumps(record, ensure_ascii=False, sort_keys=True))


def race_schema(ids: Sequence[str]) -> dict[str, Any]:
    score = {"type": "number", "minimum": 0, "maximum": 10}
    return per_item_schema(ids, {"article_1_score": score, "article_2_score": score})


def race_messages(
    benchmark: str, query: Query, response: str, reference: str, items: Sequence[GradeItem], language: str = "en"
) -> list[dict[str, str]]:
    """The RACE prompt in the task's ``language`` (en or zh, as the benchmark's own prompts): criteria, then
    the target (ARTICLE 1) and the reference (ARTICLE 2). As in the benchmark's own prompt the articles are
    labelled by position only, so the judge cannot favour or disfavour "the reference" as such."""
    system = grader_prompt(f"race_{language}").format(schema=json.dumps(race_schema(["<item id>"])))
    parts = [
        f"{TASK_LINE} and a reference report on every criterion ({RACE_KIND}).",
        section("BENCHMARK", benchmark),
        section("QUESTION", escape_section_markers(conversation_text(query))),
        section("RUBRIC ITEMS", "\n".join(race_line(item) for item in items)),
        section("ARTICLE 1", escape_section_markers(response)),
        section("ARTICLE 2", escape_section_markers(reference)),
        section("END", f"Score both articles on all {len(items)} criteria."),
    ]
    return [{"role": "system", "content": system}, {"role": "user", "content": "\n\n".join(parts)}]


def parse_race(text: str | None, ids: Sequence[str]) -> dict[str, tuple[float, float, str]]:
    """{item id: (target score, reference score, justification)} with every id exactly once, or ReplyError."""
    data = checked_reply(text, race_schema(list(ids)))
    out: dict[str, tuple[float, float, str]] = {}
    for item in data["items"]:
        if item["id"] in out:
            raise ReplyError(f"item id {item['id']!r} is graded twice")
        out[item["id"]] = (
            float(item["article_1_score"]),
            float(item["article_2_score"]),
            item["justification"].strip() or "-",
        )
    missing = [i for i in ids if i not in out]
    if missing:
        raise ReplyError(f"item ids not graded: {missing}")
    return out


def _share(target: float, reference: float) -> float:
    # the benchmark's convention: both zero scores 0
    return target / (target + reference) if target + reference > 0 else 0.0


def aggregate_race(items: Sequence[GradeItem], scores: dict[str, tuple[float, float]]) -> tuple[float, dict[str, Any]]:
    """RACE: per dimension the criterion-weighted means t_d, r_d (0..10); T = Σ W_d t_d, R = Σ W_d r_d;
    score T / (T + R) (the benchmark's overall score), per-dimension t_d / (t_d + r_d) in the details."""
    dims: dict[str, list[GradeItem]] = {}
    for item in items:
        dims.setdefault(item.data["dimension"], []).append(item)
    target_total = reference_total = weights = 0.0
    per_dim: dict[str, float] = {}
    raw: dict[str, dict[str, float]] = {}
    for name, group in dims.items():
        w = sum(i.data["criterion_weight"] for i in group)
        t = sum(i.data["criterion_weight"] * scores[i.item_id][0] for i in group) / w if w > 0 else 0.0
        r = sum(i.data["criterion_weight"] * scores[i.item_id][1] for i in group) / w if w > 0 else 0.0
        per_dim[name] = _share(t, r)
        raw[name] = {"target": t, "reference": r}
        weight = group[0].data["dimension_weight"]
        target_total, reference_total, weights = (
            target_total + weight * t,
            reference_total + weight * r,
            weights + weight,
        )
    if weights <= 0:
        raise EvalError("DeepResearchBench-style grading needs a positive dimension weight")
    return _share(target_total, reference_total), {
        "dimensions": per_dim,
        "race": {"target_total": target_total, "reference_total": reference_total, "dimensions": raw},
    }


# ---- short form ----------------------------------------------------------------------------------


def gold_answers(query: Query) -> list[str]:
    """The gold answer and its aliases (reference answer first)."""
    answers: list[str] = []
    for rubric in query.rubrics:
        check = rubric.get("check") or {}
        if check.get("type") == "final":
            answers += [str(check.get("value", ""))] + [str(a) for a in check.get("aliases") or []]
    answers = ([query.reference_answer] if query.reference_answer else []) + answers
    out = []
    for answer in answers:
        if answer.strip() and answer not in out:
            out.append(answer)
    if not out:
        raise EvalError(f"query {query.query_id!r} has no gold answer for short-form grading")
    return out


# ---- DeepSearchQA: gold answer parts and excessive answers ---------------------------------------

ANSWER_SET_KIND = "answer_set"


def answer_set_schema() -> dict[str, Any]:
    part = {
        "type": "object",
        "properties": {"answer_part": {"type": "string", "minLength": 1}, "found": {"type": "boolean"}},
        "required": ["answer_part", "found"],
        "additionalProperties": False,
    }
    return {
        "type": "object",
        "properties": {
            "explanation": {"type": "string", "minLength": 1, "maxLength": JUSTIFICATION_MAX_CHARS},
            "correctness_details": {"type": "array", "items": part, "minItems": 1},
            "excessive_answers": {"type": "array", "items": {"type": "string"}},
        },
        "required": ["explanation", "correctness_details", "excessive_answers"],
        "additionalProperties": False,
    }


def answer_type(query: Query) -> str:
    """DeepSearchQA's prompt type of the query ('Single Answer' unless the file says 'Set Answer')."""
    value = query.metadata.get("answer_type")
    return value if value in ("Single Answer", "Set Answer") else "Single Answer"


def answer_set_messages(benchmark: str, query: Query, response: str) -> list[dict[str, str]]:
    system = grader_prompt("answer_set").format(schema=json.dumps(answer_set_schema()))
    parts = [
        f"{TASK_LINE}: does it contain every part of the correct answer? ({ANSWER_SET_KIND})",
        section("BENCHMARK", benchmark),
        section("QUESTION", escape_section_markers(conversation_text(query))),
        section("PROMPT TYPE", answer_type(query)),
        section("CORRECT ANSWER", escape_section_markers(gold_answers(query)[0])),
        section("RESPONSE", escape_section_markers(response)),
        section("END", "List the correct answer's parts found or not, and the excessive answers."),
    ]
    return [{"role": "system", "content": system}, {"role": "user", "content": "\n\n".join(parts)}]


def parse_answer_set(text: str | None) -> tuple[list[tuple[str, bool]], list[str], str]:
    """([(answer part, found)], excessive answers, explanation), or ReplyError."""
    data = checked_reply(text, answer_set_schema())
    parts = [(p["answer_part"], bool(p["found"])) for p in data["correctness_details"]]
    excessive = [a for a in data["excessive_answers"] if a.strip()]
    return parts, excessive, data["explanation"].strip() or "-"


def aggregate_answer_set(parts: Sequence[tuple[str, bool]], excessive: Sequence[str]) -> tuple[float, dict[str, Any]]:
    """DeepSearchQA's metrics of one answer: P = |S∩G| / |S|, R = |S∩G| / |G|, F1, and its outcome
    (fully_correct, correct_with_extraneous, partially_correct, fully_incorrect); score 1 only if fully correct."""
    found = sum(ok for _, ok in parts)
    predicted = found + len(excessive)
    precision = found / predicted if predicted else 0.0
    recall = found / len(parts) if parts else 1.0
    f1 = 2 * precision * recall / (precision + recall) if precision + recall > 0 else 0.0
    if found == len(parts):
        outcome = "fully_correct" if not excessive else "correct_with_extraneous"
    else:
        outcome = "partially_correct" if found else "fully_incorrect"
    return (1.0 if outcome == "fully_correct" else 0.0), {
        "outcome": outcome,
        "precision": precision,
        "recall": recall,
        "f1": f1,
        "correctness_details": [{"answer_part": p, "found": ok} for p, ok in parts],
        "excessive_answers": list(excessive),
    }
