"""The windowed RL loop: curriculum, advantages per recipe, the rl flow end to end, and resume."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from rubricem_core.recipes import get_recipe
from rubricem_core.rl.curriculum import windowed_schedule
from rubricem_core.rl.update import group_advantages, per_token_advantages
from rubricem_core.scaffold import STAGES
from rubricem_core.schemas import ROLLOUTS_SCHEMA, row_keys
from rubricem_core.sql import run_sql
from rubricem_core.store import RunStore
from rubricem_core.testing import MICRO_PROFILE
from rubricem_core.trajectory import TokenTrajectory
from tests.rl_runs import RL_RUN, copy_run, sft_run  # noqa: F401  (module fixture)


def test_windowed_schedule_replays_each_window():
    ids = [f"q{i}" for i in range(10)]
    plans = windowed_schedule(ids, window=3, n_windows=2, queries_per_step=4, seed=1)
    assert [p.step for p in plans] == list(range(12))
    for w in range(2):
        fresh, replay = plans[6 * w : 6 * w + 3], plans[6 * w + 3 : 6 * w + 6]
        assert [p.query_ids for p in fresh] == [p.query_ids for p in replay]
        assert {p.phase for p in fresh} == {"new"} and {p.retrieval for p in fresh} == {"cross"}
        assert {p.phase for p in replay} == {"repeat"} and {p.retrieval for p in replay} == {"within"}
    first_pass = [q for p in plans[:3] for q in p.query_ids]
    assert len(set(first_pass[:10])) == 10, "every query is used before any repeats"
    assert windowed_schedule(ids, 3, 2, 4, seed=1) == plans
    assert windowed_schedule(ids, 3, 2, 4, seed=2) != plans
    assert [p.reflects for p in plans] == [p.phase == "new" for p in plans]  # new-query steps write reflections
    unreflecting = windowed_schedule(ids, 3, 1, 4, seed=1, reflection=False)
    assert {p.retrieval for p in unreflecting} == {"none"} and not any(p.reflects for p in unreflecting)


def test_terminal_recipe_broadcasts_the_answer_advantage():
    R = np.array([[np.nan, np.nan, np.nan, 0.2], [np.nan, np.nan, np.nan, 0.9], [np.nan, np.nan, np.nan, 0.5]])
    ga = group_advantages(R, get_recipe("baseline").lam())
    for k in range(4):
        np.testing.assert_allclose(ga.A[:, k], ga.A[:, 3])
    assert ga.A[1, 3] > 0 > ga.A[0, 3]


def test_causal_recipe_gives_stagewise_credit():
    R = np.array([[1.0, 0.0, 0.5, 0.5], [0.0, 0.0, 0.5, 0.5]])
    ga = group_advantages(R, get_recipe("ss_grpo").lam())
    assert ga.A[0, 0] > 0 > ga.A[1, 0]  # only the plan differs: only the plan gets credit
    np.testing.assert_allclose(ga.A[:, 1:], 0.0)  # later stages cannot see earlier stages' rewards


@pytest.mark.parametrize("rule", ["judged", "zero", "format"])
def test_a_stage_that_broke_the_scaffold_earns_nothing_when_violations_are_gated(rule: str):
    """Rollout 0 broke its plan and its review (the judge still liked its plan); rollout 3's judgment failed.
    Gated, the plan advantage goes to the valid ones; `format` also scores the review, which has no rubric,
    where rollout 0 broke it. R worked by hand for each rule."""
    from rubricem_core.rl.update import gate_broken_stages

    nan = float("nan")
    R = np.array([[1.0, 0.5, nan, 1.0], [0.5, 0.5, nan, 1.0], [0.5, 0.5, nan, 0.5], [nan, nan, nan, nan]])
    broken = [{"plan", "review"}, set(), set(), {"plan"}]
    failed = [False, False, False, True]
    gated = R if rule == "judged" else gate_broken_stages(R, broken, rule, failed)
    A = group_advantages(gated, get_recipe("ss_grpo").lam(), failed).A
    expected = {
        "judged": R,
        "zero": [[0.0, 0.5, nan, 1.0], [0.5, 0.5, nan, 1.0], [0.5, 0.5, nan, 0.5], [nan] * 4],
        "format": [[0.0, 0.5, 0.0, 1.0], [0.5, 0.5, 1.0, 1.0], [0.5, 0.5, 1.0, 0.5], [nan] * 4],
    }[rule]
    np.testing.assert_array_equal(gated, expected)
    if rule == "judged":
        assert A[0, 0] > max(0.0, A[1, 0])  # the broken plan is the group's best
    else:
        assert A[0, 0] < 0 < A[1, 0]
        np.testing.assert_array_equal(R[0], [1.0, 0.5, nan, 1.0])  # the judge's R is not changed in place
    if rule == "format":
        assert A[0, 2] < 0 < A[1, 2]  # the review, unscored before, now separates the group
    with pytest.raises(ValueError, match="3 rollouts"):
        gate_broken_stages(R, broken[:3])
    with pytest.raises(ValueError, match="unknown scaffold_violations rule"):
        gate_broken_stages(R, broken, "judged")


@pytest.mark.parametrize("rule", ["judged", "zero", "format"])
def test_the_judge_task_writes_and_trains_the_zeroed_rewards(rule: str):
    """stages_to_gate finds where each rollout broke the scaffold; judge_tables' `stage_rewards` carry the
    zeroed R (what SQL shows is what trains), the judge's own R untouched."""
    from rubricem_core.config import load_config
    from rubricem_core.judge.buffer import RubricBuffer
    from rubricem_core.judge.llm_judge import GenerationOutcome, GroupJudgment
    from rubricem_core.rl.steps import judge_tables, stages_to_gate
    from rubricem_core.scaffold import EXAMPLE_TRACE

    cfg = load_config(MICRO_PROFILE, {"rl.scaffold_violations": rule})
    unclosed_plan = EXAMPLE_TRACE.replace("</structured_plan>", "", 1)
    rows = [{"rollout_id": "q-r0", "text": unclosed_plan}, {"rollout_id": "q-r1", "text": EXAMPLE_TRACE}]
    broken = stages_to_gate(cfg, rows)
    if rule == "judged":
        assert broken is None
    else:
        assert broken is not None and broken["q-r1"] == set() and "plan" in broken["q-r0"]
    R = np.array([[1.0, 1.0, 1.0, 1.0], [0.5, 1.0, 1.0, 1.0]])
    group = GroupJudgment("q", ["q-r0", "q-r1"], [], [], R.copy(), [], [], GenerationOutcome("q"))
    out = judge_tables(3, [group], {"q": RubricBuffer.from_query("q", [])}, get_recipe("ss_grpo").lam(), broken)
    plan = {r["rollout_id"]: r for r in out.reward_rows if r["stage"] == "plan"}
    if rule == "judged":
        assert plan["q-r0"]["R"] == 1.0 and plan["q-r0"]["A"] > 0
    else:
        assert plan["q-r0"]["R"] == 0.0 and plan["q-r0"]["A"] < 0 < plan["q-r1"]["A"]
    np.testing.assert_array_equal(group.R, R)


@pytest.mark.parametrize("unscored", ["none", "downstream"])
def test_judge_tables_give_an_unscored_stage_the_configured_return(unscored):
    from rubricem_core.judge.buffer import RubricBuffer
    from rubricem_core.judge.llm_judge import GenerationOutcome, GroupJudgment
    from rubricem_core.rl.steps import judge_tables

    nan = float("nan")
    R = np.array([[nan, nan, 1.0, 1.0], [nan, nan, 0.0, 1.0], [nan, nan, 1.0, 0.0]])
    group = GroupJudgment("q", ["q-r0", "q-r1", "q-r2"], [], [], R.copy(), [], [], GenerationOutcome("q"))
    buffers = {"q": RubricBuffer.from_query("q", [])}
    out = judge_tables(2, [group], buffers, get_recipe("full").lam(), None, "format", unscored)
    research = {r["rollout_id"]: r for r in out.reward_rows if r["stage"] == "research"}
    assert all(r["R"] is None for r in research.values())  # the judge's R is stored as it is
    if unscored == "none":
        assert all(r["G"] is None and r["A"] == 0.0 for r in research.values())
    else:
        assert [research[f"q-r{i}"]["G"] for i in range(3)] == [2.0, 1.0, 1.0]
        assert research["q-r0"]["A"] > 0 > research["q-r1"]["A"]


def test_advantaged_token_share_counts_trained_tokens_only():
    from rubricem_core.rl.update import TrainingBatch

    def traj(mask: list[int], stages: list[int]) -> TokenTrajectory:
        n = len(mask)
        return TokenTrajectory(token_ids=list(range(n)), loss_mask=mask, stage_ids=stages, logprobs=[0.0] * n)

    batch = TrainingBatch(
        trajectories=[traj([0, 1, 1, 1], [-1, 0, 1, 1]), traj([1, 1, 0], [0, 3, 3])],
        token_advantages=[[0.5, 0.5, 0.0, -1.0], [0.0, 0.0, 2.0]],  # the masked 0.5 and 2.0 do not count
    )
    assert batch.advantaged_tokens_by_stage() == {0: (1, 2), 1: (1, 2), 3: (0, 1)}
    assert batch.advantaged_token_share() == pytest.approx(2 / 5)
    assert math.isnan(TrainingBatch().advantaged_token_share())


def test_per_token_advantages_follow_stage_and_mask():
    traj = TokenTrajectory(
        token_ids=[1, 2, 3, 4, 5],
        loss_mask=[0, 1, 0, 1, 1],
        stage_ids=[-1, 0, 1, 1, 3],
        logprobs=[float("nan"), -1.0, float("nan"), -0.5, -0.2],
    )
    assert per_token_advantages(traj, np.array([0.1, 0.2, 0.3, 0.4])) == [0.0, 0.1, 0.0, 0.2, 0.4]


def test_training_batch_trains_on_the_written_advantages():
    """Judge side (R → G, A rows) and update side (rows → token advantages) against a loop worked per
    token: a[t] = A[i, stage(t)] on trained tokens, 0 elsewhere; a failed judgment is in neither."""
    from rubricem_core.rl.update import reward_rows, training_batch

    nan = float("nan")
    R = np.array([[1.0, 0.0, nan, 0.5], [0.0, 1.0, nan, 1.0], [nan, nan, nan, nan]])
    failed = [False, False, True]
    ga = group_advantages(R, get_recipe("ss_grpo").lam(), failed)
    rows = reward_rows(4, "q", ["a", "b", "c"], ga)
    by = {(r["rollout_id"], r["stage"]): r for r in rows}
    assert all(by[("c", s)]["G"] is None and by[("c", s)]["A"] is None for s in STAGES)  # never 0
    assert by[("a", "review")]["R"] is None and by[("a", "review")]["G"] is None and by[("a", "review")]["A"] == 0.0
    rollouts = [
        {
            "rollout_id": rid,
            "judge_failed": f,
            "token_ids": [1, 2, 3, 4, 5, 6],
            "loss_mask": [0, 1, 1, 0, 1, 1],
            "stage_ids": [-1, 0, 1, 1, 2, 3],
            "logprobs": [None, -1.0, -0.5, None, -0.2, -0.1],
        }
        for rid, f in zip("abc", failed)
    ]
    batch = training_batch(rollouts, rows)
    assert len(batch.trajectories) == 2 and len(batch.token_advantages) == 2
    for i, advs in enumerate(batch.token_advantages):
        loop = [
            float(ga.A[i, s]) if m and s >= 0 else 0.0
            for m, s in zip(rollouts[i]["loss_mask"], rollouts[i]["stage_ids"])
        ]
        assert advs == loop
    assert batch.trajectories[0].logprobs[0] != batch.trajectories[0].logprobs[0]  # NULL → NaN (never sampled)
    assert batch.stage_means["reward/R/plan_mean"] == 0.5 and "reward/R/review_mean" not in batch.stage_means
    assert batch.stage_means["reward/A/plan_mean"] == pytest.approx(0.0)


def _check_prefect_view(run_dir: str) -> None:
    """The UI's view of an RL flow run: a Markdown artifact with a row per step, readable run names."""
    from prefect import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey, FlowRunFilter, FlowRunFilterName

    from flows.common import artifact_key

    with get_client(sync_client=True) as client:
        (artifact,) = client.read_artifacts(
            artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=[artifact_key("rl", run_dir)]))
        )
        assert artifact.data.startswith("# RL (ss_grpo): 2 of 2 steps done")
        assert "| 0 | new | none |" in artifact.data and "| 1 | repeat | none |" in artifact.data
        steps = client.read_flow_runs(
            flow_run_filter=FlowRunFilter(name=FlowRunFilterName(any_=["step-0-new", "step-1-repeat"]))
        )
        assert {r.name for r in steps if r.parameters.get("run_dir") == run_dir} == {"step-0-new", "step-1-repeat"}
        tasks = {
            t.name for t in client.read_task_runs(flow_run_filter=FlowRunFilter(id={"any_": [r.id for r in steps]}))
        }
        assert {"rollout-step-0", "judge-step-0", "ss-grpo-update-step-1"} <= tasks, tasks


@pytest.mark.slow
def test_rl_flow_end_to_end_and_resume(sft_run, tmp_path, monkeypatch):
    from flows.rl import rl
    from rubricem_core.rl.progress import completed_step
    from rubricem_core.store import RunStore

    straight = copy_run(sft_run, tmp_path / "straight")
    result = rl(run_dir=straight, profile=MICRO_PROFILE, overrides=RL_RUN)
    assert result["steps"] == 2
    store = RunStore(straight)
    for table in ("rollouts", "judge_rubrics", "judge_scores", "stage_rewards", "metrics"):
        assert store.partitions(table, "step") == [0, 1] or table == "metrics", table
    cols = set(store.read_table("rollouts").column_names)
    assert set(ROLLOUTS_SCHEMA.names) <= cols
    rows = store.read_rows("rollouts")
    for r in rows:
        assert len(r["token_ids"]) == len(r["loss_mask"]) == len(r["stage_ids"]) == len(r["logprobs"])
    rewards = json.loads(
        run_sql(straight, "SELECT count(*) AS n, count(G) AS g, count(A) AS a FROM stage_rewards", fmt="json")
    )[0]
    assert rewards["n"] == 2 * 2 * 2 * 4 and rewards["a"] == rewards["n"]
    names = {
        r["name"]
        for r in json.loads(run_sql(straight, "SELECT DISTINCT name FROM metrics WHERE flow = 'rl'", fmt="json"))
    }
    assert {
        "rl/loss",
        "rl/kl",
        "rl/clip_fraction",
        "rl/logprob_gap_mean",
        "judge/score_calls",
        "judge/generate_calls",
        "buffer/answer_active",
        "reward/R/answer_mean",
    } <= names
    calls = json.loads(
        run_sql(
            straight,
            "SELECT step, name, value FROM metrics WHERE name IN ('judge/score_calls', 'judge/generate_calls') ORDER BY ALL",
            fmt="json",
        )
    )
    per_step = {(c["step"], c["name"]): c["value"] for c in calls}
    assert per_step[(0, "judge/generate_calls")] == 2 and per_step[(0, "judge/score_calls")] == 4
    _check_prefect_view(straight)

    # a run that fails in step 1's update resumes to the same weights
    resumed = copy_run(sft_run, tmp_path / "resumed")
    import rubricem_core.rl.policy as rl_policy

    real = rl_policy.LocalPolicy.update  # the SS-GRPO update (SSGRPOLearner.update)

    def fail_step_1(*args, **kwargs):
        if completed_step(RunStore(resumed)) == 0:
            raise RuntimeError("injected failure in step 1")
        return real(*args, **kwargs)

    monkeypatch.setattr(rl_policy.LocalPolicy, "update", fail_step_1)
    with pytest.raises(RuntimeError, match="injected failure"):
        rl(run_dir=resumed, profile=MICRO_PROFILE, overrides=RL_RUN)
    monkeypatch.setattr(rl_policy.LocalPolicy, "update", real)
    state = rl(run_dir=resumed, profile=MICRO_PROFILE, overrides=RL_RUN, return_state=True)
    # step 1's rollouts and judgments are read back (Prefect's Cached state); its update, which failed,
    # runs again and is never reported Cached
    from prefect import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    from flows.common import subflow_runs

    with get_client(sync_client=True) as client:
        runs = [state.state_details.flow_run_id, *[r.id for r in subflow_runs(client, state.state_details.flow_run_id)]]
        tasks = client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=runs)))
    states = {t.name: t.state.name for t in tasks}
    assert states["rollout-step-1"] == states["judge-step-1"] == "Cached", states
    assert states["ss-grpo-update-step-1"] == "Completed", states
    # MLflow: the retry is a new `rl` run, the stage's current one, holding the whole curve (step 0 from the
    # failed attempt carried forward, step 1 its own); the failed attempt keeps what it logged
    from rubricem_core.tracking import Tracker

    tracker = Tracker(resumed)
    attempts = tracker.client.search_runs(
        [tracker.experiment_id()], "tags.`rubricem.flow` = 'rl'", order_by=["attributes.start_time ASC"]
    )
    assert [(r.info.run_name, r.info.status, r.data.tags["rubricem.current"]) for r in attempts] == [
        ("rl", "FAILED", "false"),
        ("rl · attempt 2", "FINISHED", "true"),
    ]
    steps = [
        sorted(m.step for m in tracker.client.get_metric_history(r.info.run_id, "reward/R/answer_mean"))
        for r in attempts
    ]
    assert steps == [[0], [0, 1]], steps

    from safetensors.torch import load_file

    a = load_file(str(tmp_path / "straight" / "checkpoints" / "rl" / "step-000001" / "model.safetensors"))
    b = load_file(str(tmp_path / "resumed" / "checkpoints" / "rl" / "step-000001" / "model.safetensors"))
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=1e-6)
    ra = RunStore(straight).read_rows("rollouts", {"step": 1})
    rb = RunStore(resumed).read_rows("rollouts", {"step": 1})
    assert [r["token_ids"] for r in ra] == [r["token_ids"] for r in rb]


JUDGE_TABLES = row_keys("rollouts", "judge_rubrics", "judge_scores", "stage_rewards")


def _judge_view(run_dir: str) -> dict:
    """The judge tables row for row (in written order), the judge's metrics but its timings, the weights."""
    from safetensors.torch import load_file

    store = RunStore(run_dir)
    out: dict = {table: store.read_rows(table) for table in JUDGE_TABLES}
    out["metrics"] = {
        (r["step"], r["name"]): r["value"]
        for r in store.read_rows("metrics")
        if r["flow"] == "rl" and r["name"].startswith(("judge/", "buffer/", "reward/")) and "seconds" not in r["name"]
    }
    out["weights"] = load_file(f"{run_dir}/checkpoints/rl/step-000001/model.safetensors")
    return out


def _assert_same_judging(a: dict, b: dict) -> None:
    for table in JUDGE_TABLES:
        assert len(a[table]) == len(b[table]), table
        for x, y in zip(a[table], b[table]):
            assert x == y, f"{table}: {[x.get(k) for k in JUDGE_TABLES[table]]} differs"
    assert a["metrics"] == b["metrics"] and a["metrics"]
    for k in a["weights"]:
        torch.testing.assert_close(a["weights"][k], b["weights"][k], rtol=0, atol=0)


@pytest.mark.slow
def test_streamed_judge_writes_the_batch_judges_tables(sft_run, tmp_path, monkeypatch):
    """judge.stream (the default) ≡ judge.stream: false in every judge table, metric and weight; and a
    streamed step whose judge task fails (judge.min_judged_fraction) reruns in the same process, its
    buffers rebuilt from the tables, to the same tables."""
    import rubricem_core.rl.steps as rl_steps
    from flows.rl import rl
    from rubricem_core.judge.llm_judge import LLMJudge
    from rubricem_core.judge.step import JudgeStepError
    from rubricem_core.judge.types import TrajectoryJudgment
    from rubricem_core.store import RunStore

    batch_calls = []
    real_judge_step = rl_steps.judge_step

    def counting_judge_step(*args, **kwargs):
        batch_calls.append(args[3])
        return real_judge_step(*args, **kwargs)

    monkeypatch.setattr(rl_steps, "judge_step", counting_judge_step)
    streamed = copy_run(sft_run, tmp_path / "streamed")
    rl(run_dir=streamed, profile=MICRO_PROFILE, overrides=RL_RUN)
    assert batch_calls == []  # every step judged while its rollouts sampled
    batch = copy_run(sft_run, tmp_path / "batch")
    rl(run_dir=batch, profile=MICRO_PROFILE, overrides={**RL_RUN, "judge.stream": False})
    assert batch_calls == [0, 1]
    reference = _judge_view(batch)
    _assert_same_judging(_judge_view(streamed), reference)

    # step 0's streamed judgments all fail: the judge task raises, having changed the session's buffers
    batch_calls.clear()
    failing = copy_run(sft_run, tmp_path / "failing")
    real_ascore = LLMJudge.ascore

    async def all_failed(self, inputs, **kwargs):
        out = await real_ascore(self, inputs, **kwargs)
        return [TrajectoryJudgment(j.rollout_id, failed=True, error="injected outage") for j in out]

    monkeypatch.setattr(LLMJudge, "ascore", all_failed)
    with pytest.raises(JudgeStepError, match="2 of 4 judgments failed|4 of 4 judgments failed"):
        rl(run_dir=failing, profile=MICRO_PROFILE, overrides=RL_RUN)
    assert all(r["judge_failed"] for r in RunStore(failing).read_rows("rollouts", {"step": 0}))
    monkeypatch.setattr(LLMJudge, "ascore", real_ascore)
    rl(run_dir=failing, profile=MICRO_PROFILE, overrides=RL_RUN)  # same process, a new session rebuilt from the tables
    assert batch_calls == [0]  # step 0 re-judged from the tables, step 1 streamed
    _assert_same_judging(_judge_view(failing), reference)


@pytest.mark.slow
def test_rl_flow_holds_nothing_per_step(sft_run, tmp_path, monkeypatch):
    """The `rl` flow run's Prefect context does not grow with the steps: a subflow's return value stays
    linked in the parent's ``run_results`` (one entry per returned value) for the parent's whole life,
    which with a metrics dict per step grew a days-long run without bound (bench/soak.py)."""
    from prefect.context import FlowRunContext

    import flows.rl as rl_flow

    sizes: list[int] = []

    class CountingProgress(rl_flow.Progress):
        def update(self, *args, **kwargs):
            sizes.append(len(FlowRunContext.get().run_results))  # in the `rl` flow run, after each step
            return super().update(*args, **kwargs)

    monkeypatch.setattr(rl_flow, "Progress", CountingProgress)
    run_dir = copy_run(sft_run, tmp_path / "four_steps")
    result = rl_flow.rl(run_dir=run_dir, profile=MICRO_PROFILE, overrides={**RL_RUN, "rl.n_windows": 2})
    assert result["steps"] == 4 and len(sizes) == 4
    assert sizes[-1] == sizes[0], sizes
    logged = json.loads(
        run_sql(run_dir, "SELECT DISTINCT step FROM metrics WHERE flow = 'rl' ORDER BY step", fmt="json")
    )
    assert [r["step"] for r in logged] == [0, 1, 2, 3]  # the steps' metrics still reach MLflow and `metrics`
    from tasks.rl import step_metrics

    assert result["last_metrics"]["rl/loss"] == pytest.approx(step_metrics(RunStore(run_dir), 3)["rl/loss"])
