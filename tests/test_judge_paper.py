"""Paper fidelity of the stagewise judge: no answer key, the paper's generation spec and counts, and the
answer-only view of Baseline-RL (DR Tulu's evolving-answer objective)."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import pytest

from rubricem_core.config import ConfigError, load_config
from rubricem_core.judge.llm_judge import GenerationInput, JudgeOptions, LLMJudge, ScoringInput
from rubricem_core.judge.prompts import (
    CENTRAL_QUESTIONS,
    RUBRIC_COUNTS,
    generation_limits,
    generation_messages,
    generation_schema,
    parse_generation,
    rubric_counts,
    scoring_messages,
    split_sections,
)
from rubricem_core.judge.types import JudgeError, JudgeQuery, JudgeRollout
from rubricem_core.sim.judge import respond
from rubricem_core.testing.openai_server import FakeOpenAIServer
from tests.judge_replies import API_KEY, RUBRICS, good_reply, is_repair, settings, trace

REFERENCE = "REFERENCE-MARK: Keto Works was founded in 1921"
SPEC_MARK = "SPEC-MARK-42"
QUERY = JudgeQuery(
    "q1",
    "Which was founded earlier, Voralis Labs or Keto Works?",
    {"kind": "comparison", "subjects": ["Voralis Labs", "Keto Works"], "note": SPEC_MARK},
    REFERENCE,
)
ROLLOUTS = [
    JudgeRollout(f"t{i}", trace(f'<cite id="D1">Voralis Labs was founded in 1950</cite>. Answer {i}.'))
    for i in range(3)
]
# text only the plan, research and review stages hold (the answer cites D1's claim, not its snippet)
NOT_IN_ANSWER = [
    "Two founding years are needed",
    "<structured_plan>",
    "<call_tool",
    "<tool_output>",
    "<snippet",
    "Verdict: ready",
    "<rubric_review>",
    "founding year → D1",
    "PLANNING RUBRIC",
]


def rubrics_reply(**per_stage: int) -> str:
    return json.dumps(
        {
            stage: [
                {"polarity": "positive", "title": f"{stage.title()} criterion {i}", "description": "d", "weight": 2}
                for i in range(per_stage.get(stage, 0))
            ]
            for stage in ("plan", "research", "review", "answer")
        }
    )


def full_reply(body: dict[str, Any]) -> str:
    """A judge model that writes the fewest rubrics the paper asks for, and scores every id."""
    if body["messages"][1]["content"].startswith("TASK: write new rubrics"):
        return rubrics_reply(plan=1, research=1, review=1, answer=2)
    return good_reply(body)


def calls_with(options: JudgeOptions) -> list[dict[str, Any]]:
    """Bodies of one generation and one scoring call sent to the endpoint."""
    with FakeOpenAIServer(full_reply, api_key=API_KEY) as server:
        judge = LLMJudge(settings(server), options)
        [outcome] = judge.generate([GenerationInput(QUERY, ROLLOUTS, [])])
        [judgment] = judge.score([ScoringInput(QUERY, ROLLOUTS[0], [r for r in RUBRICS if r.stage == "answer"])])
        bodies = list(server.chat_calls)
    assert not outcome.failed and not judgment.failed, (outcome.error, judgment.error)
    return bodies


def sent_text(bodies: list[dict[str, Any]]) -> str:
    return "\n".join(m["content"] for body in bodies for m in body["messages"])


# ---- 1. no answer key ------------------------------------------------------------------------------


def test_without_reference_no_call_carries_the_reference_answer_or_spec():
    text = sent_text(calls_with(JudgeOptions(show_reference=False)))
    assert REFERENCE not in text and "REFERENCE-MARK" not in text and SPEC_MARK not in text
    assert "<<<QUERY SPEC>>>" not in text and "<<<REFERENCE ANSWER>>>" not in text
    assert QUERY.question in text  # the query itself still is


def test_with_reference_every_call_carries_it():
    bodies = calls_with(JudgeOptions(show_reference=True))
    assert len(bodies) == 2
    for body in bodies:
        sections = dict(split_sections(body["messages"][1]["content"]))
        assert sections["REFERENCE ANSWER"] == REFERENCE and SPEC_MARK in sections["QUERY SPEC"]


def test_config_default_keeps_the_reference_for_the_builtin_judge_and_gpu_drops_it():
    assert load_config("tiny").judge.show_reference and load_config("small").judge.show_reference
    assert not load_config("gpu").judge.show_reference
    assert not load_config(
        "tiny", {"judge.model": "openai/gpt-4.1-mini", "judge.show_reference": False}
    ).judge.show_reference
    # the built-in judge reads the spec: refusing is clearer than scoring on half the facts
    with pytest.raises(ConfigError, match="show_reference=false needs an LLM judge"):
        load_config("tiny", {"judge.show_reference": False})
    with pytest.raises(ConfigError, match="show_reference=false needs an LLM judge"):
        load_config("gpu", {"judge.model": "rubricem-judge/builtin"})


# ---- 2. the paper's generation spec --------------------------------------------------------------------


def test_generation_prompt_states_the_papers_spec():
    system = generation_messages(QUERY, ROLLOUTS, [], 5)[0]["content"]
    for stage, question in CENTRAL_QUESTIONS.items():
        assert f"- {stage}: {question}" in system
    for stage in ("plan", "research", "review"):
        assert f"- {stage}: 1 to 4" in system
    assert "- answer: 2 to 5" in system
    assert "No mirror pairs" in system and "restated negated" in system
    assert "Never penalise research or an answer that goes beyond the plan because the evidence warranted it" in system
    assert "Discriminative" in system and "most important first" in system
    # the scoring prompt holds the same line on going beyond the plan
    assert (
        "went beyond the plan when the evidence warranted it"
        in scoring_messages(QUERY, ROLLOUTS[0], RUBRICS)[0]["content"]
    )


def test_counts_are_the_papers_capped_by_max_new_rubrics_per_stage():
    assert rubric_counts(5) == RUBRIC_COUNTS == {"plan": (1, 4), "research": (1, 4), "review": (1, 4), "answer": (2, 5)}
    assert rubric_counts(3) == {"plan": (1, 3), "research": (1, 3), "review": (1, 3), "answer": (2, 3)}
    assert rubric_counts(1) == {stage: (1, 1) for stage in RUBRIC_COUNTS}
    assert rubric_counts(5, ("answer",)) == {"plan": (0, 0), "research": (0, 0), "review": (0, 0), "answer": (2, 5)}
    schema = generation_schema(rubric_counts(5))["properties"]
    assert schema["plan"]["maxItems"] == 4 and schema["answer"]["maxItems"] == 5
    assert not any("minItems" in schema[stage] for stage in RUBRIC_COUNTS)  # targets, not quotas
    end = dict(split_sections(generation_messages(QUERY, ROLLOUTS, [], 5)[1]["content"]))["END"]
    assert generation_limits(end) == {"plan": 4, "research": 4, "review": 4, "answer": 5}


def test_parsing_keeps_the_first_rubrics_of_a_stage_over_its_most():
    rubrics, dropped = parse_generation(rubrics_reply(plan=6, research=1, review=4, answer=7), 5)
    by_stage = {s: [r.title for r in rubrics if r.stage == s] for s in ("plan", "research", "review", "answer")}
    assert by_stage["plan"] == [f"Plan criterion {i}" for i in range(4)]
    assert len(by_stage["review"]) == 4 and by_stage["answer"] == [f"Answer criterion {i}" for i in range(5)]
    assert dropped == [
        "plan: 'Plan criterion 4' (beyond the stage's 4 new rubrics)",
        "plan: 'Plan criterion 5' (beyond the stage's 4 new rubrics)",
        "answer: 'Answer criterion 5' (beyond the stage's 5 new rubrics)",
        "answer: 'Answer criterion 6' (beyond the stage's 5 new rubrics)",
    ]


def test_a_reply_with_fewer_rubrics_than_the_target_is_kept_without_a_repair():
    """The paper's counts are targets, not quotas: a short stage is neither an error nor repaired."""
    reply = rubrics_reply(plan=1, research=0, review=1, answer=1)
    assert len(parse_generation(reply, 5)[0]) == 3

    def model(body: dict[str, Any]) -> str:
        user = body["messages"][1]["content"]
        return reply if user.startswith("TASK: write new rubrics") else good_reply(body)

    with FakeOpenAIServer(model, api_key=API_KEY) as server:
        judge = LLMJudge(settings(server), JudgeOptions())
        [outcome] = judge.generate([GenerationInput(QUERY, ROLLOUTS, [])])
        repairs = [b for b in server.chat_calls if is_repair(b)]
    assert not outcome.failed and len(outcome.rubrics) == 3 and outcome.dropped == []
    assert repairs == [] and judge.usage.repairs["generate"] == 0


def test_the_generation_prompt_asks_targets_and_forbids_overfitting_and_self_consistency():
    system = generation_messages(QUERY, ROLLOUTS, [], 5)[0]["content"]
    assert "targets, not quotas" in system and "still write the fewest" not in system
    assert "never make one rollout's wording" in system  # no rubric fitted to one trajectory's phrasing
    assert "Quality, not self-consistency" in system


@pytest.mark.parametrize("per_rubric, expected", [(0, [4096, 4096]), (300, [4096, 256 + 300 * 20])])
def test_scoring_budget_grows_with_the_rubric_count(per_rubric, expected):
    rubrics = [dataclasses.replace(RUBRICS[0], rubric_id=f"r{i}") for i in range(20)]
    with FakeOpenAIServer(good_reply, api_key=API_KEY) as server:
        judge = LLMJudge(settings(server), JudgeOptions(max_tokens_per_rubric=per_rubric))
        judge.score([ScoringInput(QUERY, ROLLOUTS[0], rubrics[:2]), ScoringInput(QUERY, ROLLOUTS[1], rubrics)])
        budgets = sorted(b["max_tokens"] for b in server.chat_calls)
    assert budgets == expected


@pytest.mark.parametrize("max_block_chars", [50, None])
def test_max_block_chars_cuts_the_middle_or_shows_the_whole_block(max_block_chars):
    long_rollout = JudgeRollout("long", trace("x " * 400))
    content = scoring_messages(QUERY, long_rollout, RUBRICS[:1], max_block_chars)[1]["content"]
    assert ("characters omitted" in content) == (max_block_chars is not None)


def test_judge_max_block_chars_comes_from_the_config():
    from rubricem_core.judge.step import judge_options
    from rubricem_core.rl.session import recipe_settings

    cfg = load_config("research", {})
    options = judge_options(cfg, recipe_settings(cfg).judged_stages, False)
    assert options.max_block_chars is None and options.max_tokens_per_rubric == 300
    assert judge_options(load_config("tiny", {}), ("answer",), True).max_block_chars == 40_000


# ---- 3. Baseline-RL judges the answer only ------------------------------------------------------------------


def options_for(recipe: str, model: str = "openai/judge-model") -> JudgeOptions:
    from rubricem_core.judge.step import judge_options
    from rubricem_core.rl.session import recipe_settings

    cfg = load_config("tiny", {"rl.recipe": recipe, "judge.model": model})
    return judge_options(cfg, recipe_settings(cfg).judged_stages, model.startswith("rubricem-judge/"))


@pytest.mark.parametrize("recipe", ["baseline", "meta_policy"])
def test_answer_only_recipes_judge_the_question_and_the_answer_only(recipe):
    options = options_for(recipe)
    assert options.view == "answer" and options.rubric_stages == ("answer",)
    generate, score = calls_with(options)
    for body in (generate, score):
        text = sent_text([body])
        assert QUERY.question in text and '<cite id="D1">Voralis Labs was founded in 1950</cite>' in text
        assert not [piece for piece in NOT_IN_ANSWER if piece in text], body
    names = [name for name, _ in split_sections(score["messages"][1]["content"])]
    assert names == ["QUESTION", "QUERY SPEC", "REFERENCE ANSWER", "RUBRICS", "TRAJECTORY STAGE answer", "END"]
    names = [name for name, _ in split_sections(generate["messages"][1]["content"])]
    assert [n for n in names if n.startswith("ROLLOUT")] == [f"ROLLOUT {i} STAGE answer" for i in (1, 2, 3)]
    # only answer rubrics are asked for
    end = dict(split_sections(generate["messages"][1]["content"]))["END"]
    assert generation_limits(end) == {"plan": 0, "research": 0, "review": 0, "answer": 3}
    assert "- plan:" not in generate["messages"][0]["content"]


@pytest.mark.parametrize("recipe", ["ss_grpo", "full"])
def test_stagewise_recipes_keep_the_whole_trajectory(recipe):
    options = options_for(recipe)
    assert options.view == "trajectory"
    text = sent_text(calls_with(options))
    assert all(piece in text for piece in NOT_IN_ANSWER)


def test_the_builtin_judge_keeps_the_whole_trajectory_for_the_baseline():
    # its answer checks verify citations against retrieved snippets (numbers of tiny/small unchanged)
    options = options_for("baseline", "rubricem-judge/builtin")
    assert options.view == "trajectory" and options.rubric_stages == ("answer",)


def test_answer_view_without_an_answer_and_with_other_stages():
    messages = scoring_messages(QUERY, JudgeRollout("x", trace("").split("<answer>")[0]), RUBRICS[:1], view="answer")
    assert dict(split_sections(messages[1]["content"]))["TRAJECTORY STAGE answer"] == "(no answer)"
    with pytest.raises(JudgeError, match="needs rubric_stages=\\('answer',\\)"):
        JudgeOptions(view="answer")
    with pytest.raises(JudgeError, match="view must be one of"):
        JudgeOptions(view="plan", rubric_stages=("answer",))


def test_the_builtin_judge_writes_nothing_for_stages_that_get_no_rubrics():
    clean, lazy = ROLLOUTS[0].text, ROLLOUTS[0].text.replace("Voralis Labs founded", "history")
    group = [JudgeRollout("a", clean), JudgeRollout("b", lazy)]
    everything = json.loads(respond(generation_messages(QUERY, group, [], 3), {}))
    assert everything["research"]  # the two differ in their searches
    answer_only = json.loads(respond(generation_messages(QUERY, group, [], 3, stages=("answer",)), {}))
    assert all(answer_only[stage] == [] for stage in ("plan", "research", "review"))
    assert answer_only["answer"] == everything["answer"]
