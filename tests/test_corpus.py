from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from rubricem_core.corpus import CorpusError, load_corpus, split_flashrag_contents
from rubricem_core.schemas import CORPUS_SCHEMA
from tests.conftest import shared_file


def _write_jsonl(path: Path, records: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return path


def test_flashrag_sample(shared_data):
    path = shared_file(shared_data, "corpus/flashrag_wiki_dpr_sample1000.jsonl")
    table = load_corpus(path)
    assert table.schema == CORPUS_SCHEMA
    assert table.num_rows == 1000
    assert len(set(table.column("doc_id").to_pylist())) == 1000
    first = table.slice(0, 1).to_pylist()[0]
    assert first["doc_id"] == "0" and first["title"] == "Evan Morris"
    assert first["text"].startswith("Evan Morris Evan L. Morris")
    titles = table.column("title").to_pylist()
    assert all(titles) and not any(t.startswith('"') for t in titles)
    unquoted = next(r for r in table.to_pylist() if r["doc_id"] == "29")  # FlashRAG title without quotes
    assert unquoted["title"] == "Absalon" and unquoted["text"].startswith("dragged forth")
    assert set(table.column("source").to_pylist()) == {"flashrag_wiki_dpr_sample1000"}


def test_jsonl_field_variants(tmp_path):
    path = _write_jsonl(
        tmp_path / "c.jsonl",
        [
            {"id": 1, "contents": '"Alpha"\nAlpha is first.'},
            {"_id": "b", "title": "Beta", "text": "Beta text.", "source": "wiki"},
            {"doc_id": "c", "content": "No title here."},
            {"id": "d", "title": "Kept", "contents": '"Ignored"\nBody.'},
        ],
    )
    rows = load_corpus(path, source="mine").to_pylist()
    assert rows == [
        {"doc_id": "1", "title": "Alpha", "text": "Alpha is first.", "source": "mine"},
        {"doc_id": "b", "title": "Beta", "text": "Beta text.", "source": "wiki"},
        {"doc_id": "c", "title": "", "text": "No title here.", "source": "mine"},
        {"doc_id": "d", "title": "Kept", "text": "Body.", "source": "mine"},
    ]


def test_split_flashrag_contents():
    assert split_flashrag_contents('"T"\nbody\nmore') == ("T", "body\nmore")
    assert split_flashrag_contents("plain text") == (None, "plain text")
    assert split_flashrag_contents("Bare title\nbody") == ("Bare title", "body")
    long_line = "x" * 400 + "\nrest"
    assert split_flashrag_contents(long_line) == (None, long_line)


def test_very_large_document_is_kept_whole(tmp_path):
    big = "word " * 400_000
    table = load_corpus(_write_jsonl(tmp_path / "big.jsonl", [{"id": "x", "text": big}]))
    assert table.column("text")[0].as_py() == big


def test_parquet_corpus(tmp_path):
    path = tmp_path / "c.parquet"
    pq.write_table(pa.table({"id": ["a", "b"], "contents": ['"A"\nfirst', "second"], "extra": [1, 2]}), path)
    rows = load_corpus(path).to_pylist()
    assert rows == [
        {"doc_id": "a", "title": "A", "text": "first", "source": "c"},
        {"doc_id": "b", "title": "", "text": "second", "source": "c"},
    ]


def test_parquet_duplicate_ids_name_rows(tmp_path):
    path = tmp_path / "d.parquet"
    pq.write_table(pa.table({"doc_id": ["a", "b", "a"], "text": ["x", "y", "z"]}), path)
    with pytest.raises(CorpusError, match=r"d\.parquet: duplicate doc_id 'a' at row 2 \(first at row 0\)"):
        load_corpus(path)


def test_folder_corpus(tmp_path):
    root = tmp_path / "docs"
    (root / "sub").mkdir(parents=True)
    (root / "a.md").write_text("\n# Heading A\n\nBody of a.", encoding="utf-8")
    (root / "sub" / "b.txt").write_text("Plain text b.", encoding="utf-8")
    (root / "ignored.csv").write_text("x,y", encoding="utf-8")
    rows = load_corpus(root).to_pylist()
    assert [(r["doc_id"], r["title"]) for r in rows] == [("a", "Heading A"), ("sub/b", "b")]
    assert rows[0]["text"] == "\n# Heading A\n\nBody of a." and rows[0]["source"] == "docs"


@pytest.mark.parametrize(
    "lines, pattern",
    [
        (['{"id": "a", "text": "ok"}', '{"id": "b", "text": '], r"bad\.jsonl: line 2: malformed JSON"),
        (['{"id": "a", "text": "ok"}', '{"text": "no id"}'], r"line 2: missing document id"),
        (['{"id": "a"}'], r"line 1: missing document text"),
        (
            ['{"id": "a", "text": "ok"}', "", '{"id": "a", "text": "again"}'],
            r"duplicate doc_id 'a' at line 3 \(first at line 1\)",
        ),
        (['{"id": "a", "text": "   "}'], r"line 1: document 'a' has empty text"),
        (['{"id": "a", "contents": "\\"Only title\\"\\n"}'], r"line 1: document 'a' has empty text"),
        (['["not", "an", "object"]'], r"line 1: expected a JSON object"),
        (['{"id": "a", "text": 5}'], r"line 1: field 'text' must be a string"),
        (['{"id": "", "text": "x"}'], r"line 1: field 'id' must be a non-empty"),
        ([""], r"corpus is empty"),
    ],
)
def test_jsonl_errors_name_file_and_line(tmp_path, lines, pattern):
    path = tmp_path / "bad.jsonl"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    with pytest.raises(CorpusError, match=pattern):
        load_corpus(path)


def test_non_utf8_line_is_named(tmp_path):
    path = tmp_path / "latin.jsonl"
    path.write_bytes(b'{"id": "a", "text": "ok"}\n{"id": "b", "text": "caf\xe9"}\n')
    with pytest.raises(CorpusError, match=r"latin\.jsonl: line 2: not valid UTF-8"):
        load_corpus(path)


def test_folder_errors(tmp_path):
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "x.txt").write_bytes(b"\xff\xfe broken")
    with pytest.raises(CorpusError, match=r"x\.txt: not valid UTF-8"):
        load_corpus(bad)
    dup = tmp_path / "dup"
    dup.mkdir()
    (dup / "a.txt").write_text("one", encoding="utf-8")
    (dup / "a.md").write_text("two", encoding="utf-8")
    with pytest.raises(CorpusError, match=r"duplicate doc_id 'a' at file a\.txt \(first at file a\.md\)"):
        load_corpus(dup)
    empty_doc = tmp_path / "emptydoc"
    empty_doc.mkdir()
    (empty_doc / "e.md").write_text("  \n", encoding="utf-8")
    with pytest.raises(CorpusError, match=r"e\.md: document has empty text"):
        load_corpus(empty_doc)
    nothing = tmp_path / "nothing"
    nothing.mkdir()
    with pytest.raises(CorpusError, match="corpus is empty"):
        load_corpus(nothing)


def test_unsupported_or_missing_path(tmp_path):
    (tmp_path / "c.xml").write_text("<x/>", encoding="utf-8")
    with pytest.raises(CorpusError, match="unsupported corpus format '.xml'"):
        load_corpus(tmp_path / "c.xml")
    with pytest.raises(CorpusError, match="no such file"):
        load_corpus(tmp_path / "missing.jsonl")
