"""Judge calls of one RL step: ours (one generation call per query + one scoring call per trajectory)
against per-rubric scoring (one call per trajectory × rubric), on the synthetic world.

Rollouts are written by the built-in teacher with its local tools (no Prefect), with error rates so
that a group differs; the built-in judge answers through litellm, the same path a real judge takes.

    .venv/bin/python bench/judge_calls.py [--queries 8] [--rollouts 8] [--seed 0]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rubricem_core.offline import apply_offline_defaults  # noqa: E402

apply_offline_defaults()

from rubricem_core.config import TeacherConfig  # noqa: E402
from rubricem_core.judge.buffer import RubricBuffer  # noqa: E402
from rubricem_core.judge.llm_judge import LLMJudge, judge_step  # noqa: E402
from rubricem_core.judge.types import JudgeQuery, JudgeRollout  # noqa: E402
from rubricem_core.llm.types import EndpointSettings  # noqa: E402
from rubricem_core.scaffold import STAGES  # noqa: E402
from rubricem_core.sim.judge import register_builtin_judge  # noqa: E402
from rubricem_core.sim.teacher import register_builtin_teacher  # noqa: E402
from rubricem_core.sim.world import WorldConfig, generate_world  # noqa: E402
from rubricem_core.teacher.collection import run_rounds_in_memory  # noqa: E402
from rubricem_core.teacher.rounds import initial_states  # noqa: E402
from rubricem_core.tools.base import ToolEnv  # noqa: E402
from rubricem_core.tools.local import LocalBrowseTool, LocalSearchTool  # noqa: E402

TEACHER = "rubricem-teacher/scripted"
MAX_ROUNDS = 12
MAX_TOOL_CALLS = 8


def write_rollouts(queries: list[dict], tools: dict, n: int, seed: int) -> dict[str, list[JudgeRollout]]:
    cfg = TeacherConfig(skip_stage_rate=0.1, malformed_call_rate=0.15, uncited_rate=0.2, ungrounded_rate=0.2)
    register_builtin_teacher(cfg, max_tool_calls=MAX_TOOL_CALLS)
    settings = EndpointSettings(model=TEACHER, max_concurrency=8, max_retries=0, timeout_s=60)
    states = initial_states(queries, trajectories_per_query=n, seed=seed)
    run_rounds_in_memory(states, settings, ToolEnv(tools, max_calls=10**6), MAX_ROUNDS, MAX_TOOL_CALLS)
    out: dict[str, list[JudgeRollout]] = {}
    for s in states:
        out.setdefault(s.query_id, []).append(JudgeRollout(s.trajectory_id, s.text))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--queries", type=int, default=8)
    parser.add_argument("--rollouts", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--cap", type=int, default=4, help="adaptive rubrics kept per stage")
    args = parser.parse_args()

    world = generate_world(WorldConfig(seed=args.seed, n_documents=400, n_queries=args.queries, eval_fraction=0.0))
    corpus = world.corpus_table()
    tools = {"search": LocalSearchTool(corpus, top_k=5), "browse": LocalBrowseTool(corpus)}
    queries = world.queries_table().to_pylist()

    started = time.perf_counter()
    rollouts = write_rollouts(queries, tools, args.rollouts, args.seed)
    teacher_s = time.perf_counter() - started

    judge = LLMJudge(EndpointSettings(model=register_builtin_judge(), max_concurrency=8, max_retries=0, timeout_s=120))
    buffers = {
        q["query_id"]: RubricBuffer.from_query(q["query_id"], q["rubrics"], cap_per_stage=args.cap) for q in queries
    }
    groups = [
        (
            JudgeQuery(q["query_id"], q["question"], json.loads(q["spec"]), q["reference_answer"]),
            rollouts[q["query_id"]],
        )
        for q in queries
    ]
    started = time.perf_counter()
    results = judge_step(judge, groups, buffers, step=0)
    judge_s = time.perf_counter() - started

    per_rubric = judge.usage.calls["generate"]  # it needs the rubrics too
    print(
        f"{'query':<10} {'kind':<11} {'n':>2} {'rubrics':>7} {'added':>5} {'pruned':>6} {'failed':>6}  "
        + "  ".join(f"R_{s:<8}" for s in STAGES)
    )
    for q, group in zip(queries, results):
        per_rubric += len(group.judgments) * len(group.rubrics)
        means = [np.nanmean(col) if not np.isnan(col).all() else float("nan") for col in group.R.T]
        print(
            f"{group.query_id:<10} {q['kind']:<11} {len(group.judgments):>2} {len(group.rubrics):>7} "
            f"{len(group.added):>5} {len(group.pruned):>6} {group.n_failed:>6}  "
            + "  ".join(f"{m:<10.2f}" for m in means)
        )
    usage = judge.usage
    ours = usage.total_calls
    print(f"teacher rollouts: {sum(len(r) for r in rollouts.values())} in {teacher_s:.1f}s; judge step: {judge_s:.1f}s")
    print(
        f"judge calls: generate {usage.calls['generate']} + score {usage.calls['score']} "
        f"+ repairs {sum(usage.repairs.values())}; failures {usage.failures}; "
        f"tokens {usage.prompt_tokens} prompt / {usage.completion_tokens} completion"
    )
    print(
        f"figure: judge_calls={ours} calls  goal: < {per_rubric} calls of per-rubric scoring  "
        f"met: {'yes' if ours < per_rubric else 'no'}"
    )


if __name__ == "__main__":
    main()
