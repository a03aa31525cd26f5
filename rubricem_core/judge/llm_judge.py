"""The stagewise LLM judge: rubric generation and trajectory scoring through litellm.

Both calls go through the structured client (``rubricem_core.llm.structured``: bounded concurrency,
retries with backoff on 429/5xx/timeouts, resampling of replies that are not JSON). A reply that still
fails validation (not JSON, wrong shape, unknown or missing rubric ids, scores outside 0/1/2) gets one
repair: the reply and its validation error are sent back once. A scoring call that fails after that
marks the trajectory's judgment failed — it is never read as a zero.

``JudgeOptions`` sets what the judge is shown (``view``: every stage, or the answer alone for
Baseline-RL; ``show_reference``: the query's answer key or not) and how many new rubrics a stage
gets (the paper's ranges as targets, capped by ``max_new_rubrics_per_stage``; extra ones are cut, fewer
are kept).

``judge_group`` judges one query's rollout group: its generation call, its buffer updated, its scoring
calls, stage rewards, then pruning. ``judge_step`` runs it for every group of an RL step at once (one
concurrency limit over all calls); ``rubricem_core.judge.stream.StreamingJudge`` runs it for each group
as soon as the group has finished sampling. Both give the same calls with the same inputs and ids.
"""

from __future__ import annotations

import asyncio
import dataclasses
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
from rubricem_core.llm.concurrent import run_sync
from rubricem_core.llm.structured import StructuredCall, StructuredClient, StructuredOptions
from rubricem_core.llm.types import EndpointSettings
from rubricem_core.scaffold import STAGES

log = logging.getLogger(__name__)

# One logical judge call through first try and repair (the structured client's call).
PendingCall = StructuredCall

# Completion tokens of a scoring reply beyond its rubric entries (the JSON frame).
SCORING_BASE_TOKENS = 256


@dataclass
class JudgeOptions(StructuredOptions):
    """Sampling and prompt options of the judge (the endpoint itself is an ``EndpointSettings``).

    ``JudgeOptions.from_config(cfg.judge, seed=..., rubric_stages=..., view=...)``
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
        default=40_000,
        metadata={"help": "Longest stage block shown to the judge; the middle of a longer one is cut (None: no cut)."},
    )
    max_tokens_per_rubric: int = field(
        default=0,
        metadata={
            "help": "A scoring call's completion budget grows with its rubric count: max(max_tokens, "
            "SCORING_BASE_TOKENS + this x rubrics); 0 keeps max_tokens for every call."
        },
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        if not isinstance(self.max_new_rubrics_per_stage, int) or self.max_new_rubrics_per_stage < 0:
            raise JudgeError("JudgeOptions.max_new_rubrics_per_stage must be an int >= 0")
        if self.max_block_chars is not None and self.max_block_chars < 1:
            raise JudgeError("JudgeOptions.max_block_chars must be >= 1 or None")
        if self.max_tokens_per_rubric < 0:
            raise JudgeError("JudgeOptions.max_tokens_per_rubric must be >= 0")
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

    def scoring_max_tokens(self, n_rubrics: int) -> int:
        """The completion budget of a scoring call over ``n_rubrics`` rubrics (a justification and a score
        each: a fixed budget cut long rubric lists mid-reply, and the repair then failed the same way)."""
        if not self.max_tokens_per_rubric:
            return self.max_tokens
        return max(self.max_tokens, SCORING_BASE_TOKENS + self.max_tokens_per_rubric * n_rubrics)

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
        return run_sync(self.agenerate(inputs))

    async def agenerate(
        self,
        inputs: Sequence[GenerationInput],
        *,
        first_index: int = 0,
        usage: JudgeUsage | None = None,
        limit: asyncio.Semaphore | None = None,
    ) -> list[GenerationOutcome]:
        """``generate`` on the running loop. Call ids count from ``first_index`` (a group judged alone
        keeps the id it has in its step); calls are counted in ``usage`` (default: ``self.usage``);
        ``limit`` bounds the calls in flight with others sharing it."""
        usage = self.usage if usage is None else usage
        options = self.options
        limit_n, stages = options.max_new_rubrics_per_stage, options.rubric_stages
        schema = generation_schema(rubric_counts(limit_n, stages))
        pending = []
        for index, item in enumerate(inputs, start=first_index):
            messages = generation_messages(
                item.query,
                item.rollouts,
                item.existing,
                limit_n,
                options.max_block_chars,
                stages=stages,
                **options.prompt_args(),
            )
            pending.append(
                self.client.call(
                    f"generate:{index}:{item.query.query_id}",
                    messages,
                    "new_rubrics",
                    schema,
                    lambda text: parse_generation(text, limit_n, stages=stages),
                )
            )
        await self.client.aask(pending, partial(usage.add_call, GENERATE), limit)
        outcomes = []
        for item, call in zip(inputs, pending):
            if call.error is not None:
                usage.fail(GENERATE)
                log.warning("rubric generation for query %r failed: %s", item.query.query_id, call.error)
                outcomes.append(GenerationOutcome(item.query.query_id, failed=True, error=call.error))
                continue
            rubrics, dropped = call.value
            outcomes.append(GenerationOutcome(item.query.query_id, rubrics, dropped))
        return outcomes

    # ---- scoring -------------------------------------------------------------------------------
    def score(self, inputs: Sequence[ScoringInput]) -> list[TrajectoryJudgment]:
        """One call per trajectory scoring all its rubrics; failed judgments carry the reason."""
        return run_sync(self.ascore(inputs))

    async def ascore(
        self,
        inputs: Sequence[ScoringInput],
        *,
        first_index: int = 0,
        usage: JudgeUsage | None = None,
        limit: asyncio.Semaphore | None = None,
    ) -> list[TrajectoryJudgment]:
        """``score`` on the running loop; ``first_index``, ``usage`` and ``limit`` as in ``agenerate``."""
        usage = self.usage if usage is None else usage
        pending: list[PendingCall | None] = []
        for index, item in enumerate(inputs, start=first_index):
            ids = [r.rubric_id for r in item.rubrics]
            if len(set(ids)) != len(ids):
                raise JudgeError(f"rollout {item.rollout.rollout_id!r}: the rubric list repeats an id")
            if not ids:
                pending.append(None)  # nothing to score: no call
                continue
            messages = scoring_messages(
                item.query, item.rollout, item.rubrics, self.options.max_block_chars, **self.options.prompt_args()
            )
            scoring_call = self.client.call(
                f"score:{index}:{item.rollout.rollout_id}",
                messages,
                "rubric_scores",
                scoring_schema(ids),
                partial(parse_scores, rubric_ids=ids),
            )
            scoring_call.request = dataclasses.replace(
                scoring_call.request, max_tokens=self.options.scoring_max_tokens(len(ids))
            )
            pending.append(scoring_call)
        await self.client.aask([p for p in pending if p is not None], partial(usage.add_call, SCORE), limit)
        judgments = []
        for item, call in zip(inputs, pending):
            rollout_id = item.rollout.rollout_id
            if call is None:
                judgments.append(TrajectoryJudgment(rollout_id))
            elif call.error is not None:
                usage.fail(SCORE)
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
    usage: JudgeUsage = field(default_factory=JudgeUsage)  # this group's calls alone

    @property
    def n_failed(self) -> int:
        return sum(j.failed for j in self.judgments)


async def judge_group(
    judge: LLMJudge,
    query: JudgeQuery,
    rollouts: Sequence[JudgeRollout],
    buffer: RubricBuffer,
    step: int,
    *,
    index: int = 0,
    offset: int = 0,
    generate: bool = True,
    limit: asyncio.Semaphore | None = None,
) -> GroupJudgment:
    """One group: generate rubrics, add them to ``buffer``, score every rollout, aggregate, prune.

    ``index`` is the query's place in its step and ``offset`` the step-wide index of its first rollout:
    call ids (which failed judgments' errors quote) are the step's whichever way the group is judged.
    Only ``buffer`` is changed, so groups of different queries can be judged in any order or at once.
    The calls are counted in the result's ``usage``, not in ``judge.usage`` (``collect_usage`` adds them
    in plan order, so float sums do not depend on which group finished first)."""
    usage = JudgeUsage()
    if generate:
        [outcome] = await judge.agenerate(
            [GenerationInput(query, list(rollouts), buffer.active())], first_index=index, usage=usage, limit=limit
        )
    else:
        outcome = GenerationOutcome(query.query_id)
    added = buffer.add(outcome.rubrics, step)
    rubrics = [r for r in buffer.active() if r.origin == "persistent" or r.stage in judge.options.rubric_stages]
    judgments = await judge.ascore(
        [ScoringInput(query, rollout, rubrics) for rollout in rollouts], first_index=offset, usage=usage, limit=limit
    )
    pruned = buffer.after_scoring(judgments, step)
    R = zero_absent_stages(stage_scores(judgments, rubrics), [r.text for r in rollouts])
    return GroupJudgment(
        query.query_id, [r.rollout_id for r in rollouts], judgments, rubrics, R, added, pruned, outcome, usage
    )


def collect_usage(judge: LLMJudge, groups: Sequence[GroupJudgment]) -> JudgeUsage:
    """Add the groups' calls to ``judge.usage`` in the given (plan) order; returns ``judge.usage``."""
    for group in groups:
        judge.usage.merge(group.usage)
    return judge.usage


def judge_step(
    judge: LLMJudge,
    groups: Sequence[tuple[JudgeQuery, Sequence[JudgeRollout]]],
    buffers: dict[str, RubricBuffer],
    step: int,
    generate: bool = True,
) -> list[GroupJudgment]:
    """Judge every group at once (``judge_group`` each, one concurrency limit over all calls); buffers are
    updated and the calls counted in ``judge.usage``. Results in ``groups`` order."""
    ids = [query.query_id for query, _ in groups]
    if len(set(ids)) != len(ids):
        raise JudgeError(f"judge_step: a query appears twice in {ids}")  # its buffer would change twice at once
    for qid in ids:
        if qid not in buffers:
            raise JudgeError(f"no RubricBuffer for query {qid!r}")
    offsets = np.cumsum([0] + [len(rollouts) for _, rollouts in groups]).tolist()

    async def run() -> list[GroupJudgment]:
        limit = asyncio.Semaphore(judge.settings.max_concurrency)
        return await asyncio.gather(
            *(
                judge_group(
                    judge,
                    query,
                    rollouts,
                    buffers[query.query_id],
                    step,
                    index=index,
                    offset=offsets[index],
                    generate=generate,
                    limit=limit,
                )
                for index, (query, rollouts) in enumerate(groups)
            )
        )

    out = run_sync(run())
    collect_usage(judge, out)
    return out
