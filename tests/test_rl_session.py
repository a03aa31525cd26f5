"""The `rl` flow run's session (rubricem_core.rl.session.open_session): one live RLSession handed to the
tasks, rebuilt only when asked for weights it cannot reach, closed with the flow run however it ends,
and never recorded or hashed by Prefect."""

from __future__ import annotations

import pytest

from rubricem_core.config import load_config
from rubricem_core.rl import session as rl_session
from rubricem_core.rl.learner import WeightsVersion, updates_between
from rubricem_core.store import RunStore
from tests.untrained_run import UNTRAINED_TINY, write_untrained_run


def test_prefect_records_a_placeholder_for_the_session_parameter(tmp_path):
    """rl_step takes the session as a parameter: Prefect stores `<SessionManager>` for it instead of
    walking its models (and tasks have no cache key to hash it into)."""
    from prefect.cache_policies import NO_CACHE

    from flows.rl import rl_step
    from tasks.rl import judge_task, rollout_task, update_task

    cfg = load_config("tiny", UNTRAINED_TINY)
    manager = rl_session.SessionManager(RunStore(tmp_path), cfg)
    recorded = rl_step.serialize_parameters({"run_dir": str(tmp_path), "session": manager})
    assert recorded == {"run_dir": str(tmp_path), "session": "<SessionManager>"}
    assert all(t.cache_policy is NO_CACHE for t in (rollout_task, judge_task, update_task))


@pytest.mark.parametrize("recipe", ["ss_grpo", "full"])
def test_one_live_session_closed_with_the_flow_run(tmp_path, monkeypatch, recipe):
    cfg = load_config("tiny", {**UNTRAINED_TINY, "rl.recipe": recipe})
    write_untrained_run(cfg, tmp_path / "run")
    closed: list = []
    real_close = rl_session.RLSession.close

    def close(self) -> None:  # the real close, remembered
        closed.append(self)
        real_close(self)

    monkeypatch.setattr(rl_session.RLSession, "close", close)
    with pytest.raises(RuntimeError, match="a task failed"):
        with rl_session.open_session(RunStore(tmp_path / "run"), cfg) as sessions:
            live = sessions.at(-1)
            # every way a task asks for the SFT weights gets the live session, not a new one
            assert sessions.at(-1) is live and sessions.current() is live and sessions.sampling(-1) is live
            assert live.weights == live.engine_weights == WeightsVersion(-1)
            assert live.separate_engine == (recipe == "full")  # the reflection loop's engine has its own copy
            raise RuntimeError("a task failed")
    assert closed == [live]  # closed when the flow run's block ended, by its exception
    # a new flow run builds its own session
    with rl_session.open_session(RunStore(tmp_path / "run"), cfg) as sessions:
        again = sessions.at(-1)
        assert again is not live and again.weights == WeightsVersion(-1)
    assert closed == [live, again]


@pytest.mark.parametrize("recipe", ["ss_grpo", "full"])
def test_weights_versions_follow_the_runs_update_order(recipe):
    """Window 2 (new 0 1, replay 2 3, new 4 5 …): with the reflection loop, step 1 trains step 0's
    reflections and step 2 step 1's before their task updates; a replay step (3) trains none. Worked by hand."""
    cfg = load_config("tiny", {**UNTRAINED_TINY, "rl.recipe": recipe, "rl.window": 2})
    V = WeightsVersion
    got = [(u.kind, u.step, u.source_step, after) for u, after in updates_between(cfg, V(-1), V(3))]
    if recipe == "ss_grpo":
        assert got == [("task", s, s, V(s)) for s in range(4)]
    else:
        assert got == [
            ("task", 0, 0, V(0)),
            ("reflection", 1, 0, V(0, 1)),
            ("task", 1, 1, V(1)),
            ("reflection", 2, 1, V(1, 1)),
            ("task", 2, 2, V(2)),
            ("task", 3, 3, V(3)),
        ]
        # a session that applied step 2's reflection update before its task update failed resumes with the task update
        assert [(u.kind, after) for u, after in updates_between(cfg, V(1, 1), V(2))] == [("task", V(2))]
        assert [(u.kind, after) for u, after in updates_between(cfg, V(0), V(0, 1))] == [("reflection", V(0, 1))]
        assert [after for _, after in updates_between(cfg, V(0), V(1, 1))] == [V(0, 1), V(1), V(1, 1)]
    assert updates_between(cfg, V(3), V(3)) == []
    assert V(1) < V(1, 1) < V(2) and str(V(1, 1)) == "step 1 + 1 update(s) of step 2"
