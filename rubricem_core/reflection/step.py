"""Judging one step's reflection candidates, without orchestration: the reflection judge of a run's
config, its privileged inputs from the step's judge tables, and the `reflections` rows it makes.

    judge = reflection_judge(cfg, api_key)
    judged = judge_candidates(
        judge, cfg, step, queries, sources, groups, stop_texts, rubric_rows, score_rows, seconds, tokenizer.decode
    )

rubricem_core.rl.steps samples the candidates with the RL session's engine and banks the accepted ones.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from rubricem_core.config import RunConfig
from rubricem_core.judge.types import JudgeQuery
from rubricem_core.llm.endpoints import endpoint_for
from rubricem_core.reflection.judge import (
    ReflectionJudge,
    ReflectionJudgeInput,
    ReflectionJudgeOptions,
    reflection_rows,
)
from rubricem_core.reflection.meta import candidate_text, judge_view, reflection_metrics, trained_mask
from rubricem_core.schemas import nan_to_none
from rubricem_core.trajectory import TokenTrajectory


def reflection_judge(cfg: RunConfig, api_key: str | None) -> ReflectionJudge:
    """The run's reflection judge (``reflection.judge`` endpoint)."""
    endpoint = cfg.reflection.judge
    settings = endpoint_for(endpoint, api_key=api_key)
    options = ReflectionJudgeOptions.from_config(
        endpoint,
        seed=cfg.seed,
        max_trajectory_chars=endpoint.max_attempt_chars,
        validity=cfg.reflection.validity,
        judge_invalid=cfg.reflection.invalid_candidates == "judged",
    )
    return ReflectionJudge(settings, options)


@dataclass
class JudgedCandidates:
    """A step's `reflections` rows (token columns included), their metrics, and how many trajectories
    they reflect on."""

    rows: list[dict[str, Any]]
    metrics: dict[str, float]
    n_sources: int


def judge_candidates(
    judge: ReflectionJudge,
    cfg: RunConfig,
    step: int,
    queries: dict[str, dict[str, Any]],
    sources: dict[str, dict[str, Any]],
    groups: Sequence[list[TokenTrajectory]],
    stop_texts: Sequence[str],
    rubric_rows: list[dict[str, Any]],
    score_rows: list[dict[str, Any]],
    generate_seconds: float,
    decode: Callable[[list[int]], str],
) -> JudgedCandidates:
    """Score each source rollout's candidates (``groups``, in ``sources`` order, sampled in
    ``generate_seconds``) with the privileged view (the rubrics it was scored on, its scores and
    justifications, from the step's judge tables). ``decode`` (the policy tokenizer's) finds a valid
    candidate's format tags, which its ``loss_mask`` leaves out unless ``reflection.train_format_tags``."""
    inputs: list[ReflectionJudgeInput] = []
    trajs: dict[tuple[str, int], TokenTrajectory] = {}
    for (qid, src), group in zip(sources.items(), groups):
        rubrics, judgment = judge_view(qid, src["rollout_id"], rubric_rows, score_rows)
        q = queries[qid]
        inputs.append(
            ReflectionJudgeInput(
                query=JudgeQuery(
                    qid,
                    q["question"],  # the answer key only where the task judge may see it
                    reference_answer=q.get("reference_answer") if cfg.judge.show_reference else None,
                ),
                source_rollout_id=src["rollout_id"],
                trajectory_text=src["text"],
                candidates=[candidate_text(t, stop_texts) for t in group],
                rubrics=rubrics,
                judgment=judgment,
            )
        )
        for i, candidate in enumerate(group):
            trajs[(src["rollout_id"], i)] = candidate
    t0 = time.perf_counter()
    scores = judge.score(inputs)
    judge_seconds = time.perf_counter() - t0
    rows = reflection_rows(step, scores, cfg.reflection.min_score)
    for row in rows:
        traj = trajs[(row["source_rollout_id"], row["candidate"])]
        untrained_tags = row["valid"] and not cfg.reflection.train_format_tags
        row.update(
            token_ids=traj.token_ids,
            loss_mask=trained_mask(traj, decode) if untrained_tags else traj.loss_mask,
            n_tokens=len(traj),
            logprobs=[nan_to_none(x) for x in traj.logprobs],
            finish_reason=traj.finish_reason,
        )
    metrics = reflection_metrics(rows)
    metrics.update(judge.usage.metrics())
    metrics["reflection/generate_seconds"] = generate_seconds
    metrics["reflection/judge_seconds"] = judge_seconds
    return JudgedCandidates(rows, metrics, len(inputs))
