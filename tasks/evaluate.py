"""Prefect task of the `evaluate` flow: one benchmark × checkpoint × retrieval mode → one Parquet part
of `eval_results` (``tables/eval_results/<tag>--<benchmark>--<retrieval>.parquet``); a rerun returns
the summary of the part that exists instead of sampling again.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

from prefect import get_run_logger
from prefect.states import State

from rubricem_core.config import EVAL_PROTOCOL_SETTINGS, RunConfig
from rubricem_core.eval.api_policy import api_engine
from rubricem_core.eval.benchmark import (
    REFLECTIONS_TABLE,
    RESULTS_TABLE,
    EvalPart,
    PartEvaluation,
    evaluate_part,
    reflection_valid_rate,
    reflection_validity_rows,
    sample_seed,
)
from rubricem_core.eval.checkpoints import api_policy_spec
from rubricem_core.llm.endpoints import endpoint_for
from rubricem_core.rollout.factory import checkpoint_engine
from rubricem_core.store import RunStore, atomic_write_text
from tasks.inputs import search_env
from tasks.readback import parquet_task, read_back
from tasks.secrets import resolve_api_key

TABLE = RESULTS_TABLE

_ENGINES: dict[tuple[str, str], tuple[Any, Any]] = {}
_ENGINE_LOCK = threading.Lock()


def _engine(checkpoint: str, cfg: RunConfig) -> tuple[Any, Any]:
    """(engine, tokenizer) for a checkpoint, loaded once per process (benchmarks share it); a model behind
    an API (``api:<model>``) has no tokenizer."""
    api = api_policy_spec(checkpoint)
    key = (str(checkpoint) if api else str(Path(checkpoint).resolve()), cfg.rollout.engine)
    with _ENGINE_LOCK:
        if key not in _ENGINES:
            _close_engines()  # one policy in memory at a time
            if api is not None:
                _ENGINES[key] = api_engine(cfg, api, resolve_api_key(cfg.eval.api_policy))
            else:
                _ENGINES[key] = checkpoint_engine(cfg, checkpoint)
        return _ENGINES[key]


def _close_engines() -> None:
    for engine, _ in _ENGINES.values():
        close = getattr(engine, "close", None)  # a vLLM server fleet: processes of its own
        if close is not None:
            close()
    _ENGINES.clear()


def drop_engines() -> None:
    with _ENGINE_LOCK:
        _close_engines()


def _grader(cfg: RunConfig, benchmark: str):
    """The benchmark's grader: eval.graders.<benchmark> (else eval.grader) and its protocol."""
    from rubricem_core.eval.llm_grader import BenchmarkGrader, GraderOptions

    grader_cfg = cfg.eval.grader_for(benchmark)
    settings = endpoint_for(grader_cfg, api_key=resolve_api_key(grader_cfg))
    setting = EVAL_PROTOCOL_SETTINGS.get(benchmark)
    protocol = {setting: cfg.eval.protocol_for(benchmark)} if setting else {}
    return BenchmarkGrader(settings, GraderOptions.from_config(grader_cfg, seed=cfg.seed, **protocol))


@parquet_task(name="evaluate-benchmark", task_run_name="evaluate-{benchmark}-{retrieval}")
def evaluate_benchmark(
    run_dir: str, cfg: RunConfig, checkpoint: str, benchmark: str, retrieval: str
) -> dict[str, Any] | State:
    """Sample and grade one benchmark → an `eval_results` part (rubricem_core.eval.benchmark); returns its summary."""
    log = get_run_logger()
    store = RunStore(run_dir)
    done = evaluate_part(
        *(store, cfg, checkpoint, benchmark, retrieval),
        engine=lambda: _engine(checkpoint, cfg),
        grader=lambda: _grader(cfg, benchmark),
        env=lambda: search_env(run_dir, cfg),
        info=log.info,
    )
    _record_queries(store, cfg, done.part)
    if done.cached:
        summary = {"cached": True, **done.summary, **_reflection_validity(run_dir, store, cfg, checkpoint, done)}
        return read_back(summary, store.partition_path(TABLE, {}, done.part.name), run_dir)
    store.write_table(TABLE, done.rows, {}, done.part.name)
    s = {**done.summary, **_reflection_validity(run_dir, store, cfg, checkpoint, done)}
    log.info(
        "%s on %s (retrieval %s): score %.3f over %d samples of %d queries, %d grades failed, %.2f valid scaffolds"
        "; %d queries not graded (%d without rubrics, %d without a gold answer, %d without a reference)",
        *(done.part.tag, benchmark, retrieval, s["score_mean"], s["n_samples"], s["n_queries"], s["grade_failed"]),
        *(s["valid_scaffold_rate"], s["n_ungraded"], s["n_no_rubrics"], s["n_no_gold_answer"], s["n_no_reference"]),
    )
    return {"cached": False, **s}


def _record_queries(store: RunStore, cfg: RunConfig, part: EvalPart) -> None:
    """state/eval_queries/<part>.json: which queries the part evaluated, in order, and how they were chosen."""

    record = {
        "benchmark": part.benchmark,
        "checkpoint": part.tag,
        "retrieval": part.retrieval,
        "max_queries": cfg.eval.max_queries,
        "sample": cfg.eval.sample,
        "seed": sample_seed(cfg) if cfg.eval.sample == "random" else None,
        "query_ids": [q.query_id for q in part.queries],
    }
    path = store.layout.eval_queries_file(part.name)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, json.dumps(record, indent=1))


def _reflection_validity(
    run_dir: str, store: RunStore, cfg: RunConfig, checkpoint: str, done: PartEvaluation
) -> dict[str, float]:
    """The checkpoint's valid-reflection rate (eval.reflection_validity) → an `eval_reflections` part
    (same name as its `eval_results` part), sampled once."""
    if not cfg.eval.reflection_validity or api_policy_spec(checkpoint) is not None:
        return {}  # a model behind an API is not the meta-policy: its reflections are not asked for
    if not store.has(REFLECTIONS_TABLE, {}, done.part.name):
        engine, env = (lambda: _engine(checkpoint, cfg)), (lambda: search_env(run_dir, cfg))
        rows = reflection_validity_rows(cfg, done.part, done.rows, engine, env)
        store.write_table(REFLECTIONS_TABLE, rows, {}, done.part.name)
    return reflection_valid_rate(store.read_table(REFLECTIONS_TABLE, {}, done.part.name).to_pylist())
