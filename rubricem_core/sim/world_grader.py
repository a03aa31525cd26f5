"""The synthetic-world grader: deterministic, no LLM, independent of the training reward.

A trajectory is scored against the query's *persistent* rubrics only (the world's checkable facts,
the final answer, the look-alike's wrong value) — never against the judge's adaptive rubrics, so
the number cannot be gamed by what training optimised. Each rubric is checked with the built-in
judge's criteria (``sim.judge.score_rubric``: a fact counts fully only when a cited snippet the
agent actually retrieved states it) and aggregated with the judge's formula
R = Σ w·s′ / (2 Σ w). Scaffold validity and citation grounding are reported beside the score.
"""

from __future__ import annotations

from typing import Any

from rubricem_core.eval.types import EvalError, GradeResult
from rubricem_core.filtering import claim_supported, snippet_texts
from rubricem_core.judge.aggregate import stage_scores
from rubricem_core.judge.buffer import RubricBuffer
from rubricem_core.judge.types import Rubric, RubricScore, TrajectoryJudgment
from rubricem_core.scaffold import STAGE_IDS, extract_citations, validate
from rubricem_core.schemas import Query
from rubricem_core.sim.judge import Context, score_rubric
from rubricem_core.sim.trace_view import TraceView


def citation_grounding(text: str) -> dict[str, Any]:
    """Citations of the answer: how many name a retrieved id, and how many of those the snippet supports."""
    evidence = snippet_texts(text)
    cites = extract_citations(text)
    retrieved = [c for c in cites if c.doc_id in evidence]
    supported = [c for c in retrieved if claim_supported(c.claim, evidence[c.doc_id])]
    return {
        "citations": len(cites),
        "citations_retrieved": len(retrieved),
        "citations_supported": len(supported),
        # precision of the citations: supported / all (1.0 is vacuous when there are none: see `citations`)
        "citation_precision": len(supported) / len(cites) if cites else None,
    }


def _rubric_record(rubric: Rubric) -> dict[str, Any]:
    return {**rubric.shown(), "check": rubric.check}


def grade_synthetic(query: Query, text: str, max_tool_calls: int | None = None) -> GradeResult:
    """Score one trajectory of a synthetic-world query; details list every rubric's score and reason."""
    rubrics = RubricBuffer.from_query(query.query_id, query.rubrics, cap_per_stage=0).active()
    if not rubrics:
        raise EvalError(f"query {query.query_id!r} has no persistent rubrics to grade against")
    records = [_rubric_record(r) for r in rubrics]
    ctx = Context(query.question, dict(query.spec or {}), records)
    view = TraceView(text)
    scores, items = [], []
    for rubric, record in zip(rubrics, records):
        score, why = score_rubric(view, record, ctx)
        scores.append(RubricScore(rubric.rubric_id, rubric.stage, rubric.polarity, rubric.weight, score, why))
        items.append(
            {
                "title": rubric.title,
                "polarity": rubric.polarity,
                "weight": rubric.weight,
                "check": (rubric.check or {}).get("type"),
                "score": score,
                "justification": why,
            }
        )
    R = stage_scores([TrajectoryJudgment("eval", scores)], rubrics)[0]
    judged = [R[STAGE_IDS[s]] for s in sorted({r.stage for r in rubrics}, key=STAGE_IDS.__getitem__)]
    # persistent rubrics are answer-stage; a query with rubrics on several stages gets their mean.
    # No answer, no credit: an inverted negative rubric ("gives a wrong value") must not pay for silence.
    answered = bool(view.answer_plain.strip())
    mean = float(sum(judged) / len(judged)) if answered else 0.0
    finals = [i for i in items if i["check"] == "final"]
    violations = sorted({v.code for v in validate(text, max_tool_calls=max_tool_calls)})
    details = {
        "answered": answered,
        "rubrics": items,
        "correct": bool(finals) and all(i["score"] == 2 for i in finals),
        "valid_scaffold": not violations,
        "violations": violations,
        **citation_grounding(text),
    }
    return GradeResult(mean, details)
