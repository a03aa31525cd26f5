"""The one home of every table's Arrow schema, the `Query` record that fills `queries`, and the
NaN ↔ None conversion of row values.

Table names and the columns DESIGN.md lists are a contract (SQL users rely on them); tables may have
more columns. ``TABLE_SCHEMAS`` maps each table written with a fixed schema to it. JSON-valued columns
(messages, spec, metadata, rubric check, ...) are stored as JSON strings so that the tables stay flat and
DuckDB-friendly; the `Query` dataclass holds them decoded.

Floats: in memory a missing value is NaN (numpy/torch arithmetic), in a table it is NULL (SQL's
``avg`` and ``IS NULL`` see it); ``nan_to_none`` / ``none_to_nan`` are the one conversion between them.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa

RUBRIC_STAGES: tuple[str, ...] = ("plan", "research", "review", "answer")
RUBRIC_POLARITIES: tuple[str, ...] = ("positive", "negative")
# train: RL queries (and SFT's unless data.sft_split says otherwise); sft: SFT data collection only (the
# paper's short- and long-form SFT mix, apart from the RL queries); eval: held out.
QUERY_SPLITS: tuple[str, ...] = ("train", "sft", "eval")
SHORT_FORM = "short_form"  # the query kind readers give short-answer data; every other kind counts as long-form

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


# ---- SFT data collection (tasks/collect.py) -----------------------------------------------------
TEACHER_REQUESTS_SCHEMA = pa.schema(
    [
        ("request_id", pa.string()),
        ("trajectory_id", pa.string()),
        ("query_id", pa.string()),
        ("round", pa.int64()),
        ("model", pa.string()),
        ("mode", pa.string()),
        ("batch_id", pa.string()),
        ("status", pa.string()),
        ("n_messages", pa.int64()),
        ("last_message", pa.string()),
        ("submitted_at", pa.timestamp("us", tz="UTC")),
    ]
)
TEACHER_RESPONSES_SCHEMA = pa.schema(
    [
        ("request_id", pa.string()),
        ("trajectory_id", pa.string()),
        ("query_id", pa.string()),
        ("round", pa.int64()),
        ("model", pa.string()),
        ("status", pa.string()),
        ("response", pa.string()),
        ("error", pa.string()),
        ("finish_reason", pa.string()),
        ("prompt_tokens", pa.int64()),
        ("completion_tokens", pa.int64()),
        ("cost_usd", pa.float64()),
        ("attempts", pa.int64()),
        ("latency_s", pa.float64()),
        ("batch_id", pa.string()),
    ]
)
SFT_TRAJECTORIES_SCHEMA = pa.schema(
    [
        ("trajectory_id", pa.string()),
        ("query_id", pa.string()),
        ("accepted", pa.bool_()),
        ("reject_reasons", pa.list_(pa.string())),
        ("reject_details", pa.list_(pa.string())),
        ("n_tool_calls", pa.int64()),
        ("n_rounds", pa.int64()),
        ("finish_reason", pa.string()),
        ("text", pa.string()),
        ("messages", pa.string()),
        ("model", pa.string()),
        ("prompt_tokens", pa.int64()),
        ("completion_tokens", pa.int64()),
        ("cost_usd", pa.float64()),
    ]
)
# One row per trajectory touched by a round (rubricem_core.teacher.rounds.TrajectoryState.to_row, plus
# the round): the round's end state of the trajectory; a round's partition marks the round complete.
TEACHER_STATE_SCHEMA = pa.schema(
    [
        ("trajectory_id", pa.string()),
        ("query_id", pa.string()),
        ("sample_index", pa.int64()),
        ("seed", pa.int64()),
        ("messages", pa.string()),  # JSON list of {role, content}
        ("text", pa.string()),
        ("n_tool_calls", pa.int64()),
        ("n_rounds", pa.int64()),
        ("finished", pa.bool_()),
        ("finish_reason", pa.string()),
        ("error", pa.string()),
        ("prompt_tokens", pa.int64()),
        ("completion_tokens", pa.int64()),
        ("cost_usd", pa.float64()),
        ("tool_errors", pa.int64()),
        ("extra", pa.string()),  # JSON object
        ("round", pa.int64()),
    ]
)
TEACHER_REFLECTIONS_SCHEMA = pa.schema(
    [
        ("request_id", pa.string()),
        ("trajectory_id", pa.string()),
        ("query_id", pa.string()),
        ("model", pa.string()),
        ("status", pa.string()),
        ("error", pa.string()),
        ("response", pa.string()),
        ("text", pa.string()),
        ("valid", pa.bool_()),
        ("reject_codes", pa.list_(pa.string())),
        ("messages", pa.string()),
        ("prompt_tokens", pa.int64()),
        ("completion_tokens", pa.int64()),
        ("cost_usd", pa.float64()),
        ("attempts", pa.int64()),
    ]
)

# ---- one RL step (tasks/rl.py), partitioned by step ------------------------------------------------
ROLLOUTS_SCHEMA = pa.schema(
    [
        ("step", pa.int64()),
        ("query_id", pa.string()),
        ("rollout_id", pa.string()),
        ("phase", pa.string()),
        ("retrieval", pa.string()),
        ("token_ids", pa.list_(pa.int64())),
        ("loss_mask", pa.list_(pa.int8())),
        ("stage_ids", pa.list_(pa.int8())),
        ("logprobs", pa.list_(pa.float32())),
        ("n_tool_calls", pa.int64()),
        ("finish_reason", pa.string()),
        ("valid_scaffold", pa.bool_()),
        ("judge_failed", pa.bool_()),
        ("judge_error", pa.string()),
        ("violations", pa.list_(pa.string())),
        ("n_tokens", pa.int64()),
        ("n_policy_tokens", pa.int64()),
        ("prompt_len", pa.int64()),
        ("text", pa.string()),
        ("segments", pa.string()),
        ("guidance", pa.string()),
    ]
)
JUDGE_RUBRICS_SCHEMA = pa.schema(
    [
        ("step", pa.int64()),
        ("query_id", pa.string()),
        ("rubric_id", pa.string()),
        ("stage", pa.string()),
        ("polarity", pa.string()),
        ("origin", pa.string()),
        ("title", pa.string()),
        ("description", pa.string()),
        ("weight", pa.float64()),
        ("status", pa.string()),
        ("created_step", pa.int64()),
        ("pruned_step", pa.int64()),
        ("check", pa.string()),
    ]
)
JUDGE_SCORES_SCHEMA = pa.schema(
    [
        ("step", pa.int64()),
        ("query_id", pa.string()),
        ("rollout_id", pa.string()),
        ("rubric_id", pa.string()),
        ("stage", pa.string()),
        ("polarity", pa.string()),
        ("weight", pa.float64()),
        ("score", pa.int64()),
        ("justification", pa.string()),
    ]
)
STAGE_REWARDS_SCHEMA = pa.schema(
    [
        ("step", pa.int64()),
        ("query_id", pa.string()),
        ("rollout_id", pa.string()),
        ("stage", pa.string()),
        ("R", pa.float64()),
        ("G", pa.float64()),
        ("A", pa.float64()),
    ]
)

# ---- reflection meta-policy (tasks/reflection.py) and its bank -------------------------------------
REFLECTIONS_SCHEMA = pa.schema(
    [
        ("step", pa.int64()),
        ("query_id", pa.string()),
        ("source_rollout_id", pa.string()),
        ("candidate", pa.int64()),
        ("text", pa.string()),
        ("valid", pa.bool_()),
        ("score", pa.float64()),
        ("accepted", pa.bool_()),
        ("judge_failed", pa.bool_()),
        ("codes", pa.list_(pa.string())),
        ("justification", pa.string()),
        ("token_ids", pa.list_(pa.int64())),
        ("loss_mask", pa.list_(pa.int8())),
        ("logprobs", pa.list_(pa.float32())),
        ("n_tokens", pa.int64()),
        ("finish_reason", pa.string()),
    ]
)
# The `bank` table (tables/bank): one row per query, a copy of the bank's entries for SQL.
BANK_SCHEMA = pa.schema(
    [
        ("query_id", pa.string()),
        ("query_text", pa.string()),
        ("reflection", pa.string()),
        ("score", pa.float64()),
        ("step", pa.int64()),
    ]
)
# The saved bank's entries file (state/bank/part.parquet, rubricem_core.reflection.bank): the same
# columns, never null, plus each entry's id in the FAISS index saved beside it.
BANK_ENTRIES_SCHEMA = pa.schema(
    [pa.field(f.name, f.type, nullable=False) for f in BANK_SCHEMA] + [pa.field("faiss_id", pa.int64(), nullable=False)]
)

# ---- tracking (rubricem_core.tracking mirrors MLflow's metrics here for SQL) ------------------------
METRICS_SCHEMA = pa.schema(
    [
        ("step", pa.int64()),
        ("name", pa.string()),
        ("value", pa.float64()),
        ("flow", pa.string()),
        ("run_id", pa.string()),
        ("logged_at", pa.timestamp("us", tz="UTC")),
    ]
)

# ---- evaluation (rubricem_core.eval.run, tasks/evaluate.py, the ablation flow) ----------------------
EVAL_RESULTS_SCHEMA = pa.schema(
    [
        ("checkpoint", pa.string()),
        ("benchmark", pa.string()),
        ("query_id", pa.string()),
        ("retrieval", pa.string()),
        ("score", pa.float64()),
        ("details", pa.string()),
        ("sample", pa.int64()),
        ("grade_failed", pa.bool_()),
        ("error", pa.string()),
        ("grader", pa.string()),
        ("valid_scaffold", pa.bool_()),
        ("n_tool_calls", pa.int64()),
        ("finish_reason", pa.string()),
        ("n_policy_tokens", pa.int64()),
        ("guidance", pa.string()),
        ("answer", pa.string()),
        ("text", pa.string()),
        ("settings", pa.string()),
        ("step", pa.int64()),  # the RL step of the checkpoint; NULL: SFT or a checkpoint from elsewhere
    ]
)
EVAL_REFLECTIONS_SCHEMA = pa.schema(
    [
        ("checkpoint", pa.string()),
        ("benchmark", pa.string()),
        ("retrieval", pa.string()),
        ("query_id", pa.string()),
        ("sample", pa.int64()),
        ("text", pa.string()),
        ("valid", pa.bool_()),
        ("codes", pa.list_(pa.string())),
    ]
)
ABLATION_SCHEMA = pa.schema(
    [
        ("recipe", pa.string()),
        ("benchmark", pa.string()),
        ("retrieval", pa.string()),
        ("checkpoint", pa.string()),
        ("score_mean", pa.float64()),
        ("n_samples", pa.int64()),
        ("grade_failed", pa.int64()),
        ("valid_scaffold_rate", pa.float64()),
        ("rl_steps", pa.int64()),
        ("queries_per_step", pa.int64()),
        ("group_size", pa.int64()),
        ("run_dir", pa.string()),
    ]
)

# the columns that identify a row of a table: runs are compared row for row by them (resume ≡ uninterrupted)
ROW_KEYS: dict[str, tuple[str, ...]] = {
    "queries": ("query_id",),
    "corpus": ("doc_id",),
    "teacher_requests": ("request_id",),
    "teacher_responses": ("request_id",),
    "teacher_state": ("round", "trajectory_id"),
    "sft_trajectories": ("trajectory_id",),
    "rollouts": ("step", "rollout_id"),
    "judge_rubrics": ("step", "query_id", "rubric_id"),
    "judge_scores": ("step", "rollout_id", "rubric_id"),
    "stage_rewards": ("step", "rollout_id", "stage"),
    "reflections": ("step", "source_rollout_id", "candidate"),
    "bank": ("query_id", "step"),
}


def row_keys(*tables: str) -> dict[str, tuple[str, ...]]:
    """``ROW_KEYS`` of the named tables, in that order."""
    return {t: ROW_KEYS[t] for t in tables}


# table name → the schema it is written with; RunStore.write_table refuses a table that is not here
TABLE_SCHEMAS: dict[str, pa.Schema] = {
    "queries": QUERIES_SCHEMA,
    "corpus": CORPUS_SCHEMA,
    "teacher_requests": TEACHER_REQUESTS_SCHEMA,
    "teacher_responses": TEACHER_RESPONSES_SCHEMA,
    "teacher_state": TEACHER_STATE_SCHEMA,
    "sft_trajectories": SFT_TRAJECTORIES_SCHEMA,
    "teacher_reflections": TEACHER_REFLECTIONS_SCHEMA,
    "rollouts": ROLLOUTS_SCHEMA,
    "judge_rubrics": JUDGE_RUBRICS_SCHEMA,
    "judge_scores": JUDGE_SCORES_SCHEMA,
    "stage_rewards": STAGE_REWARDS_SCHEMA,
    "reflections": REFLECTIONS_SCHEMA,
    "bank": BANK_SCHEMA,
    "metrics": METRICS_SCHEMA,
    "eval_results": EVAL_RESULTS_SCHEMA,
    "eval_reflections": EVAL_REFLECTIONS_SCHEMA,
    "ablation": ABLATION_SCHEMA,
}


# ---- NaN (in memory) ↔ NULL (in a table) -----------------------------------------------------------
def nan_to_none(value: float | None) -> float | None:
    """A float for a table cell: NaN (and None) → None, anything else unchanged."""
    return None if value is None or math.isnan(value) else value


def none_to_nan(value: float | None) -> float:
    """A table cell back to a float for arithmetic: None → NaN, anything else unchanged."""
    return math.nan if value is None else value


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
    def from_row(cls, row: dict[str, Any]) -> Query:
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
