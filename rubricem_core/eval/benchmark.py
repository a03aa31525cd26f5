"""One benchmark × checkpoint × retrieval mode of a run → one part of `eval_results`
(``tables/eval_results/<tag>--<benchmark>--<retrieval>.parquet``), and the checkpoint's valid-reflection
rate on it → the `eval_reflections` part of the same name.

A part's rows carry the digest of what produced them (``settings``: options, queries, grader, bank,
engine, grading protocol); ``evaluate_part`` reads back a part with the same digest instead of
sampling again, and evaluates again when the settings changed. The Prefect task (tasks/evaluate.py)
supplies the engine, the grader and the tool environment, and writes the rows returned here.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rubricem_core.config import RunConfig
from rubricem_core.eval.api_policy import api_engine_settings
from rubricem_core.eval.checkpoints import api_policy_spec, checkpoint_tag
from rubricem_core.eval.grading import summarize, ungraded_code, ungraded_reason
from rubricem_core.eval.prompts import reference_article
from rubricem_core.eval.queries import load_benchmark_queries, select_queries
from rubricem_core.eval.run import (
    SEQUENTIAL,
    SEQUENTIAL_TRIALS,
    EvalOptions,
    SequentialOptions,
    run_eval,
    settings_digest,
)
from rubricem_core.eval.short_form import PROTOCOLS as SHORT_FORM_PROTOCOLS
from rubricem_core.eval.types import EvalError, family_of
from rubricem_core.layout import holds_policy
from rubricem_core.reflection.bank import ENTRIES_FILE, ReflectionBank, bank_dir, saved_bank_info
from rubricem_core.reflection.meta import sample_reflections
from rubricem_core.rl.progress import completed_step, newest_checkpoint
from rubricem_core.rollout.types import SamplingParams
from rubricem_core.schemas import Query, queries_from_table
from rubricem_core.seeds import EVAL_REFLECTION, EVAL_SAMPLING, derive_seed
from rubricem_core.store import RunStore
from rubricem_core.tools.base import ToolEnv

RESULTS_TABLE = "eval_results"
REFLECTIONS_TABLE = "eval_reflections"

Info = Callable[..., None]  # a logger's ``info``: ``info(msg, *args)``
EngineFactory = Callable[[], tuple[Any, Any]]  # (engine, tokenizer) of the evaluated checkpoint


def part_name(tag: str, benchmark: str, retrieval: str) -> str:
    return f"{tag}--{benchmark}--{retrieval}"


def bank_location(run_dir: str | Path, cfg: RunConfig, retrieval: str) -> Path:
    """Where RL saved the run's bank (eval.bank_dir overrides it)."""
    directory = Path(cfg.eval.bank_dir) if cfg.eval.bank_dir else bank_dir(run_dir)
    if not (directory / ENTRIES_FILE).exists():
        raise FileNotFoundError(
            f"retrieval={retrieval!r} needs a reflection bank, but none is saved at {directory} "
            "(run RL with a reflection recipe, or set eval.bank_dir)"
        )
    return directory


def default_checkpoint(store: RunStore) -> Path:
    """The newest RL checkpoint of a finished step (the last step's once RL is over: it always writes
    one; mid-run, the newest of rl.checkpoint_every's), else the SFT policy."""
    step = newest_checkpoint(store, completed_step(store))
    path = store.layout.rl_step_checkpoint(step) if step >= 0 else store.layout.sft_final
    if not holds_policy(path):
        raise FileNotFoundError(
            f"no policy checkpoint at {path}: run `rubricem sft` (or rl) first, or pass --checkpoint"
        )
    return path


def load_bank(run_dir: str | Path, cfg: RunConfig, retrieval: str) -> ReflectionBank | None:
    """The saved bank, searched with the embedder recorded with it unless eval.bank_embedder overrides it."""
    if retrieval == "none":
        return None
    return ReflectionBank.load(bank_location(run_dir, cfg, retrieval), cfg.eval.bank_embedder)


def bank_settings(run_dir: str | Path, cfg: RunConfig, retrieval: str) -> list[str | None]:
    """The bank's part of an eval part's settings. Without retrieval no bank is read: the value is the
    one such parts were keyed by before eval.bank_embedder defaulted to the recorded embedder, so their
    digests stay. With retrieval: the location and the embedder the bank is searched with."""
    if retrieval == "none":
        return [cfg.eval.bank_dir, cfg.eval.bank_embedder or "hashing"]
    embedder = cfg.eval.bank_embedder or saved_bank_info(bank_location(run_dir, cfg, retrieval)).embedder
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


def eval_queries(store: RunStore, cfg: RunConfig, benchmark: str) -> list[Query]:
    """The queries ``benchmark`` is evaluated on: the run's held-out split for the synthetic world, else
    the benchmark's file (eval.paths), eval.max_queries of them chosen per eval.sample."""
    if family_of(benchmark) == "synthetic":
        held_out = [q for q in queries_from_table(store.read_table("queries")) if q.split == "eval"]
        if not held_out:
            raise EvalError(f"{store.run_dir}: the queries table has no 'eval' split to evaluate on")
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


def grading_settings(cfg: RunConfig, benchmark: str, queries: Sequence[Query]) -> dict[str, Any]:
    """The sampling and grading choices in an eval part's settings beyond the legacy ones (first N queries,
    HealthBench joint, DeepResearchBench absolute): only added when they differ, so existing parts
    produced the legacy way keep their digests, and a part produced otherwise is evaluated again."""
    out: dict[str, Any] = {}
    if cfg.eval.sample != "first":
        out["sample"] = {"mode": cfg.eval.sample, "seed": sample_seed(cfg)}
    if benchmark == "healthbench" and cfg.eval.protocol_for(benchmark) != "joint":
        out["grading"] = cfg.eval.protocol_for(benchmark)
    if benchmark == "researchrubrics":
        out["grading"] = f"verdict/{cfg.eval.protocol_for(benchmark)}"  # the release's verdict calls
    if benchmark in SHORT_FORM_PROTOCOLS:
        out["protocol"] = SHORT_FORM_PROTOCOLS[benchmark][0]  # each benchmark's own short-answer grader
    if race_grading(cfg, benchmark):
        out["grading"] = "race"  # the references themselves too: a new reference file re-grades
        out["references"] = settings_digest({q.query_id: reference_article(q) for q in queries})
    return out


@dataclass
class EvalPart:
    """What one part of `eval_results` is evaluated with, and the digest its rows are keyed by."""

    tag: str  # the checkpoint's tag (checkpoint_tag)
    name: str  # the part's file name (part_name)
    benchmark: str
    retrieval: str
    queries: list[Query]
    options: EvalOptions
    sequential: SequentialOptions | None  # retrieval=sequential: the reflection between its trials
    settings: str  # the settings digest stored in every row


def plan_part(store: RunStore, cfg: RunConfig, checkpoint: str, benchmark: str, retrieval: str) -> EvalPart:
    """The part's queries, sampling options and settings digest."""
    run_dir = store.run_dir
    tag = checkpoint_tag(run_dir, checkpoint)
    api = api_policy_spec(checkpoint)
    queries = eval_queries(store, cfg, benchmark)
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
        "bank": bank_settings(run_dir, cfg, retrieval),
        "engine": cfg.rollout.engine if api is None else api_engine_settings(cfg, api),
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
    name = part_name(tag, benchmark, retrieval)
    return EvalPart(tag, name, benchmark, retrieval, queries, options, sequential, settings_digest(produced_by))


@dataclass
class PartEvaluation:
    """A part's `eval_results` rows and their summary; ``cached``: read back, not sampled (nothing to write)."""

    part: EvalPart
    rows: list[dict[str, Any]]
    summary: dict[str, float]
    cached: bool


def evaluate_part(
    store: RunStore,
    cfg: RunConfig,
    checkpoint: str,
    benchmark: str,
    retrieval: str,
    engine: EngineFactory,
    grader: Callable[[], Any],
    env: Callable[[], ToolEnv],
    info: Info,
) -> PartEvaluation:
    """Sample and grade one benchmark (``run_eval``), or read back its part when the settings match.
    ``engine``, ``grader`` and ``env`` are called only when sampling is due (the synthetic benchmark
    needs no grader)."""
    part = plan_part(store, cfg, checkpoint, benchmark, retrieval)
    if store.has(RESULTS_TABLE, {}, part.name):
        rows = store.read_table(RESULTS_TABLE, {}, part.name).to_pylist()
        if all(r.get("settings") == part.settings for r in rows):
            return PartEvaluation(part, rows, summarize(rows), cached=True)
        info("%s: the settings changed since %s was evaluated; evaluating again", part.name, part.tag)
        store.partition_path(REFLECTIONS_TABLE, {}, part.name).unlink(missing_ok=True)  # of the old results
    policy, tokenizer = engine()
    benchmark_grader = None if family_of(benchmark) == "synthetic" else grader()
    outcome = run_eval(
        policy,
        tokenizer,
        benchmark,
        part.queries,
        env(),
        part.options,
        part.tag,
        benchmark_grader,
        load_bank(store.run_dir, cfg, retrieval),
        part.sequential,
    )
    rows = [{**r, "settings": part.settings} for r in outcome.rows]
    return PartEvaluation(part, rows, outcome.summary, cached=False)


def reflection_validity_rows(
    cfg: RunConfig,
    part: EvalPart,
    rows: Sequence[dict[str, Any]],
    engine: EngineFactory,
    env: Callable[[], ToolEnv],
) -> list[dict[str, Any]]:
    """One unforced reflection per evaluated trajectory of a part, checked by the meta-policy's
    validator → the `eval_reflections` rows of the part."""
    policy, tokenizer = engine()
    sampling = SamplingParams(
        temperature=cfg.reflection.temperature,
        top_p=cfg.rollout.top_p,
        max_new_tokens=cfg.reflection.max_new_tokens,
        max_total_tokens=cfg.rollout.max_total_tokens,
        seed=derive_seed(cfg.seed, EVAL_REFLECTION, part.name),
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
        policy,
        tokenizer,
        sources,
        {q.query_id: q.question for q in part.queries},
        sampling,
        cfg.reflection.max_trajectory_chars,
        env(),
        cfg.reflection.max_trajectory_tokens,
        cfg.reflection.validity,
    )
    keys = ("checkpoint", "benchmark", "retrieval", "query_id", "sample")
    return [
        {**{k: by_source[x["source"]][k] for k in keys}, "text": x["text"], "valid": x["valid"], "codes": x["codes"]}
        for x in sampled
    ]


def reflection_valid_rate(rows: Sequence[dict[str, Any]]) -> dict[str, float]:
    """The checkpoint's valid-reflection rate over a part's `eval_reflections` rows (NaN: none)."""
    return {"reflection_valid_rate": sum(r["valid"] for r in rows) / len(rows) if rows else float("nan")}
