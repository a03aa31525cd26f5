"""Corpus ingestion: JSONL, Parquet or a folder of .txt/.md files -> a CORPUS_SCHEMA table.

Accepted JSONL/Parquet fields: id | doc_id | _id; title (optional); text | contents | content;
source (optional). FlashRAG-style `contents` ("\"Title\"\\ntext", quotes optional) has its title split off.
Very long documents are kept whole (the search tool chunks them); empty texts are rejected.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from rubricem_core.schemas import CORPUS_SCHEMA

ID_FIELDS = ("doc_id", "id", "_id")
TEXT_FIELDS = ("text", "contents", "content")
FOLDER_SUFFIXES = (".txt", ".md")


class CorpusError(ValueError):
    """A corpus file is malformed; the message names the file and the line/row/file at fault."""


def _first_present(record: dict[str, Any], names: tuple[str, ...]) -> tuple[str | None, Any]:
    for name in names:
        if record.get(name) is not None:
            return name, record[name]
    return None, None


MAX_TITLE_CHARS = 300


def split_flashrag_contents(contents: str) -> tuple[str | None, str]:
    """FlashRAG stores 'Title\nbody' (the title usually in double quotes); return (title, body).

    A first line longer than MAX_TITLE_CHARS is body text, not a title: (None, contents).
    """
    head, sep, body = contents.partition("\n")
    head = head.strip()
    if not sep or not head or len(head) > MAX_TITLE_CHARS:
        return None, contents
    if len(head) >= 2 and head.startswith('"') and head.endswith('"'):
        head = head[1:-1]
    return head, body


def _record_to_row(record: Any, where: str, default_source: str) -> dict[str, str]:
    if not isinstance(record, dict):
        raise CorpusError(f"{where}: expected a JSON object, got {type(record).__name__}")
    id_field, doc_id = _first_present(record, ID_FIELDS)
    if id_field is None:
        raise CorpusError(f"{where}: missing document id (one of {', '.join(ID_FIELDS)})")
    if not isinstance(doc_id, (str, int)) or isinstance(doc_id, bool) or str(doc_id).strip() == "":
        raise CorpusError(f"{where}: field {id_field!r} must be a non-empty string or integer, got {doc_id!r}")
    text_field, text = _first_present(record, TEXT_FIELDS)
    if text_field is None:
        raise CorpusError(f"{where}: missing document text (one of {', '.join(TEXT_FIELDS)})")
    if not isinstance(text, str):
        raise CorpusError(f"{where}: field {text_field!r} must be a string, got {type(text).__name__}")
    title = record.get("title")
    if title is not None and not isinstance(title, str):
        raise CorpusError(f"{where}: field 'title' must be a string, got {type(title).__name__}")
    if text_field == "contents":
        embedded_title, text = split_flashrag_contents(text)
        title = title if title is not None else embedded_title
    if not text.strip():
        raise CorpusError(f"{where}: document {doc_id!r} has empty text")
    source = record.get("source")
    return {
        "doc_id": str(doc_id),
        "title": title if title is not None else "",
        "text": text,
        "source": source if isinstance(source, str) and source else default_source,
    }


def _iter_jsonl(path: Path) -> Iterator[tuple[int, Any]]:
    with open(path, "rb") as fh:
        for line_no, raw in enumerate(fh, start=1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise CorpusError(
                    f"{path}: line {line_no}: not valid UTF-8 ({exc.reason} at byte {exc.start})"
                ) from exc
            if not line.strip():
                continue
            try:
                yield line_no, json.loads(line)
            except json.JSONDecodeError as exc:
                raise CorpusError(f"{path}: line {line_no}: malformed JSON: {exc.msg} (column {exc.colno})") from exc


def _rows_to_table(rows: list[dict[str, str]], locations: list[str], path: Path) -> pa.Table:
    if not rows:
        raise CorpusError(f"{path}: corpus is empty")
    first_seen: dict[str, str] = {}
    for row, where in zip(rows, locations):
        previous = first_seen.get(row["doc_id"])
        if previous is not None:
            raise CorpusError(f"{path}: duplicate doc_id {row['doc_id']!r} at {where} (first at {previous})")
        first_seen[row["doc_id"]] = where
    return pa.Table.from_pylist(rows, schema=CORPUS_SCHEMA)


def load_jsonl_corpus(path: Path, source: str | None = None) -> pa.Table:
    default_source = source or path.stem
    rows, locations = [], []
    for line_no, record in _iter_jsonl(path):
        where = f"line {line_no}"
        rows.append(_record_to_row(record, f"{path}: {where}", default_source))
        locations.append(where)
    return _rows_to_table(rows, locations, path)


def load_parquet_corpus(path: Path, source: str | None = None) -> pa.Table:
    try:
        table = pq.read_table(path)
    except Exception as exc:  # pyarrow raises several types for unreadable files
        raise CorpusError(f"{path}: unreadable Parquet file: {exc}") from exc
    default_source = source or path.stem
    rows, locations = [], []
    # Only the columns we map are materialised, so wide Parquet files stay cheap.
    wanted = [c for c in table.column_names if c in ID_FIELDS + TEXT_FIELDS + ("title", "source")]
    for index, record in enumerate(table.select(wanted).to_pylist()):
        where = f"row {index}"
        rows.append(_record_to_row(record, f"{path}: {where}", default_source))
        locations.append(where)
    return _rows_to_table(rows, locations, path)


def _markdown_title(text: str) -> str | None:
    for line in text.splitlines():
        stripped = line.strip()
        if stripped.startswith("#"):
            return stripped.lstrip("#").strip() or None
        if stripped:
            return None  # a heading only counts when it is the first non-empty line
    return None


def load_folder_corpus(path: Path, source: str | None = None) -> pa.Table:
    default_source = source or path.name
    files = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix.lower() in FOLDER_SUFFIXES)
    rows, locations = [], []
    for file in files:
        relative = file.relative_to(path)
        try:
            text = file.read_bytes().decode("utf-8")
        except UnicodeDecodeError as exc:
            raise CorpusError(f"{file}: not valid UTF-8 ({exc.reason} at byte {exc.start})") from exc
        if not text.strip():
            raise CorpusError(f"{file}: document has empty text")
        title = _markdown_title(text) or file.stem
        rows.append(
            {"doc_id": relative.with_suffix("").as_posix(), "title": title, "text": text, "source": default_source}
        )
        locations.append(f"file {relative.as_posix()}")
    if not rows:
        raise CorpusError(f"{path}: corpus is empty (no {'/'.join(FOLDER_SUFFIXES)} files)")
    return _rows_to_table(rows, locations, path)


def load_corpus(path: str | os.PathLike[str], source: str | None = None) -> pa.Table:
    """Load a corpus from JSONL (.jsonl/.json lines), Parquet, or a folder of .txt/.md files.

    `source` fills the `source` column where records carry none (default: the file or folder name).
    """
    path = Path(path)
    if path.is_dir():
        return load_folder_corpus(path, source)
    if not path.exists():
        raise CorpusError(f"{path}: no such file or directory")
    suffix = path.suffix.lower()
    if suffix == ".parquet":
        return load_parquet_corpus(path, source)
    if suffix in (".jsonl", ".json", ".ndjson"):
        return load_jsonl_corpus(path, source)
    raise CorpusError(f"{path}: unsupported corpus format {suffix!r} (use .jsonl, .parquet or a folder)")
