"""A model behind an API as the evaluated policy (issue #46, item 5: the paper's Fig. 6c, a frontier model
prompted with and without the scaffold). The model here is the built-in scripted teacher, offline, served
behind an OpenAI-compatible endpoint on 127.0.0.1 so the litellm path is the one a real model takes."""

from __future__ import annotations

from typing import Any

import pytest

from rubricem_core.config import load_config
from rubricem_core.environment import local_tool_env
from rubricem_core.eval.api_policy import APIPolicyEngine, api_engine
from rubricem_core.eval.checkpoints import api_policy_spec, checkpoint_tag
from rubricem_core.eval.run import EvalOptions, run_eval
from rubricem_core.llm.types import EndpointSettings
from rubricem_core.rollout.types import ANSWERED, RolloutError, RolloutRequest
from rubricem_core.scaffold import PLAIN_PROMPT_OPENING
from rubricem_core.schemas import queries_from_table
from rubricem_core.sim.teacher import ScriptedTeacher, TeacherRates
from rubricem_core.sim.world import generate_world
from rubricem_core.testing.openai_server import FakeOpenAIServer

API_KEY = "sk-test-api-policy"
CFG = load_config("tiny", {"data.world.n_queries": 16, "data.world.n_documents": 120, "tools.max_tool_calls": 6})
WORLD = generate_world(CFG.data.world)
QUERIES = [q for q in queries_from_table(WORLD.queries_table()) if q.split == "eval"][:4]
OPTIONS = EvalOptions(samples_per_query=2, temperature=0.7, max_tool_calls=6, seed=3)
STAGE_TAGS = ("<structured_plan>", "<state_evaluation>", "<review>")


def served_teacher(body: dict[str, Any]) -> str:
    """The scripted teacher as the model behind the endpoint (it reads only the chat and the seed)."""
    return ScriptedTeacher(TeacherRates(max_tool_calls=6)).respond(body["messages"], {"seed": body.get("seed")})


def _evaluate(scaffold: bool) -> tuple[Any, list[dict[str, Any]]]:
    env = local_tool_env(WORLD.corpus_table(), CFG.tools)
    with FakeOpenAIServer(served_teacher, api_key=API_KEY) as server:
        settings = EndpointSettings(
            model="openai/policy-model", api_base=server.base_url, api_key=API_KEY, timeout_s=10.0, max_retries=0
        )
        engine = APIPolicyEngine(settings, scaffold=scaffold, max_rounds=10, max_tokens=2048)
        outcome = run_eval(engine, None, "synthetic", QUERIES, env, OPTIONS, "api")
        return outcome, list(server.chat_calls)


@pytest.mark.parametrize("scaffold", [True, False])
def test_an_api_model_is_evaluated_with_and_without_the_scaffold(scaffold):
    outcome, calls = _evaluate(scaffold)
    systems = {next(m["content"] for m in c["messages"] if m["role"] == "system") for c in calls}
    assert all(s.startswith(PLAIN_PROMPT_OPENING) != scaffold for s in systems)  # the prompt it was asked for
    # the scaffold's full instructions, though tiny's own policy is prompted compactly
    assert all(s.startswith("You are a deep-research agent") == scaffold for s in systems)
    assert all(c["stop"] == ["</call_tool>"] for c in calls)  # each turn ends at a tool call
    rows = outcome.rows
    assert len(rows) == len(QUERIES) * OPTIONS.samples_per_query
    assert all(r["finish_reason"] == ANSWERED and r["n_tool_calls"] >= 1 for r in rows)
    texts = [r["text"] for r in rows]
    assert all("<tool_output>" in t and "<answer>" in t for t in texts)  # tools ran; the answer was extracted
    assert all(any(tag in t for tag in STAGE_TAGS) == scaffold for t in texts)
    summary = outcome.summary
    assert summary["valid_scaffold_rate"] == (1.0 if scaffold else 0.0)
    assert summary["answer_match_mean"] > 0.5 and summary["score_mean"] > 0.5  # the same research, graded


def test_the_same_seed_gives_the_same_trajectories():
    first, _ = _evaluate(True)
    again, _ = _evaluate(True)
    assert [r["text"] for r in first.rows] == [r["text"] for r in again.rows]


def test_the_checkpoint_argument_names_the_model_and_the_prompting(tmp_path):
    spec = api_policy_spec("api-plain:gemini/gemini-3.1-pro-preview")
    assert (spec.model, spec.scaffold) == ("gemini/gemini-3.1-pro-preview", False)
    assert checkpoint_tag(tmp_path, "api:openai/gpt-4.1") == "api-openai_gpt-4.1"
    assert checkpoint_tag(tmp_path, "api-plain:openai/gpt-4.1") == "api-plain-openai_gpt-4.1"
    assert api_policy_spec(tmp_path / "checkpoints" / "sft" / "final") is None
    with pytest.raises(ValueError, match="name the model after api:"):
        api_policy_spec("api:")


def test_the_builtin_teacher_is_the_offline_api_model():
    engine, tokenizer = api_engine(CFG, api_policy_spec("api:rubricem-teacher/scripted"))
    assert tokenizer is None and engine.scaffold and engine.max_rounds == CFG.eval.api_policy.max_rounds
    env = local_tool_env(WORLD.corpus_table(), CFG.tools)
    outcome = run_eval(engine, None, "synthetic", QUERIES[:2], env, EvalOptions(max_tool_calls=6), "api")
    assert outcome.summary["valid_scaffold_rate"] == 1.0


def test_a_request_without_its_chat_is_refused():
    engine = APIPolicyEngine(EndpointSettings(model="openai/x"), scaffold=True, max_rounds=2, max_tokens=64)
    env = local_tool_env(WORLD.corpus_table(), CFG.tools)
    with pytest.raises(RolloutError, match="needs the chat"):
        engine.generate([RolloutRequest("q", prompt_ids=[])], env)
    with pytest.raises(RolloutError, match="no weights"):
        engine.update_weights({})


@pytest.mark.parametrize("scaffold", [True, False])
def test_retrieved_guidance_reaches_either_prompt(scaffold):
    from rubricem_core.environment import prompt_messages

    seen: list[str] = []

    def record(body: dict[str, Any]) -> str:
        seen.append(next(m["content"] for m in body["messages"] if m["role"] == "system"))
        return served_teacher(body)

    messages = prompt_messages(QUERIES[0].to_row(), guidance="Search both founders first.", style="compact")
    env = local_tool_env(WORLD.corpus_table(), CFG.tools)
    with FakeOpenAIServer(record, api_key=API_KEY) as server:
        settings = EndpointSettings(model="openai/m", api_base=server.base_url, api_key=API_KEY, max_retries=0)
        engine = APIPolicyEngine(settings, scaffold=scaffold, max_rounds=4, max_tokens=512)
        engine.generate([RolloutRequest("q", prompt_ids=[], messages=messages, max_tool_calls=4)], env)
    assert seen and all("Search both founders first." in s for s in seen)
