"""Plain records of evaluation: what was sampled for a query and how it was graded."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

# benchmark → grader family (how items are scored and aggregated)
FAMILIES: dict[str, str] = {
    "synthetic": "synthetic",  # in-process, deterministic: the world's checkable facts
    "healthbench": "rubric_points",  # Σ points of met criteria / Σ positive points
    "deep_research_bench": "dimension_criteria",  # criteria 0..10, weighted within and across dimensions
    "scholarqa_cs": "rubric_properties",  # properties 0/1/2, weighted
    "simpleqa": "short_form",  # correct / incorrect / not_attempted
    "2wiki": "short_form",
    "researchqa": "rubric_coverage",  # items rated 1..5, mean of (x - 1) / 4, unweighted
    "researchrubrics": "rubric_points",  # criteria satisfied or not, one call each; Σ w·s / Σ positive w
    "webwalkerqa": "short_form",
    "deepsearchqa": "answer_set",  # gold answer parts found / excessive answers → fully correct, P / R / F1
}
# Benchmarks whose own grader asks about one criterion per call, whatever eval.healthbench_grading says
# (ResearchRubrics' evaluate_single_report: one Satisfied / Not Satisfied call per rubric).
PER_CRITERION_BENCHMARKS: frozenset[str] = frozenset({"researchrubrics"})
BENCHMARKS: tuple[str, ...] = tuple(FAMILIES)
SHORT_FORM_GRADES: tuple[str, ...] = ("correct", "incorrect", "not_attempted")


class EvalError(ValueError):
    """Evaluation input is unusable (unknown benchmark, query without rubrics, bad checkpoint...)."""


def family_of(benchmark: str) -> str:
    if benchmark not in FAMILIES:
        raise EvalError(f"unknown benchmark {benchmark!r}; expected one of {BENCHMARKS}")
    return FAMILIES[benchmark]


@dataclass
class EvalSample:
    """One sampled trajectory for one query (the policy's text, tool outputs included)."""

    query_id: str
    sample: int
    text: str
    answer: str  # inner text of <answer> ('' when none)
    n_tool_calls: int
    finish_reason: str | None
    n_policy_tokens: int
    guidance: str | None = None


@dataclass
class GradeResult:
    """Score in [0, 1] with its evidence, or ``failed=True`` (never a silent zero) with the reason."""

    score: float | None
    details: dict[str, Any] = field(default_factory=dict)
    failed: bool = False
    error: str | None = None

    def __post_init__(self) -> None:
        if self.failed:
            self.score = None
        elif self.score is None or not 0.0 <= float(self.score) <= 1.0:
            raise EvalError(f"a grade must be in [0, 1] unless failed, got {self.score!r}")
        else:
            self.score = float(self.score)

    def details_json(self) -> str:
        return json.dumps(self.details, ensure_ascii=False, sort_keys=True, default=str)


_UNSAFE = re.compile(r"[^A-Za-z0-9_.\-]+")


def safe_name(text: str) -> str:
    """A file-name-safe form of a tag (checkpoint tags name Parquet parts)."""
    out = _UNSAFE.sub("_", text).strip("._")
    if not out:
        raise EvalError(f"cannot make a file name from {text!r}")
    return out
