"""A run directory with inputs and a random-init tiny policy as its "SFT" checkpoint: flow tests that
exercise evaluation plumbing need a loadable policy, not a trained one (training is tested elsewhere)."""

from __future__ import annotations

from pathlib import Path

from rubricem_core.config import RunConfig
from rubricem_core.sft import prepare_policy
from rubricem_core.store import RunStore
from tasks.inputs import build_inputs

# The smallest tiny run a test can load and train: 60 documents, a 1-layer width-32 Qwen3.
UNTRAINED_TINY = {
    "data.world.n_documents": 60,
    "data.world.n_queries": 8,
    "policy.vocab_size": 600,
    "policy.hidden_size": 32,
    "policy.n_layers": 1,
    "policy.n_heads": 2,
    "policy.n_kv_heads": 1,
    "policy.intermediate_size": 64,
    "tracking.enabled": False,
}


def write_untrained_run(cfg: RunConfig, run: Path) -> list[str]:
    """Write `queries`, `corpus` and checkpoints/sft/final under ``run``; returns the corpus texts."""
    store = RunStore(run)
    queries, corpus = build_inputs(cfg)
    store.write_table("corpus", corpus)
    store.write_table("queries", queries)
    texts = corpus.column("text").to_pylist()
    prepare_policy(cfg.policy, run / "checkpoints" / "sft" / "final", texts, seed=0)
    return texts
