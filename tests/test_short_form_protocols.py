"""Each short-answer benchmark graded by its own protocol (issue #46, item 3): SimpleQA by simple-evals'
rules, 2Wiki by DR Tulu's answer-equivalence judge with the release's exact match and F1 beside it,
WebWalkerQA by LangChain's cot_qa with the root URL given to the policy. Worked examples from the shared
data (a gold answer graded correct, another query's gold incorrect) go through an OpenAI-compatible
endpoint on 127.0.0.1 whose model is the built-in grader reading each protocol's prompt."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from rubricem_core.eval.grading import summarize
from rubricem_core.eval.llm_grader import BenchmarkGrader
from rubricem_core.eval.prompts import grader_prompt
from rubricem_core.eval.short_form import PROTOCOLS, answer_em_f1, normalize_2wiki, protocol_of
from rubricem_core.eval.types import EvalError, GradeResult
from rubricem_core.llm.types import EndpointSettings
from rubricem_core.readers import read_queries
from rubricem_core.sim import grader as builtin_grader
from rubricem_core.testing.openai_server import FakeOpenAIServer
from tests.conftest import shared_file

API_KEY = "sk-test-short-form"
WEBWALKER = Path(__file__).parent / "data" / "benchmarks" / "webwalkerqa.json"
SHARED = {"simpleqa": "simpleqa/simple_qa_test_set.csv", "2wiki": "2wiki/2wiki_dev_trustmargin.json"}
# the prompt section that carries the gold answer in each protocol
GOLD_SECTION = {"simpleqa": "<<<GOLD TARGET>>>", "2wiki": "<<<CORRECT ANSWER>>>", "webwalkerqa": "<<<CONTEXT>>>"}


def _served_grader(body: dict[str, Any]) -> str:
    return builtin_grader.respond(body["messages"], body)


def _settings(server: FakeOpenAIServer) -> EndpointSettings:
    return EndpointSettings(
        model="openai/grader-model", api_base=server.base_url, api_key=API_KEY, timeout_s=5.0, max_retries=0
    )


def _queries(benchmark: str, shared_data: Path) -> list[Any]:
    path = WEBWALKER if benchmark == "webwalkerqa" else shared_file(shared_data, SHARED[benchmark])
    return read_queries(path)[:6]


@pytest.mark.parametrize("benchmark", sorted(PROTOCOLS))
def test_a_gold_answer_is_correct_and_another_querys_is_not(benchmark, request):
    shared_data = request.getfixturevalue("shared_data") if benchmark != "webwalkerqa" else Path("/nonexistent")
    queries = _queries(benchmark, shared_data)
    right = [(q, f"After checking the sources, the answer is {q.reference_answer}.") for q in queries]
    wrong = [(q, f"The answer is {other.reference_answer}.") for q, other in zip(queries, queries[1:] + queries[:1])]
    with FakeOpenAIServer(_served_grader, api_key=API_KEY) as server:
        results = BenchmarkGrader(_settings(server)).grade(benchmark, right + wrong)
        bodies = list(server.chat_calls)
    kind, prompt, _ = protocol_of(benchmark)
    assert len(bodies) == len(right + wrong)
    for body in bodies:
        system = next(m["content"] for m in body["messages"] if m["role"] == "system")
        user = next(m["content"] for m in body["messages"] if m["role"] == "user")
        assert system.split("\n", 1)[0] == grader_prompt(prompt).split("\n", 1)[0]  # the benchmark's own rules
        assert f"({kind})" in user.split("\n", 1)[0] and GOLD_SECTION[benchmark] in user
    assert [r.details["grade"] for r in results] == ["correct"] * len(right) + ["incorrect"] * len(wrong)
    assert [r.score for r in results] == [1.0] * len(right) + [0.0] * len(wrong)


def test_2wiki_reports_the_releases_exact_match_and_f1_of_the_extracted_answer(shared_data):
    queries = _queries("2wiki", shared_data)
    first = queries[0]  # "Who is the mother of the director of film Polish-Russian War (Film)?" → Małgorzata Braunek
    pairs = [(first, f"It is {first.reference_answer}."), (first, "It is Anna Braunek."), (first, "")]
    with FakeOpenAIServer(_served_grader, api_key=API_KEY) as server:
        results = BenchmarkGrader(_settings(server)).grade("2wiki", pairs)
    right, partial, empty = (r.details for r in results)
    assert right["extracted_final_answer"] == first.reference_answer
    assert (right["answer_em"], right["answer_f1"]) == (1.0, 1.0)
    assert partial["grade"] == "incorrect" and partial["answer_em"] == 0.0
    assert partial["answer_f1"] == pytest.approx(answer_em_f1("It is Anna Braunek.", [first.reference_answer])[1])
    assert empty["grade"] == "not_attempted" and empty["extracted_final_answer"] is None
    rows = [
        {
            "query_id": "q",
            "score": r.score,
            "grade_failed": False,
            "details": json.dumps(r.details),
            "valid_scaffold": True,
            "finish_reason": "answered",
            "n_tool_calls": 1,
            "guidance": None,
        }
        for r in results
    ]
    summary = summarize(rows)
    assert summary["answer_em_mean"] == pytest.approx(1 / 3)
    assert summary["correct_rate"] == pytest.approx(1 / 3) and summary["not_attempted_rate"] == pytest.approx(1 / 3)


@pytest.mark.parametrize(
    "prediction,golds,em,f1",
    [
        ("The Mask of Fu Manchu", ["Mask of Fu Manchu"], 1.0, 1.0),  # articles and case dropped
        ("Fu Manchu", ["Mask of Fu Manchu"], 0.0, 2 * 1.0 * 0.5 / 1.5),  # P = 2/2, R = 2/4 (no "of" dropped)
        ("Fu Manchu", ["Manchu", "Fu Manchu!"], 1.0, 1.0),  # the best over the aliases
        ("yes", ["no"], 0.0, 0.0),
        ("no, it did not", ["no"], 0.0, 0.0),  # a yes/no gold: anything but exactly "no" scores 0, overlap or not
        ("12 June 1516", ["12 June 1516"], 1.0, 1.0),
    ],
)
def test_2wiki_answer_metrics_worked_by_hand(prediction, golds, em, f1):
    got_em, got_f1 = answer_em_f1(prediction, golds)
    assert got_em == em
    assert got_f1 == pytest.approx(f1)


def test_2wiki_normalization_is_the_releases():
    assert normalize_2wiki("The  U.S.A., an Example!") == "usa example"


def test_webwalkerqa_policy_gets_the_root_url_and_the_grader_the_bare_question():
    first = read_queries(WEBWALKER)[0]
    assert first.question.endswith("\nOfficial website: https://2025.aclweb.org/")
    assert first.messages[0]["content"] == first.question
    with FakeOpenAIServer(_served_grader, api_key=API_KEY) as server:
        BenchmarkGrader(_settings(server)).grade("webwalkerqa", [(first, "March 21, 2025")])
        [body] = server.chat_calls
    user = next(m["content"] for m in body["messages"] if m["role"] == "user")
    question = user.split("<<<QUESTION>>>\n", 1)[1].split("\n\n<<<", 1)[0]
    assert question == "When is the paper submission deadline for the ACL 2025 Industry Track?"


def test_a_short_form_benchmark_without_a_protocol_is_refused():
    with pytest.raises(EvalError, match="no short-answer grading protocol"):
        protocol_of("healthbench")


def test_a_grade_off_the_protocols_schema_is_repaired_not_scored(shared_data):
    """A cot_qa reply with simple-evals' grade word is off WebWalkerQA's schema: the repair turn fixes it."""
    calls = []

    def sloppy_then_right(body: dict[str, Any]) -> str:
        calls.append(body)
        if len(calls) == 1:
            return json.dumps({"explanation": "It matches.", "grade": "correct"})
        return json.dumps({"explanation": "It matches the context.", "grade": "CORRECT"})

    first = read_queries(WEBWALKER)[0]
    with FakeOpenAIServer(sloppy_then_right, api_key=API_KEY) as server:
        [result] = BenchmarkGrader(_settings(server)).grade("webwalkerqa", [(first, "March 21, 2025")])
    assert isinstance(result, GradeResult) and result.score == 1.0 and len(calls) == 2
