"""LLM endpoints: the shared endpoint settings, the `teacher` and `judge` sections."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from rubricem_core.config.base import _Strict
from rubricem_core.redact import (
    hold_url_credentials,
    is_block_name,
    is_env_var_name,
)


class EndpointConfig(_Strict):
    """How to reach an LLM through litellm (any provider). Keys are named, never stored."""

    model: str = Field(default="", description="litellm model string, e.g. openai/gpt-4.1-mini.")
    api_base: str | None = Field(default=None, description="Provider base URL (None: provider default).")
    api_key_env: str | None = Field(
        default=None, description="Environment variable holding the API key (None for built-in models)."
    )
    api_key_secret_block: str | None = Field(
        default=None, description="Prefect Secret block name to read the key from when the variable is unset."
    )
    custom_llm_provider: str | None = Field(default=None, description="litellm provider override.")
    max_concurrency: int = Field(
        default=16,
        ge=1,
        description="Concurrent requests at most; under 429s fewer (halved per 429, grown back by successes).",
    )
    max_tokens_per_minute: int | None = Field(
        default=None,
        ge=1,
        description="Client-side token budget per minute (a call counts prompt characters / 4 + max_tokens, "
        "corrected with the usage it reports); None: no budget. Concurrent calls only.",
    )
    timeout_s: float = Field(default=120.0, gt=0, description="Per-request timeout.")
    max_retries: int = Field(default=4, ge=0, description="Retries on 429/5xx/timeouts.")
    input_cost_per_token: float | None = Field(default=None, description="Price for models unknown to litellm.")
    output_cost_per_token: float | None = Field(default=None, description="Price for models unknown to litellm.")

    @field_validator("api_key_env")
    @classmethod
    def _names_a_variable(cls, value: str | None) -> str | None:
        # a key pasted here would be recorded everywhere the config goes; the message never repeats it
        if value is not None and not is_env_var_name(value):
            raise ValueError(
                "must name an environment variable (letters, digits, underscores, e.g. OPENAI_API_KEY), not hold "
                "the key itself: export the key in a variable and give its name"
            )
        return value

    @field_validator("api_key_secret_block")
    @classmethod
    def _names_a_block(cls, value: str | None) -> str | None:
        if value is not None and not is_block_name(value):
            raise ValueError(
                "must name a Prefect Secret block (lowercase letters, digits and dashes, not a key's prefix such as "
                "sk-); the value given is not one, and is not repeated here"
            )
        return value

    @field_validator("api_base")
    @classmethod
    def _credentials_held(cls, value: str | None) -> str | None:
        # https://user:pass@host → https://user:***@host in the config (and everything recorded from it);
        # the endpoint gets the real URL back from this process (rubricem_core.redact.reveal_url)
        return hold_url_credentials(value) if value else value


class TeacherConfig(EndpointConfig):
    model: str = Field(
        default="rubricem-teacher/scripted",
        description="litellm model string. 'rubricem-teacher/...' is the built-in scripted teacher.",
    )
    mode: Literal["batch", "concurrent"] = Field(
        default="concurrent",
        description="batch: one Batch API job per round (OpenAI-format); concurrent: parallel calls.",
    )
    trajectories_per_query: int = Field(default=2, ge=1, description="Teacher traces sampled per query.")
    max_rounds: int = Field(default=8, ge=1, description="Model turns per trajectory (one batch per round).")
    max_tokens: int = Field(default=2048, ge=16, description="Completion tokens per turn.")
    temperature: float = Field(default=0.7, ge=0.0, le=2.0, description="Sampling temperature.")
    max_batch_resubmits: int = Field(default=2, ge=0, description="Resubmissions of failed batch requests.")
    batch_poll_interval_s: float = Field(default=5.0, gt=0, description="First batch poll interval.")
    batch_poll_max_interval_s: float = Field(default=60.0, gt=0, description="Longest batch poll interval.")
    batch_timeout_s: float = Field(default=24 * 3600.0, gt=0, description="Give up on a batch after this.")
    min_ok_fraction: float = Field(
        default=0.5,
        ge=0,
        le=1,
        description="A round fails (not marked done; the rerun sends only its failed requests again) when fewer "
        "of its requests than this share succeeded after retries; above it a failed request ends its trajectory.",
    )
    write_reflections: bool = Field(
        default=True,
        description="After filtering, the teacher also writes a reflection on each accepted trajectory, in the "
        "meta-policy's exact prompt and format (table teacher_reflections): SFT examples of the reflection "
        "task and the seed of the reflection bank.",
    )
    reflection_prefixes: int = Field(
        default=1,
        ge=0,
        description="Extra teacher reflections per accepted trajectory, each on a seeded prefix of it (an attempt "
        "that stopped early), so SFT teaches the format for attempts of every length, not only finished ones.",
    )

    @model_validator(mode="after")
    def _batch_speaks_openai(self) -> Any:
        # the Batch API client uploads OpenAI-format JSONL through litellm's OpenAI files and batches calls
        provider = self.model.split("/", 1)[0] if "/" in self.model else ""
        if self.mode == "batch" and provider not in ("openai", "", "rubricem-teacher") and not self.api_base:
            raise ValueError(
                f"mode: batch sends OpenAI-format Batch API jobs, which {self.model!r} does not take (litellm's "
                "batch calls here speak OpenAI's format; the Gemini API's batch mode is not among them); use "
                "mode: concurrent, or an openai/ model or an OpenAI-compatible api_base"
            )
        return self

    # Error injection for the built-in teacher, so rejection filtering has real work to do.
    skip_stage_rate: float = Field(default=0.08, ge=0, le=1, description="Built-in: drop a stage.")
    malformed_call_rate: float = Field(default=0.05, ge=0, le=1, description="Built-in: malformed tool call.")
    uncited_rate: float = Field(default=0.05, ge=0, le=1, description="Built-in: answer without citations.")
    ungrounded_rate: float = Field(default=0.08, ge=0, le=1, description="Built-in: claim its source lacks.")
    style: Literal["full", "terse"] = Field(
        default="full",
        description="Built-in: how much each stage says. 'terse' keeps every tag, fact, check and source (the "
        "judge's stage rubrics score the same) in a shorter plan, state evaluations and review (the written text "
        "~20% shorter): shorter traces, so a CPU RL step trains on fewer tokens (the `learn` profile).",
    )


class JudgeConfig(EndpointConfig):
    model: str = Field(
        default="rubricem-judge/builtin",
        description="litellm model string. 'rubricem-judge/...' is the built-in checkable judge.",
    )
    temperature: float = Field(default=0.0, ge=0, le=2, description="Judge sampling temperature.")
    max_tokens: int = Field(default=4096, ge=64, description="Completion tokens per judge call.")
    max_new_rubrics_per_stage: int = Field(
        default=3,
        ge=0,
        description="Most adaptive rubrics generated per stage per step; the paper asks 1-4 per plan/research/review "
        "stage and 2-5 for the answer, capped by this (5 allows the paper's full ranges).",
    )
    cap_per_stage: int = Field(default=5, ge=1, description="Active adaptive rubrics kept per stage.")
    max_block_chars: int | None = Field(
        default=40_000,
        ge=1,
        description="Longest stage block (or answer) shown to the judge in characters; the middle of a longer one "
        "is cut. None: shown whole (the research profile; the judge model's context must hold a group).",
    )
    max_tokens_per_rubric: int = Field(
        default=0,
        ge=0,
        description="Size each scoring call's completion budget by its rubric count: max(max_tokens, 256 + this x "
        "rubrics), so a long rubric list is never cut mid-reply; 0: max_tokens for every call.",
    )
    show_reference: bool = Field(
        default=True,
        description="Show the judge each query's reference answer and spec. That is an answer key: the paper's judge "
        "sees the query, the rollout group and its rubric buffer only (false). The built-in judge needs the spec "
        "(true).",
    )
    min_judged_fraction: float = Field(
        default=0.5,
        ge=0,
        le=1,
        description="A step fails (no update, no checkpoint; a rerun re-judges it) when fewer of its rollouts "
        "than this share were judged; with 0 only a step where every judgment failed.",
    )
    structured_output: Literal["json_schema", "json_object", "none"] = Field(
        default="json_schema", description="How JSON replies are requested from the provider."
    )
    stream: bool = Field(
        default=True,
        description="Judge each query's group as soon as it has finished sampling, while the other groups still "
        "sample (rubric generation, then its scoring calls). The judge tables are the same as with false (the "
        "judge task then judges every group after the last rollout); a rerun whose rollouts are already written "
        "judges after them.",
    )

    @model_validator(mode="after")
    def _builtin_needs_reference(self) -> Any:
        # the built-in judge's checks read the query spec (the subjects a conclusion picks between)
        if self.model.startswith("rubricem-judge/") and not self.show_reference:
            raise ValueError(
                f"judge.show_reference=false needs an LLM judge: the built-in judge {self.model!r} "
                "reads the query spec; set judge.show_reference=true or judge.model to an LLM"
            )
        return self
