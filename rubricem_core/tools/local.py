"""Offline research tools over an in-memory corpus (doc_id, title, text): search and browse.

Search indexes passages (long documents are chunked) with BM25 (bm25s); with an embedder it also
runs FAISS inner-product retrieval over the same passages and fuses the two document rankings by
reciprocal-rank fusion. Results are deduplicated by document; each hit shows a snippet cut from its
best passage around the densest cluster of query words. Both tools are deterministic.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

import numpy as np
import pyarrow as pa

from rubricem_core.embedders import Embedder
from rubricem_core.tools.base import (
    Tool,
    ToolError,
    ToolResult,
    ToolSpec,
    error_result,
    search_result,
    snippets_result,
)

REQUIRED_COLUMNS = ("doc_id", "title", "text")
_DOC_ID = re.compile(r"^[A-Za-z0-9_.:\-/#]+$")  # what the scaffold can write in a snippet id
_QUERY_WORD = re.compile(r"\w\w+")  # same notion of a word as bm25s' default splitter
_ANY_WORD = re.compile(r"\S+")
RRF_K = 60  # the usual reciprocal-rank-fusion constant; damps the weight of the very top ranks


@dataclass(frozen=True)
class Corpus:
    doc_ids: list[str]
    titles: list[str]
    texts: list[str]
    index_of: dict[str, int]

    def __len__(self) -> int:
        return len(self.doc_ids)


def load_corpus(table: pa.Table, source: str = "corpus") -> Corpus:
    """Validate a corpus table; ``source`` names it in error messages (e.g. a Parquet path)."""
    if not isinstance(table, pa.Table):
        raise ToolError(f"{source}: expected a pyarrow Table, got {type(table).__name__}")
    missing = [c for c in REQUIRED_COLUMNS if c not in table.column_names]
    if missing:
        raise ToolError(f"{source}: missing column(s) {missing}; a corpus needs {list(REQUIRED_COLUMNS)}")
    doc_ids = table.column("doc_id").to_pylist()
    titles = ["" if t is None else str(t) for t in table.column("title").to_pylist()]
    texts = ["" if t is None else str(t) for t in table.column("text").to_pylist()]
    index_of: dict[str, int] = {}
    for row, doc_id in enumerate(doc_ids):
        if doc_id is None or not _DOC_ID.match(str(doc_id)):
            raise ToolError(f"{source}: row {row} has an invalid doc_id {doc_id!r} (letters, digits, _.:-/# only)")
        doc_id = str(doc_id)
        if doc_id in index_of:
            raise ToolError(f"{source}: duplicate doc_id {doc_id!r} (rows {index_of[doc_id]} and {row})")
        index_of[doc_id] = row
    return Corpus([str(d) for d in doc_ids], titles, texts, index_of)


def chunk_spans(text: str, passage_chars: int) -> list[tuple[int, int]]:
    """Cut ``text`` into consecutive spans of about ``passage_chars``, ending at whitespace.

    Character-based (not word-based) so chunking 100k documents costs one ``find`` per passage.
    """
    n = len(text)
    if n <= passage_chars:
        return [(0, n)]
    spans = []
    start = 0
    while start < n:
        end = text.find(" ", start + passage_chars)
        end = n if end == -1 or n - end < passage_chars // 4 else end  # no tiny tail passage
        spans.append((start, end))
        start = end + 1
    return spans


def _best_window(text: str, start: int, end: int, terms: set[str], width: int) -> tuple[int, int]:
    """The ~``width``-char window inside ``text[start:end]`` holding the most query words."""
    if end - start <= width:
        return start, end
    words = [(m.start() + start, m.end() + start, m.group()) for m in _ANY_WORD.finditer(text[start:end])]
    if not words:
        return start, min(end, start + width)
    hits = [1 if any(w.lower() in terms for w in _QUERY_WORD.findall(word)) else 0 for _, _, word in words]
    best_start, best_end, best_hits = words[0][0], words[0][1], -1
    j, window_hits = 0, 0
    for i in range(len(words)):
        # the window always holds word i, then as many following words as fit in ``width``
        while j < len(words) and (j == i or words[j][1] - words[i][0] <= width):
            window_hits += hits[j]
            j += 1
        if window_hits > best_hits:
            best_start, best_end, best_hits = words[i][0], words[j - 1][1], window_hits
        window_hits -= hits[i]
    return best_start, best_end


class LocalSearchTool(Tool):
    def __init__(
        self,
        corpus: pa.Table,
        top_k: int = 5,
        snippet_chars: int = 300,
        embedder: Embedder | None = None,
        passage_chars: int = 600,
        name: str = "search",
    ):
        # bm25s runs a JAX op at import when JAX is installed; on a GPU node that grabs 75% of the GPU's
        # memory for JAX (seen on an H200: 105 GiB), starving the policy. Keep JAX on the CPU.
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
        import bm25s
        from bm25s.stopwords import STOPWORDS_EN
        from bm25s.tokenization import Tokenizer

        if top_k <= 0 or snippet_chars <= 0 or passage_chars <= 0:
            raise ToolError("top_k, snippet_chars and passage_chars must be positive")
        self.spec = ToolSpec(name, "Search the document collection; returns snippets with document ids.")
        self.corpus = load_corpus(corpus)
        self.top_k = top_k
        self.snippet_chars = snippet_chars
        self.embedder = embedder
        self._stopwords = set(STOPWORDS_EN)

        passage_doc: list[int] = []
        passage_span: list[tuple[int, int]] = []
        index_texts: list[str] = []
        for doc, (title, text) in enumerate(zip(self.corpus.titles, self.corpus.texts)):
            for start, end in chunk_spans(text, passage_chars):
                passage_doc.append(doc)
                passage_span.append((start, end))
                index_texts.append(f"{title}\n{text[start:end]}")
        self._passage_doc = np.asarray(passage_doc, dtype=np.int64)
        self._passage_span = passage_span

        self._tokenizer = Tokenizer(stopwords="english")
        passage_tokens = self._tokenizer.tokenize(index_texts, return_as="ids", show_progress=False)
        self._empty_token = self._tokenizer.get_vocab_dict().get("")
        self._bm25 = bm25s.BM25()
        self._bm25.index(passage_tokens, show_progress=False)

        self._faiss_index = None
        if embedder is not None:
            import faiss

            vectors = np.ascontiguousarray(embedder.encode(index_texts), dtype=np.float32)
            if vectors.shape != (len(index_texts), embedder.dim):
                raise ToolError(
                    f"embedder returned shape {vectors.shape}, expected ({len(index_texts)}, {embedder.dim})"
                )
            self._faiss_index = faiss.IndexFlatIP(embedder.dim)
            self._faiss_index.add(vectors)

    # ---- retrieval ----------------------------------------------------------------------------
    def _candidates(self) -> int:
        # enough passages that deduplication by document still leaves top_k documents in most cases
        return min(len(self._passage_doc), self.top_k * 5)

    def _bm25_passages(self, query: str) -> list[tuple[int, float]]:
        ids = self._tokenizer.tokenize([query], update_vocab=False, return_as="ids", show_progress=False)[0]
        ids = [i for i in ids if i != self._empty_token]  # unknown words map to the empty token
        if not ids or not len(self._passage_doc):
            return []
        docs, scores = self._bm25.retrieve(
            [ids], k=self._candidates(), show_progress=False, n_threads=1, backend_selection="numpy"
        )  # same top-k, ties included, with or without JAX
        hits = [(int(p), float(s)) for p, s in zip(docs[0], scores[0]) if s > 0]
        return sorted(hits, key=lambda h: (-h[1], h[0]))

    def _dense_passages(self, query: str) -> list[tuple[int, float]]:
        if self._faiss_index is None or self.embedder is None or not len(self._passage_doc):
            return []
        vector = np.ascontiguousarray(self.embedder.encode([query]), dtype=np.float32)
        scores, passages = self._faiss_index.search(vector, self._candidates())
        hits = [(int(p), float(s)) for p, s in zip(passages[0], scores[0]) if p >= 0 and s > 0]
        return sorted(hits, key=lambda h: (-h[1], h[0]))

    def _by_document(self, passage_hits: list[tuple[int, float]]) -> dict[int, tuple[int, int]]:
        """doc → (rank among documents, best passage), keeping each document's first (best) passage."""
        ranked: dict[int, tuple[int, int]] = {}
        for passage, _ in passage_hits:
            doc = int(self._passage_doc[passage])
            if doc not in ranked:
                ranked[doc] = (len(ranked), passage)
        return ranked

    def search(self, query: str) -> list[tuple[int, int]]:
        """Top documents as (doc row, passage to quote), best first."""
        lexical = self._by_document(self._bm25_passages(query))
        if self._faiss_index is None:
            return [(doc, passage) for doc, (_, passage) in sorted(lexical.items(), key=lambda kv: kv[1][0])][
                : self.top_k
            ]
        dense = self._by_document(self._dense_passages(query))
        fused: dict[int, float] = {}
        for ranking in (lexical, dense):
            for doc, (rank, _) in ranking.items():
                fused[doc] = fused.get(doc, 0.0) + 1.0 / (RRF_K + rank + 1)
        order = sorted(fused, key=lambda d: (-fused[d], lexical.get(d, (len(lexical),))[0], d))
        # quote the lexical best passage when there is one: it contains the query words
        return [(doc, (lexical.get(doc) or dense[doc])[1]) for doc in order[: self.top_k]]

    def snippet(self, doc: int, passage: int, query: str) -> str:
        text = self.corpus.texts[doc]
        start, end = self._passage_span[passage]
        terms = {w.lower() for w in _QUERY_WORD.findall(query)} - self._stopwords
        s, e = _best_window(text, start, end, terms, self.snippet_chars)
        body = text[s:e].strip()
        return ("…" if s > 0 else "") + body + ("…" if e < len(text) else "")

    def __call__(self, query: str) -> ToolResult:
        query = query.strip()
        if not query:
            return error_result("empty search query")
        snippets = [
            (self.corpus.doc_ids[doc], self.corpus.titles[doc], self.snippet(doc, passage, query))
            for doc, passage in self.search(query)
        ]
        return search_result(query, snippets)


class LocalBrowseTool(Tool):
    """Returns one document by id (the ids that search snippets carry)."""

    def __init__(self, corpus: pa.Table, max_chars: int = 4000, name: str = "browse"):
        if max_chars <= 0:
            raise ToolError("max_chars must be positive")
        self.spec = ToolSpec(name, "Open a document by its id (e.g. D12) and read its text.")
        self.corpus = load_corpus(corpus)
        self.max_chars = max_chars
        self._lower_index = {d.lower(): i for i, d in enumerate(self.corpus.doc_ids)}

    def __call__(self, query: str) -> ToolResult:
        doc_id = query.strip().strip("\"'`[]()<> ")
        if not doc_id:
            return error_result("empty document id")
        row = self.corpus.index_of.get(doc_id)
        if row is None:
            row = self._lower_index.get(doc_id.lower())  # policies often change the case of ids
        if row is None:
            return error_result(f"unknown document id {doc_id!r}")
        text = self.corpus.texts[row]
        if len(text) > self.max_chars:
            cut = text.rfind(" ", 0, self.max_chars)
            text = text[: cut if cut > self.max_chars // 2 else self.max_chars] + "…"
        real_id = self.corpus.doc_ids[row]
        return snippets_result([(real_id, self.corpus.titles[row], text)])
