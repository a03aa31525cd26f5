"""Prefect tasks of SFT: build/resolve the base policy, then train on accepted trajectories."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE
from prefect.states import State

from rubricem_core.config import RunConfig
from rubricem_core.layout import RunLayout, final_checkpoint_dir, holds_policy
from rubricem_core.sft import prepare_policy, train_sft
from rubricem_core.store import RunStore
from tasks.readback import parquet_task, read_back

ARTIFACT_MAX_BYTES = 200 * 2**20  # larger checkpoints are tracked by path, not copied into MLflow


def policy_base_dir(run_dir: str) -> Path:
    return RunLayout(run_dir).policy_base_dir


def sft_checkpoint_root(run_dir: str) -> Path:
    return RunLayout(run_dir).sft_checkpoints_dir


def base_policy(run_dir: str, cfg: RunConfig, log: Any) -> Path:
    """The run's base policy directory (or hub name): the tiny policy is built once per run directory
    from its corpus (by whichever task needs it first: SFT, or the teacher's reflections when their
    prompt is bounded in the policy's tokens); real models are used as named."""
    out = policy_base_dir(run_dir)
    if cfg.policy.name_or_path == "tiny" and not (out / "config.json").exists():
        corpus = RunStore(run_dir).read_table("corpus")
        texts = [f"{t}\n{x}" for t, x in zip(corpus["title"].to_pylist(), corpus["text"].to_pylist())]
        doc_ids = corpus["doc_id"].to_pylist()
        log.info("building the tiny policy (tokenizer trained on %d documents) in %s", len(texts), out)
    else:
        texts, doc_ids = [], []
    return prepare_policy(cfg.policy, out, texts, cfg.seed, doc_ids=doc_ids)


@task(name="prepare-policy", task_run_name="prepare-policy", cache_policy=NO_CACHE)
def prepare_policy_task(run_dir: str, cfg: RunConfig) -> str:
    """The tiny policy is built once per run directory from its corpus; real models are used as named."""
    log = get_run_logger()
    path = base_policy(run_dir, cfg, log)
    log.info("base policy: %s", path)
    return str(path)


@parquet_task(name="train-sft", task_run_name="train-sft")
def train_sft_task(
    run_dir: str, cfg: RunConfig, policy_dir: str, log_metrics: Callable[[dict[str, float], int], None] | None = None
) -> dict[str, Any] | State:
    log = get_run_logger()
    root = sft_checkpoint_root(run_dir)
    final = final_checkpoint_dir(root)
    if holds_policy(final):
        log.info("SFT already finished: %s (cached)", final)
        return read_back({"final_dir": str(final), "cached": True}, final, run_dir)

    def log_and_print(metrics: dict[str, float], step: int) -> None:  # progress lines come from the core's log
        if log_metrics is not None:
            log_metrics(metrics, step)

    if cfg.distributed.world_size > 1:  # Ray actors: their output is this task's log, their failure its failure
        log.info("starting %d SFT ranks on Ray", cfg.distributed.world_size)
    result = train_sft(run_dir, cfg, policy_dir, root, log_metrics=log_and_print, on_line=log.info)
    log.info("SFT done: %s", {k: v for k, v in result.items() if k != "final_dir"})
    return {**result, "cached": False}


def checkpoint_size(path: str) -> int:
    return sum(p.stat().st_size for p in Path(path).rglob("*") if p.is_file())
