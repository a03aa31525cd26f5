"""Run a policy on evaluation queries with the real tools, then grade every sample.

``run_eval`` = optional reflection guidance (``guidance_for``) → sampling with a rollout engine
(``sample_queries``) → grading (the synthetic grader in-process, the others through a
``BenchmarkGrader``) → ``eval_results`` rows (``result_rows``) and their summary (``summarize``).

``retrieval="sequential"`` is the paper's test-time sequential reuse (Fig. 6d): trial 1 with cross
retrieval → the policy reflects on each trial-1 trajectory (``reflect_on_trials``) → trial 2 guided by
that reflection, as ``within`` retrieval would show it (``sample_guided``). Both trials get rows,
with retrieval ``sequential-1`` and ``sequential-2`` (``run_sequential``).

A query the benchmark has nothing to grade against (no rubric items, no gold answer: e.g. a user's
own query file) is found before sampling (``ungraded_reason``), is not sampled, and gets one
``eval_results`` row with score NULL, ``grade_failed`` true, the reason in ``error`` and
``details.ungraded`` (``ungraded_row``); the summary counts it apart (``n_ungraded``).
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from rubricem_core import schemas
from rubricem_core.encoding import encode_prompt
from rubricem_core.environment import prompt_messages, trace_format
from rubricem_core.eval.grading import (
    UNGRADED_REASONS,
    grade_samples,
    result_rows,
    summarize,
    ungraded_reason,
    ungraded_row,
)
from rubricem_core.eval.types import EvalError, EvalSample, family_of
from rubricem_core.reflection.bank import RETRIEVAL_MODES, ReflectionBank
from rubricem_core.reflection.format import guidance_text, parse_reflection
from rubricem_core.rollout.types import RolloutRequest, SamplingParams
from rubricem_core.scaffold import extract_answer, neutralize_tags, validate
from rubricem_core.schemas import Query
from rubricem_core.tools.base import ToolEnv

log = logging.getLogger(__name__)

EVAL_RESULTS_SCHEMA = schemas.EVAL_RESULTS_SCHEMA  # defined in schemas; tasks and tests import it from here

SEQUENTIAL = "sequential"  # trial 1 (cross) → reflection → trial 2 (its own reflection)
EVAL_RETRIEVAL_MODES: tuple[str, ...] = (*RETRIEVAL_MODES, SEQUENTIAL)
SEQUENTIAL_TRIALS: tuple[str, str] = ("sequential-1", "sequential-2")  # the retrieval column of the two trials


def settings_digest(settings: dict[str, Any]) -> str:
    """A short digest of what produced a part of `eval_results` (its rows' ``settings``): a rerun with
    other settings evaluates again instead of returning the old results."""
    text = json.dumps(settings, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:12]


@dataclass
class EvalOptions:
    samples_per_query: int = field(default=1, metadata={"help": "Trajectories per query."})
    temperature: float = field(default=0.7, metadata={"help": "Sampling temperature (0 = greedy)."})
    top_p: float = field(default=1.0, metadata={"help": "Nucleus sampling."})
    max_new_tokens: int = field(default=512, metadata={"help": "Tokens per model turn."})
    max_total_tokens: int = field(default=4096, metadata={"help": "Context limit of a trajectory."})
    max_tool_calls: int = field(default=10, metadata={"help": "Tool calls per trajectory."})
    seed: int = field(default=0, metadata={"help": "Sampling seed."})
    prompt_style: str = field(default="full", metadata={"help": "System prompt style (environment.prompt_messages)."})
    retrieval: str = field(
        default="none",
        metadata={"help": "Reflection guidance: none, cross, within, or sequential (cross, reflect, retry with it)."},
    )
    retrieval_k: int = field(default=1, metadata={"help": "Reflections per query for cross retrieval."})

    def __post_init__(self) -> None:
        if self.retrieval not in EVAL_RETRIEVAL_MODES:
            raise EvalError(f"EvalOptions.retrieval must be one of {EVAL_RETRIEVAL_MODES}, got {self.retrieval!r}")
        if self.samples_per_query < 1:
            raise EvalError(f"EvalOptions.samples_per_query must be >= 1, got {self.samples_per_query}")


@dataclass
class SequentialOptions:
    """The reflection between the two trials of retrieval="sequential" (apart from EvalOptions, whose
    fields key the settings of every eval part)."""

    temperature: float = field(default=0.7, metadata={"help": "Sampling temperature of the reflection."})
    max_new_tokens: int = field(default=512, metadata={"help": "Tokens of the reflection."})
    max_trajectory_chars: int = field(default=6000, metadata={"help": "Longest trial-1 text shown (middle cut)."})
    max_trajectory_tokens: int | None = field(
        default=None,
        metadata={"help": "Longest trial-1 text shown in the policy's tokens (middle cut; replaces the characters)."},
    )
    validity: str = field(
        default="strict", metadata={"help": "Which reflections are valid: strict or structural (reflection.validity)."}
    )
    valid_only: bool = field(
        default=True,
        metadata={
            "help": "Guide trial 2 only with reflections the meta-policy's validator accepts (as the bank holds)."
        },
    )


# ---- guidance ------------------------------------------------------------------------------------


def guidance_for(bank: ReflectionBank | None, queries: Sequence[Query], mode: str, k: int = 1) -> dict[str, str | None]:
    """query_id → the guidance block to inject (None: no guidance or a bank miss)."""
    if mode not in RETRIEVAL_MODES:
        raise EvalError(f"retrieval must be one of {RETRIEVAL_MODES}, got {mode!r}")
    if mode == "none":
        return {q.query_id: None for q in queries}
    if bank is None:
        raise EvalError(f"retrieval={mode!r} needs a reflection bank")
    found = bank.retrieve_many([(q.query_id, q.question) for q in queries], mode, k=k)
    out: dict[str, str | None] = {}
    for query, entries in zip(queries, found):
        blocks = []
        for entry, _ in entries:
            reflection = parse_reflection(entry.reflection)
            source = entry.query_text if mode == "cross" else None
            blocks.append(
                guidance_text(reflection, source)
                if reflection is not None and (reflection.rubrics or reflection.takeaways)
                else neutralize_tags(entry.reflection)
            )
        out[query.query_id] = "\n\n".join(blocks) if blocks else None
    return out


def _sampling(options: EvalOptions) -> SamplingParams:
    return SamplingParams(
        temperature=options.temperature,
        top_p=options.top_p,
        max_new_tokens=options.max_new_tokens,
        max_total_tokens=options.max_total_tokens,
        seed=options.seed,
    )


def _prompt_ids(tokenizer: Any, messages: list[dict[str, str]]) -> list[int]:
    """The chat's prompt ids; none for a policy without a tokenizer (an API model reads ``messages``)."""
    return [] if tokenizer is None else encode_prompt(tokenizer, messages)


def _eval_sample(query_id: str, index: int, traj: Any, guidance: str | None) -> EvalSample:
    text = "".join(s.text for s in traj.segments if s.kind != "prompt")
    return EvalSample(
        query_id,
        index,
        text,
        extract_answer(text) or "",
        traj.n_tool_calls,
        traj.finish_reason,
        traj.meta.get("completion_tokens", traj.n_policy_tokens),  # an API model reports its usage
        guidance,
    )


def sample_queries(
    engine: Any,
    tokenizer: Any,
    queries: Sequence[Query],
    env: ToolEnv,
    options: EvalOptions,
    guidance: dict[str, str | None] | None = None,
) -> list[list[EvalSample]]:
    """``samples_per_query`` trajectories per query with the real tools, in query order."""
    guidance = guidance or {}
    sampling = _sampling(options)
    requests = []
    for query in queries:
        messages = prompt_messages(query.to_row(), guidance=guidance.get(query.query_id), style=options.prompt_style)
        requests.append(
            RolloutRequest(
                request_id=query.query_id,
                prompt_ids=_prompt_ids(tokenizer, messages),
                messages=messages,
                n=options.samples_per_query,
                sampling=sampling,
                max_tool_calls=options.max_tool_calls,
            )
        )
    groups = engine.generate(requests, env) if requests else []
    return [
        [_eval_sample(query.query_id, index, traj, guidance.get(query.query_id)) for index, traj in enumerate(group)]
        for query, group in zip(queries, groups)
    ]


def sample_guided(
    engine: Any,
    tokenizer: Any,
    queries: Sequence[Query],
    env: ToolEnv,
    options: EvalOptions,
    guidance: Mapping[tuple[str, int], str | None],
    tag: str = "t2",
) -> list[list[EvalSample]]:
    """Like ``sample_queries``, but sample ``i`` of a query gets its own guidance ``guidance[(query_id, i)]``
    (one request per sample; ``tag`` in the request ids gives them other sampling seeds than trial 1's)."""
    sampling = _sampling(options)
    keys, requests = [], []
    for query in queries:
        for index in range(options.samples_per_query):
            text = guidance.get((query.query_id, index))
            messages = prompt_messages(query.to_row(), guidance=text, style=options.prompt_style)
            keys.append((query.query_id, index, text))
            requests.append(
                RolloutRequest(
                    request_id=f"{query.query_id}#{tag}-{index}",
                    n=1,
                    sampling=sampling,
                    prompt_ids=_prompt_ids(tokenizer, messages),
                    messages=messages,
                    max_tool_calls=options.max_tool_calls,
                )
            )
    groups = engine.generate(requests, env) if requests else []
    flat = iter(_eval_sample(qid, index, group[0], text) for (qid, index, text), group in zip(keys, groups))
    return [[next(flat) for _ in range(options.samples_per_query)] for _ in queries]


def reflect_on_trials(
    engine: Any,
    tokenizer: Any,
    queries: Sequence[Query],
    samples: Sequence[Sequence[EvalSample]],
    env: ToolEnv,
    options: EvalOptions,
    sequential: SequentialOptions,
) -> list[dict[str, Any]]:
    """One unforced reflection of the policy on each trial-1 trajectory (``reflection.meta.sample_reflections``,
    the meta-policy's prompt and validator): rows with ``query_id``, ``sample``, ``text``, ``valid``, ``codes``."""
    from rubricem_core.reflection.meta import sample_reflections  # pulls in torch

    sources = [
        {"source": f"{s.query_id}#{s.sample}", "query_id": s.query_id, "sample": s.sample, "text": s.text}
        for group in samples
        for s in group
    ]
    sampling = SamplingParams(
        temperature=sequential.temperature,
        top_p=options.top_p,
        max_new_tokens=sequential.max_new_tokens,
        max_total_tokens=options.max_total_tokens,
        seed=options.seed,
    )
    by_source = {s["source"]: s for s in sources}
    rows = sample_reflections(
        engine,
        tokenizer,
        sources,
        {q.query_id: q.question for q in queries},
        sampling,
        sequential.max_trajectory_chars,
        env,
        sequential.max_trajectory_tokens,
        sequential.validity,
    )
    return [{**r, "sample": by_source[r["source"]]["sample"]} for r in rows]


def reflection_guidance(reflections: Sequence[dict[str, Any]], valid_only: bool = True) -> dict[tuple[str, int], str]:
    """(query_id, sample) → the guidance block of its trial-1 reflection, shown as within retrieval shows a
    query's own reflection; a reflection that is invalid (``valid_only``) or has no items guides nothing."""
    out = {}
    for row in reflections:
        reflection = parse_reflection(row["text"])
        if (row["valid"] or not valid_only) and reflection is not None and (reflection.rubrics or reflection.takeaways):
            out[(row["query_id"], row["sample"])] = guidance_text(reflection)
    return out


@dataclass
class EvalOutcome:
    rows: list[dict[str, Any]]
    summary: dict[str, float]


def trial_rows(
    checkpoint: str,
    benchmark: str,
    retrieval: str,
    queries: Sequence[Query],
    reason_of: Sequence[tuple[str, str] | None],
    samples: Sequence[Sequence[EvalSample]],
    grader: Any,
    options: EvalOptions,
    model: str,
) -> list[dict[str, Any]]:
    """Grade the samples of the gradable queries → rows in query order, ungraded queries included."""
    gradable = [q for q, r in zip(queries, reason_of) if r is None]
    grades = grade_samples(benchmark, gradable, samples, grader, options.max_tool_calls)
    form = trace_format(options.prompt_style)
    valid = [
        [not validate(s.text, max_tool_calls=options.max_tool_calls, trace_format=form) for s in group]
        for group in samples
    ]
    graded = iter(zip(samples, grades, valid))
    rows = []
    for query, reason in zip(queries, reason_of):
        if reason is not None:
            rows.append(ungraded_row(checkpoint, benchmark, retrieval, query.query_id, reason, model))
        else:
            group, group_grades, group_valid = next(graded)
            rows += result_rows(checkpoint, benchmark, retrieval, [group], [group_grades], model, [group_valid])
    return rows


def run_eval(
    engine: Any,
    tokenizer: Any,
    benchmark: str,
    queries: Sequence[Query],
    env: ToolEnv,
    options: EvalOptions,
    checkpoint: str,
    grader: Any = None,
    bank: ReflectionBank | None = None,
    sequential: SequentialOptions | None = None,
) -> EvalOutcome:
    """Sample every gradable query with the real tools (with reflection guidance per ``options.retrieval``),
    grade each sample independently of training rewards, and return ``eval_results`` rows and their
    summary. Queries the benchmark cannot grade (``ungraded_reason``) are not sampled but get a row
    each (``ungraded_row``); EvalError, before any sampling, when no query can be graded.
    ``retrieval="sequential"``: two trials (``run_sequential``, reflection settings ``sequential``)."""
    if not queries:
        raise EvalError(f"benchmark {benchmark!r}: no queries to evaluate")
    family = family_of(benchmark)  # fail on an unknown benchmark before sampling
    if family != "synthetic" and grader is None:
        raise EvalError(f"benchmark {benchmark!r} needs a grader (an LLM endpoint)")
    # Grade what can be graded: a query without rubrics (or gold answer, or RACE reference) is recorded, not sampled.
    needs_reference = bool(grader is not None and getattr(grader, "needs_reference", lambda _: False)(benchmark))
    reason_of = [ungraded_reason(benchmark, q, needs_reference) for q in queries]
    reasons = [r for r in reason_of if r is not None]
    gradable = [q for q, r in zip(queries, reason_of) if r is None]
    if not gradable:
        counts = ", ".join(f"{n} {code}" for code in UNGRADED_REASONS if (n := sum(c == code for c, _ in reasons)))
        raise EvalError(
            f"benchmark {benchmark!r}: none of its {len(queries)} queries can be graded ({counts}; "
            f"e.g. {reasons[0][1]}); nothing was sampled. Give the queries rubrics (or gold answers "
            "for short-form benchmarks, reference reports for RACE), or leave the benchmark out of "
            "eval.benchmarks"
        )
    if reasons:
        log.warning(
            "benchmark %r: %d of %d queries cannot be graded and are recorded without sampling: %s",
            benchmark,
            len(reasons),
            len(queries),
            "; ".join(m for _, m in reasons[:5]),
        )
    model = "builtin:synthetic" if family == "synthetic" else grader.model
    if options.retrieval == SEQUENTIAL:
        rows, summary = run_sequential(
            engine,
            tokenizer,
            benchmark,
            queries,
            reason_of,
            env,
            options,
            checkpoint,
            grader,
            bank,
            model,
            sequential or SequentialOptions(),
        )
    else:
        guidance = guidance_for(bank, gradable, options.retrieval, options.retrieval_k)
        samples = sample_queries(engine, tokenizer, gradable, env, options, guidance)
        rows = trial_rows(checkpoint, benchmark, options.retrieval, queries, reason_of, samples, grader, options, model)
        summary = summarize(rows)
    if grader is not None:
        summary.update(grader.usage.metrics("grader/"))
    return EvalOutcome(rows, summary)


def run_sequential(
    engine: Any,
    tokenizer: Any,
    benchmark: str,
    queries: Sequence[Query],
    reason_of: Sequence[tuple[str, str] | None],
    env: ToolEnv,
    options: EvalOptions,
    checkpoint: str,
    grader: Any,
    bank: ReflectionBank | None,
    model: str,
    sequential: SequentialOptions,
) -> tuple[list[dict[str, Any]], dict[str, float]]:
    """Test-time sequential reuse: trial 1 with cross retrieval from ``bank`` → the policy's reflection on
    each trial-1 trajectory → trial 2 of the same sample guided by it. Rows of both trials (retrieval
    ``sequential-1``/``sequential-2``); the summary is trial 2's, trial 1's under ``trial1/`` and the
    share of trial-1 reflections that guided trial 2 under ``sequential/``."""
    first_mode, second_mode = SEQUENTIAL_TRIALS
    gradable = [q for q, r in zip(queries, reason_of) if r is None]
    first = sample_queries(
        engine, tokenizer, gradable, env, options, guidance_for(bank, gradable, "cross", options.retrieval_k)
    )
    reflections = reflect_on_trials(engine, tokenizer, gradable, first, env, options, sequential)
    guidance = reflection_guidance(reflections, sequential.valid_only)
    second = sample_guided(engine, tokenizer, gradable, env, options, guidance)
    rows_first = trial_rows(checkpoint, benchmark, first_mode, queries, reason_of, first, grader, options, model)
    rows_second = trial_rows(checkpoint, benchmark, second_mode, queries, reason_of, second, grader, options, model)
    n_trajectories = sum(len(group) for group in first)
    summary = {
        **summarize(rows_second),
        **{f"trial1/{k}": v for k, v in summarize(rows_first).items()},
        "sequential/reflection_valid_rate": (
            sum(r["valid"] for r in reflections) / len(reflections) if reflections else math.nan
        ),
        "sequential/guided_rate": len(guidance) / n_trajectories if n_trajectories else math.nan,
    }
    return rows_first + rows_second, summary
