"""Reflection judge over real HTTP (the fake OpenAI server) and the built-in judge through litellm."""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pytest

from rubricem_core.judge.prompts import split_sections
from rubricem_core.judge.types import JudgeError, JudgeQuery, Rubric, RubricScore, TrajectoryJudgment
from rubricem_core.llm.types import EndpointSettings
from rubricem_core.reflection.format import Reflection, parse_reflection
from rubricem_core.reflection.judge import (
    CandidateScore,
    ReflectionJudge,
    ReflectionJudgeInput,
    ReflectionJudgeOptions,
    best_candidate,
    candidate_rewards,
    reflection_rows,
)
from rubricem_core.sim.reflection_judge import MODEL, builtin_score, register_builtin_reflection_judge
from rubricem_core.testing.openai_server import FakeOpenAIServer
from tests.llm_endpoints import API_KEY, make_settings

QUERY = JudgeQuery("q1", "Which was founded earlier, Voralis Labs or Keto Works?")
TRAJECTORY = (
    "<structured_plan><deep_analysis>Two founding years.</deep_analysis><rubric><knowledge_checklist>- years"
    "</knowledge_checklist><analytical_criteria>- compare</analytical_criteria><negative_constraints>- none"
    "</negative_constraints></rubric><research_plan>1. Search.</research_plan></structured_plan>"
    '<call_tool name="search">Voralis founded</call_tool><tool_output><snippet id="D1">Voralis Group: Voralis '
    "Group was founded in 1931.</snippet></tool_output><state_evaluation>Verdict: ready</state_evaluation>"
    "<review><rubric_review>- D1</rubric_review><writing_plan><thesis>t</thesis><outline>o</outline>"
    '</writing_plan></review><answer><cite id="D1">Voralis was founded in 1931</cite>, so it is older.</answer>'
)
RUBRICS = [
    Rubric.create(
        "q1", "answer", "positive", "States Voralis Labs' founding year", "gives 1950 with a citation", 2, "persistent"
    ),
    Rubric.create(
        "q1", "answer", "positive", "States Keto Works' founding year", "gives 1962 with a citation", 3, "persistent"
    ),
    Rubric.create(
        "q1",
        "answer",
        "negative",
        "Confuses Voralis Labs with Voralis Group",
        "attributes the look-alike's 1931 founding to Voralis Labs",
        2,
    ),
    Rubric.create("q1", "research", "positive", "Searches for Keto Works", "a targeted search for the company", 3),
]
SCORES = {  # raw judge scores: the answer cites the look-alike and never looks up Keto Works
    RUBRICS[0].rubric_id: (2, "the year appears"),
    RUBRICS[1].rubric_id: (0, "Keto Works is never dated"),
    RUBRICS[2].rubric_id: (2, "1931 is Voralis Group's year"),
    RUBRICS[3].rubric_id: (0, "no such search"),
}


def judgment(rollout_id: str = "t0", failed: bool = False) -> TrajectoryJudgment:
    if failed:
        return TrajectoryJudgment(rollout_id, failed=True, error="judge down")
    return TrajectoryJudgment(
        rollout_id, [RubricScore(r.rubric_id, r.stage, r.polarity, r.weight, *SCORES[r.rubric_id]) for r in RUBRICS]
    )


def render(rubrics: list[str], takeaways: list[str]) -> str:
    return Reflection(tuple(rubrics), tuple(takeaways)).render()


SPECIFIC = render(
    [
        "The report states the founding year of Keto Works, cited from a Keto Works snippet",
        "It keeps Voralis Labs apart from the look-alike Voralis Group",
    ],
    [
        'Search for "Keto Works founded" as its own query before writing',
        "Browse the Voralis Labs document and check the name is not Voralis Group before citing it",
    ],
)
MET_ONLY = render(  # specific, but about what already went right
    ["The report states when Voralis Labs was founded"], ["Search for Voralis Labs founding year"]
)
GENERIC = render(
    ["The report is accurate and complete", "Claims are supported by evidence"],
    ["Be more thorough in research", "Double-check facts before answering"],
)
REDUNDANT = render(
    ["The report states the founding year of Keto Works"],
    [
        "Search for the founding year of Keto Works",
        "Search for the Keto Works founding year",
        "Look up the founding year of Keto Works",
    ],
)
INVALID = "I think the answer was fine."


def make_input(candidates: list[str], rollout_id: str = "t0", failed: bool = False) -> ReflectionJudgeInput:
    return ReflectionJudgeInput(QUERY, rollout_id, TRAJECTORY, candidates, RUBRICS, judgment(rollout_id, failed))


def user_of(body: dict[str, Any]) -> str:
    return next(m["content"] for m in body["messages"] if m["role"] == "user")


def candidates_in(body: dict[str, Any]) -> list[int]:
    return [int(name.split()[1]) for name, _ in split_sections(user_of(body)) if name.startswith("CANDIDATE ")]


def is_repair(body: dict[str, Any]) -> bool:
    return "could not be used" in body["messages"][-1]["content"]


def good_reply(body: dict[str, Any]) -> str:
    return json.dumps(
        {
            "scores": [
                {"candidate": i, "justification": f"ok {i}", "score": round(0.1 * (i + 1), 2)}
                for i in candidates_in(body)
            ]
        }
    )


def settings(server: FakeOpenAIServer, **overrides: Any) -> EndpointSettings:
    return make_settings(server, **{"model": "openai/reflection-judge", "max_retries": 2, **overrides})


# ---- one call per trajectory, privileged inputs, invalid candidates ---------------------------------------


@pytest.mark.parametrize("judge_invalid", [True, False], ids=["paper-every-candidate-judged", "invalid-zero"])
def test_one_call_per_trajectory_scores_every_candidate_or_only_valid_ones(judge_invalid):
    inputs = [make_input([SPECIFIC, INVALID, GENERIC], "t0"), make_input([MET_ONLY, SPECIFIC], "t1")]
    with FakeOpenAIServer(good_reply, api_key=API_KEY) as server:
        judge = ReflectionJudge(settings(server), ReflectionJudgeOptions(judge_invalid=judge_invalid))
        scores = judge.score(inputs)
    assert len(server.chat_calls) == 2  # one per source trajectory, not one per candidate
    assert [(s.source_rollout_id, s.candidate) for s in scores] == [
        ("t0", 0),
        ("t0", 1),
        ("t0", 2),
        ("t1", 0),
        ("t1", 1),
    ]
    by = {(s.source_rollout_id, s.candidate): s for s in scores}
    assert by["t0", 1].valid is False and "missing_reflection" in by["t0", 1].codes
    assert by["t0", 0].score == pytest.approx(0.1) and by["t0", 2].score == pytest.approx(0.3)
    assert by["t0", 0].justification == "ok 0"
    t0_body = next(b for b in server.chat_calls if INVALID in user_of(b) or candidates_in(b) == [0, 2])
    sent = [0, 1, 2] if judge_invalid else [0, 2]
    assert candidates_in(t0_body) == sent and (INVALID in user_of(t0_body)) == judge_invalid
    enum = t0_body["response_format"]["json_schema"]["schema"]["properties"]["scores"]["items"]["properties"][
        "candidate"
    ]["enum"]
    assert enum == sent
    # the paper: the invalid candidate's reward is the judge's score; the earlier rule: a zero without a call
    assert by["t0", 1].score == pytest.approx(0.2 if judge_invalid else 0.0)
    assert candidate_rewards([by["t0", i] for i in range(3)])[1] == pytest.approx(0.2 if judge_invalid else 0.0)
    # either way it never enters the bank: the best valid candidate does
    assert best_candidate([by["t0", i] for i in range(3)]).candidate == 2
    assert judge.usage.calls == 2 and judge.usage.candidates == 5 and judge.usage.invalid_candidates == 1
    assert judge.usage.cost_usd == pytest.approx(
        judge.usage.prompt_tokens * 1e-6 + judge.usage.completion_tokens * 2e-6
    )


@pytest.mark.parametrize("judge_invalid", [True, False], ids=["paper-every-candidate-judged", "invalid-zero"])
def test_per_candidate_mode_makes_one_call_per_judged_candidate(judge_invalid):
    """The paper's protocol: a call per candidate, each showing that candidate alone (judge_invalid off:
    invalid ones cost none)."""
    inputs = [make_input([SPECIFIC, INVALID, GENERIC], "t0"), make_input([MET_ONLY, SPECIFIC], "t1")]
    options = ReflectionJudgeOptions(mode="per_candidate", judge_invalid=judge_invalid)
    with FakeOpenAIServer(good_reply, api_key=API_KEY) as server:
        judge = ReflectionJudge(settings(server), options)
        scores = judge.score(inputs)
    calls = 5 if judge_invalid else 4
    assert len(server.chat_calls) == calls and judge.usage.calls == calls
    expected = [[0], [0], [1], [1], [2]] if judge_invalid else [[0], [0], [1], [2]]
    assert sorted(candidates_in(b) for b in server.chat_calls) == expected
    by = {(s.source_rollout_id, s.candidate): s for s in scores}
    # each candidate scored alone: good_reply gives 0.1 * (number + 1) to the one it sees
    assert by["t0", 0].score == pytest.approx(0.1) and by["t0", 2].score == pytest.approx(0.3)
    assert by["t1", 1].score == pytest.approx(0.2) and by["t0", 1].valid is False
    assert by["t0", 1].score == pytest.approx(0.2 if judge_invalid else 0.0)


def test_per_candidate_builtin_scores_match_joint_ones(builtin):
    """The built-in judge scores a candidate on its own merits, so both modes give the same numbers."""
    inputs = [make_input([SPECIFIC, MET_ONLY, GENERIC])]
    joint = [s.score for s in ReflectionJudge(builtin.settings).score(inputs)]
    alone = ReflectionJudge(builtin.settings, ReflectionJudgeOptions(mode="per_candidate"))
    assert [s.score for s in alone.score(inputs)] == joint and alone.usage.calls == 3


def test_the_prompt_carries_the_privileged_inputs():
    with FakeOpenAIServer(good_reply, api_key=API_KEY) as server:
        ReflectionJudge(settings(server)).score([make_input([SPECIFIC])])
        [body] = server.chat_calls
    sections = dict(split_sections(user_of(body)))
    records = [json.loads(line) for line in sections["JUDGE RUBRICS AND SCORES"].splitlines()]
    by_title = {r["title"]: r for r in records}
    assert by_title["States Keto Works' founding year"]["credit"] == 0
    assert by_title["Confuses Voralis Labs with Voralis Group"]["score"] == 2
    assert by_title["Confuses Voralis Labs with Voralis Group"]["credit"] == 0  # negative: inverted
    assert by_title["Searches for Keto Works"]["justification"] == "no such search"
    assert "Voralis Group was founded in 1931" in sections["ATTEMPT"]
    assert sections["QUESTION"] == QUERY.question


def test_trajectory_can_be_left_out_or_clipped():
    with FakeOpenAIServer(good_reply, api_key=API_KEY) as server:
        ReflectionJudge(settings(server), ReflectionJudgeOptions(max_trajectory_chars=0)).score(
            [make_input([SPECIFIC])]
        )
        ReflectionJudge(settings(server), ReflectionJudgeOptions(max_trajectory_chars=100)).score(
            [make_input([SPECIFIC])]
        )
        hidden, clipped = (dict(split_sections(user_of(b))) for b in server.chat_calls)
    assert "ATTEMPT" not in hidden
    assert f"({len(TRAJECTORY) - 100} characters omitted from the middle)" in clipped["ATTEMPT"]


def test_all_invalid_candidates_are_judged_but_never_banked_or_cost_no_call_when_zeroed():
    candidates = [INVALID, "<reflection></reflection>"]
    with FakeOpenAIServer(good_reply, api_key=API_KEY) as server:
        judge = ReflectionJudge(settings(server))
        scores = judge.score([make_input(candidates)])
        assert len(server.chat_calls) == 1  # the paper: scored like any other
        assert [(s.valid, s.score) for s in scores] == [(False, pytest.approx(0.1)), (False, pytest.approx(0.2))]
        assert best_candidate(scores) is None
        zeroing = ReflectionJudge(settings(server), ReflectionJudgeOptions(judge_invalid=False))
        zeroed = zeroing.score([make_input(candidates)])
        assert len(server.chat_calls) == 1 and zeroing.usage.calls == 0
    assert [(s.valid, s.score, s.judge_failed) for s in zeroed] == [(False, 0.0, False), (False, 0.0, False)]


@pytest.mark.parametrize("judge_invalid", [True, False], ids=["paper-every-candidate-judged", "invalid-zero"])
def test_a_failed_source_judgment_fails_the_candidates_without_a_call(judge_invalid):
    options = ReflectionJudgeOptions(judge_invalid=judge_invalid)
    with FakeOpenAIServer(good_reply, api_key=API_KEY) as server:
        scores = ReflectionJudge(settings(server), options).score([make_input([SPECIFIC, INVALID], failed=True)])
    assert server.chat_calls == []
    assert scores[0].judge_failed and scores[0].score is None and "judge down" in scores[0].error
    # the invalid one fails with it when it would have been judged; a plain zero otherwise
    assert scores[1].judge_failed == judge_invalid and scores[1].score == (None if judge_invalid else 0.0)


def test_judgment_of_another_rollout_is_rejected():
    item = ReflectionJudgeInput(QUERY, "t0", TRAJECTORY, [SPECIFIC], RUBRICS, judgment("t9"))
    with pytest.raises(JudgeError, match="not the source rollout 't0'"):
        ReflectionJudge(EndpointSettings(model="openai/x")).score([item])


def test_scores_for_unknown_rubrics_are_rejected():
    bad = judgment()
    bad.scores.append(RubricScore("r-unknown", "answer", "positive", 1.0, 1, "?"))
    item = ReflectionJudgeInput(QUERY, "t0", TRAJECTORY, [SPECIFIC], RUBRICS, bad)
    with pytest.raises(JudgeError, match="r-unknown"):
        ReflectionJudge(EndpointSettings(model="openai/x")).score([item])


# ---- repair, retries, failure ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "broken",
    [
        '{"scores": [{"candidate": ',  # not JSON
        '{"scores": [{"candidate": 0, "justification": "j", "score": 1.5}]}',  # out of range
        '{"scores": [{"candidate": 7, "justification": "j", "score": 0.5}]}',  # unknown candidate
        '{"scores": []}',  # missing candidate
    ],
)
def test_an_unusable_reply_is_repaired_once(broken):
    def model(body: dict[str, Any]) -> str:
        return good_reply(body) if is_repair(body) else broken

    with FakeOpenAIServer(model, api_key=API_KEY) as server:
        judge = ReflectionJudge(settings(server, max_retries=0))
        [score] = judge.score([make_input([SPECIFIC])])
        repairs = [b for b in server.chat_calls if is_repair(b)]
    assert not score.judge_failed and score.score == pytest.approx(0.1)
    assert len(repairs) == 1 and repairs[0]["messages"][-2] == {"role": "assistant", "content": broken}
    assert judge.usage.calls == 1 and judge.usage.repairs == 1 and judge.usage.failed_calls == 0


@pytest.mark.parametrize("judge_invalid", [True, False], ids=["paper-every-candidate-judged", "invalid-zero"])
def test_a_reply_that_stays_unusable_fails_the_candidates_never_zero(judge_invalid):
    options = ReflectionJudgeOptions(judge_invalid=judge_invalid)
    with FakeOpenAIServer(lambda body: '{"scores": "no"}', api_key=API_KEY) as server:
        judge = ReflectionJudge(settings(server), options)
        scores = judge.score([make_input([SPECIFIC, INVALID, GENERIC])])
    assert [s.judge_failed for s in scores] == [True, judge_invalid, True]
    assert scores[0].score is None and "is not of type 'array'" in scores[0].error
    failed = 3 if judge_invalid else 2
    assert judge.usage.repairs == 1 and judge.usage.failed_calls == 1 and judge.usage.failed_candidates == failed
    rewards = candidate_rewards(scores)
    assert (
        np.isnan(rewards[0]) and np.isnan(rewards[2]) and (np.isnan(rewards[1]) if judge_invalid else rewards[1] == 0)
    )


def test_429_and_500_are_retried():
    with FakeOpenAIServer(good_reply, api_key=API_KEY, http_errors=[429, 500]) as server:
        judge = ReflectionJudge(settings(server, max_concurrency=1))
        scores = judge.score([make_input([SPECIFIC])])
    assert not scores[0].judge_failed and len(server.chat_calls) == 3
    assert judge.usage.attempts == 3 and judge.usage.calls == 1


@pytest.mark.parametrize("status", [500, 429, 400])
def test_permanent_failure_marks_candidates_judge_failed(status):
    errors = [status] * 50 if status != 400 else [400]
    with FakeOpenAIServer(good_reply, api_key=API_KEY, http_errors=errors) as server:
        judge = ReflectionJudge(settings(server, max_concurrency=1))
        scores = judge.score([make_input([SPECIFIC, GENERIC], "t0"), make_input([SPECIFIC], "t1")])
    failed = [s for s in scores if s.judge_failed]
    if status == 400:  # a client error is not retried: only the first trajectory's call fails
        assert [(s.source_rollout_id, s.candidate) for s in failed] == [("t0", 0), ("t0", 1)]
        assert not scores[2].judge_failed and scores[2].score == pytest.approx(0.1)
    else:
        assert len(failed) == 3
    assert all(s.score is None and f"status {status}" in s.error for s in failed)
    assert judge.usage.failed_candidates == len(failed)
    assert judge.usage.metrics()["reflection_judge/failed_candidates"] == float(len(failed))


# ---- using the verdicts -------------------------------------------------------------------------------


def _cs(candidate: int, score: float | None, valid: bool = True, failed: bool = False, rollout: str = "t0"):
    return CandidateScore(
        "q1", rollout, candidate, f"text {candidate}", valid, [] if valid else ["x"], score, "", failed
    )


def test_best_candidate_skips_invalid_failed_and_useless():
    scores = [_cs(0, 0.4), _cs(1, 0.9, valid=False), _cs(2, None, failed=True), _cs(3, 0.7), _cs(4, 0.7)]
    assert best_candidate(scores).candidate == 3  # ties: the lowest number
    assert best_candidate(scores, min_score=0.7) is None
    assert best_candidate([_cs(0, 0.0)]) is None  # useless reflections never enter the bank
    assert best_candidate([]) is None


def test_reflection_rows_mark_one_accepted_per_source_trajectory():
    scores = [_cs(0, 0.4), _cs(1, 0.8), _cs(0, None, failed=True, rollout="t1"), _cs(1, 0.0, valid=False, rollout="t1")]
    rows = reflection_rows(5, scores)
    assert [r["accepted"] for r in rows] == [False, True, False, False]
    assert set(rows[0]) >= {"step", "query_id", "source_rollout_id", "candidate", "text", "valid", "score", "accepted"}
    assert rows[2]["score"] is None and rows[2]["judge_failed"] is True and rows[0]["step"] == 5


# ---- the built-in judge ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def builtin() -> ReflectionJudge:
    model = register_builtin_reflection_judge()
    assert model == MODEL
    return ReflectionJudge(EndpointSettings(model=model, max_retries=0, timeout_s=30))


def test_builtin_ranks_failure_targeted_above_specific_above_generic(builtin):
    scores = builtin.score([make_input([SPECIFIC, MET_ONLY, GENERIC, REDUNDANT])])
    values = [s.score for s in scores]
    assert not any(s.judge_failed for s in scores), [s.error for s in scores]
    specific, met_only, generic, redundant = values
    assert specific > met_only > generic, values
    assert specific > redundant, values
    assert specific >= 0.6 and generic <= 0.15, values
    assert "failed rubrics" in scores[0].justification
    assert builtin.usage.calls == 1


def test_builtin_is_deterministic_and_ignores_candidate_order(builtin):
    first = builtin.score([make_input([SPECIFIC, GENERIC])])
    second = builtin.score([make_input([GENERIC, SPECIFIC])])
    assert [s.score for s in first] == [s.score for s in reversed(second)]


def test_builtin_coverage_follows_the_failed_rubrics():
    reflection = parse_reflection(MET_ONLY)
    records = [
        {
            "title": r.title,
            "description": r.description,
            "weight": r.weight,
            "credit": 2 if r.polarity == "positive" else 0,
        }
        for r in RUBRICS
    ]
    all_met = builtin_score(reflection, QUERY.question, [dict(r, credit=2) for r in records])[0]
    voralis_failed = builtin_score(
        reflection, QUERY.question, [dict(records[0], credit=0)] + [dict(r, credit=2) for r in records[1:]]
    )[0]
    keto_failed = builtin_score(
        reflection,
        QUERY.question,
        [dict(r, credit=2) for r in records[:1]]
        + [dict(records[1], credit=0)]
        + [dict(r, credit=2) for r in records[2:]],
    )[0]
    # the same reflection is worth more when the rubric it addresses is the one that failed
    assert voralis_failed > all_met > keto_failed
    no_rubrics, _ = builtin_score(reflection, QUERY.question, [])
    assert 0.0 < no_rubrics <= 1.0
