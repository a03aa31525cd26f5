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
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from rubricem_core import schemas
from rubricem_core.encoding import encode_prompt
from rubricem_core.environment import prompt_messages
from rubricem_core.eval.answer_match import match_query
from rubricem_core.eval.prompts import aggregate_items, gold_answers, grade_items, reference_article
from rubricem_core.eval.types import EvalError, EvalSample, GradeResult, family_of, safe_name
from rubricem_core.layout import STEP_CHECKPOINT, RunLayout
from rubricem_core.reflection.bank import RETRIEVAL_MODES, ReflectionBank
from rubricem_core.reflection.format import guidance_text, parse_reflection
from rubricem_core.rollout.types import ANSWERED, RolloutRequest, SamplingParams
from rubricem_core.scaffold import extract_answer, neutralize_tags, strip_tags, validate
from rubricem_core.schemas import Query
from rubricem_core.stand_ins import stand_in
from rubricem_core.tools.base import ToolEnv

log = logging.getLogger(__name__)

EVAL_RESULTS_SCHEMA = schemas.EVAL_RESULTS_SCHEMA  # defined in schemas; tasks and tests import it from here

# Why a query was not graded (``details.ungraded`` and the prefix of ``error`` in its eval_results row).
NO_RUBRICS = "no_rubrics"  # a rubric benchmark (or the synthetic world) with no rubric items for it
NO_GOLD_ANSWER = "no_gold_answer"  # a short-form benchmark with neither a reference answer nor a final rubric
NO_REFERENCE = "no_reference"  # DeepResearchBench graded by RACE, with no reference report for the query
UNGRADED_REASONS: tuple[str, ...] = (NO_RUBRICS, NO_GOLD_ANSWER, NO_REFERENCE)
SAMPLES: tuple[str, ...] = ("first", "random")  # how max_queries queries are chosen (select_queries)
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


# ---- checkpoints ---------------------------------------------------------------------------------


def checkpoint_tag(run_dir: str | Path, checkpoint: str | Path) -> str:
    """A short stable name: ``sft``, ``rl-step-000003``, or the directory name plus a path hash."""
    run, path = RunLayout(Path(run_dir).resolve()), Path(checkpoint).resolve()
    if path == run.sft_final:
        return "sft"
    if path.parent == run.rl_checkpoints_dir and STEP_CHECKPOINT.fullmatch(path.name):
        return f"rl-{path.name}"
    return f"{safe_name(path.name)}-{hashlib.sha1(str(path).encode()).hexdigest()[:8]}"


def checkpoint_step(tag: str) -> int | None:
    """The RL step whose checkpoint ``tag`` names (``rl-step-000003`` → 3); None for the SFT policy or a
    checkpoint from elsewhere (`eval_results.step`: SQL over a learning curve)."""
    match = re.fullmatch(r"rl-step-(\d+)", tag)
    return int(match.group(1)) if match else None


def checkpoint_updates(tag: str) -> int:
    """Policy updates in a checkpoint (the MLflow step of its metrics): SFT 0, RL step N → N + 1."""
    step = checkpoint_step(tag)
    return 0 if step is None else step + 1


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


# ---- sampling ------------------------------------------------------------------------------------

_CITE = re.compile(r'<cite id="([^"]*)">(.*?)</cite>', re.S)


def plain_answer(answer: str) -> str:
    """The answer as a grader reads it: ``<cite id="D1">claim</cite>`` → ``claim [D1]``, no tags."""
    return strip_tags(_CITE.sub(lambda m: f"{m.group(2)} [{m.group(1)}]", answer)).strip()


def _sampling(options: EvalOptions) -> SamplingParams:
    return SamplingParams(
        temperature=options.temperature,
        top_p=options.top_p,
        max_new_tokens=options.max_new_tokens,
        max_total_tokens=options.max_total_tokens,
        seed=options.seed,
    )


def _eval_sample(query_id: str, index: int, traj: Any, guidance: str | None) -> EvalSample:
    text = "".join(s.text for s in traj.segments if s.kind != "prompt")
    return EvalSample(
        query_id,
        index,
        text,
        extract_answer(text) or "",
        traj.n_tool_calls,
        traj.finish_reason,
        traj.n_policy_tokens,
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
                prompt_ids=encode_prompt(tokenizer, messages),
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
                    prompt_ids=encode_prompt(tokenizer, messages),
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


# ---- grading -------------------------------------------------------------------------------------


def ungraded_reason(benchmark: str, query: Query, needs_reference: bool = False) -> tuple[str, str] | None:
    """(reason code, message) when ``benchmark`` has nothing to grade ``query`` against, else None.

    Checked before sampling, so no generation is spent on a query that cannot be graded. Grading
    input that is there but malformed (a rubric without criterion text, no positive weight) is a
    data error: it raises EvalError here, before sampling, instead of after it. ``needs_reference``:
    the grader compares against the query's reference report (DeepResearchBench race)."""
    family = family_of(benchmark)
    if family == "synthetic":
        if not query.rubrics:
            return NO_RUBRICS, f"query {query.query_id!r} has no persistent rubrics to grade against"
        return None
    if family in ("short_form", "answer_set"):
        try:
            gold_answers(query)
        except EvalError as exc:
            return NO_GOLD_ANSWER, str(exc)
        return None
    if not query.rubrics:
        return NO_RUBRICS, f"query {query.query_id!r} has no rubric items to grade"
    try:
        items = grade_items(query, family)
        # the denominators do not depend on the scores: all zeros tells whether aggregation is defined
        aggregate_items(family, items, {item.item_id: 0 for item in items})
    except EvalError as exc:
        raise EvalError(f"benchmark {benchmark!r} query {query.query_id!r}: {exc}") from exc
    if needs_reference and reference_article(query) is None:
        return NO_REFERENCE, (
            f"query {query.query_id!r} has no reference report for eval.drb_grading 'race' (none "
            "in eval.paths.deep_research_bench_reference for its id)"
        )
    return None


def grade_samples(
    benchmark: str,
    queries: Sequence[Query],
    samples: Sequence[Sequence[EvalSample]],
    grader: Any = None,
    max_tool_calls: int | None = None,
) -> list[list[GradeResult]]:
    """Grades aligned with ``samples``: in-process for synthetic, else one grader call per sample."""
    family = family_of(benchmark)
    if family == "synthetic":  # the world's own grader, an offline stand-in (sim/world_grader.py)
        grade_synthetic: Callable[..., GradeResult] = stand_in("benchmark", "synthetic")
        grades = [[grade_synthetic(q, s.text, max_tool_calls) for s in group] for q, group in zip(queries, samples)]
        # beside it, the answer-match grader: the gold answer and facts matched by plain code of its own
        for q, group, group_grades in zip(queries, samples, grades):
            for s, grade in zip(group, group_grades):
                if not grade.failed:
                    grade.details["answer_match"] = match_query(q, s.answer)
        return grades
    if grader is None:
        raise EvalError(f"benchmark {benchmark!r} needs a grader (an LLM endpoint)")
    pairs = [(q, plain_answer(s.answer)) for q, group in zip(queries, samples) for s in group]
    flat = iter(grader.grade(benchmark, pairs))
    return [[next(flat) for _ in group] for group in samples]


def result_rows(
    checkpoint: str,
    benchmark: str,
    retrieval: str,
    samples: Sequence[Sequence[EvalSample]],
    grades: Sequence[Sequence[GradeResult]],
    grader_model: str,
    valid: Sequence[Sequence[bool]],
) -> list[dict[str, Any]]:
    rows = []
    for group, group_grades, group_valid in zip(samples, grades, valid):
        for sample, grade, ok in zip(group, group_grades, group_valid):
            rows.append(
                {
                    "checkpoint": checkpoint,
                    "step": checkpoint_step(checkpoint),
                    "benchmark": benchmark,
                    "query_id": sample.query_id,
                    "retrieval": retrieval,
                    "score": grade.score,
                    "details": grade.details_json(),
                    "sample": sample.sample,
                    "grade_failed": grade.failed,
                    "error": grade.error,
                    "grader": grader_model,
                    "valid_scaffold": ok,
                    "n_tool_calls": sample.n_tool_calls,
                    "finish_reason": sample.finish_reason,
                    "n_policy_tokens": sample.n_policy_tokens,
                    "guidance": sample.guidance,
                    "answer": sample.answer,
                    "text": sample.text,
                }
            )
    return rows


def ungraded_row(
    checkpoint: str, benchmark: str, retrieval: str, query_id: str, reason: tuple[str, str], grader_model: str
) -> dict[str, Any]:
    """The row of a query that was not graded: no trajectory (it was not sampled), score NULL,
    ``grade_failed`` true (so every reader that excludes failed grades from means stays right), the
    reason in ``error`` ("<code>: <message>") and in ``details`` ({"ungraded": code, "reason": message})."""
    code, message = reason
    return {
        "checkpoint": checkpoint,
        "step": checkpoint_step(checkpoint),
        "benchmark": benchmark,
        "query_id": query_id,
        "retrieval": retrieval,
        "score": None,
        "details": json.dumps({"ungraded": code, "reason": message}, ensure_ascii=False, sort_keys=True),
        "sample": None,
        "grade_failed": True,
        "error": f"{code}: {message}",
        "grader": grader_model,
        "valid_scaffold": None,
        "n_tool_calls": None,
        "finish_reason": None,
        "n_policy_tokens": None,
        "guidance": None,
        "answer": None,
        "text": None,
    }


def ungraded_code(row: dict[str, Any]) -> str | None:
    """The reason code of an eval_results row that was not graded (``ungraded_row``), else None."""
    if not row.get("grade_failed") or not row.get("details"):
        return None
    details = json.loads(row["details"])
    return details.get("ungraded") if isinstance(details, dict) else None


def summarize(rows: Sequence[dict[str, Any]]) -> dict[str, float]:
    """Means over graded samples (failed grades excluded and counted) plus sampling health.

    Queries that were not graded (``ungraded_row``: never sampled) are left out of every mean and
    rate and of ``n_samples``/``n_queries``/``grade_failed``; ``n_ungraded`` counts them, and
    ``n_<reason>`` per reason code."""
    codes = [ungraded_code(r) for r in rows]
    ungraded = [c for c in codes if c is not None]
    rows = [r for r, c in zip(rows, codes) if c is None]
    scored = [r["score"] for r in rows if not r["grade_failed"]]
    out = {
        "score_mean": float(np.mean(scored)) if scored else math.nan,
        "n_samples": float(len(rows)),
        "n_queries": float(len({r["query_id"] for r in rows})),
        "grade_failed": float(sum(r["grade_failed"] for r in rows)),
        "n_ungraded": float(len(ungraded)),
        **{f"n_{code}": float(ungraded.count(code)) for code in UNGRADED_REASONS},
        "valid_scaffold_rate": float(np.mean([r["valid_scaffold"] for r in rows])) if rows else math.nan,
        "answered_rate": float(np.mean([r["finish_reason"] == ANSWERED for r in rows])) if rows else math.nan,
        "tool_calls_mean": float(np.mean([r["n_tool_calls"] for r in rows])) if rows else math.nan,
        "guided_rate": float(np.mean([r["guidance"] is not None for r in rows])) if rows else math.nan,
    }
    details = [json.loads(r["details"]) for r in rows if not r["grade_failed"]]
    grades = [d["grade"] for d in details if "grade" in d]
    if grades:
        for name in ("correct", "incorrect", "not_attempted"):
            out[f"{name}_rate"] = grades.count(name) / len(grades)
        # simple-evals' SimpleQA aggregates: accuracy among attempted answers, and its harmonic mean with the
        # overall correct rate (the F-score, which rewards saying "I don't know" over a wrong answer)
        attempted = grades.count("correct") + grades.count("incorrect")
        given = grades.count("correct") / attempted if attempted else 0.0
        overall = out["correct_rate"]
        out["accuracy_given_attempted"] = given
        out["f_score"] = 2 * given * overall / (given + overall) if given + overall > 0 else 0.0
    raw = [d["raw"] for d in details if isinstance(d.get("raw"), (int, float)) and "achieved_points" in d]
    if raw:  # HealthBench as simple-evals reports it: the mean of unclipped example scores, then clipped
        out["score_mean_clipped_mean"] = min(1.0, max(0.0, float(np.mean(raw))))
    correct = [d["correct"] for d in details if "correct" in d]
    if correct:
        out["correct_rate"] = float(np.mean(correct))
    for name in ("f1", "precision", "recall"):  # DeepSearchQA's answer-set metrics
        values = [d[name] for d in details if isinstance(d.get(name), (int, float)) and "outcome" in d]
        if values:
            out[f"{name}_mean"] = float(np.mean(values))
    outcomes = [d["outcome"] for d in details if "outcome" in d]
    for name in ("fully_correct", "correct_with_extraneous", "partially_correct", "fully_incorrect"):
        if outcomes:
            out[f"{name}_rate"] = outcomes.count(name) / len(outcomes)
    matched = [d["answer_match"] for d in details if isinstance(d.get("answer_match"), dict)]
    if matched:  # the synthetic benchmark's second grader (eval/answer_match.py)
        out["answer_match_mean"] = float(np.mean([m["score"] for m in matched]))
        out["answer_match_final_rate"] = float(np.mean([m["final_correct"] for m in matched]))
    precision = [d["citation_precision"] for d in details if d.get("citation_precision") is not None]
    if precision:
        out["citation_precision_mean"] = float(np.mean(precision))
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
    valid = [[not validate(s.text, max_tool_calls=options.max_tool_calls) for s in group] for group in samples]
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


# ---- benchmark files -----------------------------------------------------------------------------


def select_queries(
    queries: Sequence[Query], max_queries: int | str, sample: str = "first", seed: int = 0
) -> list[Query]:
    """``max_queries`` of ``queries`` (``"all"``: every one, in file order): the first ones, or (``random``) a
    seeded sample.

    The random sample ranks each query by a hash of (seed, query_id) and keeps the lowest ranks: the
    same seed picks the same queries whatever the file order, and a larger ``max_queries`` picks a
    superset. The chosen queries keep their order in ``queries``."""
    if sample not in SAMPLES:
        raise EvalError(f"eval.sample must be one of {SAMPLES}, got {sample!r}")
    if not isinstance(max_queries, int):  # "all"
        return list(queries)
    if sample == "first" or max_queries >= len(queries):
        return list(queries[:max_queries])
    rank = {q.query_id: hashlib.sha256(f"{seed}\0{q.query_id}".encode()).hexdigest() for q in queries}
    chosen = set(sorted(rank, key=rank.__getitem__)[:max_queries])
    return [q for q in queries if q.query_id in chosen]


def load_benchmark_queries(
    benchmark: str,
    path: str | Path | None,
    max_queries: int | str,
    sample: str = "first",
    seed: int = 0,
    reference_path: str | Path | None = None,
) -> list[Query]:
    """``max_queries`` queries of a benchmark file (``select_queries``), read with the benchmark's own reader;
    with ``reference_path`` (DeepResearchBench) each gets its reference report (``attach_drb_references``)."""
    from rubricem_core.readers import attach_drb_references, read_queries

    if family_of(benchmark) == "synthetic":
        raise EvalError("the synthetic benchmark's queries are the run's held-out split, not a file")
    if not path:
        raise EvalError(f"benchmark {benchmark!r} has no file: set eval.paths.{benchmark}")
    if not Path(path).is_file():
        raise FileNotFoundError(
            f"eval.paths.{benchmark}: no such file {path} (relative paths resolve against {Path.cwd()})"
        )
    queries = select_queries(read_queries(path, format=benchmark), max_queries, sample, seed)
    if reference_path is None:
        return queries
    if family_of(benchmark) != "dimension_criteria":
        raise EvalError(f"benchmark {benchmark!r} has no reference reports (only deep_research_bench does)")
    if not Path(reference_path).is_file():
        raise FileNotFoundError(
            f"eval.paths.{benchmark}_reference: no such file {reference_path} (relative paths "
            f"resolve against {Path.cwd()})"
        )
    return attach_drb_references(queries, reference_path)
