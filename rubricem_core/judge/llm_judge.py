"""The stagewise LLM judge: rubric generation and trajectory scoring through litellm.

Both calls go through the structured client (``rubricem_core.llm.structured``: bounded concurrency,
retries with backoff on 429/5xx/timeouts, resampling of replies that are not JSON). A reply that still
fails validation (not JSON, wrong shape, unknown or missing rubric ids, scores outside 0/1/2) gets one
repair: the reply and its validation error are sent back once. A scoring call that fails after that
marks the trajectory's judgment failed — it is never read as a zero.

``JudgeOptions`` sets what the judge is shown (``view``: every stage, or the answer alone for
Baseline-RL; ``show_reference``: the query's answer key or not) and how many new rubrics a stage
gets (the paper's ranges, capped by ``max_new_rubrics_per_stage``; extra ones are cut, too few are
repaired when ``require_min_rubrics``).

``judge_step`` runs one RL step's judging for many queries: all generation calls at once, the
buffers updated, all scoring calls at once, stage rewards, then pruning.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import numpy as np

from rubricem_core.judge.aggregate import stage_scores, zero_absent_stages
from rubricem_core.judge.buffer import RubricBuffer
from rubricem_core.judge.prompts import (
    TRAJECTORY_VIEW,
    VIEWS,
    GeneratedRubric,
    generation_messages,
    generation_schema,
    parse_generation,
    parse_scores,
    rubric_counts,
    scoring_messages,
    scoring_schema,
)
from rubricem_core.judge.types import (
    GENERATE,
    SCORE,
    JudgeError,
    JudgeQuery,
    JudgeRollout,
    JudgeUsage,
    Rubric,
    RubricScore,
    TrajectoryJudgment,
)
from rubricem_core.llm.replies import ReplyError
from rubricem_core.llm.structured import StructuredCall, StructuredClient, StructuredOptions
from rubricem_core.llm.types import EndpointSettings
from rubricem_core.scaffold import STAGES

log = logging.getLogger(__name__)

# One logical judge call through first try and repair (the structured client's call).
PendingCall = StructuredCall


@dataclass
class JudgeOptions(StructuredOptions):
    """Sampling and prompt options of the judge (the endpoint itself is an ``EndpointSettings``).

    ``JudgeOptions.from_config(cfg.judge, seed=..., rubric_stages=..., view=..., require_min_rubrics=...)``
    takes the rest from the ``judge`` section.
    """

    error_type = JudgeError

    max_tokens: int = field(default=4096, metadata={"help": "Completion budget of one judge call."})
    max_new_rubrics_per_stage: int = field(
        default=3,
        metadata={
            "help": "Most new rubrics one generation call may add to a stage (the paper's "
            "1-4 per plan/research/review stage and 2-5 for the answer, capped by this)."
        },
    )
    require_min_rubrics: bool = field(
        default=False,
        metadata={
            "help": "Repair a generation reply with fewer new rubrics in a stage than the "
            "paper's fewest. Off for the built-in judge, which proposes only rubrics "
            "that separate the group (there may be none)."
        },
    )
    rubric_stages: tuple[str, ...] = field(
        default=STAGES, metadata={"help": "Stages that get adaptive rubrics; ('answer',) is the answer-only baseline."}
    )
    view: str = field(
        default=TRAJECTORY_VIEW,
        metadata={
            "help": "What the judge sees of a rollout: trajectory (every stage, tool outputs included) or "
            "answer (the question and the final answer only: DR Tulu's evolving-answer objective)."
        },
    )
    show_reference: bool = field(
        default=True,
        metadata={
            "help": "Show the query's reference answer and spec, an answer key the paper's judge never sees "
            "(it reads the query, the rollouts and its rubrics); the built-in judge needs the spec."
        },
    )
    max_block_chars: int | None = field(
        default=40_000, metadata={"help": "Longest stage block shown to the judge; the middle of a longer one is cut."}
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        if not isinstance(self.max_new_rubrics_per_stage, int) or self.max_new_rubrics_per_stage < 0:
            raise JudgeError("JudgeOptions.max_new_rubrics_per_stage must be an int >= 0")
        unknown = [s for s in self.rubric_stages if s not in STAGES]
        if unknown:
            raise JudgeError(f"JudgeOptions.rubric_stages has unknown stages {unknown}; expected some of {STAGES}")
        if self.view not in VIEWS:
            raise JudgeError(f"JudgeOptions.view must be one of {VIEWS}, got {self.view!r}")
        if self.view != TRAJECTORY_VIEW and set(self.rubric_stages) != {"answer"}:
            # a judge shown the answer alone cannot score plan, research or review rubrics
            raise JudgeError(
                f"JudgeOptions.view={self.view!r} needs rubric_stages=('answer',), got {self.rubric_stages}"
            )

    def prompt_args(self) -> dict[str, Any]:
        """What both prompts show: the rollout view and whether the answer key is in."""
        return {"view": self.view, "show_reference": self.show_reference}


@dataclass(frozen=True)
class GenerationInput:
    query: JudgeQuery
    rollouts: Sequence[JudgeRollout]
    existing: Sequence[Rubric]  # the rubrics already in force, shown so the judge does not repeat them


@dataclass
class GenerationOutcome:
    query_id: str
    rubrics: list[GeneratedRubric] = field(default_factory=list)
    dropped: list[str] = field(default_factory=list)  # principle-breaking, stage not judged, or over the count
    failed: bool = False
    error: str | None = None


@dataclass(frozen=True)
class ScoringInput:
    query: JudgeQuery
    rollout: JudgeRollout
    rubrics: Sequence[Rubric]


class LLMJudge:
    """The two judge calls against one endpoint; ``usage`` accumulates over every call made."""

    def __init__(self, settings: EndpointSettings, options: JudgeOptions | None = None) -> None:
        self.settings = settings
        self.options = options or JudgeOptions()
        self.usage = JudgeUsage()
        self.client = StructuredClient(settings, self.options)

    def ask(self, kind: str, pending: list[PendingCall]) -> None:
        """Send the calls (first try, one repair), counting them under ``kind`` in ``usage``."""
        self.client.ask(pending, partial(self.usage.add_call, kind))

    # ---- rubric generation ---------------------------------------------------------------------
    def generate(self, inputs: Sequence[GenerationInput]) -> list[GenerationOutcome]:
        """One call per query: new rubrics (not yet in any buffer), in input order."""
        options = self.options
        limit, stages = options.max_new_rubrics_per_stage, options.rubric_stages
        require_min = options.require_min_rubrics
        schema = generation_schema(rubric_counts(limit, stages), require_min)
        pending = []
        for index, item in enumerate(inputs):
            messages = generation_messages(
                item.query,
                item.rollouts,
                item.existing,
                limit,
                options.max_block_chars,
                stages=stages,
                require_min=require_min,
                **options.prompt_args(),
            )
            pending.append(
                self.client.call(
                    f"generate:{index}:{item.query.query_id}",
                    messages,
                    "new_rubrics",
                    schema,
                    lambda text: parse_generation(text, limit, stages=stages, require_min=require_min),
                )
            )
        self.ask(GENERATE, pending)
        outcomes = []
        for item, call in zip(inputs, pending):
            if call.error is not None and require_min:
                self._keep_short_reply(call, limit, stages)
            if call.error is not None:
                self.usage.fail(GENERATE)
                log.warning("rubric generation for query %r failed: %s", item.query.query_id, call.error)
                outcomes.append(GenerationOutcome(item.query.query_id, failed=True, error=call.error))
                continue
            rubrics, dropped = call.value
            outcomes.append(GenerationOutcome(item.query.query_id, rubrics, dropped))
        return outcomes

    @staticmethod
    def _keep_short_reply(call: PendingCall, limit: int, stages: Sequence[str]) -> None:
        """A repaired reply whose only fault is too few rubrics in some stage keeps the rubrics it has:
        losing every new rubric of the query would cost more than a stage one short of the paper's count."""
        try:
            rubrics, dropped = parse_generation(call.last_text, limit, stages=stages)
        except ReplyError:
            return  # broken beyond the count: the generation fails
        call.value, call.error = (rubrics, [*dropped, f"kept though {call.error}"]), None

    # ---- scoring -------------------------------------------------------------------------------
    def score(self, inputs: Sequence[ScoringInput]) -> list[TrajectoryJudgment]:
        """One call per trajectory scoring all its rubrics; failed judgments carry the reason."""
        pending: list[PendingCall | None] = []
        for index, item in enumerate(inputs):
            ids = [r.rubric_id for r in item.rubrics]
            if len(set(ids)) != len(ids):
                raise JudgeError(f"rollout {item.rollout.rollout_id!r}: the rubric list repeats an id")
            if not ids:
                pending.append(None)  # nothing to score: no call
                continue
            messages = scoring_messages(
                item.query, item.rollout, item.rubrics, self.options.max_block_chars, **self.options.prompt_args()
            )
            pending.append(
                self.client.call(
                    f"score:{index}:{item.rollout.rollout_id}",
                    messages,
                    "rubric_scores",
                    scoring_schema(ids),
                    partial(parse_scores, rubric_ids=ids),
                )
            )
        self.ask(SCORE, [p for p in pending if p is not None])
        judgments = []
        for item, call in zip(inputs, pending):
            rollout_id = item.rollout.rollout_id
            if call is None:
                judgments.append(TrajectoryJudgment(rollout_id))
            elif call.error is not None:
                self.usage.fail(SCORE)
                judgments.append(TrajectoryJudgment(rollout_id, failed=True, error=call.error))
            else:
                judgments.append(
                    TrajectoryJudgment(
                        rollout_id,
                        [
                            RubricScore(r.rubric_id, r.stage, r.polarity, r.weight, *call.value[r.rubric_id])
                            for r in item.rubrics
                        ],
                    )
                )
        return judgments


# ---- one RL step -----------------------------------------------------------------------------------


@dataclass
class GroupJudgment:
    """The judge's output for one query's rollout group at one step."""

    query_id: str
    rollout_ids: list[str]
    judgments: list[TrajectoryJudgment]
    rubrics: list[Rubric]  # the rubrics the group was scored against (before pruning)
    R: np.ndarray  # n × 4 stage rewards, NaN rows for failed judgments
    added: list[Rubric]
    pruned: list[Rubric]
    generation: GenerationOutcome

    @property
    def n_failed(self) -> int:
        return sum(j.failed for j in self.judgments)


def judge_step(
    judge: LLMJudge,
    groups: Sequence[tuple[JudgeQuery, Sequence[JudgeRollout]]],
    buffers: dict[str, RubricBuffer],
    step: int,
    generate: bool = True,
) -> list[GroupJudgment]:
    """Generate rubrics for every group, score every rollout, aggregate, prune; buffers are updated."""
    for query, _ in groups:
        if query.query_id not in buffers:
            raise JudgeError(f"no RubricBuffer for query {query.query_id!r}")
    if generate:
        outcomes = judge.generate([GenerationInput(q, list(r), buffers[q.query_id].active()) for q, r in groups])
    else:
        outcomes = [GenerationOutcome(q.query_id) for q, _ in groups]
    added = [buffers[o.query_id].add(o.rubrics, step) for o in outcomes]
    in_force = [
        [r for r in buffers[q.query_id].active() if r.origin == "persistent" or r.stage in judge.options.rubric_stages]
        for q, _ in groups
    ]
    inputs = [
        ScoringInput(q, rollout, rubrics) for (q, rollouts), rubrics in zip(groups, in_force) for rollout in rollouts
    ]
    judgments = judge.score(inputs)
    out, start = [], 0
    for (query, rollouts), rubrics, outcome, new in zip(groups, in_force, outcomes, added):
        group = judgments[start : start + len(rollouts)]
        start += len(rollouts)
        pruned = buffers[query.query_id].after_scoring(group, step)
        R = zero_absent_stages(stage_scores(group, rubrics), [r.text for r in rollouts])
        out.append(
            GroupJudgment(query.query_id, [r.rollout_id for r in rollouts], group, rubrics, R, new, pruned, outcome)
        )
    return out
