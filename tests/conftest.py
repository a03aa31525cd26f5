"""Shared pytest fixtures.

Third-party data lives in ``../shared/data`` beside the checkout (never copied into the repo);
tests that need it take the ``shared_data`` fixture and skip cleanly when it is absent.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from rubricem_core.offline import apply_offline_defaults

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
def prefect_harness():
    """One temporary Prefect API (SQLite) for every flow test of the session."""
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=180):
        yield
