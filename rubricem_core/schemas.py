"""Arrow schemas of the `queries` and `corpus` tables, and the `Query` record that fills `queries`.

JSON-valued columns (messages, spec, metadata, rubric check) are stored as JSON strings so that the
tables stay flat and DuckDB-friendly; the `Query` dataclass holds them decoded.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa

RUBRIC_STAGES: tuple[str, ...] = ("plan", "research", "review", "answer")
RUBRIC_POLARITIES: tuple[str, ...] = ("positive", "negative")
QUERY_SPLITS: tuple[str, ...] = ("train", "eval")

RUBRIC_TYPE = pa.struct(
    [
        pa.field("title", pa.string()),
        pa.field("description", pa.string()),
        pa.field("weight", pa.float64()),
        pa.field("polarity", pa.string()),
        pa.field("stage", pa.string()),
        pa.field("check", pa.string()),  # JSON object, or null when only an LLM judge can check it
    ]
)

QUERIES_SCHEMA = pa.schema(
    [
        pa.field("query_id", pa.string(), nullable=False),
        pa.field("source", pa.string(), nullable=False),
        pa.field("split", pa.string(), nullable=False),
        pa.field("kind", pa.string(), nullable=False),
        pa.field("question", pa.string(), nullable=False),
        pa.field("messages", pa.string(), nullable=False),
        pa.field("rubrics", pa.list_(RUBRIC_TYPE), nullable=False),
        pa.field("reference_answer", pa.string()),
        pa.field("spec", pa.string(), nullable=False),
        pa.field("metadata", pa.string(), nullable=False),
    ]
)

CORPUS_SCHEMA = pa.schema(
    [
        pa.field("doc_id", pa.string(), nullable=False),
        pa.field("title", pa.string(), nullable=False),
        pa.field("text", pa.string(), nullable=False),
        pa.field("source", pa.string(), nullable=False),
    ]
)


class QueryValidationError(ValueError):
    """A Query (or a row of the queries table) violates the schema contract."""


def _dumps(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)


def _validate_rubric(query_id: str, index: int, rubric: dict[str, Any]) -> None:
    where = f"query {query_id!r} rubric {index}"
    for key in ("title", "description", "weight", "polarity", "stage"):
        if key not in rubric:
            raise QueryValidationError(f"{where}: missing field {key!r}")
    if rubric["polarity"] not in RUBRIC_POLARITIES:
        raise QueryValidationError(f"{where}: polarity {rubric['polarity']!r} not in {RUBRIC_POLARITIES}")
    if rubric["stage"] not in RUBRIC_STAGES:
        raise QueryValidationError(f"{where}: stage {rubric['stage']!r} not in {RUBRIC_STAGES}")
    check = rubric.get("check")
    if check is not None and not isinstance(check, dict):
        raise QueryValidationError(f"{where}: check must be a JSON object or null, got {type(check).__name__}")


@dataclass
class Query:
    """One row of the `queries` table, with its JSON columns decoded.

    `messages` is the full prompt conversation ([{role, content}]), `rubrics` a list of dicts with
    the RUBRIC_TYPE fields (`check` a dict or None), `spec` and `metadata` plain dicts.
    """

    query_id: str
    source: str
    split: str
    kind: str
    question: str
    messages: list[dict[str, str]]
    rubrics: list[dict[str, Any]] = field(default_factory=list)
    reference_answer: str | None = None
    spec: dict[str, Any] = field(default_factory=dict)
    metadata: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.query_id:
            raise QueryValidationError("query_id must be a non-empty string")
        if self.split not in QUERY_SPLITS:
            raise QueryValidationError(f"query {self.query_id!r}: split {self.split!r} not in {QUERY_SPLITS}")
        if not isinstance(self.question, str) or not self.question.strip():
            raise QueryValidationError(f"query {self.query_id!r}: question is empty")
        for index, rubric in enumerate(self.rubrics):
            _validate_rubric(self.query_id, index, rubric)

    def to_row(self) -> dict[str, Any]:
        rubrics = [
            {
                "title": str(r["title"]),
                "description": str(r["description"]),
                "weight": float(r["weight"]),
                "polarity": r["polarity"],
                "stage": r["stage"],
                "check": None if r.get("check") is None else _dumps(r["check"]),
            }
            for r in self.rubrics
        ]
        return {
            "query_id": self.query_id,
            "source": self.source,
            "split": self.split,
            "kind": self.kind,
            "question": self.question,
            "messages": _dumps(self.messages),
            "rubrics": rubrics,
            "reference_answer": self.reference_answer,
            "spec": _dumps(self.spec),
            "metadata": _dumps(self.metadata),
        }

    @classmethod
    def from_row(cls, row: dict[str, Any]) -> "Query":
        query_id = row.get("query_id") or "?"
        try:
            rubrics = [
                {**r, "check": None if r.get("check") is None else json.loads(r["check"])}
                for r in (row.get("rubrics") or [])
            ]
            return cls(
                query_id=row["query_id"],
                source=row["source"],
                split=row["split"],
                kind=row["kind"],
                question=row["question"],
                messages=json.loads(row["messages"]),
                rubrics=rubrics,
                reference_answer=row.get("reference_answer"),
                spec=json.loads(row["spec"]) if row.get("spec") else {},
                metadata=json.loads(row["metadata"]) if row.get("metadata") else {},
            )
        except (KeyError, json.JSONDecodeError, TypeError) as exc:
            raise QueryValidationError(f"queries row {query_id!r}: cannot decode: {exc!r}") from exc


def queries_to_table(queries: list[Query]) -> pa.Table:
    """Build a QUERIES_SCHEMA table; query ids must be unique."""
    seen: set[str] = set()
    for query in queries:
        if query.query_id in seen:
            raise QueryValidationError(f"duplicate query_id {query.query_id!r}")
        seen.add(query.query_id)
    return pa.Table.from_pylist([q.to_row() for q in queries], schema=QUERIES_SCHEMA)


def queries_from_table(table: pa.Table) -> list[Query]:
    missing = [name for name in QUERIES_SCHEMA.names if name not in table.column_names]
    if missing:
        raise QueryValidationError(f"queries table lacks columns {missing}")
    return [Query.from_row(row) for row in table.to_pylist()]
