"""Benchmark graders through litellm: one structured-JSON call per answer.

The plumbing is the stagewise judge's (``LLMJudge``): ``run_concurrent`` (bounded concurrency,
retries with backoff on 429/5xx/timeouts), schema validation of the reply, and one repair turn that
sends a bad reply's validation error back. A call that still fails marks that answer's grade
failed — it is excluded from the benchmark mean and counted, never scored 0.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Sequence

from rubricem_core.eval.prompts import (
    aggregate_items,
    grade_items,
    items_messages,
    items_schema,
    parse_items,
    parse_short_form,
    short_form_messages,
    short_form_schema,
)
from rubricem_core.eval.types import EvalError, GradeResult, family_of
from rubricem_core.judge.llm_judge import JudgeOptions, LLMJudge, PendingCall
from rubricem_core.judge.types import SCORE, JudgeUsage
from rubricem_core.llm.types import EndpointSettings
from rubricem_core.schemas import Query

log = logging.getLogger(__name__)


@dataclass
class GraderOptions:
    temperature: float | None = field(default=0.0, metadata={"help": "Sampling temperature; None = provider default."})
    max_tokens: int = field(default=4096, metadata={"help": "Completion budget of one grading call."})
    seed: int | None = field(default=0, metadata={"help": "Sampling seed sent with every call (None: not sent)."})
    structured_output: str = field(
        default="json_schema", metadata={"help": "response_format: json_schema, json_object or none."})
    repair: bool = field(default=True, metadata={"help": "Send an invalid reply's error back once for a fix."})


class BenchmarkGrader:
    """Grades (query, response) pairs of one benchmark; ``usage`` accumulates over every call."""

    def __init__(self, settings: EndpointSettings, options: GraderOptions | None = None) -> None:
        self.options = options or GraderOptions()
        self._judge = LLMJudge(settings, JudgeOptions(
            temperature=self.options.temperature, max_tokens=self.options.max_tokens, seed=self.options.seed,
            structured_output=self.options.structured_output, repair=self.options.repair))

    @property
    def usage(self) -> JudgeUsage:
        return self._judge.usage

    @property
    def model(self) -> str:
        return self._judge.settings.model

    def grade(self, benchmark: str, pairs: Sequence[tuple[Query, str]]) -> list[GradeResult]:
        """One call per (query, response), in input order."""
        family = family_of(benchmark)
        if family == "synthetic":
            raise EvalError("the synthetic benchmark is graded in-process (eval.synthetic.grade_synthetic)")
        pending, items_of = [], []
        for index, (query, response) in enumerate(pairs):
            custom_id = f"grade:{index}:{query.query_id}"
            if family == "short_form":
                items_of.append(None)
                request = self._judge.make_request(custom_id, short_form_messages(benchmark, query, response),
                                               self._judge.response_format("short_form_grade", short_form_schema()))
                pending.append(PendingCall(request, parse_short_form))
            else:
                items = grade_items(query, family)
                ids = [i.item_id for i in items]
                items_of.append(items)
                request = self._judge.make_request(custom_id, items_messages(benchmark, family, query, response, items),
                                               self._judge.response_format("rubric_grades", items_schema(family, ids)))
                pending.append(PendingCall(request, lambda text, ids=ids: parse_items(text, family, ids)))
        self._judge.ask(SCORE, pending)
        out = []
        for (query, _), call, items in zip(pairs, pending, items_of):
            if call.error is not None:
                self.usage.fail(SCORE)
                log.warning("grading %s query %r failed: %s", benchmark, query.query_id, call.error)
                out.append(GradeResult(None, {"grader": self.model}, failed=True, error=call.error))
            elif items is None:
                grade, why = call.value
                out.append(GradeResult(1.0 if grade == "correct" else 0.0,
                                       {"grade": grade, "justification": why, "grader": self.model}))
            else:
                scores = {item_id: s for item_id, (s, _) in call.value.items()}
                score, extra = aggregate_items(family, items, scores)
                details = {"grader": self.model, **extra, "items": [
                    {"id": i.item_id, "criterion": i.criterion[:300], "score": call.value[i.item_id][0],
                     "justification": call.value[i.item_id][1]} for i in items]}
                out.append(GradeResult(score, details))
        return out
