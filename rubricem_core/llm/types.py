"""Plain data types shared by the LLM clients (concurrent runner, Batch API client, providers).

A ``ChatRequest`` is what the teacher or the judge wants answered; a ``ChatResult`` is what came
back, one per request, never an exception. ``EndpointSettings`` says where and how to call.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Literal

ResultStatus = Literal["ok", "failed"]


class LLMSettingsError(ValueError):
    """An ``EndpointSettings`` field has an invalid value."""


class LLMRequestError(ValueError):
    """A list of ``ChatRequest`` cannot be sent as given (duplicate or empty custom_id, no model...)."""


@dataclass
class ChatRequest:
    """One chat-completion call, identified by ``custom_id`` (unique within one run of a client)."""

    custom_id: str
    model: str  # litellm model string ("openai/gpt-4o-mini", "teacher/builtin"); "" = the settings' model
    messages: list[dict[str, Any]]
    stop: list[str] | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    seed: int | None = None
    response_format: dict[str, Any] | None = None  # e.g. {"type": "json_object"} for JSON calls
    metadata: dict[str, Any] = field(default_factory=dict)  # caller bookkeeping; never sent

    def resolved_model(self, settings: EndpointSettings) -> str:
        return self.model or settings.model

    def sampling_params(self) -> dict[str, Any]:
        """The optional OpenAI body fields that are set (None means: provider default)."""
        params: dict[str, Any] = {
            "stop": list(self.stop) if self.stop else None,
            "max_tokens": self.max_tokens,
            "temperature": self.temperature,
            "seed": self.seed,
            "response_format": self.response_format,
        }
        return {key: value for key, value in params.items() if value is not None}


@dataclass
class ChatResult:
    """The outcome of one ``ChatRequest``; ``status == "failed"`` carries the reason in ``error``."""

    custom_id: str
    status: ResultStatus
    text: str | None = None
    finish_reason: str | None = None
    error: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cost_usd: float = 0.0
    attempts: int = 0  # calls made (concurrent path) or batches the request was part of (batch path)
    latency_s: float = 0.0  # wall time from the first attempt to the final outcome
    batch_id: str | None = None  # the batch whose output decided this result (batch path only)
    rate_limited: int = 0  # 429 answers (rate-limited batch lines) this request got before its outcome
    wait_s: float = 0.0  # seconds it slept on backoff, a Retry-After or its token budget

    @property
    def retries(self) -> int:
        """Calls (batches) sent again after the first: failures retried and unusable replies resampled."""
        return max(self.attempts - 1, 0)

    @property
    def ok(self) -> bool:
        return self.status == "ok"


@dataclass
class RetryStats:
    """How hard an endpoint pushed back: retries, 429s seen and seconds slept (``llm_*`` metrics)."""

    retries: int = 0  # calls sent again (failures retried, unusable replies resampled, batches resubmitted)
    rate_limited: int = 0  # 429 answers (and rate-limited batch lines)
    wait_s: float = 0.0  # seconds slept on backoff, Retry-After and the token budget

    def add_retries(self, retries: int, rate_limited: int, wait_s: float) -> None:
        self.retries += retries
        self.rate_limited += rate_limited
        self.wait_s += wait_s

    def add_result_retries(self, result: ChatResult) -> None:
        self.add_retries(result.retries, result.rate_limited, result.wait_s)

    def retry_metrics(self, prefix: str) -> dict[str, float]:
        return {
            f"{prefix}llm_retries": float(self.retries),
            f"{prefix}llm_rate_limited": float(self.rate_limited),
            f"{prefix}llm_wait_seconds": float(self.wait_s),
        }


@dataclass
class Traffic(RetryStats):
    """HTTP attempts, tokens and dollars of the calls a client made; callers' usage records extend it."""

    attempts: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cost_usd: float = 0.0

    def add_traffic(self, prompt_tokens: int, completion_tokens: int, cost_usd: float, attempts: int) -> None:
        self.attempts += attempts
        self.prompt_tokens += prompt_tokens
        self.completion_tokens += completion_tokens
        self.cost_usd += cost_usd

    def add_result(self, result: ChatResult) -> None:
        """The traffic of one answered call (repairs are billed like first tries)."""
        self.add_traffic(result.prompt_tokens, result.completion_tokens, result.cost_usd, result.attempts)
        self.add_result_retries(result)


@dataclass
class CallUsage(Traffic):
    """``Traffic`` of a caller with one kind of call, and its logical calls, repairs and failed calls."""

    calls: int = 0
    repairs: int = 0  # a repair re-asks one call with its validation error
    failed_calls: int = 0

    def record(self, result: ChatResult, repair: bool) -> None:
        if repair:
            self.repairs += 1
        else:
            self.calls += 1
        self.add_result(result)


@dataclass
class EndpointSettings:
    """How to reach one model endpoint; shared by the concurrent runner and the Batch API client."""

    model: str
    api_base: str | None = field(default=None, repr=False)  # None = the provider's default; may hold credentials
    api_key: str | None = field(default=None, repr=False)  # resolved by the caller; never logged
    custom_llm_provider: str | None = None
    timeout_s: float = 120.0
    max_retries: int = 5
    backoff_base_s: float = 1.0
    backoff_max_s: float = 60.0
    max_concurrency: int = 8  # the most calls in flight; under 429s the runner keeps fewer (AIMD)
    max_tokens_per_minute: int | None = None  # client-side token budget (prompt chars/4 + max_tokens per call)
    # False: a fixed pool of max_concurrency calls, each backing off alone (the runner before #34;
    # bench/load_judge.py --no-adaptive); True: one in-flight limit per endpoint (concurrent.py).
    adaptive_concurrency: bool = True
    batch_poll_interval_s: float = 10.0
    batch_poll_max_interval_s: float = 300.0
    batch_timeout_s: float = 26 * 3600.0  # a 24 h completion window plus the time to finalize
    max_batch_resubmits: int = 2
    completion_window: str = "24h"
    input_cost_per_token: float | None = None  # for models missing from litellm's cost map
    output_cost_per_token: float | None = None
    batch_discount: float = 0.5  # price factor of the Batch API relative to synchronous calls

    def __post_init__(self) -> None:
        if not isinstance(self.model, str) or not self.model:
            raise LLMSettingsError("EndpointSettings.model must be a non-empty string")
        positive = (
            "timeout_s",
            "backoff_max_s",
            "batch_poll_interval_s",
            "batch_poll_max_interval_s",
            "batch_timeout_s",
        )
        for name in positive:
            if not getattr(self, name) > 0:
                raise LLMSettingsError(f"EndpointSettings.{name} must be > 0, got {getattr(self, name)!r}")
        for name in ("max_retries", "max_batch_resubmits"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 0:
                raise LLMSettingsError(f"EndpointSettings.{name} must be an int >= 0, got {value!r}")
        if not isinstance(self.max_concurrency, int) or self.max_concurrency < 1:
            raise LLMSettingsError(
                f"EndpointSettings.max_concurrency must be an int >= 1, got {self.max_concurrency!r}"
            )
        tpm = self.max_tokens_per_minute
        if tpm is not None and (not isinstance(tpm, int) or tpm < 1):
            raise LLMSettingsError(f"EndpointSettings.max_tokens_per_minute must be None or an int >= 1, got {tpm!r}")
        if self.backoff_base_s < 0:
            raise LLMSettingsError(f"EndpointSettings.backoff_base_s must be >= 0, got {self.backoff_base_s!r}")
        if self.batch_poll_max_interval_s < self.batch_poll_interval_s:
            raise LLMSettingsError("EndpointSettings.batch_poll_max_interval_s must be >= batch_poll_interval_s")
        if not 0.0 <= self.batch_discount <= 1.0:
            raise LLMSettingsError(f"EndpointSettings.batch_discount must be in [0, 1], got {self.batch_discount!r}")
        for name in ("input_cost_per_token", "output_cost_per_token"):
            value = getattr(self, name)
            if value is not None and value < 0:
                raise LLMSettingsError(f"EndpointSettings.{name} must be >= 0, got {value!r}")

    def call_kwargs(self) -> dict[str, Any]:
        """Connection kwargs for litellm calls; holds the key, so never log the returned dict."""
        kwargs: dict[str, Any] = {}
        if self.api_base is not None:
            kwargs["api_base"] = self.api_base
        if self.api_key is not None:
            kwargs["api_key"] = self.api_key
        if self.custom_llm_provider is not None:
            kwargs["custom_llm_provider"] = self.custom_llm_provider
        return kwargs


def message_text(content: Any) -> str:
    """The text of a message ``content``: a string, or OpenAI's list of typed parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = [part.get("text", "") for part in content if isinstance(part, dict)]
        return " ".join(part for part in parts if isinstance(part, str))
    return str(content)


def validate_requests(requests: list[ChatRequest], settings: EndpointSettings) -> None:
    """Reject input that would make results ambiguous: results are matched back by custom_id."""
    seen: set[str] = set()
    for index, request in enumerate(requests):
        if not isinstance(request, ChatRequest):
            raise LLMRequestError(f"requests[{index}] is {type(request).__name__}, expected ChatRequest")
        if not isinstance(request.custom_id, str) or not request.custom_id:
            raise LLMRequestError(f"requests[{index}].custom_id must be a non-empty string")
        if request.custom_id in seen:
            raise LLMRequestError(f"duplicate custom_id {request.custom_id!r} (requests[{index}])")
        seen.add(request.custom_id)
        if not request.messages:
            raise LLMRequestError(f"request {request.custom_id!r}: messages is empty")
        if not request.resolved_model(settings):
            raise LLMRequestError(f"request {request.custom_id!r}: no model")


def wants_json(request: ChatRequest) -> bool:
    kind = (request.response_format or {}).get("type")
    return kind in ("json_object", "json_schema")


def content_problem(request: ChatRequest, text: Any) -> str | None:
    """Why a returned message content is unusable for this request, or None when it is fine.

    A JSON call whose content does not parse is as useless to the judge as a failed call, so it is
    reported (and retried) as a failure rather than handed on.
    """
    if not isinstance(text, str):
        return f"response has no text content (got {type(text).__name__})"
    if wants_json(request):
        try:
            json.loads(text)
        except json.JSONDecodeError as exc:
            return f"response_format asks for JSON but the content does not parse: {exc}"
    return None
