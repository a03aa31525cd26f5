"""The answer-match grader (eval/answer_match.py): the held-out grader that shares no code with the judge.

Answers are written here from the world's ground truth, the way the scaffold's answer stage reads (cited
claims, then a concluding sentence), and every way of being wrong the grader must see is tried on them."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from rubricem_core.eval.answer_match import final_correct, match_answer, match_query, sentences, words
from rubricem_core.schemas import Query
from rubricem_core.sim.world import WorldConfig, generate_world

PHRASES = {
    "founded": "{e} was founded in {v}",
    "employees": "{e} employs {v} people",
    "headquarters": "{e} is headquartered in {v}",
    "sector": "{e} operates in the {v} sector",
    "founder_of": "{e} founded {v}",
    "acquired_by": "{e} was acquired by {v}",
}


def gold_answer(query: Query, conclusion: str | None = None, thousands: bool = True) -> str:
    claims = []
    for fact in query.metadata["required_facts"]:
        value = fact["value"]
        if thousands and fact["attribute"] == "employees":
            value = f"{int(value):,}"
        claim = PHRASES[fact["attribute"]].format(e=fact["entity"], v=value)
        claims.append(f'<cite id="{fact["doc_ids"][0]}">{claim}</cite>.')
    final = conclusion if conclusion is not None else f"Therefore: the answer is {query.reference_answer}."
    return " ".join(claims) + " " + final


@pytest.fixture(scope="module")
def queries() -> list[Query]:
    world = generate_world(WorldConfig(seed=5, n_documents=200, n_queries=24, eval_fraction=0.0))
    return [Query.from_row(r) for r in world.queries_table().to_pylist()]


def of_kind(queries: list[Query], kind: str) -> list[Query]:
    found = [q for q in queries if q.kind == kind]
    assert found, kind
    return found


@pytest.mark.parametrize("kind", ["comparison", "multi_hop", "aggregation", "timeline"])
def test_a_gold_answer_scores_full_marks(queries, kind):
    for query in of_kind(queries, kind):
        grade = match_query(query, gold_answer(query))
        assert grade["final_correct"], (query.question, gold_answer(query))
        assert grade["facts_stated"] == grade["facts_required"] > 0
        assert grade["score"] == 1.0


def test_a_comparison_that_names_the_other_side_is_wrong(queries):
    for query in of_kind(queries, "comparison"):
        loser = next(s for s in query.spec["subjects"] if s != query.reference_answer)
        grade = match_query(query, gold_answer(query, f"Therefore: {loser} wins."))
        assert not grade["final_correct"] and grade["score"] == 0.5
        hedged = match_query(query, gold_answer(query, f"Therefore: {query.reference_answer} or {loser}."))
        assert not hedged["final_correct"]


def test_a_timeline_in_the_wrong_order_is_wrong(queries):
    for query in of_kind(queries, "timeline"):
        names = query.reference_answer.split(", ")
        grade = match_query(query, gold_answer(query, "In order: " + ", ".join(reversed(names)) + "."))
        assert not grade["final_correct"]


def test_a_wrong_value_states_no_fact_and_silence_scores_zero(queries):
    query = of_kind(queries, "aggregation")[0]
    fact = query.metadata["required_facts"][0]
    wrong = gold_answer(query).replace(f"{int(fact['value']):,}", str(int(fact["value"]) + 7), 1)
    grade = match_query(query, wrong)
    assert grade["facts_stated"] == grade["facts_required"] - 1
    assert match_query(query, "")["score"] == 0.0
    assert match_query(query, "  ")["score"] == 0.0


def test_a_look_alike_entity_does_not_state_the_fact():
    facts = [{"entity": "Voralis Labs", "attribute": "founded", "value": "1901"}]
    spec = {"kind": "multi_hop"}
    assert match_answer("Voralis Systems was founded in 1901. So 1901.", "1901", spec, facts)["facts_stated"] == 0
    assert match_answer("Voralis Labs was founded in 1901. So 1901.", "1901", spec, facts)["facts_stated"] == 1


def test_numbers_match_with_or_without_separators_and_ids_are_not_words():
    assert words('<cite id="D0012">Kex employs 12,345 people</cite> [D0012].') == ["kex", "employs", "12345", "people"]
    facts = [{"entity": "Kex Labs", "attribute": "employees", "value": "12345"}]
    spec = {"kind": "aggregation"}
    assert match_answer("Kex Labs employs 12,345 people. Total: 12,345.", "12345", spec, facts)["score"] == 1.0
    assert match_answer("Kex Labs employs 12345 people. Total 12345", "12345", spec, facts)["score"] == 1.0
    assert match_answer("Kex Labs employs 123456 people. Total 123456", "12345", spec, facts)["score"] == 0.0


def test_the_final_answer_is_read_from_the_last_sentence_only():
    spec = {"kind": "comparison", "subjects": ["Abo Labs", "Bex Works"]}
    last = sentences("Abo Labs was founded in 1900. Bex Works was founded in 1950. Abo Labs was founded earlier.")[-1]
    assert final_correct(last, spec, "Abo Labs")
    assert not final_correct(sentences("Abo Labs is first. Nothing more.")[-1], spec, "Abo Labs")


def test_the_grader_imports_nothing_from_the_judge_or_the_stand_ins():
    source = Path(__file__).resolve().parents[1] / "rubricem_core" / "eval" / "answer_match.py"
    imported = set()
    for node in ast.walk(ast.parse(source.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            imported.add(node.module)
        elif isinstance(node, ast.Import):
            imported.update(alias.name for alias in node.names)
    assert not {m for m in imported if m.startswith("rubricem_core")}, imported
