"""The `rl` flow run's session (rubricem_core.rl.session.open_session): one live RLSession handed to the
tasks, rebuilt only when asked for weights it cannot reach, closed with the flow run however it ends,
and never recorded or hashed by Prefect."""

from __future__ import annotations

import pytest

from rubricem_core.config import load_config
from rubricem_core.rl import session as rl_session
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
            assert live.step == -1 and live.engine_step == -1
            assert live.separate_engine == (recipe == "full")  # the reflection loop's engine has its own copy
            raise RuntimeError("a task failed")
    assert closed == [live]  # closed when the flow run's block ended, by its exception
    # a new flow run builds its own session
    with rl_session.open_session(RunStore(tmp_path / "run"), cfg) as sessions:
        again = sessions.at(-1)
        assert again is not live and again.step == -1
    assert closed == [live, again]
