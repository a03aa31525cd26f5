"""Benchmark graders through litellm: one structured-JSON call per answer (HealthBench
``per_criterion``: one per rubric criterion; DeepResearchBench ``race``: one per answer, scoring it
against the query's reference report).

The plumbing is every judge's (``rubricem_core.llm.structured``): ``run_concurrent`` (bounded
concurrency, retries with backoff on 429/5xx/timeouts), schema validation of the reply, and one repair
turn that sends a bad reply's validation error back. A call that still fails marks that answer's grade
failed — it is excluded from the benchmark mean and counted, never scored 0. In ``per_criterion``
mode one failed criterion call fails the whole answer's grade (the criteria that were graded stay
in its details): a missing criterion would bias the score either way (a positive one lowers it, a
negative one raises it), and the official grader never scores a partial set either.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any

from rubricem_core.eval.criteria import (
    RESEARCHRUBRICS_GRADING,
    chunk_messages,
    chunk_schema,
    criterion_messages,
    criterion_schema,
    parse_chunk,
    parse_criterion,
    split_report,
    verdict_messages,
    verdict_parser,
    verdict_schema,
)
from rubricem_core.eval.drb import clean_messages, clean_parser, clean_schema, split_for_cleaning, task_language
from rubricem_core.eval.prompts import (
    ITEMS_PER_CALL,
    GradeItem,
    aggregate_answer_set,
    aggregate_items,
    aggregate_race,
    answer_set_messages,
    answer_set_schema,
    grade_items,
    items_messages,
    items_schema,
    parse_answer_set,
    parse_items,
    parse_race,
    race_messages,
    race_schema,
    reference_article,
)
from rubricem_core.eval.short_form import protocol_of, short_form_messages, short_form_parser, short_form_schema
from rubricem_core.eval.types import PER_CRITERION_BENCHMARKS, EvalError, GradeResult, family_of
from rubricem_core.judge.types import SCORE, JudgeUsage
from rubricem_core.llm.structured import StructuredCall, StructuredClient, StructuredOptions
from rubricem_core.llm.types import EndpointSettings
from rubricem_core.schemas import Query

log = logging.getLogger(__name__)

HEALTHBENCH_GRADING: tuple[str, ...] = ("per_criterion", "joint")
DRB_GRADING: tuple[str, ...] = ("absolute", "race")


@dataclass
class GraderOptions(StructuredOptions):
    """Sampling options of the grader and how two benchmarks are graded.

    ``GraderOptions.from_config(cfg.eval.grader_for(benchmark), seed=cfg.seed, <setting>=cfg.eval.protocol_for(benchmark))``
    takes the rest from the benchmark's grader section (``tasks.evaluate._grader``).
    """

    error_type = EvalError

    max_tokens: int = field(default=4096, metadata={"help": "Completion budget of one grading call."})
    healthbench_grading: str = field(
        default="per_criterion",
        metadata={
            "help": "HealthBench: per_criterion (one met/not-met call per criterion, as the official grader) or "
            "joint (one call grading all criteria)."
        },
    )
    drb_grading: str = field(
        default="absolute",
        metadata={
            "help": "DeepResearchBench: absolute (criteria scored 0..10 on their own) or race (target and reference "
            "report scored on the same criteria; score T / (T + R)). race needs each query's reference."
        },
    )

    drb_clean_max_chars: int = field(
        default=200_000,
        metadata={
            "help": "DeepResearchBench race: an article longer than this is cleaned in pieces cut at sentence ends "
            "(the release halves an article its cleaner's context refuses)."
        },
    )
    researchrubrics_grading: str = field(
        default="binary",
        metadata={
            "help": "ResearchRubrics: binary (Satisfied 1 / Not Satisfied 0, the current release) or ternary "
            "(Partially Satisfied 0.5 too, the paper-era pipeline)."
        },
    )
    researchrubrics_max_report_chars: int = field(
        default=600_000,
        metadata={
            "help": "ResearchRubrics: a report longer than this is read in chunks (the release: ~150k tokens of "
            "a 200k context, at 4 characters a token)."
        },
    )
    researchrubrics_chunk_chars: int = field(
        default=400_000,
        metadata={"help": "ResearchRubrics: the most characters a chunk holds (the release: 100k tokens)."},
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.researchrubrics_grading not in RESEARCHRUBRICS_GRADING:
            raise EvalError(
                f"researchrubrics_grading must be one of {RESEARCHRUBRICS_GRADING}, got {self.researchrubrics_grading!r}"
            )
        if not 0 < self.researchrubrics_chunk_chars <= self.researchrubrics_max_report_chars:
            raise EvalError(
                "researchrubrics_chunk_chars must be positive and at most researchrubrics_max_report_chars, got "
                f"{self.researchrubrics_chunk_chars} and {self.researchrubrics_max_report_chars}"
            )
        if self.healthbench_grading not in HEALTHBENCH_GRADING:
            raise EvalError(
                f"healthbench_grading must be one of {HEALTHBENCH_GRADING}, got {self.healthbench_grading!r}"
            )
        if self.drb_grading not in DRB_GRADING:
            raise EvalError(f"drb_grading must be one of {DRB_GRADING}, got {self.drb_grading!r}")


class BenchmarkGrader:
    """Grades (query, response) pairs of one benchmark; ``usage`` accumulates over every call."""

    def __init__(self, settings: EndpointSettings, options: GraderOptions | None = None) -> None:
        self.settings = settings
        self.options = options or GraderOptions()
        self.usage = JudgeUsage()  # every grading call counts as a "score" call (metrics grader/score_*)
        self.client = StructuredClient(settings, self.options)

    @property
    def model(self) -> str:
        return self.settings.model

    def _ask(self, calls: list[StructuredCall]) -> None:
        self.client.ask(calls, partial(self.usage.add_call, SCORE))

    def needs_reference(self, benchmark: str) -> bool:
        """Whether grading ``benchmark`` needs each query's reference report (DeepResearchBench race)."""
        return family_of(benchmark) == "dimension_criteria" and self.options.drb_grading == "race"

    def per_criterion(self, benchmark: str) -> bool:
        """One call per criterion: ResearchRubrics always (its grader's protocol), HealthBench per
        ``healthbench_grading``."""
        if benchmark in PER_CRITERION_BENCHMARKS:
            return True
        return family_of(benchmark) == "rubric_points" and self.options.healthbench_grading == "per_criterion"

    def _answer_call(self, custom_id: str, benchmark: str, family: str, query: Query, response: str) -> Any:
        """The one call that grades a short-form answer or an answer set (no rubric items)."""
        parse: Callable[[str | None], Any]
        if family == "short_form":
            messages, name = short_form_messages, "short_form_grade"
            schema, parse = short_form_schema(protocol_of(benchmark)[0]), short_form_parser(benchmark, query)
        else:
            messages, name = answer_set_messages, "answer_set_grade"
            schema, parse = answer_set_schema(), parse_answer_set
        return self.client.call(custom_id, messages(benchmark, query, response), name, schema, parse)

    def grade(self, benchmark: str, pairs: Sequence[tuple[Query, str]]) -> list[GradeResult]:
        """One grade per (query, response), in input order."""
        family = family_of(benchmark)
        if family == "synthetic":
            raise EvalError("the synthetic benchmark is graded in-process (sim/world_grader.py)")
        if self.per_criterion(benchmark):
            return self._grade_per_criterion(benchmark, pairs)
        race = self.needs_reference(benchmark)
        cleaned = self._cleaned_articles(pairs) if race else {}
        pending: list[Any] = []
        items_of: list[Any] = []
        for index, (query, response) in enumerate(pairs):
            custom_id = f"grade:{index}:{query.query_id}"
            if family == "short_form":
                items_of.append(None)
                pending.append(self._answer_call(custom_id, benchmark, family, query, response))
            elif race and isinstance(cleaned[index], _Failed):
                items_of.append(grade_items(query, family))
                pending.append(cleaned[index])
            elif race:
                items = grade_items(query, family)
                ids = [i.item_id for i in items]
                items_of.append(items)
                reference = self._reference(benchmark, query)
                messages = race_messages(benchmark, query, cleaned[index], reference, items, task_language(query))
                pending.append(
                    self.client.call(
                        custom_id,
                        messages,
                        "race_grades",
                        race_schema(ids),
                        partial(parse_race, ids=ids),
                    )
                )
            elif family == "answer_set":
                items_of.append(None)
                pending.append(self._answer_call(custom_id, benchmark, family, query, response))
            else:
                items = grade_items(query, family)
                items_of.append(items)
                pending.append(self._item_calls(custom_id, benchmark, family, query, response, items))
        self._ask(
            [c for call in pending for c in (call if isinstance(call, list) else [call]) if not isinstance(c, _Failed)]
        )
        out = []
        for index, ((query, response), call, items) in enumerate(zip(pairs, pending, items_of)):
            if isinstance(call, list):
                out.append(self._items_result(benchmark, family, query, items, call))
            elif call.error is not None:
                self.usage.fail(SCORE)
                log.warning("grading %s query %r failed: %s", benchmark, query.query_id, call.error)
                out.append(GradeResult(None, {"grader": self.model}, failed=True, error=call.error))
            elif family == "answer_set":
                parts, excessive, why = call.value
                score, extra = aggregate_answer_set(parts, excessive)
                out.append(GradeResult(score, {"grader": self.model, "explanation": why, **extra}))
            elif items is None:
                graded = call.value
                details = {"grade": graded.grade, "justification": graded.justification, "grader": self.model}
                out.append(GradeResult(1.0 if graded.grade == "correct" else 0.0, {**details, **graded.details}))
            else:
                result = self._race_result(items, call.value)
                result.details["article_chars"] = {"submitted": len(response), "cleaned": len(cleaned[index])}
                out.append(result)
        return out

    def _cleaned_articles(self, pairs: Sequence[tuple[Query, str]]) -> dict[int, Any]:
        """DeepResearchBench before RACE: every target article cleaned of its citations by the grader model,
        in its task's language (long ones in pieces). {pair index: the cleaned article, or _Failed}."""
        pieces: dict[int, list[StructuredCall]] = {}
        for index, (query, response) in enumerate(pairs):
            parts = split_for_cleaning(response, self.options.drb_clean_max_chars)
            pieces[index] = [
                self.client.call(
                    f"clean:{index}:{query.query_id}" + (f":{n}" if len(parts) > 1 else ""),
                    clean_messages(part, task_language(query)),
                    "cleaned_article",
                    clean_schema(),
                    clean_parser(part),
                )
                for n, part in enumerate(parts)
            ]
        out: dict[int, Any] = {}
        for index, done in self._ask_groups(pieces, "cleaning").items():
            out[index] = (
                _Failed(f"cleaning the article failed: {done.error}") if isinstance(done, _Failed) else "\n".join(done)
            )
        return out

    def _item_calls(
        self, custom_id: str, benchmark: str, family: str, query: Query, response: str, items: Sequence[GradeItem]
    ) -> list[StructuredCall]:
        """The calls grading an answer's rubric items: one, or one per ``ITEMS_PER_CALL[family]`` items
        (ResearchQA's batches of 8); a single call keeps the answer's custom id."""
        size = ITEMS_PER_CALL.get(family) or len(items)
        chunks = [items[start : start + size] for start in range(0, len(items), size)]
        calls = []
        for n, chunk in enumerate(chunks):
            ids = [i.item_id for i in chunk]
            calls.append(
                self.client.call(
                    custom_id if len(chunks) == 1 else f"{custom_id}:b{n}",
                    items_messages(benchmark, family, query, response, chunk),
                    "rubric_grades",
                    items_schema(family, ids),
                    partial(parse_items, family=family, ids=ids),
                )
            )
        return calls

    def _items_result(
        self, benchmark: str, family: str, query: Query, items: Sequence[GradeItem], calls: Sequence[StructuredCall]
    ) -> GradeResult:
        """An answer's grade from its item calls: failed when any call failed (ResearchQA's grader skips such
        an answer, and a missing item would bias the mean), else the family's aggregate."""
        failed = [c.error for c in calls if c.error is not None]
        if failed:
            self.usage.fail(SCORE)
            error = f"{len(failed)} of {len(calls)} grading calls failed: " + "; ".join(failed[:3])
            log.warning("grading %s query %r failed: %s", benchmark, query.query_id, error)
            return GradeResult(None, {"grader": self.model}, failed=True, error=error)
        value = {item_id: graded for c in calls for item_id, graded in c.value.items()}
        score, extra = aggregate_items(family, items, {item_id: s for item_id, (s, _) in value.items()})
        details = {
            "grader": self.model,
            **extra,
            "items": [
                {
                    "id": i.item_id,
                    "criterion": i.criterion[:300],
                    "score": value[i.item_id][0],
                    "justification": value[i.item_id][1],
                }
                for i in items
            ],
        }
        if len(calls) > 1:
            details["calls"] = len(calls)
        return GradeResult(score, details)

    @staticmethod
    def _reference(benchmark: str, query: Query) -> str:
        reference = reference_article(query)
        if reference is None:  # run_eval records such queries as ungraded (no_reference) before sampling
            raise EvalError(
                f"benchmark {benchmark!r} query {query.query_id!r}: drb_grading 'race' needs a reference "
                "report (eval.paths.deep_research_bench_reference)"
            )
        return reference

    def _race_result(self, items: Sequence[GradeItem], value: dict[str, tuple[float, float, str]]) -> GradeResult:
        score, extra = aggregate_race(items, {item_id: (t, r) for item_id, (t, r, _) in value.items()})
        details = {
            "grader": self.model,
            "grading": "race",
            **extra,
            "items": [
                {
                    "id": i.item_id,
                    "criterion": i.criterion[:300],
                    "dimension": i.data["dimension"],
                    "score": value[i.item_id][0],
                    "reference_score": value[i.item_id][1],
                    "justification": value[i.item_id][2],
                }
                for i in items
            ],
        }
        return GradeResult(score, details)

    def _grade_per_criterion(self, benchmark: str, pairs: Sequence[tuple[Query, str]]) -> list[GradeResult]:
        """One call per criterion, then Σ points · score / Σ positive points, clipped to [0, 1]: HealthBench as
        simple-evals (met or not), ResearchRubrics as its release (a verdict; long reports through their chunks'
        evidence). Any failed criterion call (or chunk call) fails the answer's grade."""
        family = family_of(benchmark)
        items_of = [grade_items(query, family) for query, _ in pairs]
        rubrics = benchmark in PER_CRITERION_BENCHMARKS
        grading = self.options.researchrubrics_grading
        evidence = self._chunk_evidence(pairs, items_of) if rubrics else {}
        calls: list[list[Any]] = []
        for index, ((query, response), items) in enumerate(zip(pairs, items_of)):
            group: list[Any] = []
            for item in items:
                custom_id = f"grade:{index}:{query.query_id}:{item.item_id}"
                found = evidence.get((index, item.item_id))
                if not rubrics:
                    messages = criterion_messages(benchmark, query, response, item)
                    group.append(
                        self.client.call(custom_id, messages, "criterion_grade", criterion_schema(), parse_criterion)
                    )
                elif isinstance(found, _Failed):
                    group.append(found)
                else:
                    messages = verdict_messages(item, grading, document=response, evidence=found)
                    group.append(
                        self.client.call(
                            custom_id, messages, "criterion_verdict", verdict_schema(grading), verdict_parser(grading)
                        )
                    )
            calls.append(group)
        self._ask([call for group in calls for call in group if isinstance(call, StructuredCall)])
        results = []
        for (query, response), items, group in zip(pairs, items_of, calls):
            result = self._criterion_result(benchmark, query, items, group)
            if rubrics:
                result.details["grading"] = f"per_criterion/{grading}"
                if len(response) > self.options.researchrubrics_max_report_chars:
                    result.details["chunks"] = len(split_report(response, self.options.researchrubrics_chunk_chars))
            results.append(result)
        return results

    def _chunk_evidence(
        self, pairs: Sequence[tuple[Query, str]], items_of: Sequence[Sequence[GradeItem]]
    ) -> dict[tuple[int, str], Any]:
        """ResearchRubrics' long reports: every chunk read for every criterion's evidence. {(pair, item id):
        the evidence of all chunks in order, or _Failed}; short reports are not in it."""
        limit, size = self.options.researchrubrics_max_report_chars, self.options.researchrubrics_chunk_chars
        pending: dict[tuple[int, str], list[StructuredCall]] = {}
        for index, ((query, response), items) in enumerate(zip(pairs, items_of)):
            if len(response) <= limit:
                continue
            chunks = split_report(response, size)
            for item in items:
                pending[(index, item.item_id)] = [
                    self.client.call(
                        f"grade:{index}:{query.query_id}:{item.item_id}:chunk{n}",
                        chunk_messages(item, chunk, n + 1, len(chunks)),
                        "chunk_evidence",
                        chunk_schema(),
                        parse_chunk,
                    )
                    for n, chunk in enumerate(chunks)
                ]
        return {
            key: done if isinstance(done, _Failed) else [passage for found in done for passage in found]
            for key, done in self._ask_groups(pending, "chunk").items()
        }

    def _ask_groups(self, groups: dict[Any, list[StructuredCall]], what: str) -> dict[Any, Any]:
        """Ask every group's calls at once; {key: its calls' values in order, or _Failed when any failed}."""
        self._ask([call for group in groups.values() for call in group])
        out: dict[Any, Any] = {}
        for key, group in groups.items():
            errors = [c.error for c in group if c.error is not None]
            if errors:
                out[key] = _Failed(f"{len(errors)} of {len(group)} {what} calls failed: {errors[0]}")
            else:
                out[key] = [c.value for c in group]
        return out

    def _criterion_result(
        self, benchmark: str, query: Query, items: Sequence[GradeItem], calls: Sequence[Any]
    ) -> GradeResult:
        graded = [
            {
                "id": i.item_id,
                "criterion": i.criterion[:300],
                "points": i.data["points"],
                **(
                    {"score": c.value.score, "justification": c.value.justification, **c.value.details}
                    if c.error is None
                    else {"error": c.error}
                ),
            }
            for i, c in zip(items, calls)
        ]
        failed = [(i.item_id, c.error) for i, c in zip(items, calls) if c.error is not None]
        details: dict[str, Any] = {"grader": self.model, "grading": "per_criterion", "items": graded}
        if failed:
            for _ in failed:
                self.usage.fail(SCORE)
            error = f"{len(failed)} of {len(items)} criterion calls failed: " + "; ".join(
                f"{item_id}: {why}" for item_id, why in failed[:3]
            )
            log.warning("grading %s query %r failed: %s", benchmark, query.query_id, error)
            return GradeResult(None, details, failed=True, error=error)
        score, extra = aggregate_items("rubric_points", items, {c["id"]: c["score"] for c in graded})
        return GradeResult(score, {**details, **extra})


@dataclass
class _Failed:
    """Work whose earlier calls failed (a report's cleaning, a criterion's chunks): its grade fails without
    the grading call."""

    error: str
    value: Any = None
