"""The built-in judge on teacher-written traces of the synthetic world, through the litellm path."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest

from rubricem_core.judge.buffer import RubricBuffer
from rubricem_core.judge.llm_judge import GenerationInput, LLMJudge, ScoringInput, judge_step
from rubricem_core.judge.prompts import generation_messages, scoring_messages
from rubricem_core.judge.types import JudgeQuery, JudgeRollout, Rubric
from rubricem_core.llm.types import EndpointSettings
from rubricem_core.sim.judge import (
    BuiltinJudgeError,
    Context,
    parse_prompt,
    register_builtin_judge,
    respond,
    score_rubric,
)
from rubricem_core.sim.trace_view import TraceView
from tests.teacher_traces import (  # noqa: F401  (tools, world: module fixtures)
    ANSWER,
    answer_rewards,
    judge_query,
    persistent,
    tools,
    world,
    write_traces,
)


@pytest.fixture(scope="module")
def queries(world):
    return world.queries_table().to_pylist()


@pytest.fixture(scope="module")
def variants(queries, tools):
    return {
        "clean": write_traces(queries, tools),
        "uncited": write_traces(queries, tools, uncited_rate=1.0),
        "wrong": write_traces(queries, tools, ungrounded_rate=1.0),
        "one_search": write_traces(queries, tools, max_tool_calls=1),
        "no_review": write_traces(queries, tools, skip_stage_rate=1.0),
    }


@pytest.fixture(scope="module")
def judge():
    model = register_builtin_judge()
    return LLMJudge(EndpointSettings(model=model, max_concurrency=4, max_retries=0, timeout_s=60))


# ---- answer scores order traces the way a grader would -----------------------------------------------


def test_clean_cited_traces_score_full_marks(judge, queries, variants):
    clean = answer_rewards(judge, queries, variants["clean"])
    assert (clean == 1.0).mean() >= 0.75, clean


@pytest.mark.parametrize("variant", ["uncited", "wrong"])
def test_correct_cited_answers_beat_uncited_and_wrong_ones(judge, queries, variants, variant):
    clean = answer_rewards(judge, queries, variants["clean"])
    worse = answer_rewards(judge, queries, variants[variant])
    assert (clean > worse).all(), (clean, worse)
    assert clean.mean() - worse.mean() >= 0.15


def test_each_criterion_explains_itself(judge, queries, variants):
    row = queries[0]
    inputs = [
        ScoringInput(judge_query(row), JudgeRollout(v, variants[v][row["query_id"]]), persistent(row))
        for v in ("clean", "uncited")
    ]
    clean, uncited = judge.score(inputs)
    fact_ids = [r.rubric_id for r in inputs[0].rubrics if r.check["type"] == "fact"]
    for rubric_id in fact_ids:
        assert clean.score_of(rubric_id) == 2 and uncited.score_of(rubric_id) == 1
    justification = next(s.justification for s in clean.scores if s.rubric_id == fact_ids[0])
    assert re.search(r'<cite id="D\d+">', justification) and "supports" in justification
    assert all(s.justification for s in clean.scores + uncited.scores)


def test_wrong_value_negative_rubric_fires_on_a_confused_answer(queries, variants):
    """Swap a fact's value for its look-alike's (citing the look-alike's snippet): the negative fires."""
    done = 0
    for row in queries:
        rubrics = persistent(row)
        negative = next(r for r in rubrics if r.polarity == "negative")
        twin = negative.check.get("confusable")
        text = variants["clean"][row["query_id"]]
        view = TraceView(text)
        twin_docs = [
            d for d, facts in view.snippet_facts.items() if any(f.entity == (twin or {}).get("entity") for f in facts)
        ]
        if twin is None or not twin_docs or negative.check["attribute"] not in ("founded", "employees"):
            continue
        entity, value = negative.check["entity"], negative.check["value"]
        claim = re.search(rf'<cite id="([^"]+)">({re.escape(entity)}[^<]*)</cite>', text)
        wrong_claim = claim.group(2).replace(f"{int(value):,}" if "," in claim.group(2) else value, twin["value"])
        confused = text.replace(claim.group(0), f'<cite id="{twin_docs[0]}">{wrong_claim}</cite>')
        ctx = Context(row["question"], json.loads(row["spec"]), [{"check": r.check} for r in rubrics])
        rubric = {"stage": "answer", "check": negative.check}
        assert score_rubric(TraceView(text), rubric, ctx)[0] == 0
        score, why = score_rubric(TraceView(confused), rubric, ctx)
        assert score == 2 and twin["value"] in why
        distractor = {"stage": "answer", "check": {"type": "cites_distractor", "entity": twin["entity"]}}
        assert score_rubric(TraceView(confused), distractor, ctx)[0] == 2
        assert score_rubric(TraceView(text), distractor, ctx)[0] == 0
        # contrasted in a group, the look-alike becomes a negative answer rubric
        group = [JudgeRollout("clean", text), JudgeRollout("confused", confused)]
        reply = json.loads(respond(generation_messages(judge_query(row), group, rubrics, 3), {}))
        [proposed] = [r for r in reply["answer"] if r["check"] == distractor["check"]]
        assert proposed["polarity"] == "negative" and proposed["title"] == f"Relies on documents about {twin['entity']}"
        done += 1
    assert done >= 1, "the fixture world should hold a query whose trace retrieved the look-alike"


# ---- rubric generation by contrast --------------------------------------------------------------------


def group_of(row, variants, names) -> list[JudgeRollout]:
    return [JudgeRollout(name, variants[name][row["query_id"]]) for name in names]


def test_generation_proposes_only_discriminative_rubrics(judge, queries, variants):
    names = ["clean", "uncited", "wrong", "one_search", "no_review"]
    rows = queries[:4]
    outcomes = judge.generate(
        [GenerationInput(judge_query(q), group_of(q, variants, names), persistent(q)) for q in rows]
    )
    stages_seen = set()
    for row, outcome in zip(rows, outcomes):
        assert not outcome.failed, outcome.error
        assert outcome.rubrics, row["question"]
        rubrics = [
            Rubric.create(row["query_id"], r.stage, r.polarity, r.title, r.description, r.weight, check=r.check)
            for r in outcome.rubrics
        ]
        judgments = judge.score(
            [ScoringInput(judge_query(row), rollout, rubrics) for rollout in group_of(row, variants, names)]
        )
        for rubric in rubrics:
            scores = [j.score_of(rubric.rubric_id) for j in judgments]
            assert len(set(scores)) > 1, (rubric.title, scores)  # it separates the group
        titles = [r.title for r in rubrics]
        assert len({t.lower() for t in titles}) == len(titles)
        assert not {t.lower() for t in titles} & {r["title"].lower() for r in row["rubrics"]}
        stages_seen |= {r.stage for r in rubrics}
    assert stages_seen >= {"research", "review", "answer"}


def test_a_fact_some_found_and_others_missed_becomes_a_research_rubric(judge, queries, variants):
    """With one search the teacher finds one fact; the full trace finds all: 'Searches for X's ...'."""
    row = next(q for q in queries if json.loads(q["spec"])["kind"] in ("comparison", "aggregation", "timeline"))
    missed = [
        f
        for f in (r.check for r in persistent(row) if r.check["type"] == "fact")
        if not TraceView(variants["one_search"][row["query_id"]]).found(f["entity"], f["attribute"])
    ]
    assert missed
    [outcome] = judge.generate(
        [GenerationInput(judge_query(row), group_of(row, variants, ["clean", "one_search"]), persistent(row))]
    )
    research = [r for r in outcome.rubrics if r.stage == "research" and r.check["type"] == "search_hit"]
    assert research, outcome.rubrics
    # only facts that separate the two rollouts: the ones the one-search trace missed
    assert {r.check["entity"] for r in research} <= {f["entity"] for f in missed}
    words = {"founded": "founding year", "employees": "employee count"}
    assert all(
        r.title.startswith(f"Searches for {r.check['entity']}'") and r.title.endswith(words[r.check["attribute"]])
        for r in research
    )


def test_identical_rollouts_get_no_new_rubrics(judge, queries, variants):
    row = queries[1]
    same = [JudgeRollout(f"t{i}", variants["clean"][row["query_id"]]) for i in range(3)]
    [outcome] = judge.generate([GenerationInput(judge_query(row), same, persistent(row))])
    assert not outcome.failed and outcome.rubrics == []


def test_generation_respects_the_stage_limit(queries, variants):
    row = queries[2]
    messages = generation_messages(
        judge_query(row),
        group_of(row, variants, ["clean", "one_search", "no_review"]),
        persistent(row),
        max_new_per_stage=1,
    )
    reply = json.loads(respond(messages, {}))
    assert all(len(reply[stage]) <= 1 for stage in ("plan", "research", "review", "answer"))


def test_judge_step_with_the_builtin_judge_evolves_the_buffer(judge, queries, variants):
    names = ["clean", "uncited", "wrong", "one_search", "no_review"]
    rows = queries[:3]
    buffers = {q["query_id"]: RubricBuffer.from_query(q["query_id"], q["rubrics"], cap_per_stage=2) for q in rows}
    groups = [(judge_query(q), group_of(q, variants, names)) for q in rows]
    first = judge_step(judge, groups, buffers, step=0)
    for group in first:
        assert group.added and group.n_failed == 0
        assert all(
            len([r for r in buffers[group.query_id].active(s) if r.origin == "adaptive"]) <= 2
            for s in ("plan", "research", "review", "answer")
        )
        assert not np.isnan(group.R[:, ANSWER]).any()
    # the clean trace leads the answer stage of its group
    for group in first:
        assert group.R[0, ANSWER] == np.nanmax(group.R[:, ANSWER])
    before = {qid: {r.key for r in buffer.active()} for qid, buffer in buffers.items()}
    second = judge_step(judge, groups, buffers, step=1)
    for group in second:
        assert not {r.key for r in group.added} & before[group.query_id]  # never a duplicate of a live rubric
        assert all(r.created_step == 1 for r in group.added)
        rows = buffers[group.query_id].rows(1)
        assert {row["rubric_id"] for row in rows if row["status"] == "pruned"} == {r.rubric_id for r in group.pruned}


# ---- generic (non-synthetic) queries ----------------------------------------------------------------


def test_non_synthetic_queries_get_lexical_criteria():
    question = "How did the Varn bridge change grain trade?"
    text = (
        "<structured_plan><deep_analysis>bridge and grain</deep_analysis><rubric><knowledge_checklist>- opening"
        "</knowledge_checklist><analytical_criteria>- effect</analytical_criteria><negative_constraints>- none"
        "</negative_constraints></rubric><research_plan>1. search</research_plan></structured_plan>"
        '<call_tool name="search">Varn bridge grain trade</call_tool><tool_output><snippet id="D8">Grain shipments'
        " through the port doubled after the Varn bridge opened.</snippet></tool_output>"
        "<state_evaluation>Verdict: ready</state_evaluation><review><rubric_review>- effect → D8</rubric_review>"
        "<writing_plan><thesis>t</thesis><outline>o</outline></writing_plan></review>"
        '<answer><cite id="D8">Grain shipments through the port doubled after the bridge opened</cite>.</answer>'
    )
    lazy = text.replace("Varn bridge grain trade", "history").split("<answer>")[0] + "<answer>No idea.</answer>"
    query = JudgeQuery("g1", question)
    on_topic = Rubric.create("g1", "answer", "positive", "Grain shipments doubled", "port grain shipments", 2)
    off_topic = Rubric.create("g1", "answer", "positive", "Discusses railway tariffs", "railway tariffs", 2)
    user = scoring_messages(query, JudgeRollout("a", text), [on_topic, off_topic])[1]["content"]
    scores = {
        s["rubric_id"]: s["score"] for s in json.loads(respond([{"role": "user", "content": user}], {}))["scores"]
    }
    assert scores == {on_topic.rubric_id: 2, off_topic.rubric_id: 0}
    messages = generation_messages(query, [JudgeRollout("a", text), JudgeRollout("b", lazy)], [], 3)
    reply = json.loads(respond(messages, {}))
    research_terms = [r["check"]["terms"][0] for r in reply["research"] if r["check"]["type"] == "terms"]
    assert {"varn", "bridge", "grain"} & set(research_terms)


# ---- the prompt round trip ----------------------------------------------------------------------------


def test_the_builtin_reads_back_what_the_prompt_carries(queries, variants):
    row = queries[0]
    text = variants["clean"][row["query_id"]]
    rubrics = persistent(row)
    user = scoring_messages(judge_query(row), JudgeRollout("x", text), rubrics)[1]["content"]
    parsed = parse_prompt(user)
    assert parsed.task == "score" and parsed.question == row["question"]
    assert parsed.spec == json.loads(row["spec"])
    assert [r["id"] for r in parsed.rubrics] == [r.rubric_id for r in rubrics]
    assert [r["check"] for r in parsed.rubrics] == [r.check for r in rubrics]
    [trajectory] = parsed.trajectories
    assert TraceView(trajectory).snippets == TraceView(text).snippets
    assert TraceView(trajectory).citations == TraceView(text).citations
    assert respond([{"role": "user", "content": user}], {}) == respond([{"role": "user", "content": user}], {})


def test_a_prompt_that_is_not_a_judge_prompt_is_refused():
    with pytest.raises(BuiltinJudgeError, match="not a judge prompt"):
        respond([{"role": "user", "content": "Write a poem."}], {})
