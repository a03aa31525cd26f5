"""Stage rewards from rubric scores: R[i, k] = Σ w·s′ / (2 Σ w) over the rubrics of stage k.

s′ = s for a positive rubric and 2 − s for a negative one, so every rubric pushes R towards 1 when
the trajectory does well by it. A stage without rubrics has no reward (NaN, stored as null), and a
failed judgment gives a NaN row: it is excluded from normalization, never read as zero. A stage the
trajectory never wrote earns 0 (``zero_absent_stages``): otherwise its negative rubrics, inverted,
would pay a trajectory for silence (no answer, no credit — the evaluation's rule too).

Two implementations — a plain loop that mirrors the formula and a vectorized one used in training —
are tested against each other and against numbers worked by hand.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from rubricem_core.judge.types import JudgeError, Rubric, TrajectoryJudgment
from rubricem_core.scaffold import STAGE_IDS, STAGES, stage_texts, strip_tags

N_STAGES = len(STAGES)


def _check_rubrics(rubrics: Sequence[Rubric]) -> None:
    seen: set[str] = set()
    for rubric in rubrics:
        if rubric.rubric_id in seen:
            raise JudgeError(f"rubric {rubric.rubric_id!r} is listed twice")
        seen.add(rubric.rubric_id)


def _score_map(judgment: TrajectoryJudgment, rubrics: Sequence[Rubric]) -> dict[str, int]:
    """Scores of a non-failed judgment for exactly ``rubrics``; a missing one is an error, not a zero."""
    scores = {s.rubric_id: s.score for s in judgment.scores}
    missing = [r.rubric_id for r in rubrics if r.rubric_id not in scores]
    if missing:
        raise JudgeError(f"judgment of rollout {judgment.rollout_id!r} has no score for rubrics {missing}")
    return scores


def stage_scores_loop(judgments: Sequence[TrajectoryJudgment], rubrics: Sequence[Rubric]) -> np.ndarray:
    """Reference implementation: the formula written as loops."""
    _check_rubrics(rubrics)
    out = np.full((len(judgments), N_STAGES), np.nan)
    for i, judgment in enumerate(judgments):
        if judgment.failed:
            continue
        scores = _score_map(judgment, rubrics)
        for k, stage in enumerate(STAGES):
            numerator = denominator = 0.0
            for rubric in rubrics:
                if rubric.stage != stage:
                    continue
                s = scores[rubric.rubric_id]
                s_prime = s if rubric.polarity == "positive" else 2 - s
                numerator += rubric.weight * s_prime
                denominator += 2 * rubric.weight
            out[i, k] = numerator / denominator if denominator > 0 else math.nan
    return out


def score_matrix(judgments: Sequence[TrajectoryJudgment], rubrics: Sequence[Rubric]) -> np.ndarray:
    """n × m raw scores (NaN rows for failed judgments), columns in ``rubrics`` order."""
    _check_rubrics(rubrics)
    matrix = np.full((len(judgments), len(rubrics)), np.nan)
    for i, judgment in enumerate(judgments):
        if not judgment.failed:
            scores = _score_map(judgment, rubrics)
            matrix[i] = [scores[r.rubric_id] for r in rubrics]
    return matrix


def stage_scores(judgments: Sequence[TrajectoryJudgment], rubrics: Sequence[Rubric]) -> np.ndarray:
    """n × 4 stage rewards in ``STAGES`` order (vectorized).

    Scores of rubrics not in ``rubrics`` are ignored: the caller picks the rubric set (e.g. the
    rubrics active when the group was scored).
    """
    S = score_matrix(judgments, rubrics)  # n × m
    if not rubrics:
        return np.full((len(judgments), N_STAGES), np.nan)
    w = np.array([r.weight for r in rubrics], dtype=float)  # m
    negative = np.array([r.polarity == "negative" for r in rubrics])
    onehot = np.zeros((len(rubrics), N_STAGES))  # m × 4: which stage each rubric belongs to
    onehot[np.arange(len(rubrics)), [STAGE_IDS[r.stage] for r in rubrics]] = 1.0
    S_prime = np.where(negative, 2.0 - S, S)
    numerator = (S_prime * w) @ onehot  # n × 4; NaN rows stay NaN
    denominator = 2.0 * (w @ onehot)  # 4
    with np.errstate(invalid="ignore", divide="ignore"):
        R = numerator / denominator
    R[:, denominator == 0] = np.nan
    return R


def written_stages(text: str) -> np.ndarray:
    """Bool (4,): whether the trajectory wrote any text (tags and tool outputs aside) in each stage."""
    texts = stage_texts(text)
    return np.array([bool(strip_tags(texts[stage]).strip()) for stage in STAGES])


def zero_absent_stages(R: np.ndarray, texts: Sequence[str]) -> np.ndarray:
    """R with 0 where a trajectory wrote nothing in a stage that has a reward (NaN stays NaN)."""
    if R.shape != (len(texts), N_STAGES):
        raise JudgeError(f"R has shape {R.shape}, expected ({len(texts)}, {N_STAGES})")
    written = np.array([written_stages(t) for t in texts]).reshape(len(texts), N_STAGES)
    return np.where(~written & ~np.isnan(R), 0.0, R)


def stage_reward_rows(
    step: int,
    query_id: str,
    rollout_ids: Sequence[str],
    R: np.ndarray,
    G: np.ndarray | None = None,
    A: np.ndarray | None = None,
) -> list[dict]:
    """``stage_rewards`` rows; R, G and A are None where NaN (G and A: None when not given)."""
    for name, values in (("R", R), ("G", G), ("A", A)):
        if values is not None and values.shape != (len(rollout_ids), N_STAGES):
            raise JudgeError(f"{name} has shape {values.shape}, expected ({len(rollout_ids)}, {N_STAGES})")

    def num(values: np.ndarray | None, i: int, k: int) -> float | None:
        return None if values is None or math.isnan(values[i, k]) else float(values[i, k])

    return [
        {
            "step": step,
            "query_id": query_id,
            "rollout_id": rollout_id,
            "stage": stage,
            "R": num(R, i, k),
            "G": num(G, i, k),
            "A": num(A, i, k),
        }
        for i, rollout_id in enumerate(rollout_ids)
        for k, stage in enumerate(STAGES)
    ]
