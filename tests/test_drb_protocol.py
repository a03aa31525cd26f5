"""DeepResearchBench graded as its release does before RACE (issue #46, item 3): each target article
cleaned of its citations by the grader model, and both the cleaning and the RACE prompts in the task's
language (zh for the Chinese half of the benchmark). Real tasks and reference reports from the shared data;
the grader is an OpenAI-compatible endpoint on 127.0.0.1."""

from __future__ import annotations

import dataclasses
import json
import re
from typing import Any

import pytest

from rubricem_core.eval.drb import split_for_cleaning, task_language
from rubricem_core.eval.llm_grader import BenchmarkGrader, GraderOptions
from rubricem_core.eval.prompts import grader_prompt
from rubricem_core.eval.queries import load_benchmark_queries
from rubricem_core.eval.types import EvalError
from rubricem_core.llm.types import EndpointSettings
from rubricem_core.readers import DRB_REFERENCE_KEY
from rubricem_core.sim import grader as builtin_grader
from rubricem_core.testing.openai_server import FakeOpenAIServer
from tests.conftest import shared_file

API_KEY = "sk-test-drb"
QUERIES = "deep_research_bench/prompt_data_query.jsonl"
REFERENCES = "deep_research_bench/test_data_cleaned_data_claude-3-7-sonnet-latest.jsonl"


@pytest.fixture(scope="module")
def drb(shared_data) -> dict[str, Any]:
    queries = load_benchmark_queries(
        "deep_research_bench",
        shared_file(shared_data, QUERIES),
        100,
        reference_path=shared_file(shared_data, REFERENCES),
    )
    return {lang: next(q for q in queries if q.metadata.get("language") == lang) for lang in ("zh", "en")}


def _user(body: dict[str, Any]) -> str:
    return next(m["content"] for m in body["messages"] if m["role"] == "user")


def _system(body: dict[str, Any]) -> str:
    return next(m["content"] for m in body["messages"] if m["role"] == "system")


def _kind(body: dict[str, Any]) -> str:
    return _user(body).split("\n", 1)[0].rsplit("(", 1)[1].split(")", 1)[0]


def _grader(server: FakeOpenAIServer, **options: Any) -> BenchmarkGrader:
    settings = EndpointSettings(
        model="openai/grader-model", api_base=server.base_url, api_key=API_KEY, timeout_s=5.0, max_retries=0
    )
    return BenchmarkGrader(settings, GraderOptions(drb_grading="race", **options))


def served(body: dict[str, Any]) -> str:
    return builtin_grader.respond(body["messages"], body)


def with_citations(article: str) -> str:
    """A report as a policy writes it: markers after its sentences and a reference list at the end."""
    marked = re.sub(r"([.。])(\s)", r"\1 [3]\2", article, count=5)
    return f"{marked}\n\nReferences\n[3] A source. https://example.org/source"


@pytest.mark.parametrize("language", ["zh", "en"])
def test_the_cleaning_and_race_prompts_are_in_the_tasks_language(drb, language):
    task = drb[language]
    assert task_language(task) == language
    report = with_citations(task.metadata[DRB_REFERENCE_KEY])
    with FakeOpenAIServer(served, api_key=API_KEY) as server:
        [result] = _grader(server).grade("deep_research_bench", [(task, report)])
        clean, race = server.chat_calls
    assert (_kind(clean), _kind(race)) == ("article_clean", "dimension_race")
    assert _system(clean).split("\n", 1)[0] == grader_prompt(f"drb_clean_{language}").split("\n", 1)[0]
    assert _system(race).split("\n", 1)[0] == grader_prompt(f"race_{language}").split("\n", 1)[0]
    target = _user(race).split("<<<ARTICLE 1>>>\n", 1)[1].split("\n\n<<<ARTICLE 2>>>", 1)[0]
    assert "[3]" not in target and "References" not in target and "example.org" not in target
    assert not result.failed and result.details["article_chars"]["cleaned"] < len(report)
    if language == "en":  # the cleaned report is the reference again: RACE scores the two the same (the
        assert result.score == pytest.approx(0.5, abs=0.02)  # built-in's word matching does not read Chinese)


def test_a_long_article_is_cleaned_in_pieces_cut_at_sentence_ends(drb):
    task = drb["en"]
    report = with_citations(task.metadata[DRB_REFERENCE_KEY])
    pieces = split_for_cleaning(report, len(report) // 3)
    assert len(pieces) >= 3 and "".join(pieces) == report
    assert all(re.search(r"[.?!。？！\n]$", p) for p in pieces[:-1])  # each cut after a sentence end
    with FakeOpenAIServer(served, api_key=API_KEY) as server:
        [result] = _grader(server, drb_clean_max_chars=len(report) // 3).grade("deep_research_bench", [(task, report)])
        kinds = [_kind(b) for b in server.chat_calls]
    assert kinds.count("article_clean") == len(pieces) and kinds.count("dimension_race") == 1
    assert not result.failed


def test_a_cleaning_that_loses_the_article_fails_the_grade_not_scores_it(drb):
    def truncating(body: dict[str, Any]) -> str:
        if _kind(body) == "article_clean":
            return json.dumps({"article": "Cleaned."})  # far shorter than the submitted report
        return served(body)

    task = drb["en"]
    with FakeOpenAIServer(truncating, api_key=API_KEY) as server:
        [result] = _grader(server).grade("deep_research_bench", [(task, task.metadata[DRB_REFERENCE_KEY])])
        kinds = [_kind(b) for b in server.chat_calls]
    assert kinds == ["article_clean", "article_clean"]  # first try and its repair; no RACE call
    assert result.failed and "cleaning the article failed" in result.error and "at least 100" in result.error


def test_a_short_answer_is_cleaned_against_half_its_length(drb):
    task = drb["en"]
    with FakeOpenAIServer(served, api_key=API_KEY) as server:
        [result] = _grader(server).grade("deep_research_bench", [(task, "Prices fell [1] in 2023.")])
    assert not result.failed and result.details["article_chars"] == {"submitted": 24, "cleaned": 20}


def test_split_for_cleaning_worked_by_hand():
    article = ("a" * 299 + ".") + ("b" * 300) + ("c" * 400)  # 1000 characters, one sentence end at 300
    assert split_for_cleaning(article, 1000) == [article]
    first, second = split_for_cleaning(article, 900)  # middle 500; no end in 300..500: cut at the middle
    assert (len(first), len(second)) == (500, 500)
    article = "x" * 350 + "." + "y" * 649  # an end at 351, within 200 before the middle (500)
    assert [len(p) for p in split_for_cleaning(article, 900)] == [351, 649]
    with pytest.raises(EvalError, match="at least 400"):
        split_for_cleaning(article, 100)


def test_task_language_defaults_to_english(drb):
    task = dataclasses.replace(drb["en"], metadata={})
    assert task_language(task) == "en"
