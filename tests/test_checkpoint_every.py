"""rl.checkpoint_every / rl.keep_checkpoints: which steps checkpoint, what a resume replays, which runs the
config refuses, pruning, and the gloo weight transfer that replaces the per-step checkpoint for an engine
beside trainer ranks. The end-to-end kills between checkpoints are in tests/test_fault_kill.py; the
2-rank flow in tests/test_rl_distributed.py."""

from __future__ import annotations

import json

import pytest

from rubricem_core.config import ConfigError, load_config
from rubricem_core.rl import progress as rl_progress
from rubricem_core.rl import session as rl_session
from rubricem_core.rl.curriculum import windowed_schedule
from rubricem_core.run_config import Change, is_safe
from rubricem_core.store import RunStore


def test_checkpoint_steps_every_n_and_always_the_last():
    cfg = load_config("tiny", {"rl.n_windows": 3, "rl.checkpoint_every": 4})  # 6 steps
    assert [s for s in range(6) if rl_progress.checkpoint_due(cfg, s)] == [3, 5]
    assert all(rl_progress.checkpoint_due(load_config("tiny"), s) for s in range(4))  # tiny: every step
    assert load_config("gpu").rl.checkpoint_every == load_config("research").rl.checkpoint_every == 10
    assert load_config("small").rl.checkpoint_every == 1 and load_config("tiny").rl.keep_checkpoints == 2


@pytest.mark.parametrize("window", [1, 2, 3])
def test_replayed_reflection_updates_are_the_flows(window, tmp_path):
    """The replay and rl_step apply a reflection update in the same steps (one rule:
    curriculum.reflection_source), and that rule is the paper's, worked from the plans by hand: on the
    candidates of the previous plan when it is a new-query step."""
    from flows.rl import _reflections_to_train

    cfg = load_config("tiny", {"rl.window": window, "rl.n_windows": 2})
    plans = windowed_schedule([f"q{i}" for i in range(8)], window, 2, 2, 0)
    assert rl_progress.last_step(cfg) == plans[-1].step
    _write_steps(RunStore(tmp_path), ("reflections",), range(len(plans)))  # so the flow's helper writes none
    session = rl_session.SessionManager(RunStore(tmp_path), cfg)  # opens nothing until a task asks
    trained = [_reflections_to_train(session, plan, prev) for plan, prev in zip(plans, [None, *plans[:-1]])]
    flow = [p.step if p is not None else None for p in trained]
    by_hand = [prev.step if prev is not None and prev.phase == "new" else None for prev in [None, *plans[:-1]]]
    assert [rl_progress.reflection_source_step(cfg, p.step) for p in plans] == flow == by_hand
    assert any(flow) and rl_progress.reflection_source_step(load_config("tiny", {"rl.recipe": "ss_grpo"}), 1) is None


def test_checkpoint_every_needs_pushed_weights_for_a_vllm_server():
    server = {"rollout.engine": "vllm_server", "rl.checkpoint_every": 10}
    with pytest.raises(ConfigError, match="rollout.weight_transfer: checkpoint makes the vLLM server reload"):
        load_config("tiny", server)
    assert load_config("tiny", {**server, "rollout.weight_transfer": "gloo"}).rl.checkpoint_every == 10


def test_checkpoint_spacing_and_retention_may_change_on_a_finished_run():
    assert is_safe(Change("rl.checkpoint_every", 1, 10)) and is_safe(Change("rl.keep_checkpoints", 2, 5))
    assert not is_safe(Change("rl.lr", 1e-4, 2e-4))


def _write_steps(store: RunStore, tables: tuple[str, ...], steps: range) -> None:
    for table in tables:
        for s in steps:
            store.write_table(table, [{"step": s}], {"step": s})


def test_a_done_step_needs_its_checkpoint_or_the_tables_to_replay_it(tmp_path):
    run = str(tmp_path)
    store = RunStore(run)
    progress = store.layout.rl_progress_file
    progress.parent.mkdir(parents=True)
    progress.write_text(json.dumps({"completed_step": 4}))
    with pytest.raises(FileNotFoundError, match=r"step 4 is complete .* rollouts/step=0000"):
        rl_progress.completed_step(RunStore(run))
    _write_steps(store, ("rollouts", "stage_rewards"), range(5))
    assert rl_progress.completed_step(RunStore(run)) == 4 and rl_progress.newest_checkpoint(RunStore(run), 4) == -1
    for step in (2, 5):  # step 5: written by an update whose step was never marked done
        ckpt = rl_progress.step_checkpoint(RunStore(run), step)
        ckpt.mkdir(parents=True)
        (ckpt / "checkpoint.json").write_text("{}")
    (rl_progress.step_checkpoint(RunStore(run), 3)).mkdir()  # a staging leftover: not a checkpoint
    assert rl_progress.newest_checkpoint(RunStore(run), 4) == 2
    cfg = load_config("tiny", {"rl.n_windows": 3})  # window 1: reflection updates in steps 1, 3, 5
    assert rl_progress.replay_gaps(RunStore(run), 2, 4, cfg) == ["reflections/step=0002"]
    assert rl_progress.replay_gaps(RunStore(run), 0, 4) == []


def test_keep_checkpoints_prunes_the_oldest(tmp_path):

    for step in (2, 5, 8, 11):
        rl_progress.step_checkpoint(RunStore(tmp_path), step).mkdir(parents=True)
    rl_progress.prune_checkpoints(RunStore(tmp_path), keep=2)
    assert sorted(p.name for p in rl_progress.rl_dir(RunStore(tmp_path)).iterdir()) == ["step-000008", "step-000011"]
