from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from rubricem_core.readers import (
    QueryFileError,
    detect_format,
    read_deep_research_bench,
    read_dr_tulu,
    read_queries,
)
from rubricem_core.schemas import QUERIES_SCHEMA, Query, QueryValidationError, queries_from_table, queries_to_table
from tests.conftest import shared_file


def _write_jsonl(path: Path, records: list) -> Path:
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records), encoding="utf-8")
    return path


def _round_trip(queries: list[Query]) -> None:
    table = queries_to_table(queries)
    assert table.schema == QUERIES_SCHEMA
    assert queries_from_table(table) == queries


# ---- real files --------------------------------------------------------------------------------


def test_healthbench(shared_data):
    path = shared_file(shared_data, "healthbench/healthbench_oss_eval_sample30.jsonl")
    queries = read_queries(path)
    assert len(queries) == 30
    assert sum(len(q.rubrics) for q in queries) == 352
    assert sum(len(q.messages) > 1 for q in queries) == 9
    raw = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]
    for query, record in zip(queries, raw):
        assert query.query_id == f"healthbench-{record['prompt_id']}"
        assert query.source == "healthbench" and query.split == "eval" and query.kind == "long_form"
        assert query.question == [m for m in record["prompt"] if m["role"] == "user"][-1]["content"]
        for rubric, item in zip(query.rubrics, record["rubrics"]):
            assert rubric["weight"] == abs(item["points"])
            assert rubric["polarity"] == ("negative" if item["points"] < 0 else "positive")
            assert rubric["description"] == item["criterion"]
        ideal = record["ideal_completions_data"]
        assert query.reference_answer == (ideal["ideal_completion"] if ideal else None)
    assert any(r["polarity"] == "negative" for q in queries for r in q.rubrics)
    _round_trip(queries)


def test_simpleqa(shared_data):
    queries = read_queries(shared_file(shared_data, "simpleqa/simple_qa_test_set.csv"))
    assert len(queries) == 4326
    first = queries[0]
    assert first.kind == "short_form" and first.split == "eval"
    assert first.question == "Who received the IEEE Frank Rosenblatt Award in 2010?"
    assert first.reference_answer == "Michio Sugeno"
    assert first.metadata["topic"] == "Science and technology"
    assert first.rubrics[0]["check"] == {"type": "final", "value": "Michio Sugeno", "aliases": ["Michio Sugeno"]}
    assert len({q.query_id for q in queries}) == 4326


def test_2wiki(shared_data):
    queries = read_queries(shared_file(shared_data, "2wiki/2wiki_dev_trustmargin.json"))
    assert len(queries) == 1000
    assert queries[1].metadata["answer_aliases"] == ["Mask of Fu Manchu", "The Mask of Fu Manchu"]
    assert queries[1].reference_answer == "Mask of Fu Manchu"
    assert queries[2].reference_answer == "12 June 1516" and queries[2].metadata["answer_aliases"] == ["12 June 1516"]
    assert all(q.kind == "short_form" and q.source == "2wiki" for q in queries)


def test_deep_research_bench(shared_data):
    query_file = shared_file(shared_data, "deep_research_bench/prompt_data_query.jsonl")
    criteria_file = shared_file(shared_data, "deep_research_bench/criteria_data_criteria.jsonl")
    queries = read_queries(query_file)  # criteria found beside the query file
    assert len(queries) == 100
    assert sum(len(q.rubrics) for q in queries) == 2517
    assert sum(q.metadata["language"] == "en" for q in queries) == 50
    criteria = {c["id"]: c for c in map(json.loads, criteria_file.read_text(encoding="utf-8").splitlines())}
    for query in queries:
        record = criteria[int(query.query_id.split("-")[-1])]
        for rubric in query.rubrics:
            check = rubric["check"]
            assert rubric["title"].startswith(f"[{check['dimension']}] ")
            assert check["dimension_weight"] == record["dimension_weight"][check["dimension"]]
            assert rubric["weight"] == pytest.approx(check["dimension_weight"] * check["criterion_weight"])
    explicit = read_deep_research_bench(query_file, criteria_path=criteria_file)
    assert explicit == queries
    _round_trip(queries)


def test_scholarqa_cs(shared_data):
    path = shared_file(shared_data, "scholarqa_cs/scholarqa_cs_test_configs_snippets.json")
    queries = read_queries(path)
    assert len(queries) == 110
    raw = json.loads(path.read_text(encoding="utf-8"))
    for query, record in zip(queries, raw):
        props = record["metric_config"]["config"]["other_properties"]
        assert query.query_id == f"scholarqa_cs-{record['case_id']}"
        assert query.question == record["initial_prompt"]
        assert [r["weight"] for r in query.rubrics] == [p["weight"] for p in props]
        assert [r["check"]["evidence"] for r in query.rubrics] == [p["evidence"] for p in props]


# ---- DR Tulu RL rows ---------------------------------------------------------------------------

DR_TULU_ROWS = [
    {  # long-form: ground_truth is a JSON string, as in rl-research/dr-tulu-rl-data
        "messages": [
            {"role": "system", "content": "You are a research agent."},
            {"role": "user", "content": "How do transformers handle long context?"},
        ],
        "ground_truth": json.dumps(
            {
                "query": "How do transformers handle long context?",
                "rubrics": [
                    {"title": "Sparse attention", "description": "Explains sparse attention patterns.", "weight": 2},
                    {"description": "Discusses positional interpolation.", "weight": 1.0},
                    {"title": "Fabrication", "description": "Invents benchmark numbers.", "weight": -1.0},
                ],
            }
        ),
        "dataset": "rubric_search",
    },
    {  # the open-instruct loader wraps ground_truth in a one-element list; "Question" key variant
        "messages": [{"role": "user", "content": "What limits battery energy density?"}],
        "ground_truth": [
            json.dumps(
                {
                    "Question": "What limits battery energy density?",
                    "rubrics": [{"description": "Mentions cathode chemistry.", "weight": 1}],
                }
            )
        ],
        "dataset": ["rubric_search"],
        "id": "row-b",
    },
    {  # short-form row: ground_truth is the answer itself
        "messages": [{"role": "user", "content": "Who wrote Middlemarch?"}],
        "ground_truth": "George Eliot",
        "dataset": "rl_rag_exact_answer",
    },
]


def _check_dr_tulu(queries: list[Query]) -> None:
    assert [q.query_id for q in queries] == ["dr_tulu-000000", "dr_tulu-row-b", "dr_tulu-000002"]
    first, second, third = queries
    assert first.split == "train" and first.kind == "long_form" and first.source == "dr_tulu"
    assert first.question == "How do transformers handle long context?"
    assert first.messages[0]["role"] == "system" and len(first.messages) == 2
    assert [(r["title"], r["weight"], r["polarity"]) for r in first.rubrics] == [
        ("Sparse attention", 2.0, "positive"),
        ("Discusses positional interpolation.", 1.0, "positive"),
        ("Fabrication", 1.0, "negative"),
    ]
    assert all(r["stage"] == "answer" for r in first.rubrics)
    assert first.metadata["dataset"] == "rubric_search"
    assert second.metadata["ground_truth_query"] == "What limits battery energy density?"
    assert len(second.rubrics) == 1
    assert third.kind == "short_form" and third.reference_answer == "George Eliot"
    assert third.rubrics[0]["check"]["type"] == "final"


def test_dr_tulu_jsonl(tmp_path):
    path = _write_jsonl(tmp_path / "rl.jsonl", DR_TULU_ROWS)
    assert detect_format(path) == "dr_tulu"
    queries = read_queries(path)
    _check_dr_tulu(queries)
    _round_trip(queries)


def test_dr_tulu_parquet(tmp_path):
    rows = [
        {
            **r,
            "ground_truth": r["ground_truth"] if isinstance(r["ground_truth"], str) else r["ground_truth"][0],
            "dataset": "rubric_search" if "id" in r else r["dataset"],
            "id": r.get("id"),
        }
        for r in DR_TULU_ROWS
    ]
    path = tmp_path / "train-00000.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)
    assert detect_format(path) == "dr_tulu"
    _check_dr_tulu(read_queries(path))


@pytest.mark.parametrize(
    "row, pattern",
    [
        ({"ground_truth": "x"}, r"line 1: field 'messages\|prompt': missing"),
        ({"messages": [{"role": "user"}], "ground_truth": "x"}, r"field 'messages\[0\]'"),
        (
            {"messages": [{"role": "assistant", "content": "hi"}], "ground_truth": "x"},
            r"field 'messages': no non-empty user",
        ),
        (
            {"messages": [{"role": "user", "content": "q"}], "ground_truth": json.dumps({"query": "q"})},
            r"field 'ground_truth': object has neither",
        ),
        (
            {
                "messages": [{"role": "user", "content": "q"}],
                "ground_truth": json.dumps({"query": "q", "rubrics": [{"description": "d", "weight": "heavy"}]}),
            },
            r"field 'ground_truth\.rubrics\[0\]\.weight': expected a number",
        ),
    ],
)
def test_dr_tulu_errors(tmp_path, row, pattern):
    path = _write_jsonl(tmp_path / "rl.jsonl", [row])
    with pytest.raises(QueryFileError, match=pattern):
        read_dr_tulu(path)


# ---- plain files -------------------------------------------------------------------------------


def test_plain_jsonl(tmp_path):
    path = _write_jsonl(
        tmp_path / "mine.jsonl",
        [
            {
                "id": 7,
                "question": "Why is the sky blue?",
                "rubrics": [
                    {"title": "Rayleigh", "description": "Mentions Rayleigh scattering", "weight": 3},
                    {"criterion": "Claims the sky reflects the sea", "points": -2},
                ],
            },
            {"query": "Capital of France?", "answer": "Paris"},
            {"query_id": "custom-1", "prompt": [{"role": "user", "content": "Hi there?"}], "split": "eval"},
        ],
    )
    queries = read_queries(path)
    assert [q.query_id for q in queries] == ["jsonl-7", "jsonl-00001", "custom-1"]
    assert [q.kind for q in queries] == ["long_form", "short_form", "long_form"]
    assert queries[0].rubrics[1] == {
        "title": "Claims the sky reflects the sea",
        "description": "Claims the sky reflects the sea",
        "weight": 2.0,
        "polarity": "negative",
        "stage": "answer",
        "check": None,
    }
    assert queries[1].reference_answer == "Paris"
    assert queries[2].split == "eval" and queries[2].question == "Hi there?"
    assert [q.split for q in read_queries(path, split="eval")] == ["eval", "eval", "eval"]


def test_queries_parquet_export_reads_back_unchanged(tmp_path, shared_data):
    queries = read_queries(shared_file(shared_data, "healthbench/healthbench_oss_eval_sample30.jsonl"))
    path = tmp_path / "queries.parquet"
    pq.write_table(queries_to_table(queries), path)
    assert detect_format(path) == "parquet"
    assert read_queries(path) == queries


# ---- errors ------------------------------------------------------------------------------------


def test_error_cases_name_file_record_and_field(tmp_path):
    bad_json = tmp_path / "broken.jsonl"
    bad_json.write_text('{"question": "ok"}\n{"question": \n', encoding="utf-8")
    with pytest.raises(QueryFileError, match=r"broken\.jsonl: line 2: malformed JSON"):
        read_queries(bad_json)

    no_question = _write_jsonl(tmp_path / "noq.jsonl", [{"question": "a"}, {"id": 3, "answer": "x"}])
    with pytest.raises(QueryFileError, match=r"noq\.jsonl: line 2: field 'question\|query\|prompt': missing"):
        read_queries(no_question)

    dup = _write_jsonl(tmp_path / "dup.jsonl", [{"id": 1, "question": "a"}, {"id": 1, "question": "b"}])
    with pytest.raises(QueryFileError, match=r"line 2: duplicate query id 'jsonl-1' \(first at line 1\)"):
        read_queries(dup)

    health = _write_jsonl(
        tmp_path / "hb.jsonl",
        [
            {
                "prompt": [{"role": "user", "content": "q"}],
                "prompt_id": "p1",
                "rubrics": [
                    {"criterion": "c", "points": 3, "tags": []},
                    {"criterion": "d", "points": "many", "tags": []},
                ],
            }
        ],
    )
    with pytest.raises(QueryFileError, match=r"hb\.jsonl: line 1: field 'rubrics\[1\]\.points': expected a number"):
        read_queries(health, format="healthbench")

    bad_stage = _write_jsonl(tmp_path / "stage.jsonl", [{"question": "q", "rubrics": [{"title": "t", "stage": "x"}]}])
    with pytest.raises(QueryFileError, match=r"field 'rubrics\[0\]\.stage'"):
        read_queries(bad_stage)

    bad_split = _write_jsonl(tmp_path / "split.jsonl", [{"question": "q", "split": "dev"}])
    with pytest.raises(QueryFileError, match=r"line 1: field 'split'"):
        read_queries(bad_split)

    latin = tmp_path / "latin.jsonl"
    latin.write_bytes(b'{"question": "caf\xe9"}\n')
    with pytest.raises(QueryFileError, match=r"latin\.jsonl: line 1: not valid UTF-8"):
        read_queries(latin)

    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n", encoding="utf-8")
    with pytest.raises(QueryFileError, match="no queries found"):
        read_queries(empty)


def test_benchmark_specific_errors(tmp_path):
    csv_path = tmp_path / "simple.csv"
    csv_path.write_text("metadata,question\n{},What?\n", encoding="utf-8")
    with pytest.raises(QueryFileError, match=r"simple\.csv: line 1: field 'answer': missing column"):
        read_queries(csv_path)
    csv_path.write_text("metadata,problem,answer\n{},What?,\n", encoding="utf-8")
    with pytest.raises(QueryFileError, match=r"line 2: field 'answer': empty"):
        read_queries(csv_path)

    wiki = tmp_path / "wiki.json"
    wiki.write_text(
        json.dumps([{"_id": "a", "question": "q", "answer": ["x"]}, {"_id": "b", "question": "q2", "answer": []}])
    )
    assert detect_format(wiki) == "2wiki"
    with pytest.raises(QueryFileError, match=r"wiki\.json: record 1: field 'answer'"):
        read_queries(wiki)

    queries = _write_jsonl(
        tmp_path / "q.jsonl",
        [
            {"id": 1, "topic": "t", "language": "en", "prompt": "p1"},
            {"id": 2, "topic": "t", "language": "en", "prompt": "p2"},
        ],
    )
    criteria = _write_jsonl(
        tmp_path / "crit.jsonl",
        [
            {
                "id": 1,
                "prompt": "p1",
                "dimension_weight": {"insight": 0.5},
                "criterions": {"insight": [{"criterion": "c", "explanation": "e", "weight": 0.4}]},
            }
        ],
    )
    with pytest.raises(QueryFileError, match=r"crit\.jsonl: no criteria for query id '2'"):
        read_queries(queries)
    criteria.write_text(
        json.dumps(
            {
                "id": 1,
                "prompt": "p1",
                "dimension_weight": {},
                "criterions": {"insight": [{"criterion": "c", "weight": 0.4}]},
            }
        )
        + "\n"
    )
    with pytest.raises(QueryFileError, match=r"crit\.jsonl: line 1: field 'dimension_weight\.insight'"):
        read_deep_research_bench(queries, criteria_path=criteria)

    with pytest.raises(ValueError, match="unknown query format"):
        read_queries(queries, format="nope")
    with pytest.raises(QueryFileError, match="no such file"):
        read_queries(tmp_path / "missing.jsonl")


def test_query_validation():
    with pytest.raises(QueryValidationError, match="split"):
        Query(query_id="a", source="s", split="dev", kind="k", question="q", messages=[])
    with pytest.raises(QueryValidationError, match="polarity"):
        Query(
            query_id="a",
            source="s",
            split="eval",
            kind="k",
            question="q",
            messages=[],
            rubrics=[{"title": "t", "description": "d", "weight": 1, "polarity": "neutral", "stage": "answer"}],
        )
    q = Query(query_id="a", source="s", split="eval", kind="k", question="q", messages=[])
    with pytest.raises(QueryValidationError, match="duplicate query_id 'a'"):
        queries_to_table([q, q])
