"""Benchmarks graded by a short final answer: SimpleQA, 2WikiMultihopQA, WebWalkerQA, DeepSearchQA."""

from __future__ import annotations

import ast
import csv
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from rubricem_core.readers.records import (
    QueryFileError,
    _check_split,
    _Collector,
    _final_rubric,
    _iter_records,
    _Record,
)
from rubricem_core.schemas import (
    Query,
)

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


# ---- WebWalkerQA -------------------------------------------------------------------------------
# Format of callanwu/WebWalkerQA (HF dataset card, as copied in Alibaba-NLP/WebWalker): records of
# {Question, Answer, Root_Url, Info: {Hop|type, Domain, Language|lang, Difficulty_Level, Source_Website,
# Golden_Path}}; the HF parquet release spells the keys in lower case (question, answer, root_url, info).
# Both spellings are read. No id field: queries are numbered by position. WebWalker's agent is asked the
# question with the website to start from ("query: … official website: …"), so the policy's question names
# the root URL; the grader reads the bare question (metadata ``BARE_QUESTION_KEY``), as its evaluator does.

BARE_QUESTION_KEY = "bare_question"


def webwalker_question(question: str, root_url: str | None) -> str:
    """The question as the policy gets it: with the benchmark's website when the record has one."""
    return f"{question}\nOfficial website: {root_url}" if root_url else question


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
        metadata: dict[str, Any] = {"answer_aliases": [answer], BARE_QUESTION_KEY: question}
        root_url = data.get("root_url") if isinstance(data.get("root_url"), str) and data["root_url"].strip() else None
        if root_url:
            metadata["root_url"] = root_url
        for key, value in (info or {}).items():
            if isinstance(value, (str, int, float, list)):
                metadata[f"info_{str(key).lower()}"] = value
        out.add(
            where,
            query_id=f"webwalkerqa-{index:05d}",
            source="webwalkerqa",
            split=split,
            kind="short_form",
            question=webwalker_question(question, root_url),
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
