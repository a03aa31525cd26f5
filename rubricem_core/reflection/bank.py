"""The reflection bank: the best reflection per query, retrievable by query similarity.

One entry per query. A FAISS ``IndexIDMap2(IndexFlatIP)`` holds the L2-normalized embedding of
each entry's query text under a stable int64 id (assigned when the query first enters; a replaced
entry keeps its id), so inner product is cosine similarity.

Retrieval modes:
  none    no guidance
  cross   the k most similar OTHER queries' reflections (cross-episode: fresh batches)
  within  the query's own reflection, or nothing (within-episode: replayed batches). With
          ``within_source="best"`` its entry (the best reflection under ``if_better``); with
          ``"window"`` (the paper) the reflection written at the ``source_step`` the caller names —
          the new-query step the current replay step repeats — whatever its score. Every added
          entry is kept by (query, step) for this, in memory only (a session rebuilds it by
          replaying the ``reflections`` table).

Replacement policy (``replace``): ``"if_better"`` (default) keeps a query's entry until a strictly
higher-scoring reflection arrives — the bank holds the best reflection seen, and a bad step cannot
overwrite a good lesson; ``"always"`` keeps the newest. Either way the step is recorded.

Thread safety: one re-entrant lock around every read or change of the entries and the index.
Embedding happens outside the lock (it is the slow part and touches no bank state).

Persistence (``save(dir)``): ``index-<hash>.faiss`` first, then ``part.parquet`` (the ``bank`` table
columns plus ``faiss_id``: ``schemas.BANK_ENTRIES_SCHEMA``), whose schema metadata names the index file, the embedding dimension and
the embedder (its ``make_embedder`` name, e.g. ``hashing:256`` or a sentence-transformers model);
both are written atomically and the parquet file is the commit point, so a save interrupted between
the two leaves the previous pair readable. Stale index files are removed after the commit.
``load(dir)`` rebuilds the recorded embedder unless it is given one. A run's bank lives at
``bank_dir(run_dir)`` (RL saves it there, evaluation reads it from there).
"""

from __future__ import annotations

import hashlib
import math
import threading
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import faiss
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from rubricem_core.embedders import Embedder, HashingEmbedder, make_embedder
from rubricem_core.schemas import BANK_ENTRIES_SCHEMA
from rubricem_core.store import RunStore, atomic_write_bytes

RETRIEVAL_MODES: tuple[str, ...] = ("none", "cross", "within")
REPLACE_POLICIES: tuple[str, ...] = ("if_better", "always")
WITHIN_SOURCES: tuple[str, ...] = ("best", "window")
ENTRIES_FILE = "part.parquet"
INDEX_META_KEY = b"rubricem.bank.index_file"
DIM_META_KEY = b"rubricem.bank.dim"
EMBEDDER_META_KEY = b"rubricem.bank.embedder"
EMBEDDER_CHECK_MIN_COSINE = 0.99  # re-embedding a stored query must give (almost) the stored vector


class BankError(ValueError):
    """Bad bank input (entry field, mode, policy) or a saved bank that cannot be read back."""


def bank_dir(run_dir: str | Path) -> Path:
    """The one place a run's reflection bank is saved (by RL) and read (by evaluation), resolved:
    ``RunLayout.bank_dir`` (beside the run's other state; tables/bank is the Parquet ``bank`` table)."""
    return RunStore(run_dir).layout.bank_dir


def embedder_spec(embedder: Embedder) -> str | None:
    """The ``make_embedder`` name that rebuilds ``embedder`` (recorded with a saved bank); None: unknown."""
    if isinstance(embedder, HashingEmbedder):
        return f"hashing:{embedder.dim}"
    name = getattr(embedder, "model_name_or_path", None)  # SentenceTransformerEmbedder
    return name if isinstance(name, str) and name else None


@dataclass(frozen=True)
class SavedBankInfo:
    """What a saved bank's ``part.parquet`` metadata records."""

    entries_path: Path
    index_file: str
    dim: int
    embedder: str | None  # the make_embedder name it was built with; None: not recorded (an older save)


def _saved_info(schema: pa.Schema, entries_path: Path) -> SavedBankInfo:
    meta = schema.metadata or {}
    if INDEX_META_KEY not in meta:
        raise BankError(f"{entries_path} has no {INDEX_META_KEY.decode()} metadata: not a saved ReflectionBank")
    embedder = meta.get(EMBEDDER_META_KEY, b"").decode() or None
    return SavedBankInfo(entries_path, meta[INDEX_META_KEY].decode(), int(meta.get(DIM_META_KEY, b"0")), embedder)


def saved_bank_info(directory: str | Path) -> SavedBankInfo:
    """The metadata of the bank saved under ``directory`` (reads the Parquet schema only)."""
    entries_path = Path(directory) / ENTRIES_FILE
    if not entries_path.exists():
        raise BankError(f"no saved bank at {directory}: {ENTRIES_FILE} is missing")
    try:
        schema = pq.read_schema(entries_path)
    except Exception as exc:  # pyarrow raises several types for corrupt files
        raise BankError(f"cannot read bank entries {entries_path}: {exc}") from exc
    return _saved_info(schema, entries_path)


def _check_dim(info: SavedBankInfo, dim: int, given: str | None) -> None:
    """A search with vectors of another width is impossible: name both embedders."""
    if info.dim != dim:
        built = repr(info.embedder) if info.embedder else "an embedder it did not record"
        raise BankError(
            f"{info.entries_path}: the bank was built with {info.dim}-dim embeddings ({built}); "
            f"the embedder given ({given!r}) gives {dim}-dim ones"
        )


def _resolve_embedder(info: SavedBankInfo, embedder: Embedder | str | None) -> tuple[Embedder, str | None]:
    """(embedder, its name) to search a saved bank with: the one given (an object or a make_embedder
    name), else the one recorded with the bank."""
    if embedder is not None and not isinstance(embedder, str):
        return embedder, embedder_spec(embedder)
    spec = embedder if embedder is not None else info.embedder
    if spec is None:
        raise BankError(
            f"{info.entries_path}: the bank does not record the embedder it was built with "
            f"({info.dim}-dim); name it (evaluation: eval.bank_embedder)"
        )
    built = make_embedder(spec)
    if built is None:
        raise BankError(f"embedder {spec!r} cannot search a bank: name an embedder (hashing[:dim] or a model)")
    return built, spec


@dataclass(frozen=True)
class BankEntry:
    query_id: str
    query_text: str
    reflection: str  # the rendered reflection (format.Reflection.render())
    score: float  # the reflection judge's score in [0, 1]
    step: int  # the RL step the reflection was written at (-1: before RL, the teacher's warm start)

    def __post_init__(self) -> None:
        where = f"bank entry {self.query_id!r}"
        if not isinstance(self.query_id, str) or not self.query_id:
            raise BankError("bank entry: query_id must be a non-empty string")
        if not isinstance(self.query_text, str):
            raise BankError(f"{where}: query_text must be a string")
        if not isinstance(self.reflection, str) or not self.reflection.strip():
            raise BankError(f"{where}: reflection must be a non-empty string")
        if isinstance(self.score, bool) or not isinstance(self.score, (int, float)) or not math.isfinite(self.score):
            raise BankError(f"{where}: score must be a finite number, got {self.score!r}")
        if isinstance(self.step, bool) or not isinstance(self.step, (int, np.integer)) or self.step < -1:
            raise BankError(f"{where}: step must be an int >= -1 (-1: written before RL), got {self.step!r}")


class ReflectionBank:
    """Thread-safe, persisted, FAISS-indexed map query_id → best reflection. See the module doc."""

    def __init__(
        self,
        embedder: Embedder,
        path: str | Path | None = None,
        replace: str = "if_better",
        within_source: str = "best",
        embedder_name: str | None = None,
    ) -> None:
        """``path``: the default directory of ``save()``; a bank saved there is loaded (resume).
        ``within_source``: "best" — within retrieval returns the query's entry; "window" — the entry
        written at the ``source_step`` given to ``retrieve_many`` (None, or none of that step: a miss).
        ``embedder_name``: recorded with a save (default: ``embedder_spec(embedder)``)."""
        if replace not in REPLACE_POLICIES:
            raise BankError(f"replace must be one of {REPLACE_POLICIES}, got {replace!r}")
        if within_source not in WITHIN_SOURCES:
            raise BankError(f"within_source must be one of {WITHIN_SOURCES}, got {within_source!r}")
        self.embedder = embedder
        self.embedder_name = embedder_name if embedder_name is not None else embedder_spec(embedder)
        self.path = Path(path) if path is not None else None
        self.replace = replace
        self.within_source = within_source
        self._lock = threading.RLock()
        self._entries: dict[str, BankEntry] = {}
        self._written: dict[tuple[str, int], BankEntry] = {}  # (query_id, step) → that step's entry
        self._ids: dict[str, int] = {}  # query_id → faiss id, stable for the bank's life
        self._by_id: dict[int, str] = {}
        self._next_id = 0
        self._index = faiss.IndexIDMap2(faiss.IndexFlatIP(int(embedder.dim)))
        self._counts = {mode: {"requests": 0, "hits": 0, "misses": 0} for mode in RETRIEVAL_MODES}
        self._adds = {"inserted": 0, "replaced": 0, "kept": 0}
        if self.path is not None and (self.path / ENTRIES_FILE).exists():
            self._load_from(self.path)

    # ---- size and contents ---------------------------------------------------------------------
    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)

    def __contains__(self, query_id: object) -> bool:
        with self._lock:
            return query_id in self._entries

    def get(self, query_id: str) -> BankEntry | None:
        with self._lock:
            return self._entries.get(query_id)

    def rows(self) -> list[dict[str, Any]]:
        """``bank`` table rows (query_id, query_text, reflection, score, step), sorted by query_id."""
        with self._lock:
            return [asdict(self._entries[q]) for q in sorted(self._entries)]

    def faiss_id(self, query_id: str) -> int | None:
        with self._lock:
            return self._ids.get(query_id)

    def written(self, query_id: str, step: int) -> BankEntry | None:
        """The entry added for ``query_id`` at ``step`` (whether or not it became the query's entry)."""
        with self._lock:
            return self._written.get((query_id, step))

    # ---- adding ---------------------------------------------------------------------------------
    def _encode(self, texts: Sequence[str]) -> np.ndarray:
        vectors = np.ascontiguousarray(self.embedder.encode(list(texts)), dtype=np.float32)
        if vectors.shape != (len(texts), self._index.d):
            raise BankError(f"embedder returned shape {vectors.shape}, expected ({len(texts)}, {self._index.d})")
        return vectors

    def add(self, entry: BankEntry) -> bool:
        """Store ``entry`` under the replacement policy; True when it was stored."""
        return self.add_many([entry])[0]

    def add_many(self, entries: Sequence[BankEntry]) -> list[bool]:
        """``add`` for several entries with one embedding batch; applied in order."""
        for entry in entries:
            if not isinstance(entry, BankEntry):
                raise BankError(f"add expects BankEntry, got {type(entry).__name__}")
        vectors = self._encode([e.query_text for e in entries]) if entries else None
        stored = []
        with self._lock:
            for entry, vector in zip(entries, vectors if vectors is not None else []):
                stored.append(self._apply(entry, vector))
        return stored

    def _keeps(self, old: BankEntry | None, new: BankEntry) -> bool:
        return old is not None and self.replace == "if_better" and not new.score > old.score

    def _apply(self, entry: BankEntry, vector: np.ndarray) -> bool:
        key = (entry.query_id, entry.step)
        if not self._keeps(self._written.get(key), entry):  # the same replace policy within one step
            self._written[key] = entry
        old = self._entries.get(entry.query_id)
        if self._keeps(old, entry):
            self._adds["kept"] += 1
            return False
        if old is None:
            faiss_id = self._next_id
            self._next_id += 1
            self._ids[entry.query_id] = faiss_id
            self._by_id[faiss_id] = entry.query_id
            self._adds["inserted"] += 1
        else:
            faiss_id = self._ids[entry.query_id]
            self._index.remove_ids(np.array([faiss_id], dtype=np.int64))  # type: ignore[arg-type]
            self._adds["replaced"] += 1
        self._index.add_with_ids(vector.reshape(1, -1), np.array([faiss_id], dtype=np.int64))
        self._entries[entry.query_id] = entry
        return True

    # ---- retrieval ------------------------------------------------------------------------------
    def retrieve(
        self, query_id: str, query_text: str, mode: str, k: int = 1, min_similarity: float | None = None
    ) -> list[BankEntry]:
        """Reflections to guide an attempt at this query (see the module doc for the modes)."""
        return [entry for entry, _ in self.retrieve_scored(query_id, query_text, mode, k, min_similarity)]

    def retrieve_scored(
        self, query_id: str, query_text: str, mode: str, k: int = 1, min_similarity: float | None = None
    ) -> list[tuple[BankEntry, float]]:
        """``retrieve`` with the cosine similarity of each entry's query (1.0 for ``within``)."""
        return self.retrieve_many([(query_id, query_text)], mode, k, min_similarity)[0]

    def retrieve_many(
        self,
        queries: Sequence[tuple[str, str]],
        mode: str,
        k: int = 1,
        min_similarity: float | None = None,
        source_step: int | None = None,
    ) -> list[list[tuple[BankEntry, float]]]:
        """``retrieve_scored`` for many (query_id, query_text) pairs with one embedding batch;
        ``source_step``: the step whose reflections ``within`` returns under ``within_source="window"``."""
        if mode not in RETRIEVAL_MODES:
            raise BankError(f"retrieval mode must be one of {RETRIEVAL_MODES}, got {mode!r}")
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise BankError(f"k must be an int >= 1, got {k!r}")
        queries = list(queries)
        if mode == "none":
            results: list[list[tuple[BankEntry, float]]] = [[] for _ in queries]
        elif mode == "within":
            results = self._search_within(queries, source_step)
        elif queries:
            vectors = self._encode([text for _, text in queries])
            with self._lock:
                results = self._search_cross(queries, vectors, k, min_similarity)
        else:
            results = []
        with self._lock:
            counts = self._counts[mode]
            counts["requests"] += len(queries)
            if mode != "none":
                hits = sum(1 for r in results if r)
                counts["hits"] += hits
                counts["misses"] += len(results) - hits
        return results

    def _search_within(
        self, queries: list[tuple[str, str]], source_step: int | None
    ) -> list[list[tuple[BankEntry, float]]]:
        with self._lock:
            if self.within_source == "best":
                found = [self._entries.get(q) for q, _ in queries]
            else:
                found = [None if source_step is None else self._written.get((q, source_step)) for q, _ in queries]
        return [[(entry, 1.0)] if entry is not None else [] for entry in found]

    def _search_cross(
        self, queries: list[tuple[str, str]], vectors: np.ndarray, k: int, min_similarity: float | None
    ) -> list[list[tuple[BankEntry, float]]]:
        if self._index.ntotal == 0:
            return [[] for _ in queries]
        # one extra neighbour: the query's own entry, when it is in the bank, is skipped
        similarities, ids = self._index.search(vectors, min(k + 1, self._index.ntotal))
        out = []
        for (query_id, _), row_sims, row_ids in zip(queries, similarities, ids):
            found = []
            for similarity, faiss_id in zip(row_sims, row_ids):
                if faiss_id < 0:
                    continue
                other = self._by_id[int(faiss_id)]
                if other == query_id:
                    continue
                if min_similarity is not None and similarity < min_similarity:
                    continue
                found.append((self._entries[other], float(similarity)))
            out.append(found[:k])
        return out

    # ---- metrics --------------------------------------------------------------------------------
    def stats(self) -> dict[str, dict[str, int]]:
        """Retrieval requests/hits/misses by mode and add outcomes (copies)."""
        with self._lock:
            return {**{mode: dict(c) for mode, c in self._counts.items()}, "adds": dict(self._adds)}

    def metrics(self, prefix: str = "bank/") -> dict[str, float]:
        stats = self.stats()
        with self._lock:
            out = {f"{prefix}size": float(len(self._entries))}
            if self._entries:
                out[f"{prefix}mean_score"] = float(np.mean([e.score for e in self._entries.values()]))
        for group, counts in stats.items():
            for name, value in counts.items():
                out[f"{prefix}{group}_{name}"] = float(value)
        return out

    # ---- persistence ----------------------------------------------------------------------------
    def save(self, directory: str | Path | None = None) -> Path:
        """Write the entries and the index under ``directory`` (default: ``path``); returns it."""
        target = Path(directory) if directory is not None else self.path
        if target is None:
            raise BankError("save() needs a directory: none given and the bank has no path")
        with self._lock:
            index_bytes = faiss.serialize_index(self._index).tobytes()
            rows = [{**asdict(self._entries[q]), "faiss_id": self._ids[q]} for q in sorted(self._entries)]
        index_name = f"index-{hashlib.sha256(index_bytes).hexdigest()[:16]}.faiss"
        target.mkdir(parents=True, exist_ok=True)
        atomic_write_bytes(target / index_name, index_bytes)
        meta = {INDEX_META_KEY: index_name.encode(), DIM_META_KEY: str(self._index.d).encode()}
        if self.embedder_name:  # what load() rebuilds by default
            meta[EMBEDDER_META_KEY] = self.embedder_name.encode()
        table = pa.Table.from_pylist(rows, schema=BANK_ENTRIES_SCHEMA).replace_schema_metadata(meta)
        sink = pa.BufferOutputStream()
        pq.write_table(table, sink)
        atomic_write_bytes(target / ENTRIES_FILE, sink.getvalue().to_pybytes())  # the commit point
        for stale in target.glob("index-*.faiss"):
            if stale.name != index_name:
                stale.unlink(missing_ok=True)
        return target

    @classmethod
    def load(
        cls, directory: str | Path, embedder: Embedder | str | None = None, replace: str = "if_better"
    ) -> ReflectionBank:
        """The bank saved under ``directory``, searched with ``embedder`` (an Embedder or a
        make_embedder name; None: the one recorded with the bank); later ``save()`` calls write back there."""
        info = saved_bank_info(directory)
        resolved, name = _resolve_embedder(info, embedder)
        _check_dim(info, int(resolved.dim), name or type(resolved).__name__)
        # an unnamed embedder that passes the vector check is the recorded one: a later save keeps its name
        return cls(resolved, path=directory, replace=replace, embedder_name=name or info.embedder)

    def _load_from(self, directory: Path) -> None:
        entries_path = directory / ENTRIES_FILE
        try:
            table = pq.read_table(entries_path)
        except Exception as exc:  # pyarrow raises several types for corrupt files
            raise BankError(f"cannot read bank entries {entries_path}: {exc}") from exc
        info = _saved_info(table.schema, entries_path)
        missing = [name for name in BANK_ENTRIES_SCHEMA.names if name not in table.column_names]
        if missing:
            raise BankError(f"{entries_path} lacks columns {missing}")
        dim = info.dim
        _check_dim(info, self._index.d, self.embedder_name or type(self.embedder).__name__)
        index_path = directory / info.index_file
        try:
            index = faiss.deserialize_index(np.frombuffer(index_path.read_bytes(), dtype=np.uint8))
        except Exception as exc:  # a missing file or faiss's RuntimeError on corrupt bytes
            raise BankError(f"cannot read bank index {index_path}: {exc}") from exc
        rows = table.to_pylist()
        if index.ntotal != len(rows) or index.d != dim:
            raise BankError(
                f"{index_path} holds {index.ntotal} vectors of dim {index.d}; "
                f"{entries_path} has {len(rows)} entries of dim {dim}"
            )
        # deserialize_index already returns the concrete class; a downcast_index wrapper would not own
        # the C++ object, which is freed with the original wrapper
        if not isinstance(index, faiss.IndexIDMap2):
            raise BankError(f"{index_path} is a {type(index).__name__}, expected IndexIDMap2")
        entries, ids = {}, {}
        for number, row in enumerate(rows):
            entry = BankEntry(
                row["query_id"], row["query_text"], row["reflection"], float(row["score"]), int(row["step"])
            )
            if entry.query_id in entries:
                raise BankError(f"{entries_path} row {number}: query_id {entry.query_id!r} appears twice")
            entries[entry.query_id] = entry
            ids[entry.query_id] = int(row["faiss_id"])
        self._check_embedder(index, entries, ids, index_path)
        self._index = index
        self._entries = entries
        self._ids = ids
        self._by_id = {faiss_id: query_id for query_id, faiss_id in ids.items()}
        self._next_id = max(ids.values(), default=-1) + 1

    def _check_embedder(self, index: Any, entries: dict[str, BankEntry], ids: dict[str, int], index_path: Path) -> None:
        """A bank searched with another embedder than it was built with returns nonsense: refuse it."""
        sample = [q for q in sorted(entries) if entries[q].query_text.strip()][:3]
        if not sample:
            return
        fresh = self._encode([entries[q].query_text for q in sample])
        for query_id, vector in zip(sample, fresh):
            try:
                stored = index.reconstruct(ids[query_id])
            except RuntimeError as exc:
                raise BankError(f"{index_path}: no vector for query {query_id!r} (faiss id {ids[query_id]})") from exc
            if np.linalg.norm(vector) == 0 and np.linalg.norm(stored) == 0:
                continue
            cosine = float(np.dot(vector, stored))
            if cosine < EMBEDDER_CHECK_MIN_COSINE:
                raise BankError(
                    f"{index_path}: the stored embedding of query {query_id!r} differs from this "
                    f"embedder's (cosine {cosine:.3f}); load the bank with the embedder that built it"
                )
