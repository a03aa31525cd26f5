"""What every reader shares: the error that names the file and record, record access over JSONL, JSON,
Parquet and CSV files, and field helpers (numbers, messages, rubric items) that name a bad field."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal, overload

import pyarrow.parquet as pq

from rubricem_core.schemas import (
    QUERY_SPLITS,
    RUBRIC_POLARITIES,
    RUBRIC_STAGES,
    Query,
    QueryValidationError,
)


class QueryFileError(ValueError):
    """A query file is malformed; the message names the file, the line/record and the field."""

    def __init__(self, path: str | os.PathLike[str], where: str | None, message: str):
        self.path, self.where = Path(path), where
        super().__init__(f"{path}: {where}: {message}" if where else f"{path}: {message}")


# ---- low-level record access -------------------------------------------------------------------


def _iter_jsonl(path: Path) -> Iterator[tuple[str, Any]]:
    with open(path, "rb") as fh:
        for line_no, raw in enumerate(fh, start=1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise QueryFileError(path, f"line {line_no}", f"not valid UTF-8 ({exc.reason})") from exc
            if not line.strip():
                continue
            try:
                yield f"line {line_no}", json.loads(line)
            except json.JSONDecodeError as exc:
                raise QueryFileError(
                    path, f"line {line_no}", f"malformed JSON: {exc.msg} (column {exc.colno})"
                ) from exc


def _load_json(path: Path) -> Any:
    try:
        return json.loads(path.read_bytes().decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise QueryFileError(path, None, f"not valid UTF-8 ({exc.reason} at byte {exc.start})") from exc
    except json.JSONDecodeError as exc:
        raise QueryFileError(path, f"line {exc.lineno}", f"malformed JSON: {exc.msg}") from exc


def _iter_json_list(path: Path) -> Iterator[tuple[str, Any]]:
    data = _load_json(path)
    if isinstance(data, dict):  # some dumps wrap the list: {"data": [...]}
        lists = [v for v in data.values() if isinstance(v, list)]
        if len(lists) != 1:
            raise QueryFileError(path, None, "expected a JSON list of records")
        data = lists[0]
    if not isinstance(data, list):
        raise QueryFileError(path, None, f"expected a JSON list of records, got {type(data).__name__}")
    for index, record in enumerate(data):
        yield f"record {index}", record


def _iter_parquet(path: Path) -> Iterator[tuple[str, Any]]:
    try:
        table = pq.read_table(path)
    except Exception as exc:  # pyarrow raises several types for unreadable files
        raise QueryFileError(path, None, f"unreadable Parquet file: {exc}") from exc
    for index, record in enumerate(table.to_pylist()):
        yield f"row {index}", record


def _iter_records(path: Path) -> Iterator[tuple[str, Any]]:
    suffix = path.suffix.lower()
    if suffix == ".parquet":
        return _iter_parquet(path)
    if suffix == ".json":
        # .json may hold a list or (despite the name) one object per line.
        head = _first_char(path)
        return _iter_json_list(path) if head == "[" or head == "{" and _is_single_json(path) else _iter_jsonl(path)
    return _iter_jsonl(path)


def _first_char(path: Path) -> str:
    with open(path, "rb") as fh:
        for raw in fh:
            stripped = raw.strip()
            if stripped:
                return chr(stripped[0])
    return ""


def _is_single_json(path: Path) -> bool:
    try:
        json.loads(path.read_bytes().decode("utf-8"))
        return True
    except (UnicodeDecodeError, json.JSONDecodeError):
        return False


# ---- field helpers -----------------------------------------------------------------------------


class _Record:
    """A record plus its location, with typed field access that raises QueryFileError."""

    def __init__(self, path: Path, where: str, data: Any):
        if not isinstance(data, dict):
            raise QueryFileError(path, where, f"expected a JSON object, got {type(data).__name__}")
        self.path, self.where, self.data = path, where, data

    def error(self, field: str, message: str) -> QueryFileError:
        return QueryFileError(self.path, self.where, f"field {field!r}: {message}")

    def first(self, *names: str, required: bool = True) -> tuple[str, Any]:
        for name in names:
            if self.data.get(name) is not None:
                return name, self.data[name]
        if required:
            raise self.error("|".join(names), "missing")
        return names[0], None

    @overload
    def text(self, *names: str, required: Literal[True] = True) -> str: ...

    @overload
    def text(self, *names: str, required: bool) -> str | None: ...

    def text(self, *names: str, required: bool = True) -> str | None:
        name, value = self.first(*names, required=required)
        if value is None:
            return None
        if not isinstance(value, str) or not value.strip():
            raise self.error(name, f"expected a non-empty string, got {value!r:.60}")
        return value

    def ident(self, *names: str) -> str:
        name, value = self.first(*names)
        if isinstance(value, bool) or not isinstance(value, (str, int)) or not str(value).strip():
            raise self.error(name, f"expected a string or integer id, got {value!r:.60}")
        return str(value)


def _number(record: _Record, field: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        try:
            return float(value)
        except (TypeError, ValueError):
            raise record.error(field, f"expected a number, got {value!r:.60}") from None
    return float(value)


def _short_title(text: str, limit: int = 80) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 1].rstrip() + "…"


def _messages(record: _Record, field: str, value: Any) -> list[dict[str, str]]:
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError:
            raise record.error(field, "expected a list of {role, content} messages (or its JSON)") from None
    if not isinstance(value, list) or not value:
        raise record.error(field, "expected a non-empty list of {role, content} messages")
    out = []
    for index, message in enumerate(value):
        if (
            not isinstance(message, dict)
            or not isinstance(message.get("role"), str)
            or not isinstance(message.get("content"), str)
        ):
            raise record.error(f"{field}[{index}]", "expected an object with string 'role' and 'content'")
        out.append({"role": message["role"], "content": message["content"]})
    return out


def _last_user_turn(record: _Record, field: str, messages: list[dict[str, str]]) -> str:
    for message in reversed(messages):
        if message["role"] == "user" and message["content"].strip():
            return message["content"]
    raise record.error(field, "no non-empty user message")


def _rubric(record: _Record, field: str, item: Any) -> dict[str, Any]:
    """Normalise one rubric of a training/plain file; weight < 0 means a negative rubric."""
    if isinstance(item, str):
        item = {"description": item}
    if not isinstance(item, dict):
        raise record.error(field, f"expected a rubric object, got {type(item).__name__}")
    description = next(
        (item[k] for k in ("description", "criterion", "rubric", "text") if isinstance(item.get(k), str)), None
    )
    title = next((item[k] for k in ("title", "name") if isinstance(item.get(k), str)), None)
    if not (description or title):
        raise record.error(field, "rubric has neither a description/criterion nor a title")
    raw_weight = next((item[k] for k in ("weight", "points", "score") if item.get(k) is not None), 1.0)
    weight = _number(record, f"{field}.weight", raw_weight)
    polarity = item.get("polarity") or ("negative" if weight < 0 else "positive")
    if polarity not in RUBRIC_POLARITIES:
        raise record.error(f"{field}.polarity", f"expected one of {RUBRIC_POLARITIES}, got {polarity!r}")
    stage = item.get("stage") or "answer"
    if stage not in RUBRIC_STAGES:
        raise record.error(f"{field}.stage", f"expected one of {RUBRIC_STAGES}, got {stage!r}")
    check = item.get("check")
    if isinstance(check, str):
        try:
            check = json.loads(check)
        except json.JSONDecodeError:
            raise record.error(f"{field}.check", "expected a JSON object") from None
    if check is not None and not isinstance(check, dict):
        raise record.error(f"{field}.check", "expected a JSON object or null")
    return {
        "title": title or _short_title(description or ""),  # without a title there is a description
        "description": description or title,
        "weight": abs(weight),
        "polarity": polarity,
        "stage": stage,
        "check": check,
    }


def _rubric_list(record: _Record, field: str, value: Any) -> list[dict[str, Any]]:
    if value is None:
        return []
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError:
            raise record.error(field, "expected a list of rubrics (or its JSON)") from None
    if not isinstance(value, list):
        raise record.error(field, f"expected a list of rubrics, got {type(value).__name__}")
    return [_rubric(record, f"{field}[{i}]", item) for i, item in enumerate(value)]


def _final_rubric(answer: str, aliases: list[str]) -> dict[str, Any]:
    return {
        "title": f"Answers {_short_title(answer, 70)}",
        "description": f"The final answer is {answer}.",
        "weight": 3.0,
        "polarity": "positive",
        "stage": "answer",
        "check": {"type": "final", "value": answer, "aliases": aliases},
    }


def _benchmark_rubric(
    title: str, description: str, signed_weight: float, benchmark: str, **check: Any
) -> dict[str, Any]:
    """An answer-stage rubric from a benchmark's criterion: weight |signed_weight|; a negative one makes
    it a negative rubric (a pitfall whose presence costs)."""
    return {
        "title": title,
        "description": description,
        "weight": abs(signed_weight),
        "polarity": "negative" if signed_weight < 0 else "positive",
        "stage": "answer",
        "check": {"type": "benchmark", "benchmark": benchmark, **check},
    }


def _check_split(split: str) -> str:
    if split not in QUERY_SPLITS:
        raise ValueError(f"split must be one of {QUERY_SPLITS}, got {split!r}")
    return split


class _Collector:
    """Accumulates queries and rejects duplicate query ids, naming both locations."""

    def __init__(self, path: Path):
        self.path = path
        self.queries: list[Query] = []
        self.seen: dict[str, str] = {}

    def add(self, where: str, **fields: Any) -> None:
        """One query; unless given, its prompt is the question as a single user turn (rubrics, reference,
        spec and metadata default as `Query`'s)."""
        fields.setdefault("messages", [{"role": "user", "content": fields["question"]}])
        query_id = fields["query_id"]
        if query_id in self.seen:
            raise QueryFileError(self.path, where, f"duplicate query id {query_id!r} (first at {self.seen[query_id]})")
        try:
            self.queries.append(Query(**fields))
        except QueryValidationError as exc:
            raise QueryFileError(self.path, where, str(exc)) from exc
        self.seen[query_id] = where

    def add_long_form(self, where: str, source: str, ident: str, split: str, **fields: Any) -> None:
        """A benchmark's long-form query, id ``{source}-{ident}``."""
        self.add(where, query_id=f"{source}-{ident}", source=source, split=split, kind="long_form", **fields)

    def result(self) -> list[Query]:
        if not self.queries:
            raise QueryFileError(self.path, None, "no queries found")
        return self.queries


def _first_record_keys(path: Path) -> set[str]:
    try:
        for _, record in _iter_records(path):
            return set(record) if isinstance(record, dict) else set()
    except QueryFileError:
        return set()
    return set()
