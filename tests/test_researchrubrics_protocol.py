"""ResearchRubrics graded as its release does (issue #46, item 3): one verdict call per rubric with the
release's reply fields, binary or ternary (Partially Satisfied 0.5), and reports longer than the grader's
context read in chunks whose evidence feeds one synthesis call per rubric. A scripted grader on 127.0.0.1."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from rubricem_core.config import ConfigError, load_config
from rubricem_core.eval.criteria import split_report
from rubricem_core.eval.llm_grader import BenchmarkGrader, GraderOptions
from rubricem_core.eval.types import EvalError
from rubricem_core.llm.types import EndpointSettings
from rubricem_core.readers import read_queries
from rubricem_core.sim.grader import register_builtin_grader
from rubricem_core.testing.openai_server import FakeOpenAIServer

API_KEY = "sk-test-researchrubrics"
QUERY = read_queries(Path(__file__).parent / "data" / "benchmarks" / "researchrubrics.jsonl")[0]
# the query's rubrics: energy density (+5), thermal runaway (+4), price range (+2), contains cobalt (-4)


def _user(body: dict[str, Any]) -> str:
    return next(m["content"] for m in body["messages"] if m["role"] == "user")


def _system(body: dict[str, Any]) -> str:
    return next(m["content"] for m in body["messages"] if m["role"] == "system")


def _title(body: dict[str, Any]) -> str:
    return _user(body).split("<<<CRITERION>>>\nTitle: ", 1)[1].split("\n", 1)[0]


def _verdict(verdict: str, score: float) -> str:
    reply = {"verdict": verdict, "score": score, "confidence": 0.8, "reasoning": "r"}
    return json.dumps({**reply, "evidence_quotes": ["q"], "missing_elements": []})


VERDICTS = {"energy density": ("Satisfied", 1.0), "thermal": ("Partially Satisfied", 0.5), "cobalt": ("Satisfied", 1.0)}


def by_keyword(body: dict[str, Any]) -> str:
    title = _title(body)
    return _verdict(*next((v for k, v in VERDICTS.items() if k in title), ("Not Satisfied", 0.0)))


def _grader(server: FakeOpenAIServer, **options: Any) -> BenchmarkGrader:
    settings = EndpointSettings(
        model="openai/grader-model", api_base=server.base_url, api_key=API_KEY, timeout_s=5.0, max_retries=0
    )
    return BenchmarkGrader(settings, GraderOptions(**options))


def test_ternary_worked_by_hand():
    with FakeOpenAIServer(by_keyword, api_key=API_KEY) as server:
        [result] = _grader(server, researchrubrics_grading="ternary").grade("researchrubrics", [(QUERY, "a report")])
        assert all("Partially Satisfied (score 0.5)" in _system(b) for b in server.chat_calls)
    # (5·1 + 4·0.5 + 2·0 − 4·1) / (5 + 4 + 2): the pitfall (negative weight) Satisfied costs its weight
    assert result.score == pytest.approx(3 / 11) and result.details["grading"] == "per_criterion/ternary"
    assert [i["verdict"] for i in result.details["items"]] == [
        "Satisfied",
        "Partially Satisfied",
        "Not Satisfied",
        "Satisfied",
    ]
    assert [i["score"] for i in result.details["items"]] == [1.0, 0.5, 0.0, 1.0]


def test_binary_offers_no_partial_verdict_and_a_partial_reply_is_off_schema():
    with FakeOpenAIServer(by_keyword, api_key=API_KEY) as server:
        [result] = _grader(server).grade("researchrubrics", [(QUERY, "a report")])
        assert not any("Partially" in _system(b) for b in server.chat_calls)
        schema = server.chat_calls[0]["response_format"]["json_schema"]["schema"]
        assert schema["properties"]["verdict"]["enum"] == ["Satisfied", "Not Satisfied"]
    # the thermal criterion's grader keeps answering "Partially Satisfied": first try and repair both fail
    assert result.failed and "1 of 4 criterion calls failed: i2" in result.error


def test_a_score_that_contradicts_its_verdict_is_repaired():
    calls: list[str] = []

    def contradicts_once(body: dict[str, Any]) -> str:
        calls.append(_title(body))
        if "price" in _title(body) and calls.count(_title(body)) == 1:
            return _verdict("Satisfied", 0.0)
        return by_keyword(body)

    with FakeOpenAIServer(contradicts_once, api_key=API_KEY) as server:
        [result] = _grader(server, researchrubrics_grading="ternary").grade("researchrubrics", [(QUERY, "a report")])
    assert len(calls) == 5 and result.score == pytest.approx(3 / 11)  # the price criterion asked twice


REPORT = "\n\n".join(
    [
        "NMC cells store more energy per kilogram than LFP cells.",
        "LFP is far less prone to thermal runaway than NMC.",
        "Prices vary; LFP packs cost less per kWh.",
        "Neither chemistry needs cobalt in LFP's case.",
    ]
)


def chunk_reader(fail_chunk: int | None = None) -> Any:
    """Chunk calls: the chunk's own text is its evidence. Verdicts from the evidence by keyword."""

    def reply(body: dict[str, Any]) -> str:
        user = _user(body)
        if "(rubric_chunk)" in user.split("\n", 1)[0]:
            number = int(user.split("<<<CHUNK>>>\n", 1)[1].split(" of ", 1)[0])
            if number == fail_chunk and "thermal" in _title(body):
                return "{not json"
            text = user.split("<<<CHUNK TEXT>>>\n", 1)[1].split("\n\n<<<", 1)[0]
            return json.dumps(
                {"relevant_evidence": [text], "satisfaction": False, "confidence_for_chunk": 0.5, "notes": "n"}
            )
        assert "<<<DOCUMENT>>>" not in user and "<<<CHUNK EVIDENCE>>>" in user
        return by_keyword(body)

    return reply


def test_a_long_report_is_read_in_chunks_then_one_synthesis_call_per_rubric():
    options = {"researchrubrics_max_report_chars": 100, "researchrubrics_chunk_chars": 100}
    chunks = split_report(REPORT, 100)
    assert len(chunks) == 3
    with FakeOpenAIServer(chunk_reader(), api_key=API_KEY) as server:
        [result] = _grader(server, researchrubrics_grading="ternary", **options).grade(
            "researchrubrics", [(QUERY, REPORT)]
        )
        kinds = [_user(b).split("\n", 1)[0].rsplit("(", 1)[1] for b in server.chat_calls]
        synthesis = [b for b in server.chat_calls if "<<<CHUNK EVIDENCE>>>" in _user(b)]
    assert kinds.count("rubric_chunk).") == 3 * 4 and kinds.count("rubric_verdict).") == 4
    evidence = json.loads(_user(synthesis[0]).split("<<<CHUNK EVIDENCE>>>\n", 1)[1].split("\n\n<<<", 1)[0])
    assert evidence == chunks  # every chunk's evidence, in the report's order
    assert result.score == pytest.approx(3 / 11) and result.details["chunks"] == 3


def test_a_failed_chunk_fails_its_rubric_without_a_verdict_call():
    options = {"researchrubrics_max_report_chars": 100, "researchrubrics_chunk_chars": 100}
    with FakeOpenAIServer(chunk_reader(fail_chunk=2), api_key=API_KEY) as server:
        [result] = _grader(server, **options).grade("researchrubrics", [(QUERY, REPORT)])
        verdicts = [_title(b) for b in server.chat_calls if "<<<CHUNK EVIDENCE>>>" in _user(b)]
    assert result.failed and "i2: 1 of 3 chunk calls failed" in result.error
    assert len(verdicts) == 3 and not any("thermal" in t for t in verdicts)


def test_split_report_packs_paragraphs_without_overlap():
    a, b, c = "a" * 50, "b" * 50, "c" * 200
    assert split_report(f"{a}\n\n{b}\n\n{c}", 120) == [f"{a}\n\n{b}", c]  # an oversized paragraph: its own chunk
    assert split_report(f"{a}\n\n{b}", 102) == [a, b]  # 50 + 2 + 50 reaches the limit: split
    assert split_report("short", 100) == ["short"]
    with pytest.raises(EvalError, match="chunk size"):
        split_report("x", 0)


def test_bad_options_are_refused():
    with pytest.raises(EvalError, match="researchrubrics_grading must be one of"):
        GraderOptions(researchrubrics_grading="partial")
    with pytest.raises(EvalError, match="researchrubrics_chunk_chars must be positive"):
        GraderOptions(researchrubrics_chunk_chars=10, researchrubrics_max_report_chars=5)


@pytest.mark.parametrize("grading", ["binary", "ternary"])
def test_the_builtin_grader_answers_every_prompt_kind(grading):
    grader = BenchmarkGrader(
        EndpointSettings(model=register_builtin_grader(), max_retries=0),
        GraderOptions(
            researchrubrics_grading=grading, researchrubrics_max_report_chars=100, researchrubrics_chunk_chars=100
        ),
    )
    short, long = grader.grade("researchrubrics", [(QUERY, "NMC has a higher energy density."), (QUERY, REPORT)])
    assert not short.failed and not long.failed and long.details["chunks"] == 3


def test_the_protocol_is_a_config_choice():
    cfg = load_config("tiny", {"eval.researchrubrics_grading": "ternary"})
    assert cfg.eval.protocol_for("researchrubrics") == "ternary"
    cfg = load_config(
        "tiny", {"eval.graders": {"researchrubrics": {"protocol": "binary"}}, "eval.researchrubrics_grading": "ternary"}
    )
    assert cfg.eval.protocol_for("researchrubrics") == "binary"
    with pytest.raises(ConfigError, match="researchrubrics_grading"):
        load_config("tiny", {"eval.researchrubrics_grading": "partial"})
