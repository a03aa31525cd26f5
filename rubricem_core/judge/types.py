"""Plain records of the stagewise judge: rubrics, per-rubric scores, judgments, and call usage.

A ``Rubric`` is one criterion of one stage (``plan|research|review|answer``); ``positive`` rubrics
reward what they describe, ``negative`` ones penalise it (aggregation inverts them: 2 − s).
``persistent`` rubrics come with the query (answer stage, never removed); ``adaptive`` ones are
written by the judge from the rollout group and pruned when they stop discriminating.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import asdict, dataclass, field
from typing import Any

from rubricem_core.llm.types import ChatResult, Traffic
from rubricem_core.scaffold import STAGES

POLARITIES: tuple[str, ...] = ("positive", "negative")
ORIGINS: tuple[str, ...] = ("persistent", "adaptive")
STATUSES: tuple[str, ...] = ("active", "pruned")
SCORES: tuple[int, ...] = (0, 1, 2)
ADAPTIVE_WEIGHTS: tuple[int, ...] = (1, 2, 3)  # what the generation call may assign

# Call kinds counted in JudgeUsage.
GENERATE = "generate"
SCORE = "score"
CALL_KINDS: tuple[str, ...] = (GENERATE, SCORE)


class JudgeError(ValueError):
    """Input to the judge is unusable (unknown stage, missing score, bad checkpoint field...)."""


_SPACE = re.compile(r"\s+")
_PUNCT = re.compile(r"[^\w\s]")


def normalize_title(title: str) -> str:
    """Case-, punctuation- and whitespace-insensitive form of a title (the dedupe key)."""
    return _SPACE.sub(" ", _PUNCT.sub(" ", title.lower())).strip()


def make_rubric_id(query_id: str, stage: str, polarity: str, title: str) -> str:
    """Stable id of a rubric: the same criterion proposed twice (any casing) gets the same id."""
    key = json.dumps([query_id, stage, polarity, normalize_title(title)], ensure_ascii=False)
    return "r" + hashlib.sha1(key.encode("utf-8")).hexdigest()[:16]


@dataclass(frozen=True)
class JudgeQuery:
    """What the judge knows about a query: the question, and for synthetic queries its spec."""

    query_id: str
    question: str
    spec: dict[str, Any] | None = None
    reference_answer: str | None = None


@dataclass(frozen=True)
class JudgeRollout:
    """One rollout as the judge sees it: the scaffold text (policy text + tool outputs)."""

    rollout_id: str
    text: str


@dataclass
class Rubric:
    rubric_id: str
    query_id: str
    stage: str
    polarity: str
    origin: str
    title: str
    description: str
    weight: float
    status: str = "active"
    created_step: int = 0
    pruned_step: int | None = None
    check: dict[str, Any] | None = None  # machine-checkable criterion (synthetic world); None otherwise

    def __post_init__(self) -> None:
        where = f"rubric {self.rubric_id!r} (query {self.query_id!r})"
        if self.stage not in STAGES:
            raise JudgeError(f"{where}: stage {self.stage!r} not in {STAGES}")
        if self.polarity not in POLARITIES:
            raise JudgeError(f"{where}: polarity {self.polarity!r} not in {POLARITIES}")
        if self.origin not in ORIGINS:
            raise JudgeError(f"{where}: origin {self.origin!r} not in {ORIGINS}")
        if self.status not in STATUSES:
            raise JudgeError(f"{where}: status {self.status!r} not in {STATUSES}")
        if not isinstance(self.title, str) or not self.title.strip():
            raise JudgeError(f"{where}: title must be a non-empty string")
        if isinstance(self.weight, bool) or not isinstance(self.weight, (int, float)) or not self.weight > 0:
            raise JudgeError(f"{where}: weight must be a number > 0, got {self.weight!r}")
        if self.check is not None and not isinstance(self.check, dict):
            raise JudgeError(f"{where}: check must be a dict or None, got {type(self.check).__name__}")
        self.weight = float(self.weight)

    def shown(self) -> dict[str, Any]:
        """The fields a judge or grader is shown (ids and text, no bookkeeping), keyed as in its prompts."""
        return {
            "id": self.rubric_id,
            "stage": self.stage,
            "polarity": self.polarity,
            "weight": self.weight,
            "title": self.title,
            "description": self.description,
        }

    @classmethod
    def create(
        cls,
        query_id: str,
        stage: str,
        polarity: str,
        title: str,
        description: str,
        weight: float,
        origin: str = "adaptive",
        created_step: int = 0,
        check: dict[str, Any] | None = None,
    ) -> Rubric:
        """A new active rubric with its id derived from (query_id, stage, polarity, title)."""
        title = _SPACE.sub(" ", str(title)).strip()
        return cls(
            make_rubric_id(query_id, stage, polarity, title),
            query_id,
            stage,
            polarity,
            origin,
            title,
            str(description).strip(),
            weight,
            "active",
            created_step,
            None,
            check,
        )

    @property
    def key(self) -> str:
        return normalize_title(self.title)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Rubric:
        known = set(cls.__dataclass_fields__)
        missing = [
            name
            for name in ("rubric_id", "query_id", "stage", "polarity", "origin", "title", "weight")
            if name not in data
        ]
        if missing:
            raise JudgeError(f"rubric record {data.get('rubric_id', '?')!r} lacks fields {missing}")
        return cls(**{key: value for key, value in data.items() if key in known})


@dataclass
class RubricScore:
    rubric_id: str
    stage: str
    polarity: str
    weight: float
    score: int  # 0 | 1 | 2: how fully the rubric's criterion holds (for negative ones: the fault)
    justification: str

    def __post_init__(self) -> None:
        if isinstance(self.score, bool) or self.score not in SCORES:
            raise JudgeError(f"score of rubric {self.rubric_id!r} must be one of {SCORES}, got {self.score!r}")


@dataclass
class TrajectoryJudgment:
    """All rubric scores of one rollout, or ``failed=True`` (never a silent zero) with the reason."""

    rollout_id: str
    scores: list[RubricScore] = field(default_factory=list)
    failed: bool = False
    error: str | None = None

    def score_of(self, rubric_id: str) -> int | None:
        return next((s.score for s in self.scores if s.rubric_id == rubric_id), None)

    def rows(self, step: int, query_id: str) -> list[dict[str, Any]]:
        """``judge_scores`` rows (none for a failed judgment: its failure lives in ``rollouts.judge_failed``)."""
        if self.failed:
            return []
        return [
            {
                "step": step,
                "query_id": query_id,
                "rollout_id": self.rollout_id,
                "rubric_id": s.rubric_id,
                "stage": s.stage,
                "polarity": s.polarity,
                "weight": float(s.weight),
                "score": int(s.score),
                "justification": s.justification,
            }
            for s in self.scores
        ]


@dataclass
class JudgeUsage(Traffic):
    """Judge traffic: logical calls (requests) by kind, HTTP attempts, tokens, dollars, failures.

    A repair re-asks one call with its validation error; it is counted under ``repairs`` and its
    tokens and cost are included in the totals (``Traffic``).
    """

    calls: dict[str, int] = field(default_factory=lambda: {kind: 0 for kind in CALL_KINDS})
    repairs: dict[str, int] = field(default_factory=lambda: {kind: 0 for kind in CALL_KINDS})
    failures: dict[str, int] = field(default_factory=lambda: {kind: 0 for kind in CALL_KINDS})

    def record(
        self,
        kind: str,
        prompt_tokens: int,
        completion_tokens: int,
        cost_usd: float,
        attempts: int,
        repair: bool = False,
    ) -> None:
        if kind not in CALL_KINDS:
            raise JudgeError(f"unknown judge call kind {kind!r}; expected one of {CALL_KINDS}")
        (self.repairs if repair else self.calls)[kind] += 1
        self.add_traffic(prompt_tokens, completion_tokens, cost_usd, attempts)

    def add_call(self, kind: str, result: ChatResult, repair: bool = False) -> None:
        """``record`` of one answered call (a structured client's record hook, with ``kind`` bound)."""
        self.record(
            kind, result.prompt_tokens, result.completion_tokens, result.cost_usd, result.attempts, repair=repair
        )
        self.add_result_retries(result)

    def fail(self, kind: str) -> None:
        self.failures[kind] += 1

    @property
    def total_calls(self) -> int:
        """Requests sent, repairs included (what a provider bills as separate calls)."""
        return sum(self.calls.values()) + sum(self.repairs.values())

    def merge(self, other: JudgeUsage) -> JudgeUsage:
        for name in ("calls", "repairs", "failures"):
            mine, theirs = getattr(self, name), getattr(other, name)
            for kind, count in theirs.items():
                mine[kind] = mine.get(kind, 0) + count
        self.add_traffic(other.prompt_tokens, other.completion_tokens, other.cost_usd, other.attempts)
        self.add_retries(other.retries, other.rate_limited, other.wait_s)
        return self

    def metrics(self, prefix: str = "judge/") -> dict[str, float]:
        """Flat name → value pairs for the ``metrics`` table / MLflow."""
        out: dict[str, float] = {}
        for kind in CALL_KINDS:
            out[f"{prefix}{kind}_calls"] = float(self.calls.get(kind, 0))
            out[f"{prefix}{kind}_repairs"] = float(self.repairs.get(kind, 0))
            out[f"{prefix}{kind}_failures"] = float(self.failures.get(kind, 0))
        out[f"{prefix}attempts"] = float(self.attempts)
        out[f"{prefix}prompt_tokens"] = float(self.prompt_tokens)
        out[f"{prefix}completion_tokens"] = float(self.completion_tokens)
        out[f"{prefix}cost_usd"] = float(self.cost_usd)
        out.update(self.retry_metrics(prefix))
        return out
