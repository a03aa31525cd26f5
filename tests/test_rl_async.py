"""One-step asynchronous RL (rl.async_steps: 1): the next step's rollouts sample with the weights
before the running update, both schedules of that work give the same numbers, and the sampler's
logprobs are the lagged policy's."""

from __future__ import annotations

import math
import shutil
from pathlib import Path

import pytest
import torch
import yaml

from rubricem_core.config import RunConfig
from rubricem_core.rl.curriculum import reflect_before_next_rollouts, sampling_step, windowed_schedule
from rubricem_core.schemas import row_keys
from rubricem_core.testing import MICRO_PROFILE


def test_sampling_step_lags_one_update_with_async():
    assert [sampling_step(s, 0) for s in range(4)] == [-1, 0, 1, 2]
    assert [sampling_step(s, 1) for s in range(4)] == [-1, -1, 0, 1]


@pytest.mark.parametrize("window", [1, 2, 3])
def test_reflections_come_first_only_when_the_next_step_replays_this_one(window):
    plans = windowed_schedule([f"q{i}" for i in range(12)], window, 2, 2, seed=0)
    first = [reflect_before_next_rollouts(p, n, window) for p, n in zip(plans, plans[1:])]
    # the last new-query step of a window with K = 1 is followed by its own replay
    want = [window == 1 and p.phase == "new" for p in plans[:-1]]
    assert first == want
    assert not reflect_before_next_rollouts(plans[-1], None, window)


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"rl": {"async_steps": 1}}, "importance_correction: tis"),
        (
            {
                "rl": {"async_steps": 1, "importance_correction": "tis"},
                "rollout": {"engine": "vllm_server", "colocate": True},
                "reflection": {"schedule": "sync"},
            },
            "rollout.colocate",
        ),
        ({"rl": {"async_steps": 2, "importance_correction": "tis"}}, "async_steps"),
    ],
)
def test_async_settings_that_cannot_work_are_refused_by_name(changes, message):
    with pytest.raises(ValueError, match=message):
        RunConfig.model_validate(changes)


SMALL = {"data.world.n_queries": 10, "data.world.eval_fraction": 0.2, "sft.max_steps": 4}  # over MICRO_PROFILE
# two new-query steps and their replays, the reflection loop on (tiny: recipe full), every checkpoint kept
ASYNC = {
    "rl.window": 2,
    "rl.n_windows": 1,
    "rl.queries_per_step": 2,
    "rl.lr": 3e-3,
    "rl.keep_checkpoints": 4,
    "rl.async_steps": 1,
    "rl.importance_correction": "tis",
}
TABLES = row_keys("rollouts", "judge_scores", "stage_rewards", "reflections", "bank")
VOLATILE = {"latency_s", "submitted_at", "logged_at"}


@pytest.fixture(scope="module")
def trained(tmp_path_factory, prefect_harness) -> Path:
    from flows.collect_sft_data import collect_sft_data
    from flows.sft import sft

    run_dir = tmp_path_factory.mktemp("rl_async") / "base"
    collect_sft_data(run_dir=str(run_dir), profile=MICRO_PROFILE, overrides=SMALL)
    sft(run_dir=str(run_dir), profile=MICRO_PROFILE, overrides=SMALL)
    return run_dir


def _rows(run_dir: Path, table: str) -> list[dict]:
    from rubricem_core.store import RunStore

    key = TABLES[table]
    rows = [{k: v for k, v in r.items() if k not in VOLATILE} for r in RunStore(run_dir).read_rows(table)]
    return sorted(rows, key=lambda r: tuple(str(r[k]) for k in key))


def _weights(ckpt: Path) -> dict[str, torch.Tensor]:
    from rubricem_core.policy.loading import load_policy

    model, _ = load_policy(str(ckpt))
    return model.state_dict()


def _sampler_gap(rows: list[dict], policy_dir: Path, temperature: float) -> float:
    """The largest |sampler logprob − ``policy_dir``'s logprob| over the rows' sampled tokens."""
    from rubricem_core.logprobs import token_logprobs
    from rubricem_core.policy.loading import load_policy

    model, _ = load_policy(str(policy_dir))
    model.eval()
    gap = 0.0
    for row in rows:
        ids = torch.tensor([row["token_ids"]])
        with torch.no_grad():
            ours = token_logprobs(model, ids, torch.ones_like(ids), temperature=temperature)[0]
        for t, sampled in enumerate(row["logprobs"]):
            if sampled is not None and not math.isnan(sampled):
                gap = max(gap, abs(float(ours[t]) - sampled))
    return gap


@pytest.mark.slow
def test_async_rl_samples_one_update_behind_and_both_schedules_agree(trained, tmp_path):
    """The overlapped run (reflection.schedule: deferred) and the one-task-after-another run (sync) give
    the same tables and weights; each step's sampler logprobs are those of the weights one update
    before the trainer's (step 1: SFT, step 2: after step 0), and the next step's rollouts ran while
    the update did."""
    from prefect import get_client
    from prefect.client.schemas.filters import TaskRunFilter, TaskRunFilterName

    from flows.rl import rl
    from rubricem_core.store import RunStore

    overlapped, sequential = tmp_path / "overlapped", tmp_path / "sequential"
    shutil.copytree(trained, overlapped)
    shutil.copytree(trained, sequential)
    rl(run_dir=str(overlapped), profile=MICRO_PROFILE, overrides={**SMALL, **ASYNC})
    rl(run_dir=str(sequential), profile=MICRO_PROFILE, overrides={**SMALL, **ASYNC, "reflection.schedule": "sync"})

    for table in TABLES:
        assert _rows(overlapped, table) == _rows(sequential, table), table
    assert len({r["step"] for r in _rows(overlapped, "reflections")}) == 2  # both new-query steps reflected
    ckpts = overlapped / "checkpoints" / "rl"
    for name in ("step-000000", "step-000003"):
        a, b = _weights(ckpts / name), _weights(sequential / "checkpoints" / "rl" / name)
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), name

    store = RunStore(overlapped)
    lag = {r["step"]: r["value"] for r in store.read_rows("metrics") if r["name"] == "rollout/policy_lag"}
    assert lag == {0: 0.0, 1: 1.0, 2: 1.0, 3: 1.0}
    tis = [r["value"] for r in store.read_rows("metrics") if r["name"] == "rl/tis_weight_mean" and r["step"] >= 2]
    assert tis and all(0 < w <= 2.0 for w in tis)  # the lag is corrected, and there is one to correct

    temperature = yaml.safe_load((overlapped / "config.yaml").read_text())["rollout"]["temperature"]
    sft_dir = overlapped / "checkpoints" / "sft" / "final"
    step1 = store.read_rows("rollouts", {"step": 1})
    step2 = store.read_rows("rollouts", {"step": 2})
    assert _sampler_gap(step1, sft_dir, temperature) < 1e-3  # step 1 sampled with the SFT weights
    assert _sampler_gap(step2, ckpts / "step-000000", temperature) < 1e-3  # step 2 with those after step 0
    assert _sampler_gap(step2, ckpts / "step-000001", temperature) > 1e-2  # not with the trainer's

    trainer_work = ["reflection-update-of-step-0", "ss-grpo-update-step-1"]
    with get_client(sync_client=True) as client:
        runs = client.read_task_runs(
            task_run_filter=TaskRunFilter(name=TaskRunFilterName(any_=["rollout-step-2", *trainer_work]))
        )
    by_step_run: dict = {}
    for run in runs:
        by_step_run.setdefault(run.flow_run_id, {})[run.name] = (run.start_time, run.end_time)
    overlapped_spans = []
    for spans in by_step_run.values():
        if len(spans) == 3:  # all ran in step 1's subflow: rollout-step-2 beside the trainer's two updates
            r0, r1 = spans["rollout-step-2"]
            u0, u1 = min(spans[n][0] for n in trainer_work), max(spans[n][1] for n in trainer_work)
            overlapped_spans.append(r0 < u1 and u0 < r1)
    # the deferred run overlapped them; the sequential one sampled after the updates
    assert sorted(overlapped_spans) == [False, True], by_step_run
