"""Teacher-written traces of the synthetic world and the built-in judge's answer rewards on them: shared by the
built-in judge and grader tests."""

from __future__ import annotations

import json

import numpy as np
import pytest

from rubricem_core.config import TeacherConfig
from rubricem_core.judge.buffer import RubricBuffer
from rubricem_core.judge.llm_judge import ScoringInput
from rubricem_core.judge.types import JudgeQuery, JudgeRollout, Rubric
from rubricem_core.llm.types import EndpointSettings
from rubricem_core.sim.teacher import register_builtin_teacher
from rubricem_core.sim.world import World, WorldConfig, generate_world
from rubricem_core.teacher.collection import run_rounds_in_memory
from rubricem_core.teacher.rounds import initial_states
from rubricem_core.tools.base import Tool, ToolEnv
from rubricem_core.tools.local import LocalBrowseTool, LocalSearchTool

TEACHER = "rubricem-teacher/scripted"
ANSWER = 3  # column of the answer stage in R


def teacher_tools(world: World) -> dict[str, Tool]:
    """The search (top 5) and browse tools the teacher's traces are written with, over the world's corpus."""
    corpus = world.corpus_table()
    return {"search": LocalSearchTool(corpus, top_k=5), "browse": LocalBrowseTool(corpus)}


@pytest.fixture(scope="module")
def world() -> World:
    """Module fixture: the judge and grader tests' world, 150 documents and 8 queries, all train."""
    return generate_world(WorldConfig(seed=3, n_documents=150, n_queries=8, eval_fraction=0.0))


@pytest.fixture(scope="module")
def tools(world: World) -> dict[str, Tool]:
    """Module fixture: teacher_tools over the importing module's ``world`` fixture (this one or its own)."""
    return teacher_tools(world)


def write_traces(queries, tools, max_tool_calls=10, **rates) -> dict[str, str]:
    """One teacher trace per query (seeded: the same query gets the same searches across variants)."""
    cfg = TeacherConfig(
        **{"skip_stage_rate": 0, "malformed_call_rate": 0, "uncited_rate": 0, "ungrounded_rate": 0, **rates}
    )
    register_builtin_teacher(cfg, max_tool_calls=max_tool_calls)
    settings = EndpointSettings(model=TEACHER, max_concurrency=4, max_retries=0, timeout_s=30)
    states = initial_states(queries, trajectories_per_query=1, seed=0)
    run_rounds_in_memory(states, settings, ToolEnv(tools, max_calls=10**6), 12, max_tool_calls)
    return {s.query_id: s.text for s in states}


def judge_query(row) -> JudgeQuery:
    return JudgeQuery(row["query_id"], row["question"], json.loads(row["spec"]), row["reference_answer"])


def persistent(row) -> list[Rubric]:
    return RubricBuffer.from_query(row["query_id"], row["rubrics"]).active()


def answer_rewards(judge, queries, traces: dict[str, str]) -> np.ndarray:
    from rubricem_core.judge.aggregate import stage_scores

    inputs = [
        ScoringInput(judge_query(q), JudgeRollout(q["query_id"], traces[q["query_id"]]), persistent(q)) for q in queries
    ]
    judgments = judge.score(inputs)
    assert not any(j.failed for j in judgments), [j.error for j in judgments]
    return np.array([stage_scores([j], i.rubrics)[0, ANSWER] for j, i in zip(judgments, inputs)])
