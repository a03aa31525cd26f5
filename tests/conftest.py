"""Shared pytest fixtures.

Third-party data lives in ``../shared/data`` beside the checkout (never copied into the repo);
tests that need it take the ``shared_data`` fixture and skip cleanly when it is absent.

No test reads the checkout's ``runs/`` (what ``make run`` writes): a test that needs a finished run
takes ``tiny_pipeline_run``, built under pytest's tmp dir (tests/test_isolation.py checks this).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from rubricem_core.offline import apply_offline_defaults
from rubricem_core.testing import MICRO_PROFILE

apply_offline_defaults()

REPO_ROOT = Path(__file__).resolve().parents[1]
SHARED_DATA = REPO_ROOT.parent / "shared" / "data"


@pytest.fixture(scope="session")
def shared_data() -> Path:
    if not SHARED_DATA.is_dir():
        pytest.skip(f"shared data not found at {SHARED_DATA}")
    return SHARED_DATA


def shared_file(shared_data: Path, relative: str) -> Path:
    """Return a file under shared/data or skip the test if it is missing."""
    path = shared_data / relative
    if not path.exists():
        pytest.skip(f"shared data file missing: {path}")
    return path


@pytest.fixture(scope="session")
def deepspeed_ok():
    """Skips a test when DeepSpeed cannot be imported (it is built from source on some machines)."""
    try:
        from rubricem_core.training.deepspeed_trainer import import_deepspeed

        import_deepspeed()
    except ImportError as exc:
        pytest.skip(f"deepspeed is not importable ({exc}); install with pip install --no-build-isolation deepspeed")


@pytest.fixture(scope="session")
def ray_cluster():
    """One local Ray for the whole pytest process (starting one costs seconds): tests that place trainer
    ranks take this fixture; Ray is shut down once, at the end of the session."""
    from rubricem_core.config import DistributedConfig
    from rubricem_core.distributed.cluster import connect, disconnect

    # Ray's memory monitor kills the newest actors when the whole machine is over 95% full, whoever fills
    # it; the test ranks are small, and on a shared machine that killed them mid-test
    os.environ.setdefault("RAY_memory_monitor_refresh_ms", "0")
    connect(DistributedConfig())
    yield
    disconnect()


@pytest.fixture(scope="session")
def prefect_harness():
    """One temporary Prefect API (SQLite) for every flow test of the session."""
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=180):
        yield


# `make run` shrunk: the suite's run (MICRO_PROFILE: the tiny profile with a smaller world, policy, SFT and
# RL), so the whole pipeline (collect → sft → rl → evaluate → report) takes about a minute on a CPU; with a
# learning curve: SFT and both RL steps evaluated.
TINY_PIPELINE = {"rl.eval_every": 1}


@pytest.fixture(scope="session")
def tiny_pipeline_run(tmp_path_factory, prefect_harness) -> Path:
    """A finished, tracked run of the whole pipeline (``rubricem run`` on the tiny profile, shrunk),
    built once per session under pytest's tmp dir. Shared: tests copy it before writing to it."""
    from flows.pipeline import pipeline

    run_dir = tmp_path_factory.mktemp("tiny_pipeline") / "tiny"
    pipeline(run_dir=str(run_dir), profile=MICRO_PROFILE, overrides=TINY_PIPELINE)
    return run_dir
