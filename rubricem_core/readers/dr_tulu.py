"""DR Tulu's RL rows (the paper's training queries)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from rubricem_core.readers.records import (
    _check_split,
    _Collector,
    _final_rubric,
    _iter_records,
    _last_user_turn,
    _messages,
    _Record,
    _rubric_list,
)
from rubricem_core.schemas import (
    Query,
)

# ---- DR Tulu RL rows ---------------------------------------------------------------------------


def _parse_ground_truth(record: _Record, value: Any) -> tuple[dict[str, Any] | None, list[str]]:
    """DR Tulu `ground_truth`: a JSON string (often wrapped in a one-element list) of
    {"query"|"Question", "rubrics": [...]} for long-form rows, or a plain answer string (or list of
    aliases) for short-form rows. Returns (rubric object or None, answer aliases)."""
    if isinstance(value, list) and len(value) == 1:
        value = value[0]
    if isinstance(value, dict):
        return value, []
    if isinstance(value, list):
        if all(isinstance(v, str) for v in value) and value:
            return None, list(value)
        raise record.error("ground_truth", "expected a JSON string, an object, or a list of answer strings")
    if not isinstance(value, str) or not value.strip():
        raise record.error("ground_truth", f"expected a non-empty string or object, got {value!r:.60}")
    try:
        parsed = json.loads(value)
    except json.JSONDecodeError:
        return None, [value]
    if isinstance(parsed, dict):
        return parsed, []
    if isinstance(parsed, list) and parsed and all(isinstance(v, str) for v in parsed):
        return None, parsed
    return None, [value]


def read_dr_tulu(path: str | os.PathLike[str], split: str = "train") -> list[Query]:
    """DR Tulu RL rows (JSONL or Parquet): `messages`, `ground_truth`, optional `dataset`, `id`."""
    path, split = Path(path), _check_split(split)
    out = _Collector(path)
    for index, (where, data) in enumerate(_iter_records(path)):
        record = _Record(path, where, data)
        _, raw_messages = record.first("messages", "prompt")
        messages = _messages(record, "messages", raw_messages)
        _, raw_truth = record.first("ground_truth", "ground_truths", "label")
        truth, aliases = _parse_ground_truth(record, raw_truth)
        metadata: dict[str, Any] = {}
        if isinstance(data.get("dataset"), (str, list)):
            metadata["dataset"] = data["dataset"]
        rubrics: list[dict[str, Any]] = []
        reference = None
        if truth is not None:
            if truth.get("rubrics") is not None:
                rubrics = _rubric_list(record, "ground_truth.rubrics", truth["rubrics"])
            answer = next(
                (truth[k] for k in ("answer", "Answer", "ground_truth") if isinstance(truth.get(k), str)), None
            )
            if answer:
                aliases = [answer]
            if not rubrics and not aliases:
                raise record.error("ground_truth", "object has neither 'rubrics' nor an 'answer'")
            gt_query = truth.get("query") or truth.get("Question")
            if isinstance(gt_query, str):
                metadata["ground_truth_query"] = gt_query
        if aliases:
            reference = aliases[0]
            metadata["answer_aliases"] = aliases
            if not rubrics:
                rubrics = [_final_rubric(reference, aliases)]
        raw_id = data.get("id", data.get("query_id"))
        query_id = f"dr_tulu-{raw_id}" if isinstance(raw_id, (str, int)) and str(raw_id) else f"dr_tulu-{index:06d}"
        out.add(
            where,
            query_id=query_id,
            source="dr_tulu",
            split=split,
            kind="long_form" if truth is not None and truth.get("rubrics") else "short_form",
            question=_last_user_turn(record, "messages", messages),
            messages=messages,
            rubrics=rubrics,
            reference_answer=reference,
            metadata=metadata,
        )
    return out.result()
