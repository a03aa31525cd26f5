from __future__ import annotations

import io
import json
import os
import re
import subprocess
import sys
import time

import pyarrow.parquet as pq
import pytest
from pydantic import ValidationError

from rubricem_core.schemas import CORPUS_SCHEMA, QUERIES_SCHEMA, queries_from_table
from rubricem_core.sim.facts import Fact, read_facts
from rubricem_core.sim.world import WorldConfig, generate_world


@pytest.fixture(scope="module")
def world():
    return generate_world(WorldConfig(seed=7, n_documents=2000, n_queries=120, eval_fraction=0.25))


@pytest.fixture(scope="module")
def tiny_world():
    return generate_world(WorldConfig(seed=1, n_documents=50, n_queries=20))


def _parquet_bytes(table) -> bytes:
    sink = io.BytesIO()
    pq.write_table(table, sink)
    return sink.getvalue()


def test_corpus_has_exact_size_and_stable_ids(world, tiny_world):
    for w, n in ((world, 2000), (tiny_world, 50)):
        ids = [d.doc_id for d in w.documents]
        assert len(ids) == n and len(set(ids)) == n
        assert all(re.fullmatch(r"D\d{6}", i) for i in ids)
        assert ids == sorted(ids)
        assert w.corpus_table().schema == CORPUS_SCHEMA


def test_read_facts_recovers_exactly_the_generated_facts(world):
    recovered: set[Fact] = set()
    for doc in world.documents:
        facts = read_facts(doc.text)
        assert set(facts) == set(world.doc_facts[doc.doc_id]), doc.text
        recovered.update(facts)
    assert recovered == set(world.facts)
    assert len(world.facts) == len(set(world.facts))


def test_read_facts_ignores_truncated_and_foreign_sentences(world):
    doc = next(d for d in world.documents if len(read_facts(d.text)) >= 3)
    full = read_facts(doc.text)
    truncated = doc.text[: len(doc.text) - 5]  # cuts the last sentence
    assert read_facts(truncated) == full[: len(read_facts(truncated))]
    assert len(read_facts(truncated)) < len(full)
    assert read_facts("The weather was fine. Nothing here is a fact.") == []
    assert read_facts(f"{doc.title}\n{doc.text}") == full


def test_same_seed_same_bytes_and_other_seed_differs():
    cfg = WorldConfig(seed=3, n_documents=300, n_queries=30)
    a, b = generate_world(cfg), generate_world(cfg)
    assert _parquet_bytes(a.corpus_table()) == _parquet_bytes(b.corpus_table())
    assert _parquet_bytes(a.queries_table()) == _parquet_bytes(b.queries_table())
    c = generate_world(cfg.model_copy(update={"seed": 4}))
    assert _parquet_bytes(c.corpus_table()) != _parquet_bytes(a.corpus_table())


def test_bytes_do_not_depend_on_hash_randomisation():
    code = (
        "import hashlib, json;"
        "from rubricem_core.sim.world import WorldConfig, generate_world;"
        "w = generate_world(WorldConfig(seed=3, n_documents=300, n_queries=30));"
        "rows = [d.text for d in w.documents] + [json.dumps(q.to_row(), sort_keys=True) for q in w.queries];"
        "print(hashlib.sha256('\\n'.join(rows).encode()).hexdigest())"
    )
    digests = set()
    for hash_seed in ("1", "2"):
        env = {**os.environ, "PYTHONHASHSEED": hash_seed}
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
        digests.add(out.stdout.strip())
    assert len(digests) == 1


def test_distractors_share_a_name_word_with_a_real_entity(world):
    real_orgs = {o.name: o for o in world.organizations if not o.is_distractor}
    distractors = [o for o in world.organizations if o.is_distractor]
    assert len(distractors) == round(0.2 * len(world.organizations))
    for org in distractors:
        twin = real_orgs[org.confusable_with]
        assert org.name != twin.name
        assert org.name.split()[0] == twin.name.split()[0]
        assert org.founded != twin.founded and org.employees != twin.employees
    real_people = {p.name for p in world.persons if not p.is_distractor}
    for person in (p for p in world.persons if p.is_distractor):
        assert person.confusable_with in real_people
        assert person.name.split()[-1] == person.confusable_with.split()[-1]
    # Distractor passages exist and are readable like any other.
    titles = {d.title for d in world.documents}
    assert all(o.name in titles for o in distractors)


def test_near_duplicates_rephrase_the_same_facts(world):
    by_title: dict[str, list] = {}
    for doc in world.documents:
        by_title.setdefault(doc.title, []).append(doc)
    duplicated = [docs for docs in by_title.values() if len(docs) > 1]
    assert len(duplicated) == round(0.1 * 2 * len(world.organizations))
    for first, second in duplicated:
        assert first.text != second.text
        assert set(read_facts(first.text)) == set(read_facts(second.text))


def _answer_from_gold_docs(world, query) -> str:
    """Answer a query as a reader would: only from the text of its gold documents and the spec."""
    texts = {d.doc_id: d.text for d in world.documents}
    facts: dict[tuple[str, str], str] = {}
    for doc_id in query.metadata["gold_doc_ids"]:
        for fact in read_facts(texts[doc_id]):
            facts[(fact.entity, fact.attribute)] = fact.value
    spec = query.spec
    if spec["kind"] == "multi_hop":
        first = spec["hops"][0]
        middle = facts[(first["entity"], first["relation"])]
        return facts[(middle, spec["hops"][1]["relation"])]
    values = {s: int(facts[(s, spec["attribute"])]) for s in spec["subjects"]}
    if spec["op"] == "earlier":
        return min(values, key=values.get)
    if spec["op"] == "more":
        return max(values, key=values.get)
    if spec["op"] == "sum":
        return str(sum(values.values()))
    if spec["op"] == "sort":
        return ", ".join(sorted(values, key=values.get))
    raise AssertionError(f"unexpected op {spec['op']}")


def test_every_query_is_answerable_from_its_gold_documents(world):
    for query in world.queries:
        assert _answer_from_gold_docs(world, query) == query.reference_answer, query.question


def test_queries_cover_all_kinds_and_carry_rubrics(world):
    assert len(world.queries) == 120
    assert {q.kind for q in world.queries} == {"comparison", "multi_hop", "aggregation", "timeline"}
    assert len({q.question for q in world.queries}) == len(world.queries)
    truth = set(world.facts)
    for query in world.queries:
        assert re.fullmatch(r"syn-\d{5}", query.query_id)
        assert query.messages == [{"role": "user", "content": query.question}]
        assert set(query.spec) <= {"kind", "attribute", "subjects", "op", "hops"}
        assert query.spec["op"] in {"earlier", "more", "sum", "sort", "lookup"}
        facts = [r for r in query.rubrics if r["check"]["type"] == "fact"]
        finals = [r for r in query.rubrics if r["check"]["type"] == "final"]
        negatives = [r for r in query.rubrics if r["polarity"] == "negative"]
        assert len(facts) == len(query.metadata["required_facts"]) >= 2
        assert all(r["weight"] == 2 and r["stage"] == "answer" for r in facts)
        assert len(finals) == 1 and finals[0]["weight"] == 3
        assert finals[0]["check"]["value"] == query.reference_answer
        assert len(negatives) == 1 and negatives[0]["check"]["type"] == "wrong_value"
        for rubric in facts:
            check = rubric["check"]
            fact = Fact(check["entity"], check["attribute"], check["value"])
            assert fact in truth
            assert check["doc_ids"] == world.fact_doc_ids[fact]
            assert set(check["doc_ids"]) <= set(query.metadata["gold_doc_ids"])
        # The spec states only what the question says: no answers, no document ids.
        spec_text = json.dumps(query.spec)
        assert "D0" not in spec_text
        if query.kind in ("aggregation", "multi_hop"):
            assert query.reference_answer not in spec_text


def test_negative_rubric_names_the_confusable_value_when_there_is_one(world):
    by_name = {o.name: o for o in world.organizations} | {p.name: p for p in world.persons}
    confused = 0
    for query in world.queries:
        check = next(r for r in query.rubrics if r["polarity"] == "negative")["check"]
        if check["confusable"] is not None:
            confused += 1
            twin = by_name[check["confusable"]["entity"]]
            assert twin.is_distractor and twin.confusable_with == check["entity"]
            assert twin.facts()[check["attribute"]] == check["confusable"]["value"] != check["value"]
    assert confused > 0


def test_eval_split_is_deterministic_fraction(world):
    assert sum(q.split == "eval" for q in world.queries) == 30
    again = generate_world(world.config)
    assert [q.split for q in again.queries] == [q.split for q in world.queries]


def test_tiny_world_still_gives_several_queries_of_every_kind(tiny_world):
    assert len(tiny_world.queries) >= 8
    assert {q.kind for q in tiny_world.queries} == {"comparison", "multi_hop", "aggregation", "timeline"}
    for query in tiny_world.queries:
        assert _answer_from_gold_docs(tiny_world, query) == query.reference_answer


def test_queries_table_round_trips(world):
    table = world.queries_table()
    assert table.schema == QUERIES_SCHEMA
    assert queries_from_table(table) == world.queries


def test_query_kinds_filter():
    w = generate_world(WorldConfig(seed=2, n_documents=200, n_queries=10, query_kinds=["timeline"]))
    assert {q.kind for q in w.queries} == {"timeline"}


@pytest.mark.parametrize(
    "bad",
    [
        {"n_documents": 10},
        {"n_documents": 200_000},
        {"query_kinds": []},
        {"query_kinds": ["trivia"]},
        {"eval_fraction": 1.5},
        {"distractor_rate": 0.9},
    ],
)
def test_bad_config_is_rejected(bad):
    with pytest.raises(ValidationError):
        WorldConfig(**bad)


def test_scales_to_100k_documents():
    start = time.perf_counter()
    w = generate_world(WorldConfig(seed=0, n_documents=100_000, n_queries=500))
    elapsed = time.perf_counter() - start
    assert len(w.documents) == 100_000 and len(w.queries) == 500
    assert elapsed < 45, f"100k-document world took {elapsed:.1f}s"
    for doc in w.documents[::997]:  # a sample stays parseable at scale (names remain unambiguous)
        assert set(read_facts(doc.text)) == set(w.doc_facts[doc.doc_id])


@pytest.mark.parametrize("n_documents", [50, 51, 333])
@pytest.mark.parametrize("distractor_rate, near_duplicate_rate", [(0.0, 0.0), (0.5, 1.0), (0.1, 0.35)])
def test_size_is_exact_and_facts_readable_for_any_rates(n_documents, distractor_rate, near_duplicate_rate):
    w = generate_world(
        WorldConfig(
            seed=11,
            n_documents=n_documents,
            n_queries=8,
            distractor_rate=distractor_rate,
            near_duplicate_rate=near_duplicate_rate,
        )
    )
    assert len(w.documents) == n_documents
    assert len(w.queries) == 8
    assert {f for d in w.documents for f in read_facts(d.text)} == set(w.facts)
    if distractor_rate == 0.0:
        assert not any(o.is_distractor for o in w.organizations)
    if near_duplicate_rate == 0.0:
        assert len({d.title for d in w.documents}) == n_documents
