"""The SFT tests' shared run: the tiny profile's collection with a small world and policy, once per test
module (``collected_run``), and the SFT settings that train it in a few steps with checkpoints between."""

from __future__ import annotations

from typing import Any

import pytest

SFT_RUN = {
    "data.world.n_documents": 120,
    "data.world.n_queries": 10,
    "data.world.eval_fraction": 0.2,
    "teacher.trajectories_per_query": 2,
    "policy.vocab_size": 1024,
    "policy.hidden_size": 64,
    "policy.n_layers": 2,
    "policy.intermediate_size": 128,
    "sft.max_steps": 8,
    "sft.warmup_steps": 2,
    "sft.checkpoint_every": 3,
    "sft.log_every": 2,
    "sft.max_tokens_per_batch": 8192,
}


@pytest.fixture(scope="module")
def collected_run(tmp_path_factory: pytest.TempPathFactory, prefect_harness: Any) -> str:
    from flows.collect_sft_data import collect_sft_data

    run_dir = str(tmp_path_factory.mktemp("sft") / "run")
    collect_sft_data(run_dir=run_dir, profile="tiny", overrides=SFT_RUN)
    return run_dir
