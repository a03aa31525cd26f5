"""The one-thread fixture of tests that train or sample tiny models (rubricem_core.testing.tiny_models)."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    # Matrices this small gain nothing from OpenMP threads, and on a busy 2-core machine two
    # spinning threads made a step ~15x slower (0.8 s vs 0.05 s measured).
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
