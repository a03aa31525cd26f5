"""A benchmark rubric row (a Query's rubric dict, answer stage) and an eval query, shared by the grader tests."""

from __future__ import annotations

from typing import Any

from rubricem_core.schemas import Query


def rubric(description: str, weight: float, polarity: str = "positive", **check: Any) -> dict[str, Any]:
    """``check`` fields, when given, make it a benchmark check (``{"type": "benchmark", **check}``)."""
    return {
        "title": description[:40],
        "description": description,
        "weight": weight,
        "polarity": polarity,
        "stage": "answer",
        "check": {"type": "benchmark", **check} if check else None,
    }


def eval_query(
    query_id: str, source: str, question: str, rubrics: list[dict[str, Any]], kind: str = "long_form", **fields: Any
) -> Query:
    """An eval-split query whose one message is its question."""
    return Query(
        query_id=query_id,
        source=source,
        split="eval",
        kind=kind,
        question=question,
        messages=[{"role": "user", "content": question}],
        rubrics=rubrics,
        **fields,
    )
