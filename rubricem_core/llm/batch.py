"""OpenAI-format Batch API client (through litellm's files and batches calls).

One ``run`` uploads all requests as one JSONL file, creates a batch, reports its id through
``on_submitted`` (so a caller can persist it and re-attach after a crash with ``resume_batch_id``
instead of paying twice), polls with a growing interval, downloads the output and error files and
turns every line into a ``ChatResult``. Requests that failed for a transient reason (server error,
rate limit, expired batch, malformed output) go into a new batch holding only them, up to
``settings.max_batch_resubmits`` times; after that they are returned as failed.

The file and batch calls themselves are retried on 429/5xx, a 429's Retry-After waited out (one longer
than ``backoff_max_s`` fails the call); ``stats`` counts those retries, 429s and seconds slept, and each
result its rate-limited lines (``rate_limited``) and batches (``attempts``).

Terminal batch statuses: ``completed``; ``expired`` and ``failed`` (partial output kept, the rest
resubmitted); ``cancelled`` (partial output kept, the rest failed without resubmission: a cancel
is a deliberate stop).
"""

from __future__ import annotations

import json
import logging
import re
import time
from collections import Counter, defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from rubricem_core.llm._litellm import litellm
from rubricem_core.llm.concurrent import error_status, error_text, is_retryable_error, retry_after_s, retry_delay
from rubricem_core.llm.cost import call_cost
from rubricem_core.llm.types import (
    ChatRequest,
    ChatResult,
    EndpointSettings,
    RetryStats,
    content_problem,
    validate_requests,
)

log = logging.getLogger(__name__)

T = TypeVar("T")

CHAT_ENDPOINT = "/v1/chat/completions"
TERMINAL_STATUSES = frozenset({"completed", "expired", "failed", "cancelled"})
# Per-line error codes worth a new batch; anything else (invalid request, cancelled) is final.
RETRYABLE_LINE_CODES = frozenset(
    {"server_error", "rate_limit_exceeded", "batch_expired", "timeout", "internal_error", "service_unavailable"}
)
_CUSTOM_ID_IN_BROKEN_LINE = re.compile(r'"custom_id"\s*:\s*"((?:[^"\\]|\\.)*)"')


class BatchError(RuntimeError):
    """The batch as a whole could not be uploaded, created, polled or downloaded."""


class BatchTimeoutError(BatchError):
    """A batch did not reach a terminal status within ``batch_timeout_s``.

    The batch is left running: pass ``batch_id`` as ``resume_batch_id`` to collect it later.
    """

    def __init__(self, batch_id: str, waited_s: float, last_status: str | None) -> None:
        super().__init__(
            f"batch {batch_id} not finished after {waited_s:.1f}s (last status: {last_status}); "
            f"resume it with resume_batch_id={batch_id!r}"
        )
        self.batch_id = batch_id
        self.waited_s = waited_s
        self.last_status = last_status


@dataclass
class _LineOutcome:
    result: ChatResult
    retryable: bool
    rate_limited: int = 0  # 1: the line failed on the provider's rate limit


def _field(obj: Any, name: str) -> Any:
    """Attribute or key access: litellm returns pydantic objects, tests may hand in dicts."""
    if isinstance(obj, dict):
        return obj.get(name)
    return getattr(obj, name, None)


def _batch_errors_text(batch: Any) -> str:
    errors = _field(batch, "errors")
    data = _field(errors, "data") if errors is not None else None
    messages = [f"{_field(item, 'code')}: {_field(item, 'message')}" for item in (data or [])]
    return "; ".join(messages) or "no error details"


class BatchClient:
    """Runs chat requests through one provider's Batch API; see the module docstring."""

    def __init__(
        self,
        settings: EndpointSettings,
        provider: str = "openai",
        sleep: Callable[[float], None] = time.sleep,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.settings = settings
        self.provider = provider
        self._sleep = sleep
        self._clock = clock
        self.stats = RetryStats()  # the file and batch calls' retries, 429s and backoff sleeps

    # ---- public ----------------------------------------------------------------------------
    def run(
        self,
        requests: list[ChatRequest],
        resume_batch_id: str | None = None,
        on_submitted: Callable[[str], None] | None = None,
    ) -> list[ChatResult]:
        """Answer every request (in request order); failed ones carry their error.

        With ``resume_batch_id`` the first round re-attaches to that batch instead of uploading;
        requests it does not answer are sent in a new batch.
        """
        requests = list(requests)
        validate_requests(requests, self.settings)
        pending: dict[str, ChatRequest] = {request.custom_id: request for request in requests}
        final: dict[str, ChatResult] = {}
        batches_seen: Counter[str] = Counter()
        paid_usd: defaultdict[str, float] = defaultdict(float)
        first_sent: dict[str, float] = {}
        rate_limited: Counter[str] = Counter()
        batch_id = resume_batch_id
        resubmits = 0
        while pending:
            if batch_id is None:
                batch_id = self._submit(list(pending.values()))
                if on_submitted is not None:
                    on_submitted(batch_id)
            now = self._clock()
            for custom_id in pending:
                batches_seen[custom_id] += 1
                first_sent.setdefault(custom_id, now)
            batch = self._wait(batch_id)
            outcomes = self._collect(batch, batch_id, pending)
            finished_at = self._clock()
            retry: dict[str, ChatRequest] = {}
            for custom_id, request in pending.items():
                outcome = outcomes[custom_id]
                result = outcome.result
                paid_usd[custom_id] += result.cost_usd
                result.cost_usd = paid_usd[custom_id]
                result.attempts = batches_seen[custom_id]
                result.latency_s = finished_at - first_sent[custom_id]
                result.batch_id = batch_id
                rate_limited[custom_id] += outcome.rate_limited
                result.rate_limited = rate_limited[custom_id]
                if result.ok or not outcome.retryable or resubmits >= self.settings.max_batch_resubmits:
                    if not result.ok and outcome.retryable:
                        result.error = f"{result.error} (gave up after {result.attempts} batches)"
                    final[custom_id] = result
                else:
                    retry[custom_id] = request
            if retry:
                log.info(
                    "batch %s: %d of %d requests failed transiently; resubmitting them",
                    batch_id,
                    len(retry),
                    len(pending),
                )
                resubmits += 1
            pending = retry
            batch_id = None
        return [final[request.custom_id] for request in requests]

    # ---- steps -----------------------------------------------------------------------------
    def _connection(self) -> dict[str, Any]:
        kwargs = {key: value for key, value in self.settings.call_kwargs().items() if key != "custom_llm_provider"}
        return {
            **kwargs,
            "custom_llm_provider": self.provider,
            "timeout": self.settings.timeout_s,
            "max_retries": 0,  # retries happen in _with_retries, with our backoff
        }

    def _with_retries(self, what: str, call: Callable[[], T], retry_on: Callable[[BaseException], bool]) -> T:
        attempt = 0
        while True:
            attempt += 1
            try:
                return call()
            except Exception as exc:
                hint = retry_after_s(exc) if error_status(exc) == 429 else None
                self.stats.add_retries(0, int(error_status(exc) == 429), 0.0)
                if not retry_on(exc) or attempt > self.settings.max_retries:
                    raise BatchError(error_text(exc, self.settings, context=f"{what}: ")) from exc
                if hint is not None and hint > self.settings.backoff_max_s:
                    raise BatchError(
                        error_text(exc, self.settings, context=f"{what}: ")
                        + f" (the endpoint asks to wait {hint:.0f}s, more than backoff_max_s="
                        f"{self.settings.backoff_max_s:g})"
                    ) from exc
                delay = retry_delay(exc, attempt, self.settings, hint)
                self.stats.add_retries(1, 0, delay)
                self._sleep(delay)

    def body_model(self, request: ChatRequest) -> str:
        """The model name the provider expects inside a batch line (no litellm provider prefix)."""
        model = request.resolved_model(self.settings)
        prefix = f"{self.provider}/"
        return model[len(prefix) :] if model.startswith(prefix) else model

    def jsonl_bytes(self, requests: list[ChatRequest]) -> bytes:
        lines = []
        for request in requests:
            body = {"model": self.body_model(request), "messages": request.messages, **request.sampling_params()}
            lines.append(
                json.dumps(
                    {"custom_id": request.custom_id, "method": "POST", "url": CHAT_ENDPOINT, "body": body},
                    ensure_ascii=False,
                )
            )
        return ("\n".join(lines) + "\n").encode("utf-8")

    def _submit(self, requests: list[ChatRequest]) -> str:
        data = self.jsonl_bytes(requests)
        connection = self._connection()
        uploaded = self._with_retries(
            "uploading the batch input file",
            lambda: litellm.create_file(file=("rubricem_batch.jsonl", data), purpose="batch", **connection),
            is_retryable_error,
        )

        # A timed-out create may still have created the batch; retrying then could pay twice, so
        # only retry answers that say for sure nothing was created (rate limit, server error).
        def surely_not_created(exc: BaseException) -> bool:
            status = error_status(exc)
            return status is not None and (status == 429 or status >= 500) and is_retryable_error(exc)

        batch = self._with_retries(
            "creating the batch",
            lambda: litellm.create_batch(
                completion_window=self.settings.completion_window,
                endpoint=CHAT_ENDPOINT,
                input_file_id=uploaded.id,
                **connection,
            ),
            surely_not_created,
        )
        log.info("submitted batch %s with %d requests (input file %s)", batch.id, len(requests), uploaded.id)
        return str(batch.id)

    def _wait(self, batch_id: str) -> Any:
        """Poll until the batch is terminal; transient polling errors are tolerated until the deadline."""
        started = self._clock()
        interval = self.settings.batch_poll_interval_s
        last_status: str | None = None
        connection = self._connection()
        while True:
            try:
                batch = litellm.retrieve_batch(batch_id=batch_id, **connection)
            except Exception as exc:
                if not is_retryable_error(exc):
                    raise BatchError(error_text(exc, self.settings, context=f"polling batch {batch_id}: ")) from exc
                self.stats.add_retries(0, int(error_status(exc) == 429), 0.0)
                log.warning("polling batch %s failed transiently: %s", batch_id, type(exc).__name__)
            else:
                status = str(_field(batch, "status"))
                if status != last_status:
                    log.info("batch %s: %s", batch_id, status)
                    last_status = status
                if status in TERMINAL_STATUSES:
                    return batch
            waited = self._clock() - started
            remaining = self.settings.batch_timeout_s - waited
            if remaining <= 0:
                raise BatchTimeoutError(batch_id, waited, last_status)
            self._sleep(min(interval, remaining))
            interval = min(interval * 1.5, self.settings.batch_poll_max_interval_s)

    def _download(self, file_id: str) -> str:
        connection = self._connection()
        content = self._with_retries(
            f"downloading batch file {file_id}",
            lambda: litellm.file_content(file_id=file_id, **connection),
            is_retryable_error,
        )
        raw = content.content if hasattr(content, "content") else content
        if isinstance(raw, str):
            return raw
        return bytes(raw).decode("utf-8", errors="replace")

    def _collect(self, batch: Any, batch_id: str, pending: dict[str, ChatRequest]) -> dict[str, _LineOutcome]:
        """An outcome for every pending request, from the batch's files or its final status."""
        outcomes: dict[str, _LineOutcome] = {}
        for file_field in ("output_file_id", "error_file_id"):
            file_id = _field(batch, file_field)
            if not file_id:
                continue
            for line in self._download(str(file_id)).splitlines():
                if not line.strip():
                    continue
                parsed = self._parse_line(line, batch_id, pending)
                if parsed is None:
                    continue
                custom_id, outcome = parsed
                # A request answered in the output file wins over a duplicate entry in the error file.
                if custom_id not in outcomes or (outcome.result.ok and not outcomes[custom_id].result.ok):
                    outcomes[custom_id] = outcome
        status = str(_field(batch, "status"))
        if status == "failed":
            reason, retryable = f"batch failed: {_batch_errors_text(batch)}", True
        elif status == "cancelled":
            reason, retryable = "batch was cancelled before this request ran", False
        elif status == "expired":
            reason, retryable = "batch expired before this request ran", True
        else:
            reason, retryable = "batch finished without a result line for this request", True
        for custom_id in pending:
            if custom_id not in outcomes:
                outcomes[custom_id] = _LineOutcome(
                    self._failed(custom_id, batch_id, f"{reason} (status {status})"), retryable
                )
        return outcomes

    def _failed(self, custom_id: str, batch_id: str, reason: str, **fields: Any) -> ChatResult:
        return ChatResult(
            custom_id=custom_id,
            status="failed",
            error=f"request {custom_id!r} in batch {batch_id}: {reason}",
            batch_id=batch_id,
            **fields,
        )

    def _parse_line(self, line: str, batch_id: str, pending: dict[str, ChatRequest]) -> tuple[str, _LineOutcome] | None:
        try:
            record = json.loads(line)
            if not isinstance(record, dict):
                raise ValueError("line is not a JSON object")
        except ValueError:
            match = _CUSTOM_ID_IN_BROKEN_LINE.search(line)
            custom_id = json.loads(f'"{match.group(1)}"') if match else None
            if custom_id not in pending:
                log.warning("batch %s: unparseable output line without a known custom_id", batch_id)
                return None
            return custom_id, _LineOutcome(self._failed(custom_id, batch_id, "malformed output line"), True)
        custom_id = record.get("custom_id")
        if custom_id not in pending:
            log.warning("batch %s: output line for unknown custom_id %r ignored", batch_id, custom_id)
            return None
        raw_response = record.get("response")
        response: dict[str, Any] = raw_response if isinstance(raw_response, dict) else {}
        status_code = response.get("status_code")
        error = record.get("error")
        if status_code is not None and status_code != 200:
            raw_body, raw_detail = response.get("body"), None
            body: dict[str, Any] = raw_body if isinstance(raw_body, dict) else {}
            raw_detail = body.get("error")
            detail: dict[str, Any] = raw_detail if isinstance(raw_detail, dict) else {}
            message = detail.get("message") or json.dumps(body)[:500]
            retryable = status_code in (408, 409, 429) or status_code >= 500
            return custom_id, _LineOutcome(
                self._failed(custom_id, batch_id, f"status {status_code}: {message}"),
                retryable,
                int(status_code == 429),
            )
        if error:
            code = error.get("code") if isinstance(error, dict) else None
            message = error.get("message") if isinstance(error, dict) else str(error)
            return custom_id, _LineOutcome(
                self._failed(custom_id, batch_id, f"error {code}: {message}"),
                code in RETRYABLE_LINE_CODES,
                int(code == "rate_limit_exceeded"),
            )
        return custom_id, self._parse_response_body(custom_id, batch_id, pending[custom_id], response.get("body"))

    def _parse_response_body(self, custom_id: str, batch_id: str, request: ChatRequest, body: Any) -> _LineOutcome:
        try:
            choice = body["choices"][0]
            text = choice["message"]["content"]
            finish_reason = choice.get("finish_reason")
            usage = body.get("usage") or {}
            prompt_tokens = int(usage.get("prompt_tokens") or 0)
            completion_tokens = int(usage.get("completion_tokens") or 0)
        except (KeyError, IndexError, TypeError, ValueError, AttributeError) as exc:
            return _LineOutcome(self._failed(custom_id, batch_id, f"malformed response body ({exc!r})"), True)
        cost = call_cost(
            request.resolved_model(self.settings), prompt_tokens, completion_tokens, self.settings, batch=True
        )
        problem = content_problem(request, text)
        if problem:
            return _LineOutcome(
                self._failed(
                    custom_id,
                    batch_id,
                    problem,
                    finish_reason=finish_reason,
                    text=text if isinstance(text, str) else None,
                    prompt_tokens=prompt_tokens,
                    completion_tokens=completion_tokens,
                    cost_usd=cost,
                ),
                True,
            )
        return _LineOutcome(
            ChatResult(
                custom_id=custom_id,
                status="ok",
                text=text,
                finish_reason=finish_reason,
                prompt_tokens=prompt_tokens,
                completion_tokens=completion_tokens,
                cost_usd=cost,
                batch_id=batch_id,
            ),
            False,
        )
