"""ResearchQA, ResearchRubrics, WebWalkerQA and DeepSearchQA: readers of their published formats (hand-written
items under tests/data/benchmarks), their grading protocols through the benchmark grader (a fake
OpenAI-compatible server and the built-in offline grader), and eval.graders (a grader per benchmark)."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path
from typing import Any

import pytest

from rubricem_core.config import ConfigError, EvalConfig, load_config
from rubricem_core.eval.grading import summarize, ungraded_reason
from rubricem_core.eval.llm_grader import BenchmarkGrader
from rubricem_core.eval.prompts import ITEMS_PER_CALL, aggregate_answer_set
from rubricem_core.llm.types import EndpointSettings
from rubricem_core.readers import QueryFileError, detect_format, read_queries
from rubricem_core.sim.grader import register_builtin_grader
from rubricem_core.testing.openai_server import FakeOpenAIServer
from tests.llm_endpoints import API_KEY, make_settings

DATA = Path(__file__).parent / "data" / "benchmarks"
FILES = {
    "researchqa": DATA / "researchqa.json",
    "researchrubrics": DATA / "researchrubrics.jsonl",
    "webwalkerqa": DATA / "webwalkerqa.json",
    "deepsearchqa": DATA / "deepsearchqa.csv",
}


# ---- readers ------------------------------------------------------------------------------------


@pytest.mark.parametrize("benchmark", sorted(FILES))
def test_each_file_is_detected_and_read_with_its_benchmarks_ids(benchmark):
    path = FILES[benchmark]
    assert detect_format(path) == benchmark
    queries = read_queries(path)
    assert queries == read_queries(path, format=benchmark)
    assert len(queries) == 2 and all(q.source == benchmark and q.split == "eval" for q in queries)
    assert all(q.query_id.startswith(f"{benchmark}-") for q in queries)
    assert all(ungraded_reason(benchmark, q) is None for q in queries)


def test_researchqa_items_are_unweighted_with_their_type():
    first, second = read_queries(FILES["researchqa"])
    assert first.query_id == "researchqa-rqa-bio-0001" and first.question.startswith("How do CRISPR")
    assert [r["check"]["rubric_type"] for r in first.rubrics] == ["explanation", "citation", "limitation"]
    assert {r["weight"] for r in first.rubrics + second.rubrics} == {1.0}
    assert first.metadata == {
        "general_domain": "Life Sciences",
        "subdomain": "Biology",
        "field": "Molecular Biology",
        "date": "2023-05",
    }


def test_researchrubrics_keeps_signed_weights_and_axes():
    first, _ = read_queries(FILES["researchrubrics"])
    assert first.query_id == "researchrubrics-683a58c9a7e7fe4e7695846f"
    assert [r["check"]["points"] for r in first.rubrics] == [5.0, 4.0, 2.0, -4.0]
    assert [r["polarity"] for r in first.rubrics] == ["positive"] * 3 + ["negative"]
    assert first.rubrics[1]["check"]["axis"] == "Implicit Criteria"
    assert first.metadata["logical_nesting"] == "Intermediate"


def test_webwalkerqa_reads_both_key_spellings():
    upper, lower = read_queries(FILES["webwalkerqa"])
    assert (upper.reference_answer, lower.reference_answer) == ("March 21, 2025", "San Francisco")
    assert (
        upper.metadata["root_url"] == "https://2025.aclweb.org/" and upper.metadata["info_difficulty_level"] == "Easy"
    )
    assert lower.metadata["info_type"] == "multi_source"
    assert upper.kind == lower.kind == "short_form"


def test_deepsearchqa_keeps_the_answer_type():
    set_answer, single = read_queries(FILES["deepsearchqa"])
    assert set_answer.metadata["answer_type"] == "Set Answer" and set_answer.reference_answer == "Belgium, Luxembourg"
    assert single.metadata == {
        "answer_type": "Single Answer",
        "answer_aliases": ["2012"],
        "problem_category": "History",
    }


@pytest.mark.parametrize(
    "benchmark,name,text,pattern",
    [
        ("researchqa", "r.json", '[{"id": "a", "query": "q?", "rubric": []}]', r"record 0: field 'rubric'"),
        (
            "researchqa",
            "r.json",
            '[{"id": "a", "query": "q?", "rubric": [{"type": "x"}]}]',
            r"record 0: field 'rubric\[0\]\.rubric_item'",
        ),
        ("researchqa", "r.json", '[{"id": "a", "rubric": [{"rubric_item": "x"}]}]', r"record 0: field 'query'"),
        (
            "researchrubrics",
            "r.jsonl",
            '{"prompt": "p", "sample_id": "s", "rubrics": [{"criterion": "c"}]}\n',
            r"line 1: field 'rubrics\[0\]\.weight': missing",
        ),
        (
            "researchrubrics",
            "r.jsonl",
            '{"prompt": "p", "sample_id": "s", "rubrics": [{"criterion": "c", "weight": 1}]}\n'
            '{"prompt": "p", "sample_id": "t", "rubrics": [{"criterion": "c", "weight": "heavy"}]}\n',
            r"line 2: field 'rubrics\[0\]\.weight': expected a number",
        ),
        ("webwalkerqa", "w.json", '[{"Question": "q?", "Root_Url": "u"}]', r"record 0: field 'answer'"),
        (
            "deepsearchqa",
            "d.csv",
            "problem,problem_category,answer,answer_type\nq?,Geo,x,Many Answers\n",
            r"line 2: field 'answer_type': expected one of",
        ),
        (
            "deepsearchqa",
            "d.csv",
            "problem,problem_category,answer,answer_type\nq?,Geo,,Set Answer\n",
            r"line 2: field 'answer'",
        ),
    ],
)
def test_bad_files_name_file_line_and_field(tmp_path, benchmark, name, text, pattern):
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    with pytest.raises(QueryFileError, match=pattern) as info:
        read_queries(path, format=benchmark)
    assert str(path) in str(info.value)


# ---- grading protocols: a scripted grader model ----------------------------------------------------


def _user(body: dict[str, Any]) -> str:
    return next(m["content"] for m in body["messages"] if m["role"] == "user")


def _settings(server: FakeOpenAIServer) -> EndpointSettings:
    return make_settings(server, model="openai/grader-model", max_retries=0)


def coverage_grader(ratings: dict[str, int]) -> Any:
    """Rates each ResearchQA item by the first matching keyword of its text (else 1, Not at all)."""

    def reply(body: dict[str, Any]) -> str:
        items = [json.loads(line) for line in re.findall(r'^\{"criterion".*$', _user(body), flags=re.M)]
        scores = [next((v for k, v in ratings.items() if k in i["criterion"]), 1) for i in items]
        return json.dumps({"items": [{"id": i["id"], "justification": "x", "score": s} for i, s in zip(items, scores)]})

    return reply


def test_researchqa_coverage_is_the_mean_of_normalised_ratings():
    query = read_queries(FILES["researchqa"])[0]
    ratings = {"guide RNA": 5, "high-fidelity": 3, "limitation": 2}  # → 1, 0.5, 0.25
    with FakeOpenAIServer(coverage_grader(ratings), api_key=API_KEY) as server:
        [result] = BenchmarkGrader(_settings(server)).grade("researchqa", [(query, "an answer")])
        assert len(server.chat_calls) == 1 and "(rubric_coverage)" in _user(server.chat_calls[0])
    assert result.score == pytest.approx((1 + 0.5 + 0.25) / 3)
    assert result.details["item_coverage"] == [1.0, 0.5, 0.25]


def test_researchqa_rates_eight_items_per_call_and_one_failed_batch_fails_the_answer():
    query = read_queries(FILES["researchqa"])[0]
    many = [dict(query.rubrics[0], description=f"Does it say fact {n}?") for n in range(11)]
    big = dataclasses.replace(query, rubrics=many)
    with FakeOpenAIServer(coverage_grader({"fact": 5}), api_key=API_KEY) as server:
        [result] = BenchmarkGrader(_settings(server)).grade("researchqa", [(big, "text")])
        sizes = sorted(len(re.findall(r'^\{"criterion"', _user(b), flags=re.M)) for b in server.chat_calls)
    assert ITEMS_PER_CALL["rubric_coverage"] == 8 and sizes == [3, 8]
    assert result.score == 1.0 and result.details["calls"] == 2

    def half_broken(body: dict[str, Any]) -> str:
        if '"i9"' in _user(body):
            return "not json"
        return coverage_grader({"fact": 5})(body)

    with FakeOpenAIServer(half_broken, api_key=API_KEY) as server:
        [failed] = BenchmarkGrader(_settings(server)).grade("researchqa", [(big, "text")])
    assert failed.failed and failed.score is None and "1 of 2 grading calls failed" in failed.error


def criterion_grader(met: set[str]) -> Any:
    """ResearchRubrics criteria: Satisfied when a keyword of ``met`` occurs in the criterion's title."""

    def reply(body: dict[str, Any]) -> str:
        title = _user(body).split("<<<CRITERION>>>\nTitle: ", 1)[1].split("\n", 1)[0]
        verdict, score = ("Satisfied", 1.0) if any(k in title for k in met) else ("Not Satisfied", 0.0)
        return json.dumps(
            {
                "verdict": verdict,
                "score": score,
                "confidence": 0.9,
                "reasoning": "x",
                "evidence_quotes": [],
                "missing_elements": [],
            }
        )

    return reply


@pytest.mark.parametrize(
    "met,score,raw",
    [
        ({"energy density", "thermal", "price"}, 11 / 11, 11 / 11),
        ({"energy density", "thermal", "price", "cobalt"}, 7 / 11, 7 / 11),  # a negative criterion costs its weight
        ({"price"}, 2 / 11, 2 / 11),
        ({"cobalt"}, 0.0, -4 / 11),  # clipped to [0, 1], the compliance score itself in the details
    ],
)
def test_researchrubrics_is_one_call_per_criterion_with_its_compliance_score(met, score, raw):
    query = read_queries(FILES["researchrubrics"])[0]
    with FakeOpenAIServer(criterion_grader(met), api_key=API_KEY) as server:
        [result] = BenchmarkGrader(_settings(server)).grade("researchrubrics", [(query, "a report")])
        assert len(server.chat_calls) == 4  # whatever eval.healthbench_grading says
        assert all("\nCategory: " in _user(b) and "\nWeight: " in _user(b) for b in server.chat_calls)
    assert result.score == pytest.approx(score) and result.details["raw"] == pytest.approx(raw)
    assert result.details["grading"] == "per_criterion/binary"


# ---- the built-in offline grader (the offline profiles' grader) -------------------------------------


@pytest.fixture(scope="module")
def builtin() -> BenchmarkGrader:
    return BenchmarkGrader(EndpointSettings(model=register_builtin_grader(), max_retries=0))


def test_webwalkerqa_answer_check(builtin):
    first, second = read_queries(FILES["webwalkerqa"])
    results = builtin.grade(
        "webwalkerqa", [(first, "The deadline is March 21, 2025."), (second, "Mountain View"), (second, "")]
    )
    assert [r.score for r in results] == [1.0, 0.0, 0.0]
    # LangChain's cot_qa, WebWalkerQA's evaluator, knows CORRECT and INCORRECT only: no answer is incorrect
    assert [r.details["grade"] for r in results] == ["correct", "incorrect", "incorrect"]


@pytest.mark.parametrize(
    "response,score,outcome,precision,recall",
    [
        ("Belgium and Luxembourg", 1.0, "fully_correct", 1.0, 1.0),
        ("Luxembourg, Belgium, Switzerland", 0.0, "correct_with_extraneous", 2 / 3, 1.0),
        ("Belgium", 0.0, "partially_correct", 1.0, 0.5),
        ("Austria", 0.0, "fully_incorrect", 0.0, 0.0),
    ],
)
def test_deepsearchqa_set_answers(builtin, response, score, outcome, precision, recall):
    set_answer = read_queries(FILES["deepsearchqa"])[0]
    [result] = builtin.grade("deepsearchqa", [(set_answer, response)])
    assert result.score == score and result.details["outcome"] == outcome
    assert (result.details["precision"], result.details["recall"]) == (pytest.approx(precision), pytest.approx(recall))


def test_deepsearchqa_single_answer_and_summary(builtin):
    set_answer, single = read_queries(FILES["deepsearchqa"])
    results = builtin.grade("deepsearchqa", [(single, "He died in 2012."), (single, "1999"), (set_answer, "Belgium")])
    assert [r.score for r in results] == [1.0, 0.0, 0.0]
    rows = [
        {
            "query_id": q,
            "score": r.score,
            "grade_failed": False,
            "details": r.details_json(),
            "valid_scaffold": True,
            "finish_reason": "answered",
            "n_tool_calls": 1,
            "guidance": None,
        }
        for q, r in zip("abc", results)
    ]
    summary = summarize(rows)
    assert summary["score_mean"] == pytest.approx(1 / 3) and summary["fully_correct_rate"] == pytest.approx(1 / 3)
    assert summary["f1_mean"] == pytest.approx((1 + 0 + 2 / 3) / 3)


@pytest.mark.parametrize(
    "parts,excessive,expected",
    [
        ([("a", True), ("b", True)], [], (1.0, "fully_correct", 1.0)),
        ([("a", True), ("b", True)], ["c", "d"], (0.0, "correct_with_extraneous", 2 * 0.5 * 1 / 1.5)),
        ([("a", True), ("b", False)], ["c"], (0.0, "partially_correct", 0.5)),
        ([("a", False)], [], (0.0, "fully_incorrect", 0.0)),
    ],
)
def test_answer_set_metrics(parts, excessive, expected):
    score, details = aggregate_answer_set(parts, excessive)
    assert (score, details["outcome"], details["f1"]) == (expected[0], expected[1], pytest.approx(expected[2]))


def test_builtin_research_coverage_and_compliance_move_with_the_answer(builtin):
    rqa = read_queries(FILES["researchqa"])[1]
    rr = read_queries(FILES["researchrubrics"])[1]
    good = "LoRA trains low-rank update matrices while the base weights stay frozen; its memory use is far below full fine-tuning."
    coverage = [r.score for r in builtin.grade("researchqa", [(rqa, good), (rqa, "No idea.")])]
    compliance = [
        r.score
        for r in builtin.grade(
            "researchrubrics",
            [(rr, "The United Kingdom pilot of 2022: most companies kept the four-day week."), (rr, "Nothing.")],
        )
    ]
    assert coverage[0] > coverage[1] == 0.0 and compliance[0] > compliance[1] == 0.0


# ---- eval.graders ---------------------------------------------------------------------------------


def test_graders_inherit_eval_grader_and_refuse_unknown_benchmarks():
    cfg = EvalConfig.model_validate(
        {
            "grader": {"model": "openai/gpt-4.1-mini", "api_key_env": "OPENAI_API_KEY", "timeout_s": 300},
            "graders": {"deep_research_bench": {"model": "gemini/gemini-2.5-pro", "api_key_env": "GEMINI_API_KEY"}},
        }
    )
    drb = cfg.grader_for("deep_research_bench")
    assert (drb.model, drb.api_key_env, drb.timeout_s) == ("gemini/gemini-2.5-pro", "GEMINI_API_KEY", 300)
    assert cfg.grader_for("researchqa") is cfg.grader
    assert EvalConfig.model_validate(cfg.model_dump()) == cfg  # a saved config reads back the same
    with pytest.raises(ValueError, match=r"unknown benchmarks \['nope'\]; choose from \['healthbench'"):
        EvalConfig.model_validate({"graders": {"nope": {"model": "x"}}})
    with pytest.raises(ValueError, match="synthetic"):
        EvalConfig.model_validate({"graders": {"synthetic": {}}})


@pytest.mark.parametrize(
    "entry,benchmark,protocol",
    [
        ({}, "deep_research_bench", "absolute"),
        ({"protocol": "race"}, "deep_research_bench", "race"),
        ({"protocol": "joint"}, "healthbench", "joint"),
        ({}, "researchqa", None),
    ],
)
def test_a_graders_protocol_overrides_the_eval_switch(entry, benchmark, protocol):
    cfg = EvalConfig.model_validate({"graders": {benchmark: entry}})
    assert cfg.protocol_for(benchmark) == protocol


@pytest.mark.parametrize(
    "entry,pattern",
    [
        ({"researchqa": {"protocol": "batched"}}, "researchqa has one grading protocol"),
        ({"deep_research_bench": {"protocol": "joint"}}, r"must be one of \['absolute', 'race'\]"),
    ],
)
def test_bad_protocols_are_refused(entry, pattern):
    with pytest.raises(ValueError, match=pattern):
        EvalConfig.model_validate({"graders": entry})


def test_research_profile_names_the_papers_grader_families():
    cfg = load_config("research")
    assert cfg.eval.benchmarks == ["healthbench", "researchqa", "deep_research_bench", "researchrubrics"]
    models = {b: cfg.eval.grader_for(b).model for b in cfg.eval.benchmarks}
    assert models["healthbench"].startswith("openai/gpt-4.1") and models["researchqa"].startswith("openai/gpt-4.1")
    assert (
        models["deep_research_bench"].startswith("gemini/") and cfg.eval.protocol_for("deep_research_bench") == "race"
    )
    assert cfg.eval.grader_for("deep_research_bench").api_key_env == "GEMINI_API_KEY"
    assert all(cfg.eval.grader_for(b).api_key_env for b in cfg.eval.benchmarks)
    with pytest.raises(ConfigError):
        load_config("research", {"eval.graders.unknown_bench.model": "x"})


def test_each_benchmark_is_graded_by_its_own_grader():
    from tasks.evaluate import _grader

    cfg = load_config(
        "tiny",
        {"eval.graders": {"deep_research_bench": {"max_concurrency": 3, "max_tokens": 999, "protocol": "race"}}},
    )
    drb, other = _grader(cfg, "deep_research_bench"), _grader(cfg, "researchqa")
    assert (drb.settings.max_concurrency, drb.options.max_tokens) == (3, 999) and drb.needs_reference(
        "deep_research_bench"
    )
    assert other.settings.max_concurrency == cfg.eval.grader.max_concurrency != 3
    assert other.options.max_tokens == cfg.eval.grader.max_tokens and not other.needs_reference("deep_research_bench")
