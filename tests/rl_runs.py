"""The RL tests' shared run: the suite's micro profile collected and fine-tuned once per test module
(``sft_run``), the reflection loop's forced candidates (``forced_reflections``) and an `rl` run copied
from it (``rl_with_reflections``). Test modules import the fixtures by name; pytest gives each module
its own instance (module scope)."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest

from rubricem_core.store import RunStore
from rubricem_core.testing import MICRO_PROFILE
from rubricem_core.testing.forced_reflections import forcing_engine

RL_RUN = {  # over the suite's run (rubricem_core/testing/micro.yaml)
    "data.world.n_documents": 120,
    "data.world.n_queries": 10,
    "data.world.eval_fraction": 0.2,
    "teacher.trajectories_per_query": 2,
    "sft.max_steps": 4,
    "rl.recipe": "ss_grpo",
}

REFLECT = {
    **RL_RUN,
    "rl.recipe": "full",
    "rl.window": 2,
    "reflection.n_candidates": 3,
    "reflection.max_new_tokens": 400,
    "reflection.max_trajectory_chars": 1500,
    "reflection.warm_bank": False,  # an empty bank at step 0 (the warm start: tests/test_reflection_warm.py)
}


@pytest.fixture(scope="module")
def sft_run(tmp_path_factory: pytest.TempPathFactory, prefect_harness: Any) -> Path:
    from flows.collect_sft_data import collect_sft_data
    from flows.sft import sft

    run_dir = tmp_path_factory.mktemp("rl") / "base"
    collect_sft_data(run_dir=str(run_dir), profile=MICRO_PROFILE, overrides=RL_RUN)
    sft(run_dir=str(run_dir), profile=MICRO_PROFILE, overrides=RL_RUN)
    return run_dir


@pytest.fixture(scope="module")
def forced_reflections() -> Any:
    """Even candidates of every reflection request spell a valid reflection for their question."""
    import rubricem_core.rollout.factory as engine_factory

    state: dict = {"questions": {}}
    monkeypatch = pytest.MonkeyPatch()
    monkeypatch.setattr(
        engine_factory, "HFRolloutEngine", forcing_engine(engine_factory.HFRolloutEngine, state["questions"])
    )
    yield state
    monkeypatch.undo()


def copy_run(src: str | Path, dst: str | Path) -> str:
    shutil.copytree(src, dst)
    return str(dst)


def rl_with_reflections(sft_run: Path, dst: Path, state: dict, **extra: Any) -> str:
    """`rl` with the reflection loop (REFLECT and ``extra``) on a copy of ``sft_run``, its questions
    handed to the forced candidates."""
    from flows.rl import rl

    run_dir = copy_run(sft_run, dst)
    state["questions"].update({q["query_id"]: q["question"] for q in RunStore(run_dir).read_rows("queries")})
    rl(run_dir=run_dir, profile=MICRO_PROFILE, overrides={**REFLECT, **extra})
    return run_dir
