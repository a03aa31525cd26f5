"""RubricBuffer: persistent rubrics, dedupe, pruning of non-discriminative rubrics, caps, checkpoints."""

from __future__ import annotations

import json

import pytest

from rubricem_core.judge.buffer import RubricBuffer
from rubricem_core.judge.prompts import GeneratedRubric
from rubricem_core.judge.types import JudgeError, Rubric, RubricScore, TrajectoryJudgment, make_rubric_id
from rubricem_core.schemas import JUDGE_RUBRICS_SCHEMA
from rubricem_core.sim.world import WorldConfig, generate_world


@pytest.fixture(scope="module")
def query_row():
    world = generate_world(WorldConfig(seed=5, n_documents=80, n_queries=4, eval_fraction=0.0))
    return world.queries_table().to_pylist()[0]


def gen(stage: str, title: str, polarity: str = "positive", weight: int = 2) -> GeneratedRubric:
    return GeneratedRubric(stage, polarity, title, f"{title}.", weight)


def judgments_for(
    buffer: RubricBuffer, table: dict[str, list[int]], failed: tuple[int, ...] = ()
) -> list[TrajectoryJudgment]:
    """One judgment per column of ``table`` (rubric title → scores per rollout); unlisted rubrics get 1."""
    rubrics = buffer.active()
    n = len(next(iter(table.values())))
    out = []
    for i in range(n):
        if i in failed:
            out.append(TrajectoryJudgment(f"t{i}", failed=True, error="x"))
            continue
        scores = [
            RubricScore(r.rubric_id, r.stage, r.polarity, r.weight, table.get(r.title, [1] * n)[i], "j")
            for r in rubrics
        ]
        out.append(TrajectoryJudgment(f"t{i}", scores))
    return out


def test_from_query_makes_persistent_answer_rubrics(query_row):
    buffer = RubricBuffer.from_query(query_row["query_id"], query_row["rubrics"], cap_per_stage=3)
    active = buffer.active()
    assert len(active) == len(query_row["rubrics"]) >= 3
    assert {r.origin for r in active} == {"persistent"} and {r.stage for r in active} == {"answer"}
    assert any(r.polarity == "negative" for r in active)
    # the check column arrives as a JSON string and is decoded
    assert all(isinstance(r.check, dict) and "type" in r.check for r in active)
    # ids are a stable hash of (query_id, stage, polarity, title)
    again = RubricBuffer.from_query(query_row["query_id"], query_row["rubrics"])
    assert [r.rubric_id for r in again.active()] == [r.rubric_id for r in active]
    assert active[0].rubric_id == make_rubric_id(query_row["query_id"], "answer", active[0].polarity, active[0].title)


def test_from_query_names_the_bad_field():
    with pytest.raises(JudgeError, match="rubric 1: missing fields \\['stage'\\]"):
        RubricBuffer.from_query(
            "q",
            [
                {"title": "a", "weight": 1, "polarity": "positive", "stage": "answer"},
                {"title": "b", "weight": 1, "polarity": "positive"},
            ],
        )
    with pytest.raises(JudgeError, match="check is not JSON"):
        RubricBuffer.from_query(
            "q", [{"title": "a", "weight": 1, "polarity": "positive", "stage": "answer", "check": "{oops"}]
        )
    with pytest.raises(JudgeError, match="stage 'conclusion'"):
        RubricBuffer.from_query("q", [{"title": "a", "weight": 1, "polarity": "positive", "stage": "conclusion"}])


def test_add_dedupes_by_normalized_title(query_row):
    buffer = RubricBuffer.from_query(query_row["query_id"], query_row["rubrics"])
    persistent_title = query_row["rubrics"][0]["title"]
    added = buffer.add(
        [
            gen("research", "Searches for Voralis Labs' founding year"),
            gen("research", "searches for voralis labs founding year!"),  # same after normalization
            gen("answer", persistent_title.upper()),  # duplicates a persistent rubric
            gen("plan", "Plans both lookups"),
        ],
        step=1,
    )
    assert [r.title for r in added] == ["Searches for Voralis Labs' founding year", "Plans both lookups"]
    assert all(r.origin == "adaptive" and r.created_step == 1 and r.status == "active" for r in added)
    assert buffer.add([gen("plan", "PLANS BOTH LOOKUPS.")], step=2) == []
    assert len(buffer.active("research")) == 1 and len(buffer.active("plan")) == 1


def test_rubric_id_is_stable_across_casing():
    a = Rubric.create("q", "plan", "positive", "Plans  both lookups", "d", 2)
    b = Rubric.create("q", "plan", "positive", "plans both lookups.", "d", 2)
    c = Rubric.create("q", "plan", "negative", "plans both lookups", "d", 2)
    assert a.rubric_id == b.rubric_id != c.rubric_id


def test_non_discriminative_adaptive_rubrics_are_pruned_persistent_never(query_row):
    buffer = RubricBuffer.from_query(query_row["query_id"], query_row["rubrics"], cap_per_stage=5)
    buffer.add(
        [gen("research", "Varies"), gen("research", "Constant"), gen("review", "Also constant", "negative")], step=1
    )
    persistent_title = buffer.active("answer")[0].title
    judgments = judgments_for(
        buffer, {"Varies": [0, 2, 1], "Constant": [2, 2, 2], "Also constant": [0, 0, 0], persistent_title: [1, 1, 1]}
    )
    pruned = buffer.after_scoring(judgments, step=1)
    assert sorted(r.title for r in pruned) == ["Also constant", "Constant"]
    assert all(r.status == "pruned" and r.pruned_step == 1 for r in pruned)
    titles = {r.title for r in buffer.active()}
    assert "Varies" in titles and persistent_title in titles  # persistent: constant but kept
    assert len(buffer.active("answer")) == len(query_row["rubrics"])


def test_failed_judgments_do_not_count_as_variation():
    buffer = RubricBuffer("q", cap_per_stage=5)
    buffer.add([gen("plan", "Covers both companies")], step=0)
    # the failed rollout would have scored differently; with it excluded the rubric is constant
    judgments = judgments_for(buffer, {"Covers both companies": [2, 0, 2, 2]}, failed=(1,))
    assert [r.title for r in buffer.after_scoring(judgments, step=0)] == ["Covers both companies"]


def test_fewer_than_two_valid_scores_keep_the_rubric():
    buffer = RubricBuffer("q", cap_per_stage=5)
    buffer.add([gen("plan", "Covers both companies")], step=0)
    judgments = judgments_for(buffer, {"Covers both companies": [2, 0, 0]}, failed=(1, 2))
    assert buffer.after_scoring(judgments, step=0) == []
    assert len(buffer.active("plan")) == 1


@pytest.mark.parametrize("cap", [1, 2, 3])
def test_over_cap_stages_keep_the_most_discriminative(cap):
    buffer = RubricBuffer("q", cap_per_stage=cap)
    # score std across the group: wide 1.0 > mid 0.71 > low 0.43; the plan stage is under its cap
    buffer.add(
        [gen("research", "low"), gen("research", "wide"), gen("research", "mid"), gen("plan", "plan one")], step=4
    )
    table = {"low": [1, 1, 1, 2], "wide": [0, 2, 0, 2], "mid": [0, 1, 2, 1], "plan one": [0, 1, 0, 1]}
    pruned = buffer.after_scoring(judgments_for(buffer, table), step=4)
    kept = [r.title for r in buffer.active("research")]
    ranking = ["wide", "mid", "low"]
    assert sorted(kept) == sorted(ranking[:cap])
    assert sorted(r.title for r in pruned) == sorted(ranking[cap:])
    assert [r.title for r in buffer.active("plan")] == ["plan one"]


def test_cap_ties_go_to_heavier_then_older():
    buffer = RubricBuffer("q", cap_per_stage=2)
    buffer.add([gen("answer", "old light", weight=1)], step=0)
    buffer.add([gen("answer", "new heavy", weight=3), gen("answer", "new light", weight=1)], step=1)
    table = {"old light": [0, 2], "new heavy": [0, 2], "new light": [0, 2]}
    pruned = buffer.after_scoring(judgments_for(buffer, table), step=1)
    assert [r.title for r in pruned] == ["new light"]


def test_rows_record_every_change(query_row):
    buffer = RubricBuffer.from_query(query_row["query_id"], query_row["rubrics"], cap_per_stage=5)
    buffer.add([gen("research", "Varies"), gen("research", "Constant")], step=1)
    buffer.after_scoring(judgments_for(buffer, {"Varies": [0, 2], "Constant": [1, 1]}), step=1)
    rows1 = buffer.rows(1)
    assert all(set(JUDGE_RUBRICS_SCHEMA.names) <= set(row) for row in rows1)
    by_title = {row["title"]: row for row in rows1}
    assert by_title["Constant"]["status"] == "pruned" and by_title["Constant"]["pruned_step"] == 1
    assert by_title["Varies"]["status"] == "active" and by_title["Varies"]["created_step"] == 1
    assert sum(row["origin"] == "persistent" for row in rows1) == len(query_row["rubrics"])
    json.dumps(rows1)  # plain values only (check is a JSON string)
    rows2 = buffer.rows(2)
    assert "Constant" not in {row["title"] for row in rows2}  # pruned earlier: not repeated
    assert "Varies" in {row["title"] for row in rows2}


def test_a_pruned_rubric_proposed_again_comes_back():
    buffer = RubricBuffer("q", cap_per_stage=3)
    first = buffer.add([gen("plan", "Names both companies")], step=0)[0]
    buffer.after_scoring(judgments_for(buffer, {"Names both companies": [2, 2]}), step=0)
    assert buffer.active() == []
    again = buffer.add([gen("plan", "names both companies")], step=3)
    assert [r.rubric_id for r in again] == [first.rubric_id]
    assert again[0].created_step == 3 and again[0].pruned_step is None


def test_checkpoint_round_trip(query_row):
    buffer = RubricBuffer.from_query(query_row["query_id"], query_row["rubrics"], cap_per_stage=2)
    buffer.add(
        [gen("research", "Varies"), gen("research", "Constant"), gen("review", "Maps ids", "negative", 3)], step=1
    )
    buffer.after_scoring(judgments_for(buffer, {"Varies": [0, 2], "Constant": [1, 1], "Maps ids": [2, 0]}), step=1)
    restored = RubricBuffer.from_dict(json.loads(json.dumps(buffer.to_dict())))
    assert restored.to_dict() == buffer.to_dict()
    assert restored.rows(1) == buffer.rows(1)
    assert [r.rubric_id for r in restored.active()] == [r.rubric_id for r in buffer.active()]


def test_bad_checkpoints_and_inputs_fail_clearly():
    with pytest.raises(JudgeError, match="lacks field 'rubrics'"):
        RubricBuffer.from_dict({"query_id": "q", "cap_per_stage": 2})
    other = Rubric.create("other", "plan", "positive", "t", "d", 1)
    with pytest.raises(JudgeError, match="of query 'other'"):
        RubricBuffer.from_dict({"query_id": "q", "cap_per_stage": 2, "rubrics": [other.to_dict()]})
    with pytest.raises(JudgeError, match="cap_per_stage"):
        RubricBuffer("q", cap_per_stage=-1)
    with pytest.raises(JudgeError, match="unknown stage"):
        RubricBuffer("q").active("writing")
    with pytest.raises(JudgeError, match="weight must be a number > 0"):
        Rubric.create("q", "plan", "positive", "t", "d", 0)


@pytest.mark.parametrize("cap", [1, 2, 5])
def test_from_rows_of_every_step_rebuilds_the_live_buffer(query_row, cap):
    """A resumed run rebuilds each buffer from the `judge_rubrics` partitions: additions, pruning, the
    cap, a pruned rubric proposed again — state and creation order equal to the live buffer's."""
    qid = query_row["query_id"]
    live = RubricBuffer.from_query(qid, query_row["rubrics"], cap_per_stage=cap)
    steps = [
        (
            [gen("plan", "Names sources"), gen("research", "Cites doc"), gen("research", "Two searches")],
            {"Names sources": [1, 0, 1], "Cites doc": [1, 1, 1]},
        ),
        (
            [gen("research", "Reads abstracts"), gen("plan", "Names sources"), gen("review", "Checks gaps")],
            {"Reads abstracts": [0, 1, 1], "Checks gaps": [2, 2, 2]},
        ),
        (
            [gen("research", "Cites doc"), gen("review", "Flags conflicts", weight=3)],  # Cites doc comes back
            {"Cites doc": [0, 1, 0], "Flags conflicts": [1, 0, 1]},
        ),
    ]
    rows = []
    for step, (new, table) in enumerate(steps):
        live.add(new, step)
        live.after_scoring(judgments_for(live, table, failed=(2,) if step == 1 else ()), step)
        rows.extend(json.loads(json.dumps(live.rows(step))))  # as Parquet gives them back: check as JSON text
        rebuilt = RubricBuffer.from_rows(qid, rows, cap_per_stage=cap)
        assert rebuilt.to_dict() == live.to_dict(), f"step {step}"
        assert [r.rubric_id for r in rebuilt.active()] == [r.rubric_id for r in live.active()]
    assert any(r["status"] == "pruned" for r in rows), "the scenario must prune"
    with pytest.raises(JudgeError, match="given for"):
        RubricBuffer.from_rows("other", rows, cap_per_stage=cap)
