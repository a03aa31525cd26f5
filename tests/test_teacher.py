"""The built-in teacher through litellm, the multi-round loop, and rejection filtering (no Prefect)."""

from __future__ import annotations

import json
import re

import pytest

from rubricem_core.config import TeacherConfig
from rubricem_core.filtering import filter_trace
from rubricem_core.llm.types import EndpointSettings
from rubricem_core.scaffold import validate
from rubricem_core.sim.teacher import register_builtin_teacher, understand_question
from rubricem_core.sim.world import WorldConfig, generate_world
from rubricem_core.teacher.collection import run_rounds_in_memory
from rubricem_core.teacher.rounds import initial_states
from rubricem_core.tools.base import ToolEnv
from tests.teacher_traces import tools  # noqa: F401  (a module fixture over this module's world)

MODEL = "rubricem-teacher/scripted"


@pytest.fixture(scope="module")
def world():
    return generate_world(WorldConfig(seed=3, n_documents=150, n_queries=16, eval_fraction=0.0))


def collect(world, tools, max_rounds=12, max_tool_calls=10, **rates):
    cfg = TeacherConfig(
        **{"skip_stage_rate": 0, "malformed_call_rate": 0, "uncited_rate": 0, "ungrounded_rate": 0, **rates}
    )
    register_builtin_teacher(cfg, max_tool_calls=max_tool_calls)
    settings = EndpointSettings(model=MODEL, max_concurrency=4, max_retries=0, timeout_s=30)
    queries = [q for q in world.queries_table().to_pylist()]
    states = initial_states(queries, trajectories_per_query=1, seed=0)
    run_rounds_in_memory(states, settings, ToolEnv(tools, max_calls=10**6), max_rounds, max_tool_calls)
    return queries, states


def test_question_forms_of_every_kind_are_understood(world):
    kinds = {q.kind for q in world.queries}
    assert kinds == {"comparison", "multi_hop", "aggregation", "timeline"}
    for q in world.queries:
        task = understand_question(q.question)
        assert task is not None, q.question
        assert task.subjects == json.loads(json.dumps(q.spec))["subjects"]


def test_clean_teacher_writes_valid_grounded_correct_traces(world, tools):
    queries, states = collect(world, tools)
    assert all(s.finished for s in states)
    ref = {q["query_id"]: q["reference_answer"] for q in queries}
    accepted = correct = 0
    for s in states:
        decision = filter_trace(s.text, s.n_tool_calls, s.finish_reason)
        accepted += decision.accepted
        answer = s.text.split("<answer>")[-1]
        correct += ref[s.query_id].replace(",", "") in answer.replace(",", "")
    assert sum(s.n_tool_calls for s in states) / len(states) >= 2, "queries need several searches"
    assert accepted / len(states) >= 0.8
    assert correct / len(states) >= 0.7


@pytest.mark.parametrize(
    "rates, code",
    [
        ({"uncited_rate": 1.0}, "uncited_answer"),
        ({"ungrounded_rate": 1.0}, "ungrounded_citation"),
        ({"malformed_call_rate": 1.0}, "malformed_tool_call"),
    ],
)
def test_injected_errors_are_rejected_with_their_code(world, tools, rates, code):
    _, states = collect(world, tools, **rates)
    decisions = [filter_trace(s.text, s.n_tool_calls, s.finish_reason) for s in states]
    hits = sum(code in d.reject_reasons for d in decisions)
    assert hits / len(states) >= 0.6, [d.reject_reasons for d in decisions]


def test_skipped_stages_fail_validation(world, tools):
    _, states = collect(world, tools, skip_stage_rate=1.0)
    assert all(not filter_trace(s.text, s.n_tool_calls, s.finish_reason).accepted for s in states)


def test_tool_budget_ends_the_search(world, tools):
    _, states = collect(world, tools, max_tool_calls=1)
    for s in states:
        assert s.finished
        # one real call, then the teacher must answer (possibly admitting gaps)
        assert s.n_tool_calls <= 2
        assert "<answer>" in s.text or s.finish_reason != "answered"


def test_teacher_never_reads_ground_truth(world, tools):
    """With search disabled the teacher cannot find facts, so it must not state the answer."""
    broken = {"search": lambda q: (_ for _ in ()).throw(RuntimeError("index down")), "browse": tools["browse"]}
    queries, states = collect(world, broken, max_rounds=6)
    ref = {q["query_id"]: q["reference_answer"] for q in queries}
    for s in states:
        answer = s.text.split("<answer>")[-1] if "<answer>" in s.text else ""
        assert "<cite" not in answer
        assert ref[s.query_id] not in answer
        assert validate(s.text)  # not a clean trace


def _reflect(question: str, text: str) -> str:
    from rubricem_core.reflection.format import reflection_messages
    from rubricem_core.sim.provider import message_text
    from rubricem_core.sim.teacher import ScriptedTeacher, TeacherRates

    messages = reflection_messages(question, text)
    assert message_text(messages[0]["content"])  # the meta-policy's own prompt
    return ScriptedTeacher(TeacherRates()).respond(messages, {"seed": 0})


def test_teacher_reflections_are_valid_and_grounded_in_the_trajectory(world, tools):
    """The built-in teacher answers the meta-policy's reflection prompt in its format: every reflection
    passes the validator, names the documents where the trajectory found its facts, and says which
    facts a trajectory never found and that it never answered."""
    from rubricem_core.reflection.format import parse_reflection, validate_reflection

    queries, states = collect(world, tools)
    question = {q["query_id"]: q["question"] for q in queries}
    for s in states:
        text = _reflect(question[s.query_id], s.text)
        assert validate_reflection(text, s.text, question[s.query_id]) == [], text
        reflection = parse_reflection(text)
        found = re.findall(r'<snippet id="([^"]+)"', s.text)
        assert any(doc in " ".join(reflection.takeaways) for doc in found), (text, found)
    # the same question, but the attempt stops after its plan: no fact found, no answer
    s = states[0]
    cut = s.text.split("<tool_output>")[0]
    text = _reflect(question[s.query_id], cut)
    assert validate_reflection(text, cut, question[s.query_id]) == []
    takeaways = " ".join(parse_reflection(text).takeaways)
    assert "was never found" in takeaways and "without an answer" in takeaways
    subjects = understand_question(question[s.query_id]).subjects
    assert subjects[0] in text


def test_teacher_reflection_of_a_question_outside_the_world():
    from rubricem_core.reflection.format import validate_reflection

    text = _reflect(
        "Why do migrating birds fly in a V formation?",
        '<call_tool name="search">bird V formation</call_tool><tool_output>nothing</tool_output><answer>Drafting.</answer>',
    )
    assert validate_reflection(text) == [] and "bird V formation" in text and "cites nothing" in text


def test_the_terse_style_keeps_every_tag_fact_and_source_in_fewer_words(world, tools):
    from rubricem_core.sim.judge import Context, score_rubric
    from rubricem_core.sim.trace_view import TraceView

    queries, full = collect(world, tools)
    _, terse = collect(world, tools, style="terse")
    by_id = {q["query_id"]: q for q in queries}
    for a, b in zip(full, terse):
        assert a.query_id == b.query_id and a.n_tool_calls == b.n_tool_calls  # the same searches
        assert a.text.split("<answer>")[-1] == b.text.split("<answer>")[-1]  # the same cited answer
        assert (
            filter_trace(a.text, a.n_tool_calls, a.finish_reason).accepted
            == filter_trace(b.text, b.n_tool_calls, b.finish_reason).accepted
        )
        # the judge's plan and review rubrics score each required fact the same in both styles
        query = by_id[a.query_id]
        ctx = Context(query["question"], json.loads(query["spec"]), [])
        for fact in json.loads(query["metadata"])["required_facts"]:
            for kind in ("plan_covers", "review_maps"):
                rubric = {
                    "stage": "plan",
                    "check": {"type": kind, "entity": fact["entity"], "attribute": fact["attribute"]},
                }
                assert (
                    score_rubric(TraceView(a.text), rubric, ctx)[0] == score_rubric(TraceView(b.text), rubric, ctx)[0]
                )

    def written(text: str) -> int:  # what the teacher wrote: the text without the tool outputs
        return len(re.sub(r"<tool_output>.*?</tool_output>", "", text, flags=re.S))

    shrink = sum(written(b.text) for b in terse) / sum(written(a.text) for a in full)
    assert shrink < 0.85, shrink  # measured 0.78: the plan, state evaluations and review shrink; the answer stays
