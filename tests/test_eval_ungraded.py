"""Held-out queries the benchmark cannot grade (no rubric items, no gold answer; issue #21): they are
found before sampling, recorded in eval_results with score NULL and the reason, and left out of the
summary's means (counted in n_ungraded); a benchmark with nothing gradable fails with a clear error."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest

from rubricem_core.eval import run as eval_run
from rubricem_core.eval.grading import summarize, ungraded_reason
from rubricem_core.eval.llm_grader import BenchmarkGrader
from rubricem_core.eval.queries import load_benchmark_queries
from rubricem_core.eval.run import EVAL_RESULTS_SCHEMA, EvalOptions, run_eval
from rubricem_core.eval.types import EvalError, EvalSample
from rubricem_core.llm.types import EndpointSettings
from rubricem_core.rollout.types import ANSWERED
from rubricem_core.schemas import Query
from rubricem_core.sim.grader import register_builtin_grader

PROPERTIES = [
    {"name": "rag", "criterion": "Mentions retrieval-augmented generation", "weight": 2, "evidence": []},
    {"name": "bench", "criterion": "Discusses evaluation benchmarks", "weight": 1, "evidence": []},
]


def scholarqa_file(tmp_path: Path, with_properties: list[bool]) -> Path:
    """A user's ScholarQA-CS-style file; cases marked False have no rubric properties."""
    cases = [
        {
            "case_id": f"c{i}",
            "initial_prompt": f"Question {i} about RAG?",
            "metric_config": {"name": "rubric", "config": {"other_properties": PROPERTIES if has else []}},
        }
        for i, has in enumerate(with_properties)
    ]
    path = tmp_path / "mine.json"
    path.write_text(json.dumps(cases), encoding="utf-8")
    return path


ANSWER = "Retrieval-augmented generation is discussed, and evaluation benchmarks are covered."


@pytest.fixture
def sampled(monkeypatch) -> list[list[str]]:
    """Replaces the policy: records which queries were sampled, answers every one with ANSWER."""
    calls: list[list[str]] = []

    def sample(engine, tokenizer, queries, env, options, guidance=None):
        calls.append([q.query_id for q in queries])
        return [
            [
                EvalSample(q.query_id, i, f"<answer>{ANSWER}</answer>", ANSWER, 1, ANSWERED, 12)
                for i in range(options.samples_per_query)
            ]
            for q in queries
        ]

    monkeypatch.setattr(eval_run, "sample_queries", sample)
    return calls


@pytest.fixture(scope="module")
def grader() -> BenchmarkGrader:
    return BenchmarkGrader(EndpointSettings(model=register_builtin_grader(), max_concurrency=2, max_retries=0))


def evaluate(benchmark: str, queries: list[Query], grader: Any = None, samples: int = 2):
    return run_eval(None, None, benchmark, queries, None, EvalOptions(samples_per_query=samples), "ck", grader)


def test_queries_without_rubrics_are_recorded_not_sampled(tmp_path, sampled, grader):
    queries = load_benchmark_queries("scholarqa_cs", scholarqa_file(tmp_path, [True, False, True]), 10)
    outcome = evaluate("scholarqa_cs", queries, grader)
    assert sampled == [["scholarqa_cs-c0", "scholarqa_cs-c2"]]  # no generation spent on c1
    rows = outcome.rows
    assert [r["query_id"] for r in rows] == ["scholarqa_cs-c0"] * 2 + ["scholarqa_cs-c1"] + ["scholarqa_cs-c2"] * 2
    graded = [r for r in rows if r["query_id"] != "scholarqa_cs-c1"]
    assert all(r["score"] is not None and 0 < r["score"] <= 1 and not r["grade_failed"] for r in graded)
    [missing] = [r for r in rows if r["query_id"] == "scholarqa_cs-c1"]
    assert missing["score"] is None and missing["grade_failed"] and missing["sample"] is None
    assert missing["error"].startswith("no_rubrics: ") and "scholarqa_cs-c1" in missing["error"]
    assert json.loads(missing["details"])["ungraded"] == "no_rubrics"
    assert missing["text"] is None and missing["valid_scaffold"] is None

    s = outcome.summary
    assert s["score_mean"] == pytest.approx(sum(r["score"] for r in graded) / 4)
    assert (s["n_samples"], s["n_queries"], s["grade_failed"]) == (4, 2, 0)
    assert (s["n_ungraded"], s["n_no_rubrics"], s["n_no_gold_answer"]) == (1, 1, 0)
    assert s["answered_rate"] == 1.0 and s["grader/score_calls"] == 4  # over sampled rows only

    # the rows as a cached Parquet part read them back give the same summary
    table = pa.Table.from_pylist([{**r, "settings": "x"} for r in rows], schema=EVAL_RESULTS_SCHEMA)
    again = summarize(table.to_pylist())
    assert again == {k: v for k, v in s.items() if not k.startswith("grader/")}


def test_a_benchmark_with_nothing_to_grade_fails_before_sampling(tmp_path, sampled, grader):
    queries = load_benchmark_queries("scholarqa_cs", scholarqa_file(tmp_path, [False, False]), 10)
    with pytest.raises(EvalError, match=r"'scholarqa_cs'.*none of its 2 queries can be graded \(2 no_rubrics"):
        evaluate("scholarqa_cs", queries, grader)
    assert sampled == []


def query(query_id: str, source: str, kind: str = "long_form", rubrics: list | None = None, **kw: Any) -> Query:
    return Query(
        query_id=query_id,
        source=source,
        split="eval",
        kind=kind,
        question="Q?",
        messages=[{"role": "user", "content": "Q?"}],
        rubrics=rubrics or [],
        **kw,
    )


def test_short_form_without_a_gold_answer_is_recorded(sampled, grader):
    queries = [query("a", "simpleqa", "short_form", reference_answer="Paris"), query("b", "simpleqa", "short_form")]
    outcome = evaluate("simpleqa", queries, grader, samples=1)
    assert sampled == [["a"]]
    assert [(r["query_id"], r["score"] is None) for r in outcome.rows] == [("a", False), ("b", True)]
    assert outcome.rows[1]["error"].startswith("no_gold_answer: ")
    assert outcome.summary["n_no_gold_answer"] == 1 and outcome.summary["n_ungraded"] == 1


def test_synthetic_queries_without_rubrics_fail_clearly(sampled):
    with pytest.raises(EvalError, match=r"'synthetic'.*1 no_rubrics.*persistent rubrics"):
        evaluate("synthetic", [query("s0", "synthetic")])
    assert sampled == []


def test_malformed_rubrics_still_fail_but_before_sampling(sampled, grader):
    bad = {"title": "", "description": "", "weight": 1.0, "polarity": "positive", "stage": "answer", "check": None}
    good = query("g", "scholarqa_cs", rubrics=[{**bad, "description": "Mentions RAG"}])
    with pytest.raises(EvalError, match=r"'scholarqa_cs' query 'm'.*no criterion text"):
        evaluate("scholarqa_cs", [good, query("m", "scholarqa_cs", rubrics=[bad])], grader)
    negative_only = query(
        "n",
        "healthbench",
        rubrics=[
            {
                **bad,
                "description": "Harmful advice",
                "polarity": "negative",
                "check": {"type": "benchmark", "points": -3},
            }
        ],
    )
    with pytest.raises(EvalError, match=r"query 'n'.*positive points"):
        ungraded_reason("healthbench", negative_only)
    assert sampled == []


def test_summary_of_a_part_with_only_old_style_rows_is_unchanged():
    rows = [
        {
            "query_id": "q",
            "score": 0.5,
            "grade_failed": False,
            "details": "{}",
            "valid_scaffold": True,
            "finish_reason": ANSWERED,
            "n_tool_calls": 1,
            "guidance": None,
        },
        {
            "query_id": "q",
            "score": None,
            "grade_failed": True,
            "details": '{"grader": "m"}',
            "valid_scaffold": False,
            "finish_reason": ANSWERED,
            "n_tool_calls": 0,
            "guidance": None,
        },
    ]
    s = summarize(rows)
    assert (s["score_mean"], s["n_samples"], s["grade_failed"], s["n_ungraded"]) == (0.5, 2, 1, 0)
    assert math.isclose(s["valid_scaffold_rate"], 0.5)


def _graded(details: dict, score: float) -> dict:
    return {
        "query_id": f"q{id(details)}",
        "score": score,
        "grade_failed": False,
        "details": json.dumps(details),
        "valid_scaffold": True,
        "finish_reason": ANSWERED,
        "n_tool_calls": 1,
        "guidance": None,
    }


def test_simple_evals_aggregates_worked_by_hand():
    # SimpleQA: 3 correct, 1 incorrect, 1 not attempted → correct 3/5, given attempted 3/4, F = 2·.75·.6/1.35
    grades = ["correct", "correct", "correct", "incorrect", "not_attempted"]
    s = summarize([_graded({"grade": g}, float(g == "correct")) for g in grades])
    assert math.isclose(s["correct_rate"], 0.6) and math.isclose(s["accuracy_given_attempted"], 0.75)
    assert math.isclose(s["f_score"], 2 * 0.75 * 0.6 / 1.35)
    none = summarize([_graded({"grade": "not_attempted"}, 0.0)])
    assert none["accuracy_given_attempted"] == 0.0 and none["f_score"] == 0.0
    # HealthBench: examples scored -0.5 and 0.9 (raw) → per-example clipped mean (0 + 0.9) / 2 = 0.45, while
    # simple-evals clips the mean: (-0.5 + 0.9) / 2 = 0.2
    examples = [(-0.5, 0.0), (0.9, 0.9)]
    hb = summarize(
        [
            _graded({"achieved_points": raw * 10, "positive_points": 10, "raw": raw}, clipped)
            for raw, clipped in examples
        ]
    )
    assert math.isclose(hb["score_mean"], 0.45) and math.isclose(hb["score_mean_clipped_mean"], 0.2)
