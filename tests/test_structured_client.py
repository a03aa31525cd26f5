"""The one structured-LLM client (llm.structured) that the task judge, the reflection judge and the benchmark
graders send their calls through, the Options built from config sections, and the one endpoint factory
(llm.endpoints) for every built-in provider and a litellm model."""

from __future__ import annotations

import json
from typing import Any

import pytest

from rubricem_core.config import load_config
from rubricem_core.eval.llm_grader import BenchmarkGrader, GraderOptions
from rubricem_core.eval.types import EvalError
from rubricem_core.judge.llm_judge import GenerationInput, JudgeOptions, LLMJudge, ScoringInput
from rubricem_core.judge.types import JudgeError
from rubricem_core.llm import structured
from rubricem_core.llm._litellm import litellm
from rubricem_core.llm.endpoints import builtin_provider, endpoint_for, endpoint_settings
from rubricem_core.llm.replies import ReplyError, checked_reply, entries_shape, one_entry_per_id, response_format
from rubricem_core.llm.structured import StructuredClient, StructuredOptions
from rubricem_core.llm.types import CallUsage, EndpointSettings
from rubricem_core.reflection.judge import ReflectionJudge, ReflectionJudgeOptions
from rubricem_core.sim.provider import register_completion_provider, registered_provider_names
from rubricem_core.sim.teacher import TeacherRates
from rubricem_core.stand_ins import stand_in_names
from tests import test_eval_graders as graders
from tests import test_judge_llm as judge_data
from tests import test_reflection_judge as reflection_data

SCHEMA = {
    "type": "object",
    "properties": {"answer": {"type": "integer"}},
    "required": ["answer"],
    "additionalProperties": False,
}
SENT: list[dict[str, Any]] = []  # what the scripted provider was asked: messages and params


def _scripted(messages: list[dict[str, Any]], params: dict[str, Any]) -> str:
    """A wrong-shaped reply first, the right one when the repair turn asks again; "boom" raises (a 400)."""
    SENT.append({"messages": messages, "params": params})
    last = messages[-1]["content"]
    if "boom" in last:
        raise RuntimeError("provider down")
    return '{"answer": 42}' if "could not be used" in last else '{"answer": "forty-two"}'


@pytest.fixture
def client():
    register_completion_provider("rubricem-test-structured", _scripted)
    SENT.clear()
    return StructuredClient(EndpointSettings(model="rubricem-test-structured/m", max_retries=0, timeout_s=30))


def _answer(text: str | None) -> int:
    return checked_reply(text, SCHEMA)["answer"]


# ---- the client ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "mode,expected",
    [
        ("json_schema", {"type": "json_schema", "json_schema": {"name": "n", "schema": SCHEMA, "strict": False}}),
        ("json_object", {"type": "json_object"}),
        ("none", None),
    ],
)
def test_the_request_carries_the_options_and_the_reply_format(mode, expected):
    options = StructuredOptions(temperature=0.3, max_tokens=77, seed=5, structured_output=mode)
    request = StructuredClient(EndpointSettings(model="m"), options).request(
        "c1", [{"role": "user", "content": "x"}], "n", SCHEMA
    )
    assert response_format(mode, "n", SCHEMA) == expected == request.response_format
    assert (request.custom_id, request.model, request.max_tokens, request.temperature, request.seed) == (
        "c1",
        "",
        77,
        0.3,
        5,
    )


def test_an_unusable_reply_is_repaired_once_and_every_call_is_recorded(client):
    usage = CallUsage()
    records: list[tuple[str, bool]] = []
    calls = [
        client.call(f"c{i}", [{"role": "user", "content": f"question {i}"}], "answer", SCHEMA, _answer)
        for i in range(2)
    ]
    client.ask(calls, lambda result, repair: (records.append((result.custom_id, repair)), usage.record(result, repair)))
    assert [c.value for c in calls] == [42, 42] and all(c.error is None for c in calls)
    assert sorted(records) == [("c0", False), ("c0:repair", True), ("c1", False), ("c1:repair", True)]
    assert (usage.calls, usage.repairs, usage.attempts) == (2, 2, 4) and usage.prompt_tokens > 0
    repair_turn = SENT[-1]["messages"]
    assert repair_turn[-2] == {"role": "assistant", "content": '{"answer": "forty-two"}'}
    assert repair_turn[-1]["content"].startswith("Your reply could not be used: at answer:")
    assert SENT[0]["params"]["response_format"]["json_schema"]["name"] == "answer"


def test_without_repair_the_validation_error_is_kept(client):
    client.options = StructuredOptions(repair=False)
    [call] = [client.call("c0", [{"role": "user", "content": "q"}], "answer", SCHEMA, _answer)]
    client.ask([call])
    assert call.value is None and call.error.startswith("at answer:") and len(SENT) == 1


def test_a_call_that_failed_without_text_is_not_repaired(client):
    [call] = [client.call("c0", [{"role": "user", "content": "boom"}], "answer", SCHEMA, _answer)]
    client.ask([call])
    assert call.last_text is None and "provider down" in call.error and len(SENT) == 1


def test_verdict_list_schema_and_its_prompt_shape():
    fields = {"score": {"type": "integer"}}
    exact = one_entry_per_id("scores", "rubric_id", ["a", "b"], fields)
    assert checked_reply(
        json.dumps({"scores": [{"rubric_id": "a", "score": 1}, {"rubric_id": "b", "score": 0}]}), exact
    )
    with pytest.raises(ReplyError, match="scores"):
        checked_reply(json.dumps({"scores": [{"rubric_id": "c", "score": 1}, {"rubric_id": "a", "score": 0}]}), exact)
    shape = entries_shape("scores", "rubric_id", {"type": "string"}, fields)["properties"]["scores"]
    assert "minItems" not in shape and shape["items"]["properties"]["rubric_id"] == {"type": "string"}


def test_all_three_callers_send_through_the_one_client(monkeypatch):
    """The task judge, the reflection judge and the grader: every request goes out through llm.structured."""
    sent: list[str] = []
    real = structured.arun_concurrent

    async def spy(requests, settings, **kwargs):
        sent.extend(r.custom_id for r in requests)
        return await real(requests, settings, **kwargs)

    monkeypatch.setattr(structured, "arun_concurrent", spy)
    judge_model, reflection_model, grader_model = (
        endpoint_for(section).model
        for section in (_section("judge"), _section("reflection.judge"), _section("eval.grader"))
    )

    judge = LLMJudge(EndpointSettings(model=judge_model, max_retries=0, timeout_s=60))
    [outcome] = judge.generate([GenerationInput(judge_data.QUERY, judge_data.ROLLOUTS, [])])
    judgments = judge.score([ScoringInput(judge_data.QUERY, r, judge_data.RUBRICS) for r in judge_data.ROLLOUTS])
    assert not outcome.failed and not any(j.failed for j in judgments)
    assert judge.usage.calls == {"generate": 1, "score": len(judge_data.ROLLOUTS)}

    reflection = ReflectionJudge(EndpointSettings(model=reflection_model, max_retries=0, timeout_s=60))
    scores = reflection.score([reflection_data.make_input([reflection_data.SPECIFIC, reflection_data.GENERIC])])
    assert not any(s.judge_failed for s in scores) and reflection.usage.calls == 1

    grader = BenchmarkGrader(EndpointSettings(model=grader_model, max_retries=0, timeout_s=60))
    [grade] = grader.grade("simpleqa", [(graders.SHORT, "Paris")])
    assert grade.score == 1.0 and grader.usage.calls["score"] == 1

    kinds = [custom_id.split(":")[0] for custom_id in sent]
    assert kinds == ["generate"] + ["score"] * len(judge_data.ROLLOUTS) + ["reflect", "grade"]


# ---- options from config sections -------------------------------------------------------------------


def test_options_are_built_from_their_config_sections():
    cfg = load_config(
        "tiny",
        {
            "judge.max_new_rubrics_per_stage": 2,
            "judge.structured_output": "json_object",
            "reflection.judge.mode": "per_candidate",
            "eval.grader.max_tokens": 512,
        },
    )
    judge = JudgeOptions.from_config(cfg.judge, seed=cfg.seed, rubric_stages=("answer",), view="answer")
    assert judge == JudgeOptions(
        temperature=cfg.judge.temperature,
        max_tokens=cfg.judge.max_tokens,
        seed=cfg.seed,
        max_new_rubrics_per_stage=2,
        rubric_stages=("answer",),
        structured_output="json_object",
        view="answer",
        show_reference=cfg.judge.show_reference,
        max_block_chars=cfg.judge.max_block_chars,
    )
    endpoint = cfg.reflection.judge
    assert ReflectionJudgeOptions.from_config(endpoint, seed=cfg.seed) == ReflectionJudgeOptions(
        temperature=endpoint.temperature,
        max_tokens=endpoint.max_tokens,
        seed=cfg.seed,
        structured_output=endpoint.structured_output,
        mode="per_candidate",
    )
    grader = cfg.eval.grader
    assert GraderOptions.from_config(
        grader, seed=cfg.seed, healthbench_grading="joint", drb_grading=cfg.eval.drb_grading
    ) == GraderOptions(
        temperature=grader.temperature,
        max_tokens=512,
        seed=cfg.seed,
        structured_output=grader.structured_output,
        healthbench_grading="joint",
        drb_grading=cfg.eval.drb_grading,
    )
    assert TeacherRates.from_config(cfg.teacher, max_tool_calls=3) == TeacherRates(
        skip_stage_rate=cfg.teacher.skip_stage_rate,
        malformed_call_rate=cfg.teacher.malformed_call_rate,
        uncited_rate=cfg.teacher.uncited_rate,
        ungrounded_rate=cfg.teacher.ungrounded_rate,
        max_tool_calls=3,
    )


@pytest.mark.parametrize(
    "options,error",
    [
        (lambda: JudgeOptions(structured_output="yaml"), JudgeError),
        (lambda: ReflectionJudgeOptions(max_tokens=0), JudgeError),
        (lambda: GraderOptions(structured_output="yaml"), EvalError),
    ],
)
def test_each_caller_rejects_bad_shared_options_with_its_own_error(options, error):
    with pytest.raises(error, match="structured_output|max_tokens"):
        options()


# ---- the endpoint factory ---------------------------------------------------------------------------


def _section(dotted: str, **overrides: Any):
    node = load_config("tiny", {f"{dotted}.{key}": value for key, value in overrides.items()})
    for part in dotted.split("."):
        node = getattr(node, part)
    return node


@pytest.mark.parametrize(
    "dotted,model,expected",
    [
        ("teacher", "rubricem-teacher/scripted", "rubricem-teacher/scripted"),  # the teacher answers any name
        ("judge", "rubricem-judge/anything", "rubricem-judge/builtin"),
        ("reflection.judge", "rubricem-reflection-judge/x", "rubricem-reflection-judge/builtin"),
        ("eval.grader", "rubricem-grader/x", "rubricem-grader/builtin"),
    ],
)
def test_a_builtin_model_registers_its_provider(monkeypatch, dotted, model, expected):
    provider = model.split("/")[0]
    monkeypatch.setattr(
        litellm, "custom_provider_map", [p for p in litellm.custom_provider_map if p.get("provider") != provider]
    )
    section = _section(dotted, model=model, max_concurrency=3)
    assert builtin_provider(model) == provider and provider not in registered_provider_names()
    settings = endpoint_for(section, max_tool_calls=4)
    assert provider in registered_provider_names()
    assert (settings.model, settings.api_key, settings.max_concurrency) == (expected, None, 3)
    assert set(stand_in_names("provider")) == {
        "rubricem-teacher",
        "rubricem-judge",
        "rubricem-reflection-judge",
        "rubricem-grader",
    }


@pytest.mark.parametrize("dotted", ["teacher", "judge", "reflection.judge", "eval.grader"])
def test_a_litellm_model_is_left_alone_and_its_settings_copied(monkeypatch, dotted):
    monkeypatch.setenv("RUBRICEM_TEST_KEY", "sk-from-env")
    before = list(litellm.custom_provider_map)
    section = _section(
        dotted,
        model="openai/gpt-4o-mini",
        api_base="http://127.0.0.1:9/v1",
        api_key_env="RUBRICEM_TEST_KEY",
        timeout_s=7.0,
        max_retries=1,
        input_cost_per_token=1e-6,
    )
    settings = endpoint_for(section)
    assert litellm.custom_provider_map == before and builtin_provider(section.model) is None
    assert (
        settings.model,
        settings.api_base,
        settings.api_key,
        settings.timeout_s,
        settings.max_retries,
        settings.input_cost_per_token,
    ) == ("openai/gpt-4o-mini", "http://127.0.0.1:9/v1", "sk-from-env", 7.0, 1, 1e-6)
    assert endpoint_for(section, api_key="sk-secret-block").api_key == "sk-secret-block"  # the caller's key wins
    if dotted == "teacher":  # batch fields exist on the teacher only
        assert (settings.batch_poll_interval_s, settings.max_batch_resubmits) == (
            section.batch_poll_interval_s,
            section.max_batch_resubmits,
        )
    else:
        assert settings.batch_poll_interval_s == EndpointSettings(model="m").batch_poll_interval_s
    assert endpoint_settings(section, api_key="k") == endpoint_for(section, api_key="k")
