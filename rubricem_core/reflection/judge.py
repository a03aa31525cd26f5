"""The reflection judge: how useful is each reflection candidate for a future attempt?

It sees what the policy did not: the judge rubrics of the query and the source trajectory's
rubric scores with their justifications. It returns a usefulness score in [0, 1] with a
justification for every candidate.

Calls (``mode``): ``per_candidate`` (the paper) scores each candidate in its own call, so a
candidate's score never depends on the others in its group and one failed call costs one
candidate. ``joint`` scores all candidates of a source trajectory in ONE call: n times fewer
calls and prompt tokens (the rubrics and the attempt are sent once), the candidates side by side;
a call that still fails after retries and one repair marks every candidate of that trajectory
``judge_failed``. Either way a failed candidate is excluded from the group, never scored 0.

Invalid candidates (``validate_reflection`` codes) are marked invalid and never enter the bank. As the paper
(App. D) has it, every candidate is judged, invalid ones too, and the meta-policy's GRPO group uses the judge's
scores: a candidate whose format is broken is rewarded for what it says, not zeroed by a check the judge
never saw (``judge_invalid``, on by default; off: scored 0 without a call, the project's earlier rule, and a
trajectory whose candidates are all invalid costs no call).

The offline built-in judge (litellm provider ``rubricem-reflection-judge``) that reads the same prompt
is a stand-in (sim/reflection_judge.py), reached by its provider name.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any, ClassVar

import numpy as np

from rubricem_core.judge.prompts import escape_section_markers
from rubricem_core.judge.types import JudgeError, JudgeQuery, Rubric, TrajectoryJudgment
from rubricem_core.llm.replies import ReplyError, checked_reply, entries_shape, one_entry_per_id
from rubricem_core.llm.structured import StructuredCall, StructuredClient, StructuredOptions
from rubricem_core.llm.types import CallUsage, EndpointSettings
from rubricem_core.reflection.format import (
    MAX_REFLECTION_CHARS,
    VALIDITY_MODES,
    clip_middle,
    validate_reflection,
)

log = logging.getLogger(__name__)

TASK_LINE = "TASK: score reflection candidates"
JUSTIFICATION_MAX_CHARS = 2000
JUDGE_MODES: tuple[str, ...] = ("per_candidate", "joint")


# ---- inputs and outputs ----------------------------------------------------------------------------


@dataclass(frozen=True)
class ReflectionJudgeInput:
    """The candidates written about one source trajectory, with the judge's privileged view of it."""

    query: JudgeQuery
    source_rollout_id: str
    trajectory_text: str
    candidates: Sequence[str]
    rubrics: Sequence[Rubric]  # the rubrics the trajectory was scored against
    judgment: TrajectoryJudgment  # its scores and justifications


@dataclass
class CandidateScore:
    """One candidate's verdict. ``score`` is None exactly when ``judge_failed``."""

    query_id: str
    source_rollout_id: str
    candidate: int
    text: str
    valid: bool
    codes: list[str] = field(default_factory=list)
    score: float | None = None
    justification: str = ""
    judge_failed: bool = False
    error: str | None = None

    def row(self, step: int, accepted: bool) -> dict[str, Any]:
        """One ``reflections`` table row."""
        return {
            "step": int(step),
            "query_id": self.query_id,
            "source_rollout_id": self.source_rollout_id,
            "candidate": int(self.candidate),
            "text": self.text,
            "valid": bool(self.valid),
            "score": None if self.score is None else float(self.score),
            "accepted": bool(accepted),
            "judge_failed": bool(self.judge_failed),
            "codes": list(self.codes),
            "justification": self.justification,
        }


@dataclass
class ReflectionJudgeUsage(CallUsage):
    """Reflection-judge traffic and outcomes, for the ``metrics`` table / MLflow."""

    candidates: int = 0
    invalid_candidates: int = 0
    failed_candidates: int = 0

    # metric order: the calls, their traffic, then the candidates' outcomes
    METRICS: ClassVar[tuple[str, ...]] = (
        "calls",
        "repairs",
        "failed_calls",
        "attempts",
        "prompt_tokens",
        "completion_tokens",
        "cost_usd",
        "candidates",
        "invalid_candidates",
        "failed_candidates",
    )

    def metrics(self, prefix: str = "reflection_judge/") -> dict[str, float]:
        out = {f"{prefix}{name}": float(getattr(self, name)) for name in self.METRICS}
        out.update(self.retry_metrics(prefix))
        return out


@dataclass
class ReflectionJudgeOptions(StructuredOptions):
    """Sampling and prompt options of the reflection judge (the endpoint is an ``EndpointSettings``).

    ``ReflectionJudgeOptions.from_config(cfg.reflection.judge, seed=cfg.seed)`` takes the rest from the section.
    """

    error_type = JudgeError

    max_tokens: int = field(default=4096, metadata={"help": "Completion budget of one call (all candidates)."})
    max_trajectory_chars: int | None = field(
        default=20_000,
        metadata={"help": "Longest source trajectory shown (its middle is cut); 0 = not shown; None = all."},
    )
    max_reflection_chars: int = field(
        default=MAX_REFLECTION_CHARS, metadata={"help": "Longer candidates are invalid (too_long)."}
    )
    validity: str = field(
        default="structural",
        metadata={"help": "Which candidates are valid: strict (this project's checks) or structural (the paper's)."},
    )
    mode: str = field(
        default="joint",
        metadata={"help": "per_candidate: one call per candidate (the paper); joint: one call per source trajectory."},
    )
    judge_invalid: bool = field(
        default=True,
        metadata={"help": "Judge invalid candidates too (the paper); False: score them 0 without a call."},
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.max_trajectory_chars is not None and self.max_trajectory_chars < 0:
            raise JudgeError("ReflectionJudgeOptions.max_trajectory_chars must be >= 0 or None")
        if self.max_reflection_chars < 1:
            raise JudgeError("ReflectionJudgeOptions.max_reflection_chars must be >= 1")
        if self.validity not in VALIDITY_MODES:
            raise JudgeError(f"ReflectionJudgeOptions.validity must be one of {VALIDITY_MODES}, got {self.validity!r}")
        if self.mode not in JUDGE_MODES:
            raise JudgeError(f"ReflectionJudgeOptions.mode must be one of {JUDGE_MODES}, got {self.mode!r}")


# ---- prompt, schema, reply -------------------------------------------------------------------------

SYSTEM = """You judge reflections that a research agent wrote about one of its own attempts at a question. A reflection has reflection rubrics (criteria a strong report meets) and takeaways (lessons for the next attempt). It will be shown to the agent as guidance on a later attempt at this question or a similar one.

You see privileged information the agent did not: the judge rubrics of the question, and how the attempt scored on each (score 0/1/2 with a justification; "credit" is the score with negative rubrics inverted, so credit 2 means the rubric was fully satisfied and credit < 2 means it was failed or partly failed).

Score each candidate's usefulness for a future attempt, from 0.0 to 1.0:
- It identifies what actually went wrong: the failed rubrics (credit < 2), especially heavy ones, in specific terms — the entities, facts, sources or mistakes involved. The agent never saw the rubrics, so reward reflections that reach the same conclusions on their own; do not require the rubric wording.
- Its takeaways are concrete and actionable (what to search, what to verify, which look-alike to avoid), not generic advice ("be thorough", "double-check").
- It is faithful to the attempt (no invented failures or facts) and not redundant (no item repeated in other words).
1.0: would clearly fix the failures; 0.5: partly useful; 0.0: useless or misleading.
Write a short justification for each candidate (which failures it addresses, what it misses), then its score. Score every candidate listed exactly once, by its number.

Reply with one JSON object and nothing else, following this JSON schema:
{schema}"""


# A scored candidate: its justification, then the usefulness score.
_SCORE_FIELDS = {
    "justification": {"type": "string", "minLength": 1, "maxLength": JUSTIFICATION_MAX_CHARS},
    "score": {"type": "number", "minimum": 0, "maximum": 1},
}


def reply_schema(candidates: Sequence[int]) -> dict[str, Any]:
    return one_entry_per_id("scores", "candidate", candidates, _SCORE_FIELDS)


def _section(name: str, body: str) -> str:
    return f"<<<{name}>>>\n{body.strip()}"


def credit(polarity: str, score: int) -> int:
    """Score with negative rubrics inverted: 2 = fully satisfied."""
    return 2 - score if polarity == "negative" else score


def rubric_score_lines(rubrics: Sequence[Rubric], judgment: TrajectoryJudgment) -> list[str]:
    """One JSON line per rubric: the rubric, its score on the trajectory and the justification."""
    by_id = {s.rubric_id: s for s in judgment.scores}
    known = {r.rubric_id for r in rubrics}
    unknown = sorted(set(by_id) - known)
    if unknown:
        raise JudgeError(f"rollout {judgment.rollout_id!r}: scores for rubrics not in the rubric list: {unknown}")
    lines = []
    for rubric in rubrics:
        scored = by_id.get(rubric.rubric_id)
        record = {
            **rubric.shown(),
            "score": None if scored is None else scored.score,
            "credit": None if scored is None else credit(rubric.polarity, scored.score),
            "justification": None if scored is None else scored.justification,
        }
        lines.append(escape_section_markers(json.dumps(record, ensure_ascii=False, sort_keys=True)))
    return lines


def judge_messages(
    item: ReflectionJudgeInput, candidates: Sequence[int], max_trajectory_chars: int | None
) -> list[dict[str, str]]:
    # The system prompt shows the reply shape with a generic candidate field so it is identical for
    # every call (providers cache shared prefixes); the exact schema travels as response_format.
    shape = entries_shape(
        "scores", "candidate", {"type": "integer", "description": "a listed candidate number"}, _SCORE_FIELDS
    )
    parts = [TASK_LINE, _section("QUESTION", escape_section_markers(item.query.question))]
    parts.append(
        _section("JUDGE RUBRICS AND SCORES", "\n".join(rubric_score_lines(item.rubrics, item.judgment)) or "(none)")
    )
    if max_trajectory_chars != 0:
        shown, omitted = clip_middle(item.trajectory_text, max_trajectory_chars)
        head = f"({omitted} characters omitted from the middle)\n" if omitted else ""
        parts.append(_section("ATTEMPT", head + escape_section_markers(shown)))
    for index in candidates:
        parts.append(_section(f"CANDIDATE {index}", escape_section_markers(item.candidates[index])))
    parts.append(_section("END", "Score candidates " + ", ".join(str(i) for i in candidates) + "."))
    return [
        {"role": "system", "content": SYSTEM.format(schema=json.dumps(shape))},
        {"role": "user", "content": "\n\n".join(parts)},
    ]


def parse_reply(text: str | None, candidates: Sequence[int]) -> dict[int, tuple[float, str]]:
    """{candidate: (score, justification)} with every asked candidate exactly once, or ReplyError."""
    data = checked_reply(text, reply_schema(list(candidates)))
    out: dict[int, tuple[float, str]] = {}
    for entry in data["scores"]:
        index = int(entry["candidate"])
        if index in out:
            raise ReplyError(f"candidate {index} is scored twice")
        score = float(entry["score"])
        if not math.isfinite(score):
            raise ReplyError(f"candidate {index}: score is not a finite number")
        out[index] = (score, entry["justification"].strip() or "-")
    missing = [index for index in candidates if index not in out]
    if missing:
        raise ReplyError(f"candidates not scored: {missing}")
    return out


# ---- the judge ------------------------------------------------------------------------------------


class ReflectionJudge:
    """Scores reflection candidates against one endpoint; ``usage`` accumulates over every call."""

    def __init__(self, settings: EndpointSettings, options: ReflectionJudgeOptions | None = None) -> None:
        self.settings = settings
        self.options = options or ReflectionJudgeOptions()
        self.usage = ReflectionJudgeUsage()
        self.client = StructuredClient(settings, self.options, failure="reflection judge call failed")

    def score(self, inputs: Sequence[ReflectionJudgeInput]) -> list[CandidateScore]:
        """Every candidate of every input, in input order then candidate order."""
        out: list[list[CandidateScore]] = []
        calls: list[StructuredCall] = []
        targets: list[tuple[int, list[int]]] = []  # each call's (input index, candidates)
        for index, item in enumerate(inputs):
            if item.judgment.rollout_id != item.source_rollout_id:
                raise JudgeError(
                    f"input {index}: judgment is for rollout {item.judgment.rollout_id!r}, "
                    f"not the source rollout {item.source_rollout_id!r}"
                )
            scores = []
            for number, text in enumerate(item.candidates):
                codes = validate_reflection(
                    text,
                    item.trajectory_text,
                    item.query.question,
                    self.options.max_reflection_chars,
                    self.options.validity,
                )
                scores.append(
                    CandidateScore(
                        item.query.query_id, item.source_rollout_id, number, text, valid=not codes, codes=codes
                    )
                )
                if codes and not self.options.judge_invalid:  # a zero, decided without the judge
                    scores[-1].score = 0.0
                    scores[-1].justification = "invalid: " + ", ".join(codes)
            out.append(scores)
            judged = [s.candidate for s in scores if s.valid or self.options.judge_invalid]
            if not judged:
                continue
            if item.judgment.failed:
                # no privileged inputs to judge with: the candidates cannot be scored, not scored 0
                for number in judged:
                    scores[number].judge_failed = True
                    scores[number].error = f"source trajectory judgment failed: {item.judgment.error}"
                continue
            groups = [[n] for n in judged] if self.options.mode == "per_candidate" else [judged]
            for group in groups:
                suffix = f":{group[0]}" if self.options.mode == "per_candidate" else ""
                messages = judge_messages(item, group, self.options.max_trajectory_chars)
                calls.append(
                    self.client.call(
                        f"reflect:{index}:{item.source_rollout_id}{suffix}",
                        messages,
                        "reflection_scores",
                        reply_schema(group),
                        partial(parse_reply, candidates=group),
                    )
                )
                targets.append((index, group))
        self.client.ask(calls, self.usage.record)
        for call, (index, group) in zip(calls, targets):
            scores = out[index]
            if call.error is not None:
                self.usage.failed_calls += 1
                log.warning("reflection judge call for rollout %r failed: %s", scores[0].source_rollout_id, call.error)
                for number in group:
                    scores[number].judge_failed, scores[number].error = True, call.error
                continue
            for number, (value, why) in call.value.items():
                scores[number].score, scores[number].justification = value, why
        flat = [s for scores in out for s in scores]
        self.usage.candidates += len(flat)
        self.usage.invalid_candidates += sum(not s.valid for s in flat)
        self.usage.failed_candidates += sum(s.judge_failed for s in flat)
        return flat


# ---- using the verdicts -----------------------------------------------------------------------------


def best_candidate(scores: Sequence[CandidateScore], min_score: float = 0.0) -> CandidateScore | None:
    """The valid, judged candidate with the highest score above ``min_score`` (ties: lowest number).

    A candidate the judge found useless (score <= min_score) never enters the bank.
    """
    eligible = [
        (s.score, s) for s in scores if s.valid and not s.judge_failed and s.score is not None and s.score > min_score
    ]
    if not eligible:
        return None
    return min(eligible, key=lambda e: (-e[0], e[1].candidate))[1]


def candidate_rewards(scores: Sequence[CandidateScore]) -> np.ndarray:
    """Rewards for the GRPO group of one source trajectory: NaN marks judge failures (excluded)."""
    return np.array([np.nan if s.judge_failed or s.score is None else s.score for s in scores], dtype=np.float64)


def reflection_rows(step: int, scores: Sequence[CandidateScore], min_score: float = 0.0) -> list[dict[str, Any]]:
    """``reflections`` rows; ``accepted`` marks the best candidate of each source trajectory."""
    groups: dict[tuple[str, str], list[CandidateScore]] = {}
    for s in scores:
        groups.setdefault((s.query_id, s.source_rollout_id), []).append(s)
    accepted = {id(best) for group in groups.values() if (best := best_candidate(group, min_score)) is not None}
    return [s.row(step, id(s) in accepted) for s in scores]
