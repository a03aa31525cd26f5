"""Prefect task of the `evaluate` flow: one benchmark × checkpoint × retrieval mode → one Parquet part
of `eval_results` (``tables/eval_results/<tag>--<benchmark>--<retrieval>.parquet``); a rerun returns
the summary of the part that exists instead of sampling again.
"""

from __future__ import annotations

import dataclasses
import threading
from pathlib import Path
from typing import Any

from prefect import get_run_logger
from prefect.states import State

from rubricem_core.config import EVAL_PROTOCOL_SETTINGS, RunConfig
from rubricem_core.eval.prompts import reference_article
from rubricem_core.eval.run import (
    EVAL_RESULTS_SCHEMA,
    SEQUENTIAL,
    SEQUENTIAL_TRIALS,
    EvalOptions,
    SequentialOptions,
    checkpoint_tag,
    load_benchmark_queries,
    run_eval,
    select_queries,
    settings_digest,
    summarize,
    ungraded_code,
    ungraded_reason,
)
from rubricem_core.eval.types import EvalError, family_of
from rubricem_core.llm.endpoints import endpoint_for
from rubricem_core.policy.loading import auto_device, load_policy
from rubricem_core.reflection.bank import ENTRIES_FILE, ReflectionBank, bank_dir, saved_bank_info
from rubricem_core.reflection.meta import sample_reflections
from rubricem_core.rl.session import completed_step, newest_checkpoint
from rubricem_core.rollout import SamplingParams
from rubricem_core.rollout.factory import make_engine
from rubricem_core.schemas import EVAL_REFLECTIONS_SCHEMA, queries_from_table
from rubricem_core.seeds import EVAL_REFLECTION, EVAL_SAMPLING, derive_seed
from rubricem_core.store import RunStore
from tasks.inputs import search_env
from tasks.readback import parquet_task, read_back
from tasks.secrets import resolve_api_key

TABLE = "eval_results"

_ENGINES: dict[tuple[str, str], tuple[Any, Any]] = {}
_ENGINE_LOCK = threading.Lock()


def default_checkpoint(run_dir: str) -> Path:
    """The newest RL checkpoint of a finished step (the last step's once RL is over: it always writes
    one; mid-run, the newest of rl.checkpoint_every's), else the SFT policy."""
    store = RunStore(run_dir)
    step = newest_checkpoint(store, completed_step(store))
    path = store.layout.rl_step_checkpoint(step) if step >= 0 else store.layout.sft_final
    if not (path / "config.json").exists():
        raise FileNotFoundError(
            f"no policy checkpoint at {path}: run `rubricem sft` (or rl) first, or pass --checkpoint"
        )
    return path


def part_name(tag: str, benchmark: str, retrieval: str) -> str:
    return f"{tag}--{benchmark}--{retrieval}"


def _engine(checkpoint: str, cfg: RunConfig) -> tuple[Any, Any]:
    """(engine, tokenizer) for a checkpoint, loaded once per process (benchmarks share it)."""
    key = (str(Path(checkpoint).resolve()), cfg.rollout.engine)
    with _ENGINE_LOCK:
        if key not in _ENGINES:
            _close_engines()  # one policy in memory at a time
            # vLLM loads its own copy from the directory: the HF one is only its tokenizer's source.
            device = "cpu" if cfg.rollout.engine in ("vllm", "vllm_server") else auto_device()
            model, tokenizer = load_policy(checkpoint, dtype=cfg.policy.dtype, device=device)
            # vllm_server: the RL fleet's layout and schedule, serving the evaluated checkpoint's own weights
            log = Path(checkpoint).resolve().parent / f".{Path(checkpoint).name}.vllm-eval.log"
            engine = make_engine(cfg, checkpoint, tokenizer, model=model, log_path=log, push=False)
            _ENGINES[key] = (engine, tokenizer)
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


def _bank_location(run_dir: str, cfg: RunConfig, retrieval: str) -> Path:
    """Where RL saved the run's bank (eval.bank_dir overrides it)."""
    directory = Path(cfg.eval.bank_dir) if cfg.eval.bank_dir else bank_dir(run_dir)
    if not (directory / ENTRIES_FILE).exists():
        raise FileNotFoundError(
            f"retrieval={retrieval!r} needs a reflection bank, but none is saved at {directory} "
            "(run RL with a reflection recipe, or set eval.bank_dir)"
        )
    return directory


def _bank(run_dir: str, cfg: RunConfig, retrieval: str) -> ReflectionBank | None:
    """The saved bank, searched with the embedder recorded with it unless eval.bank_embedder overrides it."""
    if retrieval == "none":
        return None
    return ReflectionBank.load(_bank_location(run_dir, cfg, retrieval), cfg.eval.bank_embedder)


def _bank_settings(run_dir: str, cfg: RunConfig, retrieval: str) -> list[str | None]:
    """The bank's part of an eval part's settings. Without retrieval no bank is read: the value is the
    one such parts were keyed by before eval.bank_embedder defaulted to the recorded embedder, so their
    digests stay. With retrieval: the location and the embedder the bank is searched with."""
    if retrieval == "none":
        return [cfg.eval.bank_dir, cfg.eval.bank_embedder or "hashing"]
    embedder = cfg.eval.bank_embedder or saved_bank_info(_bank_location(run_dir, cfg, retrieval)).embedder
    return [cfg.eval.bank_dir, embedder]


def sequential_options(cfg: RunConfig) -> SequentialOptions:
    """The reflection between the trials of retrieval=sequential: the meta-policy's own settings."""
    return SequentialOptions(
        temperature=cfg.reflection.temperature,
        max_new_tokens=cfg.reflection.max_new_tokens,
        max_trajectory_chars=cfg.reflection.max_trajectory_chars,
        max_trajectory_tokens=cfg.reflection.max_trajectory_tokens,
        validity=cfg.reflection.validity,
    )


def sequential_settings(sequential: SequentialOptions) -> dict[str, Any]:
    """The sequential options an eval part is keyed by. A token bound is added only when set, so the
    digests of parts evaluated before reflection.max_trajectory_tokens existed stay as they were; so is the
    validity when strict (the only rule before reflection.validity)."""
    settings = dataclasses.asdict(sequential)
    if settings["max_trajectory_tokens"] is None:
        del settings["max_trajectory_tokens"]
    if settings["validity"] == "strict":
        del settings["validity"]
    return settings


def sample_seed(cfg: RunConfig) -> int:
    """Seed of eval.sample: random (eval.sample_seed, else the run's seed)."""
    return cfg.seed if cfg.eval.sample_seed is None else cfg.eval.sample_seed


def race_grading(cfg: RunConfig, benchmark: str) -> bool:
    """Whether ``benchmark`` is graded relative to reference reports (DeepResearchBench, eval.drb_grading race)."""
    return family_of(benchmark) == "dimension_criteria" and cfg.eval.protocol_for(benchmark) == "race"


def eval_queries(run_dir: str, cfg: RunConfig, benchmark: str) -> list:
    if family_of(benchmark) == "synthetic":
        held_out = [q for q in queries_from_table(RunStore(run_dir).read_table("queries")) if q.split == "eval"]
        if not held_out:
            raise EvalError(f"{run_dir}: the queries table has no 'eval' split to evaluate on")
        return select_queries(held_out, cfg.eval.max_queries, cfg.eval.sample, sample_seed(cfg))
    reference = None
    if race_grading(cfg, benchmark):
        reference = cfg.eval.paths.get(f"{benchmark}_reference")
        if not reference:
            raise EvalError(
                f"eval.drb_grading is 'race', which scores {benchmark} against reference reports: set "
                f"eval.paths.{benchmark}_reference (or eval.drb_grading: absolute)"
            )
    return load_benchmark_queries(
        benchmark, cfg.eval.paths.get(benchmark), cfg.eval.max_queries, cfg.eval.sample, sample_seed(cfg), reference
    )


def grading_settings(cfg: RunConfig, benchmark: str, queries: list) -> dict[str, Any]:
    """The sampling and grading choices in an eval part's settings beyond the legacy ones (first N queries,
    HealthBench joint, DeepResearchBench absolute): only added when they differ, so existing parts
    produced the legacy way keep their digests, and a part produced otherwise is evaluated again."""
    out: dict[str, Any] = {}
    if cfg.eval.sample != "first":
        out["sample"] = {"mode": cfg.eval.sample, "seed": sample_seed(cfg)}
    if benchmark == "healthbench" and cfg.eval.protocol_for(benchmark) != "joint":
        out["grading"] = cfg.eval.protocol_for(benchmark)
    if race_grading(cfg, benchmark):
        out["grading"] = "race"  # the references themselves too: a new reference file re-grades
        out["references"] = settings_digest({q.query_id: reference_article(q) for q in queries})
    return out


@parquet_task(name="evaluate-benchmark", task_run_name="evaluate-{benchmark}-{retrieval}")
def evaluate_benchmark(
    run_dir: str, cfg: RunConfig, checkpoint: str, benchmark: str, retrieval: str
) -> dict[str, Any] | State:
    """Sample and grade one benchmark → an `eval_results` part; returns its summary."""
    log = get_run_logger()
    store = RunStore(run_dir)
    tag = checkpoint_tag(run_dir, checkpoint)
    part = part_name(tag, benchmark, retrieval)
    queries = eval_queries(run_dir, cfg, benchmark)
    options = EvalOptions(
        samples_per_query=cfg.eval.samples_per_query,
        temperature=cfg.eval.temperature,
        top_p=cfg.rollout.top_p,
        max_new_tokens=cfg.rollout.max_new_tokens,
        max_total_tokens=cfg.rollout.max_total_tokens,
        max_tool_calls=cfg.tools.max_tool_calls,
        seed=derive_seed(cfg.seed, EVAL_SAMPLING, benchmark),
        prompt_style=cfg.policy.prompt_style,
        retrieval=retrieval,
        retrieval_k=cfg.eval.retrieval_k,
    )
    produced_by: dict[str, Any] = {
        "options": dataclasses.asdict(options),
        "queries": [q.query_id for q in queries],
        "grader": cfg.eval.grader_for(benchmark).model_dump(
            include={"model", "temperature", "max_tokens", "structured_output"}
        ),
        "bank": _bank_settings(run_dir, cfg, retrieval),
        "engine": cfg.rollout.engine,
        **grading_settings(cfg, benchmark, queries),
    }
    # A query that gains rubrics (or loses them) is evaluated again, not read back as ungraded. Only
    # added when there are such queries, so the digests of existing parts stay as they were.
    ungraded = [q.query_id for q in queries if ungraded_reason(benchmark, q, race_grading(cfg, benchmark)) is not None]
    if ungraded:
        produced_by["ungraded"] = ungraded
    sequential = sequential_options(cfg) if retrieval == SEQUENTIAL else None
    if sequential is not None:
        produced_by["sequential"] = sequential_settings(sequential)
    settings = settings_digest(produced_by)
    if store.has(TABLE, {}, part):
        rows = store.read_table(TABLE, {}, part).to_pylist()
        if all(r.get("settings") == settings for r in rows):
            summary = {
                "cached": True,
                **summarize(rows),
                **_reflection_validity(run_dir, cfg, checkpoint, part, rows, queries),
            }
            return read_back(summary, store.partition_path(TABLE, {}, part), run_dir)
        log.info("%s: the settings changed since %s was evaluated; evaluating again", part, tag)
        store.partition_path(REFLECTIONS_TABLE, {}, part).unlink(missing_ok=True)  # of the old results
    engine, tokenizer = _engine(checkpoint, cfg)
    grader = None if family_of(benchmark) == "synthetic" else _grader(cfg, benchmark)
    outcome = run_eval(
        engine,
        tokenizer,
        benchmark,
        queries,
        search_env(run_dir, cfg),
        options,
        tag,
        grader,
        _bank(run_dir, cfg, retrieval),
        sequential,
    )
    rows = [{**r, "settings": settings} for r in outcome.rows]
    store.write_table(TABLE, rows, {}, part, schema=EVAL_RESULTS_SCHEMA)
    s = {**outcome.summary, **_reflection_validity(run_dir, cfg, checkpoint, part, outcome.rows, queries)}
    log.info(
        "%s on %s (retrieval %s): score %.3f over %d samples of %d queries, %d grades failed, %.2f valid scaffolds"
        "; %d queries not graded (%d without rubrics, %d without a gold answer, %d without a reference)",
        tag,
        benchmark,
        retrieval,
        s["score_mean"],
        s["n_samples"],
        s["n_queries"],
        s["grade_failed"],
        s["valid_scaffold_rate"],
        s["n_ungraded"],
        s["n_no_rubrics"],
        s["n_no_gold_answer"],
        s["n_no_reference"],
    )
    return {"cached": False, **s}


REFLECTIONS_TABLE = "eval_reflections"


def _reflection_validity(
    run_dir: str, cfg: RunConfig, checkpoint: str, part: str, rows: list[dict[str, Any]], queries: list
) -> dict[str, float]:
    """The checkpoint's valid-reflection rate: one unforced reflection per evaluated trajectory, checked
    by the meta-policy's validator → an `eval_reflections` part (same name as its `eval_results` part)."""
    if not cfg.eval.reflection_validity:
        return {}
    store = RunStore(run_dir)
    if not store.has(REFLECTIONS_TABLE, {}, part):
        engine, tokenizer = _engine(checkpoint, cfg)
        sampling = SamplingParams(
            temperature=cfg.reflection.temperature,
            top_p=cfg.rollout.top_p,
            max_new_tokens=cfg.reflection.max_new_tokens,
            max_total_tokens=cfg.rollout.max_total_tokens,
            seed=derive_seed(cfg.seed, EVAL_REFLECTION, part),
        )
        # ungraded queries were never sampled: no trajectory to reflect on
        # the two trials of retrieval=sequential share (query, sample): their ids name the trial too
        by_source = {
            f"{r['query_id']}-e{r['sample']}" + (f"-{r['retrieval']}" if r["retrieval"] in SEQUENTIAL_TRIALS else ""): r
            for r in rows
            if ungraded_code(r) is None
        }
        sources = [{"source": sid, "query_id": r["query_id"], "text": r["text"]} for sid, r in by_source.items()]
        sampled = sample_reflections(
            engine,
            tokenizer,
            sources,
            {q.query_id: q.question for q in queries},
            sampling,
            cfg.reflection.max_trajectory_chars,
            search_env(run_dir, cfg),
            cfg.reflection.max_trajectory_tokens,
            cfg.reflection.validity,
        )
        out = [
            {
                **{
                    k: by_source[x["source"]][k] for k in ("checkpoint", "benchmark", "retrieval", "query_id", "sample")
                },
                "text": x["text"],
                "valid": x["valid"],
                "codes": x["codes"],
            }
            for x in sampled
        ]
        store.write_table(REFLECTIONS_TABLE, out, {}, part, schema=EVAL_REFLECTIONS_SCHEMA)
    written = store.read_table(REFLECTIONS_TABLE, {}, part).to_pylist()
    return {"reflection_valid_rate": sum(r["valid"] for r in written) / len(written) if written else float("nan")}
