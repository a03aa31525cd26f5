"""SFT query sources: SearchArena conversations, OpenScholar questions."""

from __future__ import annotations

import os
from pathlib import Path

from rubricem_core.readers.records import _check_split, _Collector, _iter_records, _messages, _Record
from rubricem_core.schemas import (
    Query,
)

# ---- SFT sources: SearchArena conversations, OpenScholar questions ------------------------------

# SearchArena's intent labels (Miroyan et al., 2025): a factual lookup asks for a short fact; every other
# intent (synthesis, analysis, recommendation, explanation, ...) asks for a long-form answer.
_SHORT_INTENTS = frozenset({"factual lookup", "factual_lookup", "factual"})


def read_searcharena(path: str | os.PathLike[str], split: str = "sft") -> list[Query]:
    """SearchArena conversations (lmarena-ai/search-arena-24k, JSONL or Parquet): one query per
    conversation, its first user turn (later turns answer a model's reply, not a standalone question).
    Fields: messages_a|messages (a list of {role, content}; both sides of a battle share the user turns),
    question_id|id (else the record number), primary_intent (a factual lookup is short-form, any other
    intent long-form; without it, long-form), language. Default split: sft (the paper's SFT data)."""
    path, split = Path(path), _check_split(split)
    out = _Collector(path)
    for index, (where, data) in enumerate(_iter_records(path)):
        record = _Record(path, where, data)
        name, value = record.first("messages_a", "messages")
        messages = _messages(record, name, value)
        first = next((m["content"] for m in messages if m["role"] == "user" and m["content"].strip()), None)
        if first is None:
            raise record.error(name, "no non-empty user message")
        _, raw_id = record.first("question_id", "id", required=False)
        intent = data.get("primary_intent")
        metadata = {
            k: data[k] for k in ("language", "primary_intent", "secondary_intent") if isinstance(data.get(k), str)
        }
        out.add(
            where,
            query_id=f"searcharena-{raw_id if raw_id is not None else f'{index:05d}'}",
            source="searcharena",
            split=split,
            kind="short_form" if isinstance(intent, str) and intent.strip().lower() in _SHORT_INTENTS else "long_form",
            question=first,
            messages=[{"role": "user", "content": first}],
            metadata=metadata,
        )
    return out.result()


def read_openscholar(path: str | os.PathLike[str], split: str = "sft") -> list[Query]:
    """OpenScholar questions (allenai/openscilm_queries, queries.jsonl; OpenScholar's demo queries): a
    scientific-literature question per record in query|question|input|text, its id in id|query_id|qid
    (else the record number). Every question asks for a long-form, cited synthesis. Default split: sft."""
    path, split = Path(path), _check_split(split)
    out = _Collector(path)
    for index, (where, data) in enumerate(_iter_records(path)):
        record = _Record(path, where, data)
        question = record.text("query", "question", "input", "text")
        assert question is not None  # required
        _, raw_id = record.first("id", "query_id", "qid", required=False)
        out.add(
            where,
            query_id=f"openscholar-{raw_id if raw_id is not None else f'{index:05d}'}",
            source="openscholar",
            split=split,
            kind="long_form",
            question=question,
        )
    return out.result()
