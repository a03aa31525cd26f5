"""Grading evaluated samples: why a query cannot be graded, the grader's calls over every sample, the
`eval_results` rows (graded and ungraded), and the summary a flow logs."""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from rubricem_core.eval.answer_match import match_query
from rubricem_core.eval.checkpoints import checkpoint_step
from rubricem_core.eval.prompts import aggregate_items, gold_answers, grade_items, reference_article
from rubricem_core.eval.types import EvalError, EvalSample, GradeResult, family_of
from rubricem_core.rollout.types import ANSWERED
from rubricem_core.scaffold import strip_tags
from rubricem_core.schemas import Query
from rubricem_core.stand_ins import stand_in

# Why a query was not graded (``details.ungraded`` and the prefix of ``error`` in its eval_results row).
NO_RUBRICS = "no_rubrics"  # a rubric benchmark (or the synthetic world) with no rubric items for it
NO_GOLD_ANSWER = "no_gold_answer"  # a short-form benchmark with neither a reference answer nor a final rubric
NO_REFERENCE = "no_reference"  # DeepResearchBench graded by RACE, with no reference report for the query
UNGRADED_REASONS: tuple[str, ...] = (NO_RUBRICS, NO_GOLD_ANSWER, NO_REFERENCE)


_CITE = re.compile(r'<cite id="([^"]*)">(.*?)</cite>', re.S)


def plain_answer(answer: str) -> str:
    """The answer as a grader reads it: ``<cite id="D1">claim</cite>`` → ``claim [D1]``, no tags."""
    return strip_tags(_CITE.sub(lambda m: f"{m.group(2)} [{m.group(1)}]", answer)).strip()


def ungraded_reason(benchmark: str, query: Query, needs_reference: bool = False) -> tuple[str, str] | None:
    """(reason code, message) when ``benchmark`` has nothing to grade ``query`` against, else None.

    Checked before sampling, so no generation is spent on a query that cannot be graded. Grading
    input that is there but malformed (a rubric without criterion text, no positive weight) is a
    data error: it raises EvalError here, before sampling, instead of after it. ``needs_reference``:
    the grader compares against the query's reference report (DeepResearchBench race)."""
    family = family_of(benchmark)
    if family == "synthetic":
        if not query.rubrics:
            return NO_RUBRICS, f"query {query.query_id!r} has no persistent rubrics to grade against"
        return None
    if family in ("short_form", "answer_set"):
        try:
            gold_answers(query)
        except EvalError as exc:
            return NO_GOLD_ANSWER, str(exc)
        return None
    if not query.rubrics:
        return NO_RUBRICS, f"query {query.query_id!r} has no rubric items to grade"
    try:
        items = grade_items(query, family)
        # the denominators do not depend on the scores: all zeros tells whether aggregation is defined
        aggregate_items(family, items, {item.item_id: 0 for item in items})
    except EvalError as exc:
        raise EvalError(f"benchmark {benchmark!r} query {query.query_id!r}: {exc}") from exc
    if needs_reference and reference_article(query) is None:
        return NO_REFERENCE, (
            f"query {query.query_id!r} has no reference report for eval.drb_grading 'race' (none "
            "in eval.paths.deep_research_bench_reference for its id)"
        )
    return None


def grade_samples(
    benchmark: str,
    queries: Sequence[Query],
    samples: Sequence[Sequence[EvalSample]],
    grader: Any = None,
    max_tool_calls: int | None = None,
) -> list[list[GradeResult]]:
    """Grades aligned with ``samples``: in-process for synthetic, else one grader call per sample."""
    family = family_of(benchmark)
    if family == "synthetic":  # the world's own grader, an offline stand-in (sim/world_grader.py)
        grade_synthetic: Callable[..., GradeResult] = stand_in("benchmark", "synthetic")
        grades = [[grade_synthetic(q, s.text, max_tool_calls) for s in group] for q, group in zip(queries, samples)]
        # beside it, the answer-match grader: the gold answer and facts matched by plain code of its own
        for q, group, group_grades in zip(queries, samples, grades):
            for s, grade in zip(group, group_grades):
                if not grade.failed:
                    grade.details["answer_match"] = match_query(q, s.answer)
        return grades
    if grader is None:
        raise EvalError(f"benchmark {benchmark!r} needs a grader (an LLM endpoint)")
    pairs = [(q, plain_answer(s.answer)) for q, group in zip(queries, samples) for s in group]
    flat = iter(grader.grade(benchmark, pairs))
    return [[next(flat) for _ in group] for group in samples]


def result_rows(
    checkpoint: str,
    benchmark: str,
    retrieval: str,
    samples: Sequence[Sequence[EvalSample]],
    grades: Sequence[Sequence[GradeResult]],
    grader_model: str,
    valid: Sequence[Sequence[bool]],
) -> list[dict[str, Any]]:
    rows = []
    for group, group_grades, group_valid in zip(samples, grades, valid):
        for sample, grade, ok in zip(group, group_grades, group_valid):
            rows.append(
                {
                    "checkpoint": checkpoint,
                    "step": checkpoint_step(checkpoint),
                    "benchmark": benchmark,
                    "query_id": sample.query_id,
                    "retrieval": retrieval,
                    "score": grade.score,
                    "details": grade.details_json(),
                    "sample": sample.sample,
                    "grade_failed": grade.failed,
                    "error": grade.error,
                    "grader": grader_model,
                    "valid_scaffold": ok,
                    "n_tool_calls": sample.n_tool_calls,
                    "finish_reason": sample.finish_reason,
                    "n_policy_tokens": sample.n_policy_tokens,
                    "guidance": sample.guidance,
                    "answer": sample.answer,
                    "text": sample.text,
                }
            )
    return rows


def ungraded_row(
    checkpoint: str, benchmark: str, retrieval: str, query_id: str, reason: tuple[str, str], grader_model: str
) -> dict[str, Any]:
    """The row of a query that was not graded: no trajectory (it was not sampled), score NULL,
    ``grade_failed`` true (so every reader that excludes failed grades from means stays right), the
    reason in ``error`` ("<code>: <message>") and in ``details`` ({"ungraded": code, "reason": message})."""
    code, message = reason
    return {
        "checkpoint": checkpoint,
        "step": checkpoint_step(checkpoint),
        "benchmark": benchmark,
        "query_id": query_id,
        "retrieval": retrieval,
        "score": None,
        "details": json.dumps({"ungraded": code, "reason": message}, ensure_ascii=False, sort_keys=True),
        "sample": None,
        "grade_failed": True,
        "error": f"{code}: {message}",
        "grader": grader_model,
        "valid_scaffold": None,
        "n_tool_calls": None,
        "finish_reason": None,
        "n_policy_tokens": None,
        "guidance": None,
        "answer": None,
        "text": None,
    }


def ungraded_code(row: dict[str, Any]) -> str | None:
    """The reason code of an eval_results row that was not graded (``ungraded_row``), else None."""
    if not row.get("grade_failed") or not row.get("details"):
        return None
    details = json.loads(row["details"])
    return details.get("ungraded") if isinstance(details, dict) else None


def summarize(rows: Sequence[dict[str, Any]]) -> dict[str, float]:
    """Means over graded samples (failed grades excluded and counted) plus sampling health.

    Queries that were not graded (``ungraded_row``: never sampled) are left out of every mean and
    rate and of ``n_samples``/``n_queries``/``grade_failed``; ``n_ungraded`` counts them, and
    ``n_<reason>`` per reason code."""
    codes = [ungraded_code(r) for r in rows]
    ungraded = [c for c in codes if c is not None]
    rows = [r for r, c in zip(rows, codes) if c is None]
    scored = [r["score"] for r in rows if not r["grade_failed"]]
    out = {
        "score_mean": float(np.mean(scored)) if scored else math.nan,
        "n_samples": float(len(rows)),
        "n_queries": float(len({r["query_id"] for r in rows})),
        "grade_failed": float(sum(r["grade_failed"] for r in rows)),
        "n_ungraded": float(len(ungraded)),
        **{f"n_{code}": float(ungraded.count(code)) for code in UNGRADED_REASONS},
        "valid_scaffold_rate": float(np.mean([r["valid_scaffold"] for r in rows])) if rows else math.nan,
        "answered_rate": float(np.mean([r["finish_reason"] == ANSWERED for r in rows])) if rows else math.nan,
        "tool_calls_mean": float(np.mean([r["n_tool_calls"] for r in rows])) if rows else math.nan,
        "guided_rate": float(np.mean([r["guidance"] is not None for r in rows])) if rows else math.nan,
    }
    details = [json.loads(r["details"]) for r in rows if not r["grade_failed"]]
    grades = [d["grade"] for d in details if "grade" in d]
    if grades:
        for name in ("correct", "incorrect", "not_attempted"):
            out[f"{name}_rate"] = grades.count(name) / len(grades)
        # simple-evals' SimpleQA aggregates: accuracy among attempted answers, and its harmonic mean with the
        # overall correct rate (the F-score, which rewards saying "I don't know" over a wrong answer)
        attempted = grades.count("correct") + grades.count("incorrect")
        given = grades.count("correct") / attempted if attempted else 0.0
        overall = out["correct_rate"]
        out["accuracy_given_attempted"] = given
        out["f_score"] = 2 * given * overall / (given + overall) if given + overall > 0 else 0.0
    em = [d["answer_em"] for d in details if isinstance(d.get("answer_em"), (int, float))]
    if em:  # 2WikiMultihopQA's own answer metrics, on the judge's extracted answer (eval/short_form.py)
        out["answer_em_mean"] = float(np.mean(em))
        out["answer_f1_mean"] = float(np.mean([d["answer_f1"] for d in details if "answer_em" in d]))
    raw = [d["raw"] for d in details if isinstance(d.get("raw"), (int, float)) and "achieved_points" in d]
    if raw:  # HealthBench as simple-evals reports it: the mean of unclipped example scores, then clipped
        out["score_mean_clipped_mean"] = min(1.0, max(0.0, float(np.mean(raw))))
    correct = [d["correct"] for d in details if "correct" in d]
    if correct:
        out["correct_rate"] = float(np.mean(correct))
    for name in ("f1", "precision", "recall"):  # DeepSearchQA's answer-set metrics
        values = [d[name] for d in details if isinstance(d.get(name), (int, float)) and "outcome" in d]
        if values:
            out[f"{name}_mean"] = float(np.mean(values))
    outcomes = [d["outcome"] for d in details if "outcome" in d]
    for name in ("fully_correct", "correct_with_extraneous", "partially_correct", "fully_incorrect"):
        if outcomes:
            out[f"{name}_rate"] = outcomes.count(name) / len(outcomes)
    matched = [d["answer_match"] for d in details if isinstance(d.get("answer_match"), dict)]
    if matched:  # the synthetic benchmark's second grader (eval/answer_match.py)
        out["answer_match_mean"] = float(np.mean([m["score"] for m in matched]))
        out["answer_match_final_rate"] = float(np.mean([m["final_correct"] for m in matched]))
    precision = [d["citation_precision"] for d in details if d.get("citation_precision") is not None]
    if precision:
        out["citation_precision_mean"] = float(np.mean(precision))
    return out
