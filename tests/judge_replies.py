"""A judged query, its rollouts and rubrics, and the replies a well-behaved judge gives on the fake OpenAI
server: shared by the LLM judge tests."""

from __future__ import annotations

import json
from typing import Any

from rubricem_core.judge.llm_judge import (
    ScoringInput,
)
from rubricem_core.judge.prompts import (
    split_sections,
)
from rubricem_core.judge.types import JudgeQuery, JudgeRollout, Rubric
from rubricem_core.llm.types import EndpointSettings
from rubricem_core.testing.openai_server import FakeOpenAIServer
from tests.llm_endpoints import make_settings

API_KEY = "sk-judge-test-0123456789"
QUERY = JudgeQuery(
    "q1",
    "Which was founded earlier, Voralis Labs or Keto Works?",
    {"kind": "comparison", "subjects": ["Voralis Labs", "Keto Works"]},
    "Keto Works",
)


def trace(answer: str, plan_item: str = "the founding year of Voralis Labs") -> str:
    return (
        "<structured_plan><deep_analysis>Two founding years are needed.</deep_analysis><rubric>"
        f"<knowledge_checklist>- {plan_item}</knowledge_checklist>"
        "<analytical_criteria>- compare the years</analytical_criteria>"
        "<negative_constraints>- no look-alike companies</negative_constraints></rubric>"
        "<research_plan>1. Search both.</research_plan></structured_plan>\n"
        '<call_tool name="search">Voralis Labs founded</call_tool>'
        '<tool_output><snippet id="D1">Voralis Labs: Voralis Labs was founded in 1950.</snippet></tool_output>'
        "<state_evaluation>Found D1. Verdict: ready</state_evaluation>\n"
        "<review><rubric_review>- founding year → D1</rubric_review><writing_plan><thesis>t</thesis>"
        "<outline>o</outline></writing_plan></review>\n"
        f"<answer>{answer}</answer>"
    )


ROLLOUTS = [
    JudgeRollout(f"t{i}", trace(f'<cite id="D1">Voralis Labs was founded in 1950</cite>. Answer {i}.'))
    for i in range(3)
]
RUBRICS = [
    Rubric.create(
        "q1", "answer", "positive", "States Voralis Labs' founding year", "1950 with a citation", 2, "persistent"
    ),
    Rubric.create(
        "q1", "answer", "negative", "Confuses Voralis Labs with Voralis Group", "wrong year", 2, "persistent"
    ),
    Rubric.create("q1", "research", "positive", "Searches for Keto Works", "a targeted search", 3),
]
NEW_RUBRICS = {
    "plan": [{"polarity": "positive", "title": "Plans to find both founding years", "description": "d", "weight": 2}],
    "research": [
        {"polarity": "negative", "title": "Searches for Voralis Group instead", "description": "d", "weight": 1}
    ],
    "review": [],
    "answer": [
        {"polarity": "positive", "title": "Names Keto Works as the older company", "description": "d", "weight": 3},
        {"polarity": "positive", "title": "Wraps the claims in cite tags", "description": "format only", "weight": 1},
    ],
}


def rubric_ids_in(body: dict[str, Any]) -> list[str]:
    user = next(m["content"] for m in body["messages"] if m["role"] == "user")
    sections = dict(split_sections(user))
    return [json.loads(line)["id"] for line in sections["RUBRICS"].splitlines()]


def is_repair(body: dict[str, Any]) -> bool:
    return body["messages"][-1]["role"] == "user" and "could not be used" in body["messages"][-1]["content"]


def good_reply(body: dict[str, Any]) -> str:
    """A well-behaved judge model: new rubrics, or score 2 for every id of the prompt."""
    user = next(m["content"] for m in body["messages"] if m["role"] == "user")
    if user.startswith("TASK: write new rubrics"):
        return json.dumps(NEW_RUBRICS)
    return json.dumps(
        {
            "scores": [
                {"rubric_id": rid, "justification": "seen in the answer", "score": 2} for rid in rubric_ids_in(body)
            ]
        }
    )


def settings(server: FakeOpenAIServer, **overrides: Any) -> EndpointSettings:
    """The judge's endpoint on the fake server (tests.llm_endpoints' settings, with the judge's model and key)."""
    values: dict[str, Any] = dict(model="openai/judge-model", api_key=API_KEY, max_retries=2, backoff_max_s=0.02)
    return make_settings(server, **{**values, **overrides})


def score_inputs(rollouts=ROLLOUTS, rubrics=RUBRICS) -> list[ScoringInput]:
    return [ScoringInput(QUERY, rollout, rubrics) for rollout in rollouts]
