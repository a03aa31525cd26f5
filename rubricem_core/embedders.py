"""Text embedders for dense retrieval (local search tool, reflection bank).

Every embedder returns float32 rows that are L2-normalized, so inner product is cosine similarity
and FAISS ``IndexFlatIP`` can be used directly. An all-empty text (no word characters) has no
direction and comes back as a zero row.
"""

from __future__ import annotations

import re
import zlib
from collections.abc import Sequence
from typing import Protocol, runtime_checkable

import numpy as np


class EmbedderError(RuntimeError):
    """An embedder cannot be built (missing optional dependency, bad name or model path)."""


@runtime_checkable
class Embedder(Protocol):
    @property
    def dim(self) -> int: ...

    def encode(self, texts: Sequence[str]) -> np.ndarray:
        """Return an ``(len(texts), dim)`` float32 array of L2-normalized rows."""
        ...


def l2_normalize(matrix: np.ndarray) -> np.ndarray:
    """Row-normalize in float32; zero rows stay zero instead of becoming NaN."""
    matrix = np.asarray(matrix, dtype=np.float32)
    norms = np.linalg.norm(matrix, axis=1, keepdims=True)
    return matrix / np.where(norms > 0, norms, 1.0).astype(np.float32)


_WORD = re.compile(r"\w+")
_MASK64 = np.uint64(0xFFFFFFFFFFFFFFFF)


def _mix64(values: np.ndarray) -> np.ndarray:
    """splitmix64 finalizer: spreads combined word hashes over all 64 bits (uint64 arithmetic wraps)."""
    z = values.astype(np.uint64, copy=True)
    z ^= z >> np.uint64(30)
    z *= np.uint64(0xBF58476D1CE4E5B9)
    z ^= z >> np.uint64(27)
    z *= np.uint64(0x94D049BB133111EB)
    z ^= z >> np.uint64(31)
    return z


class HashingEmbedder:
    """Signed feature hashing of lower-cased word unigrams and bigrams; no model, deterministic.

    Hashes come from CRC32 of each word (stable across processes, unlike ``hash()``); bigram
    hashes are derived from the two word hashes with integer mixing in numpy, so only one Python
    dictionary lookup per word is paid.
    """

    def __init__(self, dim: int = 256, batch_size: int = 4096):
        if dim <= 0:
            raise EmbedderError(f"HashingEmbedder dim must be positive, got {dim}")
        self._dim = int(dim)
        self._batch_size = max(1, int(batch_size))
        self._word_hash: dict[str, int] = {}

    @property
    def dim(self) -> int:
        return self._dim

    def _hash_words(self, words: list[str]) -> np.ndarray:
        cache = self._word_hash
        hashes = list(map(cache.get, words))
        for i, h in enumerate(hashes):
            if h is None:  # first sighting of this word
                word = words[i]
                h = zlib.crc32(word.encode("utf-8")) | 0x100000000  # keep unigram ids off zero
                cache[word] = hashes[i] = h
        return np.fromiter(hashes, dtype=np.uint64, count=len(hashes))

    def _encode_batch(self, texts: Sequence[str]) -> np.ndarray:
        rows: list[np.ndarray] = []
        features: list[np.ndarray] = []
        for row, text in enumerate(texts):
            words = _WORD.findall(text.lower())
            if not words:
                continue
            unigrams = self._hash_words(words)
            # bigram = ordered pair of word hashes; the multiplier keeps (a, b) != (b, a)
            bigrams = unigrams[:-1] * np.uint64(0x9E3779B97F4A7C15) + unigrams[1:] + np.uint64(0x632BE59BD9B4E019)
            hashed = _mix64(np.concatenate([unigrams, bigrams]))
            features.append(hashed)
            rows.append(np.full(len(hashed), row, dtype=np.int64))
        n = len(texts)
        if not features:
            return np.zeros((n, self._dim), dtype=np.float32)
        hashed = np.concatenate(features)
        row_ids = np.concatenate(rows)
        columns = (hashed % np.uint64(self._dim)).astype(np.int64)
        signs = np.where((hashed >> np.uint64(63)) == 1, -1.0, 1.0)  # top bit is independent of the column
        flat = np.bincount(row_ids * self._dim + columns, weights=signs, minlength=n * self._dim)
        return l2_normalize(flat.reshape(n, self._dim))

    def encode(self, texts: Sequence[str]) -> np.ndarray:
        if isinstance(texts, str):
            raise TypeError("encode expects a sequence of texts, not a single string")
        texts = list(texts)
        if not texts:
            return np.zeros((0, self._dim), dtype=np.float32)
        parts = [
            self._encode_batch(texts[start : start + self._batch_size])
            for start in range(0, len(texts), self._batch_size)
        ]
        return np.concatenate(parts, axis=0)


class SentenceTransformerEmbedder:
    """A sentence-transformers model (e.g. a local Qwen3-Embedding or MiniLM checkout)."""

    def __init__(self, model_name_or_path: str, device: str | None = None, batch_size: int = 64):
        try:
            from sentence_transformers import SentenceTransformer  # optional dependency
        except ImportError as exc:
            raise EmbedderError(
                f"embedder {model_name_or_path!r} needs sentence-transformers, which is not installed; "
                "install the extra: pip install 'rubricem[embed]'"
            ) from exc
        try:
            self._model = SentenceTransformer(model_name_or_path, device=device)
        except Exception as exc:  # offline hub or a bad path: name the model in the message
            raise EmbedderError(f"cannot load sentence-transformers model {model_name_or_path!r}: {exc}") from exc
        dim = self._model.get_sentence_embedding_dimension()
        if not dim:
            raise EmbedderError(f"model {model_name_or_path!r} does not report an embedding dimension")
        self._dim = int(dim)
        self._batch_size = batch_size
        self.model_name_or_path = model_name_or_path

    @property
    def dim(self) -> int:
        return self._dim

    def encode(self, texts: Sequence[str]) -> np.ndarray:
        texts = list(texts)
        if not texts:
            return np.zeros((0, self._dim), dtype=np.float32)
        vectors = self._model.encode(
            texts,
            batch_size=self._batch_size,
            normalize_embeddings=True,
            show_progress_bar=False,
            convert_to_numpy=True,
        )
        return l2_normalize(vectors)


def make_embedder(name: str | None) -> Embedder | None:
    """``None``/"none" → no dense retrieval; "hashing" or "hashing:<dim>" → HashingEmbedder;
    anything else is a sentence-transformers model name or local path."""
    if name is None:
        return None
    key = name.strip()
    if key.lower() in ("", "none"):
        return None
    if key.lower() == "hashing":
        return HashingEmbedder()
    if key.lower().startswith("hashing:"):
        dim_text = key.split(":", 1)[1]
        if not dim_text.isdigit():
            raise EmbedderError(f"bad embedder name {name!r}: expected 'hashing:<dim>' with an integer dim")
        return HashingEmbedder(dim=int(dim_text))
    return SentenceTransformerEmbedder(key)
