"""The stagewise judge of one RL step, without orchestration: the judge of a run's config, the groups
it judges from a step's `rollouts` rows, and the tables its judgments make.

    judge = step_judge(cfg, judged_stages, api_key)
    results = judge_step(judge, judge_groups(rollouts, queries, query_ids), buffers, step)   # or streamed
    changed = mark_failures(rollouts, errors)                     # the judge's verdict on each rollout row

rubricem_core.rl.steps drives it with the RL session's rubric buffers (and its streaming judge).
"""

from __future__ import annotations

import json
from typing import Any

from rubricem_core.config import JudgeConfig, RunConfig
from rubricem_core.judge.llm_judge import GroupJudgment, JudgeOptions, LLMJudge
from rubricem_core.judge.types import JudgeQuery, JudgeRollout
from rubricem_core.llm.endpoints import builtin_provider, endpoint_for


class JudgeStepError(RuntimeError):
    """Too few of a step's rollouts could be judged to train on them."""


def judge_query(q: dict[str, Any]) -> JudgeQuery:
    """What the judge is told of a `queries` row."""
    spec = json.loads(q["spec"]) if q.get("spec") else None
    return JudgeQuery(q["query_id"], q["question"], spec=spec, reference_answer=q.get("reference_answer"))


def judge_options(cfg: RunConfig, judged_stages: tuple[str, ...], builtin: bool) -> JudgeOptions:
    """The stagewise judge's options for this run's recipe and judge."""
    # A recipe that judges the answer alone (baseline: DR Tulu's evolving-answer objective; meta_policy:
    # the same plus reflections) has its judge read the question and the final answer only. The built-in
    # judge keeps the whole trajectory: its answer checks verify citations against the snippets the
    # research retrieved (without them every citation reads as invented).
    answer_only = tuple(judged_stages) == ("answer",) and not builtin
    return JudgeOptions.from_config(
        cfg.judge,
        seed=cfg.seed,
        rubric_stages=judged_stages,
        view="answer" if answer_only else "trajectory",
    )


def step_judge(cfg: RunConfig, judged_stages: tuple[str, ...], api_key: str | None) -> LLMJudge:
    """The run's stagewise judge (``judge`` endpoint, the recipe's judged stages)."""
    builtin = builtin_provider(cfg.judge.model) == "rubricem-judge"
    settings = endpoint_for(cfg.judge, api_key=api_key)
    return LLMJudge(settings, judge_options(cfg, judged_stages, builtin))


def judge_groups(
    rollouts: list[dict[str, Any]], queries: dict[str, dict[str, Any]], query_ids: tuple[str, ...] | list[str]
) -> list[tuple[JudgeQuery, list[JudgeRollout]]]:
    """Each query's group of `rollouts` rows, in ``query_ids`` order, as the judge reads them."""
    return [
        (
            judge_query(queries[qid]),
            [JudgeRollout(r["rollout_id"], r["text"]) for r in rollouts if r["query_id"] == qid],
        )
        for qid in query_ids
    ]


def mark_failures(rollouts: list[dict[str, Any]], errors: dict[str, str]) -> bool:
    """Set each `rollouts` row's judge_failed/judge_error to the judge's verdict (``errors``: the failed
    judgments' errors by rollout id); whether that changed any row (with every judgment in, the rollouts
    partition stays as sampled)."""
    if all(
        r["judge_failed"] == (r["rollout_id"] in errors) and r["judge_error"] == errors.get(r["rollout_id"])
        for r in rollouts
    ):
        return False
    for r in rollouts:
        r["judge_failed"] = r["rollout_id"] in errors
        r["judge_error"] = errors.get(r["rollout_id"])
    return True


def check_enough_judged(step: int, n_rollouts: int, errors: dict[str, str], judge: JudgeConfig) -> None:
    """Raise JudgeStepError when too few rollouts were judged to train on (judge.min_judged_fraction)."""
    judged = n_rollouts - len(errors)
    if judged == 0 or judged < judge.min_judged_fraction * n_rollouts:
        # Nothing is marked done: no rubrics, scores or rewards of this step; the rerun re-judges it
        # from the buffers of the step before (rebuilt from the tables).
        first = "; ".join(f"{rid}: {err}" for rid, err in list(errors.items())[:3])
        raise JudgeStepError(
            f"step {step}: {len(errors)} of {n_rollouts} judgments failed (judge.min_judged_fraction="
            f"{judge.min_judged_fraction}); nothing was trained or checkpointed; fix the judge endpoint "
            f"({judge.model}) and rerun to re-judge this step. First errors: {first}"
        )


def check_streamed(results: list[GroupJudgment], rollouts: list[dict[str, Any]]) -> None:
    """The streamed groups judged exactly the rollouts the table holds (ids and texts were made by one path)."""
    judged = [rid for g in results for rid in g.rollout_ids]
    if judged != [r["rollout_id"] for r in rollouts]:
        raise RuntimeError(f"the streamed judge judged rollouts {judged[:4]}..., the table holds others")
