"""Stage rewards R = Σ w·s′ / (2 Σ w): hand-worked numbers, loop ≡ vectorized, failure handling."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest

from rubricem_core.judge.aggregate import stage_reward_rows, stage_scores, stage_scores_loop
from rubricem_core.judge.types import JudgeError, Rubric, RubricScore, TrajectoryJudgment
from rubricem_core.scaffold import STAGES
from rubricem_core.schemas import JUDGE_SCORES_SCHEMA

IMPLEMENTATIONS = [stage_scores, stage_scores_loop]


def rubric(name: str, stage: str, polarity: str, weight: float) -> Rubric:
    return Rubric.create("q1", stage, polarity, name, f"{name} description", weight)


def judged(rollout_id: str, rubrics: list[Rubric], scores: list[int]) -> TrajectoryJudgment:
    return TrajectoryJudgment(
        rollout_id,
        [RubricScore(r.rubric_id, r.stage, r.polarity, r.weight, s, "because") for r, s in zip(rubrics, scores)],
    )


# plan: P1 (+, w1), P2 (−, w2); research: S1 (+, w3); review: none; answer: A1 (+, w2), A2 (−, w1)
RUBRICS = [
    rubric("P1", "plan", "positive", 1),
    rubric("P2", "plan", "negative", 2),
    rubric("S1", "research", "positive", 3),
    rubric("A1", "answer", "positive", 2),
    rubric("A2", "answer", "negative", 1),
]
SCORES = {
    "a": [2, 0, 1, 2, 0],
    "b": [0, 2, 2, 1, 1],
    "d": [1, 1, 0, 0, 2],
}
# Worked by hand:
#   a: plan (1·2 + 2·(2−0)) / (2·3) = 6/6 = 1;  research 3·1 / 6 = 0.5;  answer (2·2 + 1·(2−0)) / 6 = 1
#   b: plan (0 + 2·(2−2)) / 6 = 0;              research 3·2 / 6 = 1;    answer (2·1 + 1·(2−1)) / 6 = 0.5
#   c: failed → NaN row
#   d: plan (1·1 + 2·(2−1)) / 6 = 0.5;          research 0;             answer (0 + 1·(2−2)) / 6 = 0
#   review has no rubrics → NaN column
EXPECTED = np.array(
    [
        [1.0, 0.5, np.nan, 1.0],
        [0.0, 1.0, np.nan, 0.5],
        [np.nan, np.nan, np.nan, np.nan],
        [0.5, 0.0, np.nan, 0.0],
    ]
)


def hand_judgments() -> list[TrajectoryJudgment]:
    return [
        judged("a", RUBRICS, SCORES["a"]),
        judged("b", RUBRICS, SCORES["b"]),
        TrajectoryJudgment("c", failed=True, error="judge call failed: 503"),
        judged("d", RUBRICS, SCORES["d"]),
    ]


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_matches_hand_worked_numbers(implementation):
    R = implementation(hand_judgments(), RUBRICS)
    assert R.shape == (4, len(STAGES))
    np.testing.assert_allclose(R, EXPECTED, equal_nan=True)


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_a_failed_judgment_is_nan_never_zero(implementation):
    R = implementation(hand_judgments(), RUBRICS)
    assert np.isnan(R[2]).all()
    assert not np.isnan(R[[0, 1, 3]][:, [0, 1, 3]]).any()


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("index, delta, direction", [(0, +1, +1), (1, +1, -1), (3, -1, -1), (4, -1, +1)])
def test_raising_a_score_moves_its_stage_the_right_way(implementation, index, delta, direction):
    """Positive rubrics pull R up with the score, negative ones push it down."""
    base = [1, 1, 1, 1, 1]
    changed = list(base)
    changed[index] += delta
    before = implementation([judged("x", RUBRICS, base)], RUBRICS)
    after = implementation([judged("x", RUBRICS, changed)], RUBRICS)
    stage = STAGES.index(RUBRICS[index].stage)
    assert np.sign(after[0, stage] - before[0, stage]) == direction
    others = [k for k in range(len(STAGES)) if k != stage]
    np.testing.assert_allclose(after[0, others], before[0, others], equal_nan=True)


@pytest.mark.parametrize("seed", range(6))
def test_loop_and_vectorized_agree_on_random_groups(seed):
    rng = random.Random(seed)
    rubrics = [
        rubric(f"R{i}", rng.choice(STAGES), rng.choice(["positive", "negative"]), rng.choice([1, 2, 3, 0.5]))
        for i in range(rng.randint(1, 12))
    ]
    judgments = []
    for i in range(rng.randint(1, 10)):
        if rng.random() < 0.2:
            judgments.append(TrajectoryJudgment(f"t{i}", failed=True, error="x"))
        else:
            judgments.append(judged(f"t{i}", rubrics, [rng.choice([0, 1, 2]) for _ in rubrics]))
    loop = stage_scores_loop(judgments, rubrics)
    vectorized = stage_scores(judgments, rubrics)
    np.testing.assert_allclose(vectorized, loop, equal_nan=True, rtol=0, atol=1e-12)
    finite = vectorized[~np.isnan(vectorized)]
    assert ((finite >= 0) & (finite <= 1)).all()


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_scores_outside_the_rubric_set_are_ignored(implementation):
    extra = rubric("E", "answer", "positive", 5)
    judgments = [judged("a", RUBRICS + [extra], SCORES["a"] + [0])]
    np.testing.assert_allclose(implementation(judgments, RUBRICS), EXPECTED[:1], equal_nan=True)


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_a_missing_score_is_an_error_not_a_zero(implementation):
    judgments = [judged("a", RUBRICS[:-1], SCORES["a"][:-1])]
    with pytest.raises(JudgeError, match="rollout 'a' has no score"):
        implementation(judgments, RUBRICS)


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_duplicate_rubrics_are_rejected(implementation):
    with pytest.raises(JudgeError, match="listed twice"):
        implementation(hand_judgments(), RUBRICS + [RUBRICS[0]])


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_no_rubrics_gives_nan_everywhere(implementation):
    R = implementation([TrajectoryJudgment("a"), TrajectoryJudgment("b")], [])
    assert R.shape == (2, 4) and np.isnan(R).all()


def test_stage_reward_rows_write_null_for_nan():
    R = stage_scores(hand_judgments(), RUBRICS)
    rows = stage_reward_rows(3, "q1", ["a", "b", "c", "d"], R)
    assert len(rows) == 16
    by_key = {(r["rollout_id"], r["stage"]): r["R"] for r in rows}
    assert by_key[("a", "plan")] == 1.0 and by_key[("b", "answer")] == 0.5
    assert by_key[("a", "review")] is None and by_key[("c", "plan")] is None
    assert all(r["step"] == 3 and r["query_id"] == "q1" for r in rows)
    with pytest.raises(JudgeError, match="shape"):
        stage_reward_rows(3, "q1", ["a"], R)


def test_judgment_rows_follow_the_judge_scores_contract():
    judgment = hand_judgments()[0]
    rows = judgment.rows(step=2, query_id="q1")
    assert len(rows) == len(RUBRICS)
    assert set(rows[0]) == set(JUDGE_SCORES_SCHEMA.names)
    assert [r["score"] for r in rows] == SCORES["a"]
    assert TrajectoryJudgment("c", failed=True).rows(2, "q1") == []


@pytest.mark.parametrize("bad", [3, -1, True, 1.5])
def test_rubric_score_rejects_out_of_range_values(bad):
    with pytest.raises(JudgeError, match="must be one of"):
        RubricScore("r", "plan", "positive", 1.0, bad, "x")


def test_nan_is_not_confused_with_zero():
    R = stage_scores(hand_judgments(), RUBRICS)
    assert R[3, 1] == 0.0 and not math.isnan(R[3, 1])


# ---- a stage the trajectory never wrote earns nothing --------------------------------------------

FULL_TRACE = (
    "<structured_plan>find X</structured_plan>"
    '<call_tool name="search">X</call_tool><tool_output><snippet id="D1">X is 3.</snippet></tool_output>'
    "<review><rubric_review>X → D1</rubric_review></review>"
    '<answer><cite id="D1">X is 3</cite>.</answer>'
)
NO_ANSWER = FULL_TRACE.split("<answer>")[0]
STRAY_CLOSE = NO_ANSWER + "X is 3.</answer>"  # closes an answer it never opened (a tiny policy's slip)
EMPTY_ANSWER = NO_ANSWER + "<answer> </answer>"


@pytest.mark.parametrize("text, answered", [(FULL_TRACE, True), (NO_ANSWER, False), (EMPTY_ANSWER, False)])
def test_written_stages_reads_the_answer_block(text, answered):
    from rubricem_core.judge.aggregate import written_stages

    written = written_stages(text)
    assert written.tolist()[:2] == [True, True]
    assert bool(written[STAGES.index("answer")]) is answered


def test_silence_earns_no_credit_from_inverted_negative_rubrics():
    from rubricem_core.judge.aggregate import zero_absent_stages

    # both rollouts violate nothing (negative A2 scored 0) and meet no positive rubric; only one answered
    scores = [0, 0, 0, 0, 0]
    judgments = [
        judged("answered", RUBRICS, scores),
        judged("silent", RUBRICS, scores),
        TrajectoryJudgment("failed", failed=True, error="503"),
    ]
    R = stage_scores(judgments, RUBRICS)
    answer = STAGES.index("answer")
    assert R[0, answer] == R[1, answer] == pytest.approx(1 / 3)  # the hole: silence paid like an answer
    out = zero_absent_stages(R, [FULL_TRACE, NO_ANSWER, NO_ANSWER])
    assert out[0, answer] == pytest.approx(1 / 3)
    assert out[1, answer] == 0.0
    assert np.isnan(out[2]).all()  # a failed judgment stays excluded, never zero
    assert np.isnan(out[:, STAGES.index("review")]).all()  # a stage without rubrics has no reward, written or not
    np.testing.assert_array_equal(out[:, :2], R[:, :2])  # written stages unchanged


def test_judge_step_zeroes_the_unanswered_rollouts_answer_reward(monkeypatch):
    from rubricem_core.judge.buffer import RubricBuffer
    from rubricem_core.judge.llm_judge import judge_step
    from rubricem_core.judge.types import JudgeQuery, JudgeRollout, JudgeUsage

    negative = rubric("no wrong value", "answer", "negative", 1)

    class FakeJudge:  # the aggregation under test, not the LLM calls
        class options:
            rubric_stages = STAGES

        class settings:
            max_concurrency = 1

        usage = JudgeUsage()

        async def agenerate(self, inputs, **_):
            from rubricem_core.judge.llm_judge import GenerationOutcome

            return [GenerationOutcome(i.query.query_id) for i in inputs]

        async def ascore(self, inputs, **_):
            return [judged(i.rollout.rollout_id, list(i.rubrics), [0] * len(i.rubrics)) for i in inputs]

    buffer = RubricBuffer("q1", cap_per_stage=5)
    buffer.add([negative], step=0)
    groups = [(JudgeQuery("q1", "What is X?"), [JudgeRollout("r0", FULL_TRACE), JudgeRollout("r1", STRAY_CLOSE)])]
    (result,) = judge_step(FakeJudge(), groups, {"q1": buffer}, step=0)
    answer = STAGES.index("answer")
    assert result.R[0, answer] == 1.0 and result.R[1, answer] == 0.0
