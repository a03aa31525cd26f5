"""Readers for real query sets -> list[Query] (the `queries` table).

One function per format; `read_queries` picks one from `format` or from the file's content.
Benchmark sets default to the "eval" split, training sets (DR Tulu RL rows, plain files) to "train".

Rubric `check` objects written here:
  {"type": "final", "value", "aliases"}        short-form answer, checkable by string match
  {"type": "benchmark", "benchmark", ...}       judged by an LLM; carries the source's own details
                                                (HealthBench points/tags, ScholarQA evidence,
                                                DeepResearchBench dimension and weights, ResearchQA
                                                item type, ResearchRubrics signed weight and axis)

ResearchQA, ResearchRubrics, WebWalkerQA and DeepSearchQA are read in their published formats; the
comment above each reader names the source (repository / dataset card, commit) and the fields followed.
"""

from __future__ import annotations

import ast
import csv
import dataclasses
import json
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Literal, overload

import pyarrow.parquet as pq

from rubricem_core.schemas import (
    QUERIES_SCHEMA,
    QUERY_SPLITS,
    RUBRIC_POLARITIES,
    RUBRIC_STAGES,
    Query,
    QueryValidationError,
    queries_from_table,
)

FORMATS: tuple[str, ...] = (
    "dr_tulu",
    "healthbench",
    "scholarqa_cs",
    "deep_research_bench",
    "simpleqa",
    "2wiki",
    "researchqa",
    "researchrubrics",
    "webwalkerqa",
    "deepsearchqa",
    "searcharena",
    "openscholar",
    "jsonl",
    "parquet",
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

    def result(self) -> list[Query]:
        if not self.queries:
            raise QueryFileError(self.path, None, "no queries found")
        return self.queries


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


# ---- HealthBench -------------------------------------------------------------------------------


def read_healthbench(path: str | os.PathLike[str], split: str = "eval") -> list[Query]:
    """HealthBench JSONL: prompt (conversation), prompt_id, rubrics [{criterion, points, tags}]."""
    path, split = Path(path), _check_split(split)
    out = _Collector(path)
    for where, data in _iter_records(path):
        record = _Record(path, where, data)
        messages = _messages(record, "prompt", record.first("prompt")[1])
        _, items = record.first("rubrics")
        if not isinstance(items, list) or not items:
            raise record.error("rubrics", "expected a non-empty list")
        rubrics = []
        for i, item in enumerate(items):
            field = f"rubrics[{i}]"
            if (
                not isinstance(item, dict)
                or not isinstance(item.get("criterion"), str)
                or not item["criterion"].strip()
            ):
                raise record.error(f"{field}.criterion", "missing or not a string")
            if "points" not in item:
                raise record.error(f"{field}.points", "missing")
            points = _number(record, f"{field}.points", item["points"])
            tags = item.get("tags") or []
            rubrics.append(
                {
                    "title": _short_title(item["criterion"]),
                    "description": item["criterion"],
                    "weight": abs(points),
                    "polarity": "negative" if points < 0 else "positive",
                    "stage": "answer",
                    "check": {"type": "benchmark", "benchmark": "healthbench", "points": points, "tags": tags},
                }
            )
        ideal = data.get("ideal_completions_data")
        reference = ideal.get("ideal_completion") if isinstance(ideal, dict) else None
        metadata = {"example_tags": data.get("example_tags") or [], "n_turns": len(messages)}
        if isinstance(ideal, dict) and ideal.get("ideal_completions_group"):
            metadata["ideal_completions_group"] = ideal["ideal_completions_group"]
        out.add(
            where,
            query_id=f"healthbench-{record.ident('prompt_id')}",
            source="healthbench",
            split=split,
            kind="long_form",
            question=_last_user_turn(record, "prompt", messages),
            messages=messages,
            rubrics=rubrics,
            reference_answer=reference if isinstance(reference, str) else None,
            metadata=metadata,
        )
    return out.result()


# ---- ScholarQA-CS ------------------------------------------------------------------------------


def read_scholarqa_cs(path: str | os.PathLike[str], split: str = "eval") -> list[Query]:
    """ScholarQA-CS JSON: case_id, initial_prompt, metric_config.config.other_properties[...]."""
    path, split = Path(path), _check_split(split)
    out = _Collector(path)
    for where, data in _iter_records(path):
        record = _Record(path, where, data)
        question = record.text("initial_prompt")
        config = (
            (data.get("metric_config") or {}).get("config") if isinstance(data.get("metric_config"), dict) else None
        )
        if not isinstance(config, dict):
            raise record.error("metric_config.config", "missing or not an object")
        properties = config.get("other_properties")
        if not isinstance(properties, list):
            raise record.error("metric_config.config.other_properties", "missing or not a list")
        rubrics = []
        for i, item in enumerate(properties):
            field = f"metric_config.config.other_properties[{i}]"
            if not isinstance(item, dict) or not isinstance(item.get("criterion"), str):
                raise record.error(f"{field}.criterion", "missing or not a string")
            weight = _number(record, f"{field}.weight", item.get("weight"))
            name = item.get("name") if isinstance(item.get("name"), str) else f"item_{i}"
            rubrics.append(
                {
                    "title": f"{name}: {_short_title(item['criterion'], 60)}",
                    "description": item["criterion"],
                    "weight": abs(weight),
                    "polarity": "negative" if weight < 0 else "positive",
                    "stage": "answer",
                    "check": {
                        "type": "benchmark",
                        "benchmark": "scholarqa_cs",
                        "name": name,
                        "evidence": item.get("evidence") or [],
                    },
                }
            )
        scalar_config = {k: v for k, v in config.items() if isinstance(v, (int, float, str)) and k != "question"}
        metadata = {
            "metric": (data.get("metric_config") or {}).get("name"),
            "metric_config": scalar_config,
            "annotator": data.get("annotator"),
        }
        out.add(
            where,
            query_id=f"scholarqa_cs-{record.ident('case_id')}",
            source="scholarqa_cs",
            split=split,
            kind="long_form",
            question=question,
            rubrics=rubrics,
            metadata=metadata,
        )
    return out.result()


# ---- DeepResearchBench -------------------------------------------------------------------------


def _first_record_keys(path: Path) -> set[str]:
    try:
        for _, record in _iter_records(path):
            return set(record) if isinstance(record, dict) else set()
    except QueryFileError:
        return set()
    return set()


def _find_drb_criteria(query_path: Path) -> Path | None:
    for candidate in sorted(query_path.parent.glob("*.jsonl")):
        if candidate != query_path and "criterions" in _first_record_keys(candidate):
            return candidate
    return None


def _drb_rubrics(record: _Record) -> list[dict[str, Any]]:
    _, dim_weights = record.first("dimension_weight")
    _, criterions = record.first("criterions")
    if not isinstance(dim_weights, dict) or not isinstance(criterions, dict):
        raise record.error("dimension_weight|criterions", "expected objects keyed by dimension")
    rubrics = []
    for dimension, items in criterions.items():
        if dimension not in dim_weights:
            raise record.error(f"dimension_weight.{dimension}", "missing weight for a dimension with criteria")
        dim_weight = _number(record, f"dimension_weight.{dimension}", dim_weights[dimension])
        if not isinstance(items, list):
            raise record.error(f"criterions.{dimension}", "expected a list")
        for i, item in enumerate(items):
            field = f"criterions.{dimension}[{i}]"
            if not isinstance(item, dict) or not isinstance(item.get("criterion"), str):
                raise record.error(f"{field}.criterion", "missing or not a string")
            weight = _number(record, f"{field}.weight", item.get("weight"))
            explanation = item.get("explanation") if isinstance(item.get("explanation"), str) else item["criterion"]
            rubrics.append(
                {
                    "title": f"[{dimension}] {_short_title(item['criterion'])}",
                    "description": explanation,
                    "weight": dim_weight * weight,
                    "polarity": "positive",
                    "stage": "answer",
                    "check": {
                        "type": "benchmark",
                        "benchmark": "deep_research_bench",
                        "dimension": dimension,
                        "dimension_weight": dim_weight,
                        "criterion_weight": weight,
                        "criterion": item["criterion"],
                    },
                }
            )
    return rubrics


def read_deep_research_bench(
    path: str | os.PathLike[str], criteria_path: str | os.PathLike[str] | None = None, split: str = "eval"
) -> list[Query]:
    """DeepResearchBench query JSONL (id, topic, language, prompt) joined by id with the criteria JSONL.

    Rubric weight = dimension_weight * criterion weight. `criteria_path` defaults to a sibling JSONL
    whose records carry `criterions`; without one the queries have no rubrics.
    """
    path, split = Path(path), _check_split(split)
    criteria_file = Path(criteria_path) if criteria_path is not None else _find_drb_criteria(path)
    rubrics_by_id: dict[str, list[dict[str, Any]]] = {}
    if criteria_file is not None:
        for where, data in _iter_records(criteria_file):
            record = _Record(criteria_file, where, data)
            rubrics_by_id[record.ident("id")] = _drb_rubrics(record)
    out = _Collector(path)
    for where, data in _iter_records(path):
        record = _Record(path, where, data)
        query_id = record.ident("id")
        question = record.text("prompt")
        if criteria_file is not None and query_id not in rubrics_by_id:
            raise QueryFileError(criteria_file, None, f"no criteria for query id {query_id!r} of {path} ({where})")
        metadata = {"topic": data.get("topic"), "language": data.get("language")}
        out.add(
            where,
            query_id=f"deep_research_bench-{query_id}",
            source="deep_research_bench",
            split=split,
            kind="long_form",
            question=question,
            rubrics=rubrics_by_id.get(query_id, []),
            metadata=metadata,
        )
    return out.result()


DRB_REFERENCE_KEY = "reference_article"  # Query.metadata key of a DeepResearchBench reference report


def read_drb_references(path: str | os.PathLike[str]) -> dict[str, str]:
    """DeepResearchBench reference reports (JSONL of id, prompt, article, as the benchmark's
    ``test_data/cleaned_data/reference.jsonl``) → {query_id as ``read_deep_research_bench`` names it: article}.

    RACE grading scores a report relative to its query's reference report. Records are matched by id;
    their ``prompt`` is kept for ``attach_drb_references`` to check against the query's question."""
    return {query_id: article for query_id, (article, _) in _drb_reference_records(Path(path)).items()}


def _drb_reference_records(path: Path) -> dict[str, tuple[str, str | None]]:
    if not path.is_file():
        raise QueryFileError(path, None, "no such file")
    out: dict[str, tuple[str, str | None]] = {}
    for where, data in _iter_records(path):
        record = _Record(path, where, data)
        query_id = f"deep_research_bench-{record.ident('id')}"
        if query_id in out:
            raise QueryFileError(path, where, f"field 'id': a second reference for {query_id!r}")
        out[query_id] = (record.text("article"), record.text("prompt", required=False))
    return out


def attach_drb_references(queries: list[Query], path: str | os.PathLike[str]) -> list[Query]:
    """The queries with their reference report in ``metadata["reference_article"]`` (where the file has one;
    the policy's prompt never shows metadata). A reference written for another prompt than its query's
    (a different release of the benchmark) is an error, not a silent mismatch."""
    path = Path(path)
    records = _drb_reference_records(path)
    out = []
    for query in queries:
        found = records.get(query.query_id)
        if found is None:
            out.append(query)
            continue
        article, prompt = found
        if prompt is not None and prompt.strip() != query.question.strip():
            raise QueryFileError(
                path,
                None,
                f"the reference for {query.query_id!r} was written for another prompt "
                f"({prompt[:60]!r} vs {query.question[:60]!r})",
            )
        out.append(dataclasses.replace(query, metadata={**query.metadata, DRB_REFERENCE_KEY: article}))
    return out


# ---- SimpleQA ----------------------------------------------------------------------------------


def read_simpleqa(path: str | os.PathLike[str], split: str = "eval") -> list[Query]:
    """SimpleQA CSV: metadata (a Python dict literal), question|problem, true_answer|answer."""
    path, split = Path(path), _check_split(split)
    out = _Collector(path)
    try:
        with open(path, encoding="utf-8", newline="") as fh:
            reader = csv.DictReader(fh)
            columns = set(reader.fieldnames or [])
            question_col = "question" if "question" in columns else "problem"
            answer_col = "true_answer" if "true_answer" in columns else "answer"
            for col in (question_col, answer_col):
                if col not in columns:
                    raise QueryFileError(path, "line 1", f"field {col!r}: missing column (have {sorted(columns)})")
            for index, row in enumerate(reader):
                where = f"line {reader.line_num}"
                question, answer = (row.get(question_col) or "").strip(), (row.get(answer_col) or "").strip()
                if not question:
                    raise QueryFileError(path, where, f"field {question_col!r}: empty")
                if not answer:
                    raise QueryFileError(path, where, f"field {answer_col!r}: empty")
                metadata: dict[str, Any] = {}
                raw_meta = row.get("metadata")
                if raw_meta:
                    try:
                        parsed = ast.literal_eval(raw_meta)
                        metadata = parsed if isinstance(parsed, dict) else {"raw": raw_meta}
                    except (ValueError, SyntaxError):
                        metadata = {"raw": raw_meta}
                out.add(
                    where,
                    query_id=f"simpleqa-{index:05d}",
                    source="simpleqa",
                    split=split,
                    kind="short_form",
                    question=question,
                    messages=[{"role": "user", "content": question}],
                    rubrics=[_final_rubric(answer, [answer])],
                    reference_answer=answer,
                    spec={},
                    metadata=metadata,
                )
    except UnicodeDecodeError as exc:
        raise QueryFileError(path, None, f"not valid UTF-8 ({exc.reason})") from exc
    except csv.Error as exc:
        raise QueryFileError(path, None, f"malformed CSV: {exc}") from exc
    return out.result()


# ---- 2WikiMultihopQA ---------------------------------------------------------------------------


def read_2wiki(path: str | os.PathLike[str], split: str = "eval") -> list[Query]:
    """2Wiki JSON list: question, answer (a string or a list of aliases), _id|id|test_id."""
    path, split = Path(path), _check_split(split)
    out = _Collector(path)
    for index, (where, data) in enumerate(_iter_records(path)):
        record = _Record(path, where, data)
        question = record.text("question")
        name, answer = record.first("answer", "answers")
        aliases = [answer] if isinstance(answer, str) else answer
        if not isinstance(aliases, list) or not aliases or not all(isinstance(a, str) and a.strip() for a in aliases):
            raise record.error(name, "expected a non-empty string or a non-empty list of strings")
        _, raw_id = record.first("_id", "id", "test_id", required=False)
        query_id = f"2wiki-{raw_id}" if raw_id is not None else f"2wiki-{index:05d}"
        metadata: dict[str, Any] = {"answer_aliases": aliases}
        if isinstance(data.get("type"), str):
            metadata["type"] = data["type"]
        out.add(
            where,
            query_id=query_id,
            source="2wiki",
            split=split,
            kind="short_form",
            question=question,
            rubrics=[_final_rubric(aliases[0], aliases)],
            reference_answer=aliases[0],
            metadata=metadata,
        )
    return out.result()


# ---- ResearchQA --------------------------------------------------------------------------------
# Format of realliyifei/ResearchQA (HF dataset realliyifei/ResearchQA, test.json / valid.json / full.json;
# loader `researchqa_loader.py` at commit 3ed036d): a JSON list of {id, general_domain, subdomain, field,
# query, date, rubric: [{rubric_item, type}]}. Rubric items carry no weight: ResearchQA's coverage is the
# unweighted mean over them (``eval.prompts``, family rubric_coverage).


def read_researchqa(path: str | os.PathLike[str], split: str = "eval") -> list[Query]:
    """ResearchQA JSON list (or JSONL/Parquet of the same records): id, query, rubric [{rubric_item, type}],
    general_domain, subdomain, field, date."""
    path, split = Path(path), _check_split(split)
    out = _Collector(path)
    for where, data in _iter_records(path):
        record = _Record(path, where, data)
        question = record.text("query")
        _, items = record.first("rubric")
        if not isinstance(items, list) or not items:
            raise record.error("rubric", "expected a non-empty list of {rubric_item, type}")
        rubrics = []
        for i, item in enumerate(items):
            field = f"rubric[{i}]"
            if not isinstance(item, dict):
                raise record.error(field, f"expected an object, got {type(item).__name__}")
            text = item.get("rubric_item")
            if not isinstance(text, str) or not text.strip():
                raise record.error(f"{field}.rubric_item", "missing or not a non-empty string")
            kind = item.get("type")
            if kind is not None and not isinstance(kind, str):
                raise record.error(f"{field}.type", f"expected a string, got {kind!r:.60}")
            rubrics.append(
                {
                    "title": _short_title(text),
                    "description": text,
                    "weight": 1.0,
                    "polarity": "positive",
                    "stage": "answer",
                    "check": {"type": "benchmark", "benchmark": "researchqa", "rubric_type": kind},
                }
            )
        metadata = {k: data.get(k) for k in ("general_domain", "subdomain", "field", "date") if data.get(k) is not None}
        out.add(
            where,
            query_id=f"researchqa-{record.ident('id')}",
            source="researchqa",
            split=split,
            kind="long_form",
            question=question,
            rubrics=rubrics,
            metadata=metadata,
        )
    return out.result()


# ---- ResearchRubrics ---------------------------------------------------------------------------
# Format of ScaleAI/researchrubrics (HF dataset ScaleAI/researchrubrics, processed_data.jsonl; README of
# github.com/scaleapi/researchrubrics at commit 2dc80e2): JSONL of {prompt, sample_id, domain,
# conceptual_breadth, logical_nesting, exploration, rubrics: [{criterion, weight, axis}]}. A weight may be
# negative (an undesirable property): its points count when the criterion is satisfied, as HealthBench's.


def read_researchrubrics(path: str | os.PathLike[str], split: str = "eval") -> list[Query]:
    """ResearchRubrics JSONL (or JSON/Parquet): sample_id, prompt, rubrics [{criterion, weight, axis}], domain and
    the three complexity labels."""
    path, split = Path(path), _check_split(split)
    out = _Collector(path)
    for where, data in _iter_records(path):
        record = _Record(path, where, data)
        question = record.text("prompt")
        _, items = record.first("rubrics")
        if isinstance(items, str):  # the compiled CSV/Parquet export keeps rubrics as a JSON string
            try:
                items = json.loads(items)
            except json.JSONDecodeError:
                raise record.error("rubrics", "expected a list of {criterion, weight, axis} (or its JSON)") from None
        if not isinstance(items, list) or not items:
            raise record.error("rubrics", "expected a non-empty list of {criterion, weight, axis}")
        rubrics = []
        for i, item in enumerate(items):
            field = f"rubrics[{i}]"
            if not isinstance(item, dict):
                raise record.error(field, f"expected an object, got {type(item).__name__}")
            if not isinstance(item.get("criterion"), str) or not item["criterion"].strip():
                raise record.error(f"{field}.criterion", "missing or not a non-empty string")
            if item.get("weight") is None:
                raise record.error(f"{field}.weight", "missing")
            weight = _number(record, f"{field}.weight", item["weight"])
            axis = item.get("axis")
            if axis is not None and not isinstance(axis, str):
                raise record.error(f"{field}.axis", f"expected a string, got {axis!r:.60}")
            rubrics.append(
                {
                    "title": _short_title(item["criterion"]),
                    "description": item["criterion"],
                    "weight": abs(weight),
                    "polarity": "negative" if weight < 0 else "positive",
                    "stage": "answer",
                    "check": {"type": "benchmark", "benchmark": "researchrubrics", "points": weight, "axis": axis},
                }
            )
        labels = ("domain", "conceptual_breadth", "logical_nesting", "exploration")
        out.add(
            where,
            query_id=f"researchrubrics-{record.ident('sample_id')}",
            source="researchrubrics",
            split=split,
            kind="long_form",
            question=question,
            rubrics=rubrics,
            metadata={k: data[k] for k in labels if data.get(k) is not None},
        )
    return out.result()


# ---- WebWalkerQA -------------------------------------------------------------------------------
# Format of callanwu/WebWalkerQA (HF dataset card, as copied in Alibaba-NLP/WebWalker): records of
# {Question, Answer, Root_Url, Info: {Hop|type, Domain, Language|lang, Difficulty_Level, Source_Website,
# Golden_Path}}; the HF parquet release spells the keys in lower case (question, answer, root_url, info).
# Both spellings are read. No id field: queries are numbered by position.


def read_webwalkerqa(path: str | os.PathLike[str], split: str = "eval") -> list[Query]:
    """WebWalkerQA JSON list / JSONL / Parquet: question, answer, root_url, info (keys in either case)."""
    path, split = Path(path), _check_split(split)
    out = _Collector(path)
    for index, (where, data) in enumerate(_iter_records(path)):
        if isinstance(data, dict):
            data = {str(k).lower(): v for k, v in data.items()}
        record = _Record(path, where, data)
        question = record.text("question")
        answer = record.text("answer")
        assert question is not None and answer is not None  # required fields
        info = data.get("info")
        if info is not None and not isinstance(info, dict):
            raise record.error("info", f"expected an object, got {type(info).__name__}")
        metadata: dict[str, Any] = {"answer_aliases": [answer]}
        if isinstance(data.get("root_url"), str):
            metadata["root_url"] = data["root_url"]
        for key, value in (info or {}).items():
            if isinstance(value, (str, int, float, list)):
                metadata[f"info_{str(key).lower()}"] = value
        out.add(
            where,
            query_id=f"webwalkerqa-{index:05d}",
            source="webwalkerqa",
            split=split,
            kind="short_form",
            question=question,
            rubrics=[_final_rubric(answer, [answer])],
            reference_answer=answer,
            metadata=metadata,
        )
    return out.result()


# ---- DeepSearchQA ------------------------------------------------------------------------------
# Format of google/deepsearchqa (HF dataset card; DSQA-full.csv, also on Kaggle): CSV columns problem,
# problem_category, answer, answer_type ("Single Answer" | "Set Answer"). No id column: queries are
# numbered by row. The gold answer of a Set Answer problem lists its items in one string; the grader
# splits it into parts (the benchmark's own grader prompt, ``eval.prompts`` answer_set).

DEEPSEARCHQA_ANSWER_TYPES: tuple[str, ...] = ("Single Answer", "Set Answer")


def read_deepsearchqa(path: str | os.PathLike[str], split: str = "eval") -> list[Query]:
    """DeepSearchQA CSV (or JSONL/Parquet of the same columns): problem, problem_category, answer, answer_type."""
    path, split = Path(path), _check_split(split)
    out = _Collector(path)
    for index, (where, data) in enumerate(_iter_table_records(path)):
        record = _Record(path, where, data)
        question = record.text("problem")
        answer = record.text("answer")
        assert question is not None and answer is not None  # required fields
        answer_type = record.text("answer_type")
        if answer_type not in DEEPSEARCHQA_ANSWER_TYPES:
            raise record.error("answer_type", f"expected one of {DEEPSEARCHQA_ANSWER_TYPES}, got {answer_type!r:.60}")
        metadata: dict[str, Any] = {"answer_type": answer_type, "answer_aliases": [answer]}
        if isinstance(data.get("problem_category"), str):
            metadata["problem_category"] = data["problem_category"]
        out.add(
            where,
            query_id=f"deepsearchqa-{index:05d}",
            source="deepsearchqa",
            split=split,
            kind="short_form",
            question=question,
            rubrics=[_final_rubric(answer, [answer])],
            reference_answer=answer,
            metadata=metadata,
        )
    return out.result()


def _iter_table_records(path: Path) -> Iterator[tuple[str, Any]]:
    """A CSV file's rows (``line N``, header = line 1) as dicts, else ``_iter_records``."""
    if path.suffix.lower() != ".csv":
        yield from _iter_records(path)
        return
    try:
        with open(path, encoding="utf-8", newline="") as fh:
            reader = csv.DictReader(fh)
            for row in reader:
                yield f"line {reader.line_num}", {k: v for k, v in row.items() if k is not None}
    except UnicodeDecodeError as exc:
        raise QueryFileError(path, None, f"not valid UTF-8 ({exc.reason})") from exc
    except csv.Error as exc:
        raise QueryFileError(path, None, f"malformed CSV: {exc}") from exc


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


# ---- dispatch ----------------------------------------------------------------------------------


def detect_format(path: str | os.PathLike[str]) -> str:
    """Guess a file's format from its content (first record's fields), falling back to its suffix."""
    path = Path(path)
    suffix = path.suffix.lower()
    if suffix == ".csv":
        with open(path, encoding="utf-8", errors="replace", newline="") as fh:
            header = next(csv.reader(fh), [])
        return "deepsearchqa" if {"problem", "answer_type"} <= set(header) else "simpleqa"
    if suffix == ".parquet":
        try:
            names = set(pq.read_schema(path).names)
        except Exception as exc:  # pyarrow raises several types for unreadable files
            raise QueryFileError(path, None, f"unreadable Parquet file: {exc}") from exc
        return "dr_tulu" if {"messages", "ground_truth"} <= names else "parquet"
    keys = _first_record_keys(path)
    if "ground_truth" in keys and ("messages" in keys or "prompt" in keys):
        return "dr_tulu"
    if {"prompt_id", "rubrics", "prompt"} <= keys:
        return "healthbench"
    if {"sample_id", "rubrics", "prompt"} <= keys:
        return "researchrubrics"
    if {"query", "rubric"} <= keys:
        return "researchqa"
    if {"question", "answer", "root_url"} <= {k.lower() for k in keys}:
        return "webwalkerqa"
    if {"problem", "answer", "answer_type"} <= keys:
        return "deepsearchqa"
    if "metric_config" in keys and "initial_prompt" in keys:
        return "scholarqa_cs"
    if "criterions" in keys or {"id", "topic", "language", "prompt"} <= keys:
        return "deep_research_bench"
    if {"question", "answer"} <= keys and keys & {"_id", "test_id", "supporting_facts", "evidences"}:
        return "2wiki"
    if "messages_a" in keys and ("model_a" in keys or "winner" in keys):
        return "searcharena"
    return "jsonl"


_READERS: dict[str, Callable[..., list[Query]]] = {
    "dr_tulu": read_dr_tulu,
    "healthbench": read_healthbench,
    "scholarqa_cs": read_scholarqa_cs,
    "deep_research_bench": read_deep_research_bench,
    "simpleqa": read_simpleqa,
    "2wiki": read_2wiki,
    "researchqa": read_researchqa,
    "researchrubrics": read_researchrubrics,
    "webwalkerqa": read_webwalkerqa,
    "deepsearchqa": read_deepsearchqa,
    "searcharena": read_searcharena,
    "openscholar": read_openscholar,
    "jsonl": read_plain_queries,
    "parquet": read_plain_queries,
}


def read_queries(path: str | os.PathLike[str], format: str | None = None, split: str | None = None) -> list[Query]:
    """Read a query file in any supported format; `split` overrides the format's default split."""
    path = Path(path)
    if not path.is_file():
        raise QueryFileError(path, None, "no such file")
    chosen = format or detect_format(path)
    if chosen not in _READERS:
        raise ValueError(f"unknown query format {chosen!r}; choose one of {FORMATS}")
    if chosen == "deep_research_bench" and "criterions" in _first_record_keys(path):
        # Given the criteria file itself: its records carry the prompt too.
        reader = _READERS[chosen]
        return reader(path, criteria_path=path, split=split) if split else reader(path, criteria_path=path)
    return _READERS[chosen](path, split=split) if split else _READERS[chosen](path)
