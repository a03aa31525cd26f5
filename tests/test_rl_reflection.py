"""The reflection meta-policy inside the rl flow: candidates → judge → bank → retrieval, the deferred
reflection update (step N−1's candidates trained in step N), deferred == sync, and resume.

The tiny SFT policy has never seen a reflection prompt, so left alone it writes no valid reflection and
the loop would have nothing to bank. The engine's ``forced_policy`` hook (a test hook of our own
engine, still recording the sampled logprobs) makes even-numbered candidates spell out a
question-specific reflection; odd ones are sampled freely. That gives every group a reward spread.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from rubricem_core.reflection.format import parse_reflection, validate_reflection
from rubricem_core.reflection.meta import candidate_advantages, pick_source_rollouts
from rubricem_core.sql import run_sql
from rubricem_core.store import RunStore
from rubricem_core.testing import MICRO_PROFILE
from tests.rl_runs import REFLECT, copy_run, forced_reflections, rl_with_reflections, sft_run  # noqa: F401  (module fixtures)


def test_pick_source_rollouts_is_uniform_and_skips_failed_judgments():
    rollouts = [{"query_id": "q", "rollout_id": f"q-r{i}", "judge_failed": i == 0} for i in range(4)]
    picks = [pick_source_rollouts(rollouts, ["q"], seed=0, step=s)["q"]["rollout_id"] for s in range(400)]
    counts = {rid: picks.count(rid) for rid in set(picks)}
    assert "q-r0" not in counts and set(counts) == {"q-r1", "q-r2", "q-r3"}
    assert min(counts.values()) > 100  # uniform: ≈133 each
    assert pick_source_rollouts([{"query_id": "q", "rollout_id": "a", "judge_failed": True}], ["q"], 0, 0) == {}


@pytest.mark.parametrize(
    "scores,expected",
    [
        ([0.0, 1.0], [-0.7071, 0.7071]),
        ([0.5, 0.5, 0.5], [0.0, 0.0, 0.0]),
        ([None, 0.2, 0.8], [0.0, -0.7071, 0.7071]),
        ([0.0, 0.0, 0.9], [-0.5774, -0.5774, 1.1547]),
    ],
)
def test_candidate_advantages_match_hand_numbers(scores, expected):
    assert candidate_advantages(scores) == pytest.approx(expected, abs=1e-3)


@pytest.fixture(scope="module")
def deferred_run(sft_run, tmp_path_factory, forced_reflections):
    return rl_with_reflections(sft_run, tmp_path_factory.mktemp("reflect") / "deferred", forced_reflections)


def _weights(run_dir: str, step: int) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(f"{run_dir}/checkpoints/rl/step-{step:06d}/model.safetensors")


@pytest.mark.slow
def test_reflection_loop_deferred_equals_sync(deferred_run, sft_run, tmp_path, forced_reflections):
    deferred = deferred_run
    store = RunStore(deferred)
    plans = [(0, "new", "cross"), (1, "new", "cross"), (2, "repeat", "within"), (3, "repeat", "within")]
    rollouts = store.read_rows("rollouts")
    assert sorted({(r["step"], r["phase"], r["retrieval"]) for r in rollouts}) == plans

    # reflections: only new-query steps, one source rollout per query, n candidates each
    assert store.partitions("reflections", "step") == [0, 1]
    refl = store.read_rows("reflections")
    assert len(refl) == 2 * 2 * 3
    assert {"step", "query_id", "source_rollout_id", "candidate", "text", "valid", "score", "accepted"} <= set(refl[0])
    for r in refl:
        assert r["valid"] == (not validate_reflection(r["text"]))
        if r["candidate"] % 2 == 0:
            assert r["valid"] and r["score"] > 0, (r["codes"], r["score"], r["justification"], r["text"])
        # the update trains what the policy wrote (sampled: a logprob), less a valid candidate's format tags
        written = sum(lp is not None for lp in r["logprobs"])
        assert (sum(r["loss_mask"]) < written) if r["valid"] else (sum(r["loss_mask"]) == written)
    assert sum(r["accepted"] for r in refl) == 4  # one per query (every group has a valid candidate)
    bank = store.read_rows("bank")
    assert {b["query_id"] for b in bank} == {r["query_id"] for r in refl}
    assert all(parse_reflection(b["reflection"]) is not None for b in bank)

    # retrieval: step 0 has an empty bank (misses); step 1 finds step 0's reflections of other queries;
    # replays find each query's own reflection, injected into the prompt's guidance block
    by_step = {s: [r for r in rollouts if r["step"] == s] for s in range(4)}
    assert all(r["guidance"] is None for r in by_step[0])
    assert all(r["guidance"] for r in by_step[1])
    assert all(r["guidance"] and "similar question" not in r["guidance"] for s in (2, 3) for r in by_step[s])
    metrics = {
        (m["step"], m["name"]): m["value"]
        for m in json.loads(run_sql(deferred, "SELECT step, name, value FROM metrics WHERE flow = 'rl'", fmt="json"))
    }
    assert metrics[(0, "retrieval/cross_misses")] == 2 and metrics[(1, "retrieval/cross_hits")] == 2
    assert metrics[(2, "retrieval/within_hits")] == 2 and metrics[(3, "retrieval/within_hits")] == 2
    assert metrics[(0, "reflection/acceptance_rate")] == 1.0 and metrics[(1, "bank/size")] == 4

    # deferral: step N trains on step N−1's candidates; no update in step 0, none for step 2's (repeat)
    assert metrics[(1, "reflection_update/source_step")] == 0 and metrics[(2, "reflection_update/source_step")] == 1
    assert (0, "reflection_update/source_step") not in metrics and (3, "reflection_update/source_step") not in metrics
    assert (
        metrics[(1, "reflection_update/nonzero_advantages")] > 0 and metrics[(1, "reflection_update/policy_tokens")] > 0
    )

    # the sync schedule does the same work in the same order of weight changes: same numbers
    sync = rl_with_reflections(sft_run, tmp_path / "sync", forced_reflections, **{"reflection.schedule": "sync"})
    for step in (2, 3):
        a, b = _weights(deferred, step), _weights(sync, step)
        for k in a:
            torch.testing.assert_close(a[k], b[k], rtol=0, atol=1e-6)
    assert [r["token_ids"] for r in RunStore(sync).read_rows("rollouts")] == [r["token_ids"] for r in rollouts]
    assert [(r["text"], r["score"]) for r in RunStore(sync).read_rows("reflections")] == [
        (r["text"], r["score"]) for r in refl
    ]


@pytest.mark.slow
def test_reflection_loop_resumes_exactly(deferred_run, sft_run, tmp_path, forced_reflections, monkeypatch):
    from rubricem_core.rl.progress import completed_step
    from rubricem_core.store import RunStore

    straight = deferred_run

    # a crash in step 2's task update (after the deferred reflection update of step 1 was applied in
    # memory), and the reflections of step 1 lost: the rerun regenerates them with step 0's weights
    # and re-applies the reflection update from step 1's checkpoint
    from flows.rl import rl

    resumed = copy_run(sft_run, tmp_path / "resumed")
    from rubricem_core.rl.policy import LocalPolicy

    real = LocalPolicy.save

    def fail_in_step_2(self, directory, extra):
        if extra["step"] == 2:  # after both of step 2's updates, before its checkpoint
            raise RuntimeError("injected failure in step 2's task update")
        return real(self, directory, extra)

    monkeypatch.setattr(LocalPolicy, "save", fail_in_step_2)
    with pytest.raises(RuntimeError, match="injected failure"):
        rl(run_dir=resumed, profile=MICRO_PROFILE, overrides=REFLECT)
    monkeypatch.setattr(LocalPolicy, "save", real)
    store = RunStore(resumed)
    assert completed_step(RunStore(resumed)) == 1
    shutil.rmtree(store.table_dir("reflections") / "step=0001")
    rl(run_dir=resumed, profile=MICRO_PROFILE, overrides=REFLECT)

    for step in (2, 3):
        a, b = _weights(straight, step), _weights(resumed, step)
        for k in a:
            torch.testing.assert_close(a[k], b[k], rtol=0, atol=1e-6)
    key = lambda r: (r["step"], r["source_rollout_id"], r["candidate"])  # noqa: E731
    ra = sorted(RunStore(straight).read_rows("reflections"), key=key)
    rb = sorted(store.read_rows("reflections"), key=key)
    assert [(r["text"], r["score"], r["accepted"]) for r in ra] == [(r["text"], r["score"], r["accepted"]) for r in rb]
    assert RunStore(straight).read_rows("bank") == store.read_rows("bank")
