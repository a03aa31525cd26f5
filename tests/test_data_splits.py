"""data.sft_split and data.rl_filter: SFT traces on their own queries apart from RL, RL on long-form only
(the paper: "the SFT stage includes both short-form and long-form data, while the RL stage exclusively
focuses on long-form queries")."""

from __future__ import annotations

from pathlib import Path

import pytest

from rubricem_core.config import load_config
from rubricem_core.run_config import Change, refused_changes
from rubricem_core.schemas import Query, queries_to_table
from rubricem_core.sim.world import WorldConfig, generate_world
from rubricem_core.splits import rl_queries, sft_queries
from rubricem_core.store import RunStore


def _query(qid: str, split: str, kind: str) -> Query:
    return Query(qid, "test", split, kind, f"question {qid}?", [{"role": "user", "content": f"question {qid}?"}])


QUERIES = [
    _query("long-train", "train", "long_form"),
    _query("short-train", "train", "short_form"),
    _query("syn-train", "train", "comparison"),  # a synthetic research question: long-form
    _query("short-sft", "sft", "short_form"),
    _query("long-sft", "sft", "long_form"),
    _query("held-out", "eval", "long_form"),
]
ROWS = [q.to_row() for q in QUERIES]


@pytest.mark.parametrize(
    "sft_split, expected",
    [
        ("train", ["long-train", "short-train", "syn-train"]),
        ("sft", ["short-sft", "long-sft"]),
        ("sft+train", ["long-train", "short-train", "syn-train", "short-sft", "long-sft"]),
    ],
)
def test_sft_split_picks_the_teachers_queries(sft_split, expected):
    assert [q["query_id"] for q in sft_queries(ROWS, sft_split)] == expected


@pytest.mark.parametrize(
    "rl_filter, expected",
    [("none", ["long-train", "short-train", "syn-train"]), ("long_form", ["long-train", "syn-train"])],
)
def test_rl_filter_keeps_long_form_train_queries_only(rl_filter, expected):
    assert [q["query_id"] for q in rl_queries(ROWS, rl_filter)] == expected


def test_empty_selections_name_the_setting():
    with pytest.raises(ValueError, match="data.sft_split='sft': no query has split sft"):
        sft_queries([r for r in ROWS if r["split"] != "sft"], "sft")
    with pytest.raises(ValueError, match="none left by data.rl_filter='long_form'"):
        rl_queries([r for r in ROWS if r["query_id"] == "short-train"], "long_form")


def test_the_rl_schedule_and_the_teacher_read_the_settings(tmp_path: Path):
    from flows.rl import rl_plans
    from tasks.collect import load_states

    store = RunStore(tmp_path / "run")
    store.write_table("queries", queries_to_table(QUERIES))
    cfg = load_config("tiny", {"data.rl_filter": "long_form", "data.sft_split": "sft", "rl.queries_per_step": 1})
    scheduled = {qid for plan in rl_plans(store, cfg) for qid in plan.query_ids}
    assert scheduled == {"long-train", "syn-train"}
    states = load_states(store, cfg, upto_round=-1)
    assert {s.query_id for s in states} == {"short-sft", "long-sft"}


def test_the_world_puts_a_share_of_its_non_eval_queries_in_sft_and_keeps_the_rest():
    base = WorldConfig(n_documents=200, n_queries=20, eval_fraction=0.2)
    plain = generate_world(base).queries
    mixed = generate_world(base.model_copy(update={"sft_fraction": 0.5})).queries
    assert [q.split for q in plain].count("sft") == 0
    assert [q.split for q in mixed].count("sft") == 8  # half of the 16 non-eval queries
    # the same queries, the same held-out set: only train queries moved to sft
    assert [(q.query_id, q.question) for q in plain] == [(q.query_id, q.question) for q in mixed]
    assert [q.split == "eval" for q in plain] == [q.split == "eval" for q in mixed]


def test_rl_filter_may_change_until_rl_has_sampled(tmp_path: Path):
    store = RunStore(tmp_path / "run")
    store.write_table("queries", queries_to_table(QUERIES))
    change = Change("data.rl_filter", "none", "long_form")
    assert refused_changes(store.run_dir, [change]) == []
    assert refused_changes(store.run_dir, [Change("data.sft_split", "train", "sft")])  # the teacher read it
    store.write_table("rollouts", [{"step": 0}], partition={"step": 0})
    assert refused_changes(store.run_dir, [change]) == [(change, "rl")]


# ---- the SFT sources' readers: hand-written records in their published shapes -------------------------
def _jsonl(path: Path, records: list[dict]) -> Path:
    import json

    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def test_searcharena_conversations_give_their_first_user_turn_and_intent_kind(tmp_path: Path):
    from rubricem_core.readers import detect_format, read_queries

    battle = {
        "question_id": "abc123",
        "model_a": "sonar-pro-high",
        "model_b": "gemini-2.5-pro-grounding",
        "winner": "model_a",
        "language": "English",
        "primary_intent": "Info Synthesis",
        "messages_a": [
            {"role": "user", "content": "Compare the 2024 EU and US AI rules for foundation models."},
            {"role": "assistant", "content": "The EU AI Act ..."},
            {"role": "user", "content": "And China?"},
        ],
        "messages_b": [{"role": "user", "content": "Compare the 2024 EU and US AI rules for foundation models."}],
    }
    lookup = {
        **battle,
        "question_id": "def456",
        "primary_intent": "Factual Lookup",
        "messages_a": [{"role": "user", "content": "Who won the 2025 Giro d'Italia?"}],
    }
    path = _jsonl(tmp_path / "search_arena.jsonl", [battle, lookup])
    assert detect_format(path) == "searcharena"
    queries = read_queries(path)
    assert [(q.query_id, q.split, q.kind, q.question) for q in queries] == [
        ("searcharena-abc123", "sft", "long_form", "Compare the 2024 EU and US AI rules for foundation models."),
        ("searcharena-def456", "sft", "short_form", "Who won the 2025 Giro d'Italia?"),
    ]
    assert queries[0].metadata == {"language": "English", "primary_intent": "Info Synthesis"}
    bad = _jsonl(tmp_path / "bad.jsonl", [{**battle, "messages_a": [{"role": "assistant", "content": "hi"}]}])
    with pytest.raises(ValueError, match=r"bad.jsonl: line 1: field 'messages_a': no non-empty user message"):
        read_queries(bad, format="searcharena")


def test_openscholar_questions_are_long_form_sft_queries(tmp_path: Path):
    from rubricem_core.readers import read_queries

    path = _jsonl(
        tmp_path / "queries.jsonl",
        [
            {"id": 7, "query": "What are the main approaches to retrieval-augmented LMs for scientific QA?"},
            {"question": "How do protein language models handle long-range contacts?"},
        ],
    )
    queries = read_queries(path, format="openscholar")
    assert [(q.query_id, q.split, q.kind, q.source) for q in queries] == [
        ("openscholar-7", "sft", "long_form", "openscholar"),
        ("openscholar-00001", "sft", "long_form", "openscholar"),
    ]
    with pytest.raises(ValueError, match=r"line 1: field 'query\|question\|input\|text': missing"):
        read_queries(_jsonl(tmp_path / "empty.jsonl", [{"id": 1}]), format="openscholar")
