"""Plain query files (JSONL or Parquet in the `queries` table's own shape)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pyarrow.parquet as pq

from rubricem_core.readers.records import (
    QueryFileError,
    _check_split,
    _Collector,
    _iter_records,
    _last_user_turn,
    _messages,
    _Record,
    _rubric_list,
)
from rubricem_core.schemas import (
    QUERIES_SCHEMA,
    QUERY_SPLITS,
    Query,
    QueryValidationError,
    queries_from_table,
)

# ---- plain query files -------------------------------------------------------------------------


def read_plain_queries(path: str | os.PathLike[str], split: str = "train", source: str | None = None) -> list[Query]:
    """Plain JSONL/JSON/Parquet queries: question|query|prompt (required), optional query_id|id,
    messages, rubrics, reference_answer|answer, kind, split, spec, metadata.

    A Parquet file with every `queries` column (our own export) is read back unchanged.
    """
    path, split = Path(path), _check_split(split)
    if path.suffix.lower() == ".parquet":
        try:
            names = pq.read_schema(path).names
        except Exception as exc:  # pyarrow raises several types for unreadable files
            raise QueryFileError(path, None, f"unreadable Parquet file: {exc}") from exc
        if all(name in names for name in QUERIES_SCHEMA.names):
            try:
                return queries_from_table(pq.read_table(path))
            except QueryValidationError as exc:
                raise QueryFileError(path, None, str(exc)) from exc
    source = source or ("parquet" if path.suffix.lower() == ".parquet" else "jsonl")
    out = _Collector(path)
    for index, (where, data) in enumerate(_iter_records(path)):
        record = _Record(path, where, data)
        name, asked = record.first("question", "query", "prompt")
        messages = None
        if isinstance(asked, list):  # a prompt given as a conversation
            messages = _messages(record, name, asked)
            question = _last_user_turn(record, name, messages)
        else:
            question = record.text(name)
        if data.get("messages") is not None:
            messages = _messages(record, "messages", data["messages"])
        messages = messages or [{"role": "user", "content": question}]
        rubrics = _rubric_list(record, "rubrics", data.get("rubrics"))
        reference = record.text("reference_answer", "answer", required=False)
        if data.get("query_id") is not None:
            query_id = record.ident("query_id")
        elif data.get("id") is not None:
            query_id = f"{source}-{record.ident('id')}"
        else:
            query_id = f"{source}-{index:05d}"
        row_split = data.get("split", split)
        if row_split not in QUERY_SPLITS:
            raise record.error("split", f"expected one of {QUERY_SPLITS}, got {row_split!r}")
        kind = data.get("kind") or ("short_form" if reference and not rubrics else "long_form")
        for field in ("spec", "metadata"):
            if data.get(field) is not None and not isinstance(data[field], (dict, str)):
                raise record.error(field, "expected an object")
        spec, metadata = (
            json.loads(data[f]) if isinstance(data.get(f), str) else (data.get(f) or {}) for f in ("spec", "metadata")
        )
        out.add(
            where,
            query_id=query_id,
            source=source,
            split=row_split,
            kind=str(kind),
            question=question,
            messages=messages,
            rubrics=rubrics,
            reference_answer=reference,
            spec=spec,
            metadata=metadata,
        )
    return out.result()
