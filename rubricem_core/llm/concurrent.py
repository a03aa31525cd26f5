"""Many chat calls at once through ``litellm.acompletion``, for providers without a Batch API.

Bounded concurrency (a fixed pool of workers), a per-call timeout, and retries with exponential
backoff and full jitter on transient errors (429, 5xx, timeouts, connection errors). Client errors
(400, 401, 403, 404, ...) fail at once. One bad request never raises: it comes back as a
``ChatResult`` with status "failed". Results are returned in request order.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import random
import time
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

import httpx
import openai

from rubricem_core.llm._litellm import litellm
from rubricem_core.llm.cost import call_cost
from rubricem_core.llm.types import ChatRequest, ChatResult, EndpointSettings, content_problem, validate_requests
from rubricem_core.redact import MASK, redact_text

log = logging.getLogger(__name__)

ResultCallback = Callable[[ChatResult], None]
T = TypeVar("T")

# 408 request timeout and 409 conflict are transient at OpenAI-style endpoints as well.
RETRYABLE_STATUS = frozenset({408, 409, 429})
MAX_ERROR_CHARS = 2000


def error_status(exc: BaseException) -> int | None:
    status = getattr(exc, "status_code", None)
    return status if isinstance(status, int) else None


def is_retryable_error(exc: BaseException) -> bool:
    """True for errors worth another try: rate limits, server errors, timeouts, lost connections."""
    if isinstance(
        exc, (asyncio.TimeoutError, TimeoutError, ConnectionError, httpx.TransportError, openai.APIConnectionError)
    ):  # APIConnectionError covers APITimeoutError
        return True
    status = error_status(exc)
    if status is None:
        return False
    return status in RETRYABLE_STATUS or status >= 500


def error_text(exc: BaseException, settings: EndpointSettings, context: str = "") -> str:
    """A one-line description of an error, with the API key and URL credentials scrubbed out just in case."""
    status = error_status(exc)
    kind = type(exc).__name__
    if isinstance(exc, (asyncio.TimeoutError, TimeoutError)):
        message = f"timed out after {settings.timeout_s:g}s"
    else:
        message = " ".join(str(exc).split())
    head = f"{kind} (status {status})" if status is not None else kind
    text = f"{context}{head}: {message}" if message else f"{context}{head}"
    if settings.api_key:
        text = text.replace(settings.api_key, MASK)
    if settings.api_base:  # it may carry credentials (https://user:pass@host)
        text = text.replace(settings.api_base, redact_text(settings.api_base))
    return redact_text(text)[:MAX_ERROR_CHARS]


def backoff_delay(attempt: int, settings: EndpointSettings, rng: random.Random | None = None) -> float:
    """Full-jitter exponential backoff for retry number ``attempt`` (1 = the first retry)."""
    ceiling = min(settings.backoff_max_s, settings.backoff_base_s * (2 ** max(attempt - 1, 0)))
    return (rng or random).uniform(0.0, ceiling)


def _retry_after_s(exc: BaseException) -> float | None:
    """The server's Retry-After hint in seconds, when a 429 carries one."""
    response = getattr(exc, "response", None)
    headers = getattr(response, "headers", None)
    if headers is None:
        return None
    try:
        value = headers.get("retry-after")
        return float(value) if value is not None else None
    except (TypeError, ValueError):
        return None


def _result_from_response(
    request: ChatRequest, response: Any, settings: EndpointSettings, model: str, attempts: int, started: float
) -> ChatResult:
    choice = response.choices[0]
    text = choice.message.content
    usage = getattr(response, "usage", None)
    prompt_tokens = int(getattr(usage, "prompt_tokens", 0) or 0)
    completion_tokens = int(getattr(usage, "completion_tokens", 0) or 0)
    problem = content_problem(request, text)
    return ChatResult(
        custom_id=request.custom_id,
        status="failed" if problem else "ok",
        text=text if isinstance(text, str) else None,
        finish_reason=choice.finish_reason,
        error=f"request {request.custom_id!r}: {problem}" if problem else None,
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        cost_usd=call_cost(model, prompt_tokens, completion_tokens, settings, batch=False),
        attempts=attempts,
        latency_s=time.monotonic() - started,
    )


async def _call_with_retries(request: ChatRequest, settings: EndpointSettings) -> ChatResult:
    model = request.resolved_model(settings)
    kwargs = {
        "model": model,
        "messages": request.messages,
        **request.sampling_params(),
        **settings.call_kwargs(),
        "timeout": settings.timeout_s,
        "max_retries": 0,  # retries happen here, with our backoff; the SDK must not add its own
        "num_retries": 0,
    }
    started = time.monotonic()
    attempts = 0
    paid_usd = 0.0  # answered-but-unusable attempts cost money too
    while True:
        attempts += 1
        try:
            # wait_for bounds in-process providers too, which ignore the timeout kwarg.
            response = await asyncio.wait_for(litellm.acompletion(**kwargs), timeout=settings.timeout_s)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            retryable = is_retryable_error(exc)
            if not retryable or attempts > settings.max_retries:
                suffix = f" (gave up after {attempts} attempts)" if retryable else ""
                return ChatResult(
                    custom_id=request.custom_id,
                    status="failed",
                    error=error_text(exc, settings, context=f"request {request.custom_id!r}: ") + suffix,
                    cost_usd=paid_usd,
                    attempts=attempts,
                    latency_s=time.monotonic() - started,
                )
            delay = backoff_delay(attempts, settings)
            hint = _retry_after_s(exc) if error_status(exc) == 429 else None
            if hint is not None:
                delay = min(max(delay, hint), settings.backoff_max_s)
            log.debug(
                "request %r attempt %d failed (%s); retrying in %.2fs",
                request.custom_id,
                attempts,
                type(exc).__name__,
                delay,
            )
            await asyncio.sleep(delay)
            continue
        result = _result_from_response(request, response, settings, model, attempts, started)
        paid_usd += result.cost_usd
        result.cost_usd = paid_usd
        # Unusable content (e.g. JSON that does not parse) may come out fine when sampled again.
        if result.ok or attempts > settings.max_retries:
            return result
        log.debug("request %r attempt %d: %s; retrying", request.custom_id, attempts, result.error)


async def arun_concurrent(
    requests: list[ChatRequest],
    settings: EndpointSettings,
    on_result: ResultCallback | None = None,
    limit: asyncio.Semaphore | None = None,
) -> list[ChatResult]:
    """Answer every request; at most ``settings.max_concurrency`` calls are in flight at once, and with
    ``limit`` (a semaphore shared by concurrent ``arun_concurrent`` calls on one loop) at most its value
    over all of them."""
    requests = list(requests)
    validate_requests(requests, settings)
    results: list[ChatResult | None] = [None] * len(requests)
    next_index = iter(range(len(requests)))

    async def call(request: ChatRequest) -> ChatResult:
        if limit is None:
            return await _call_with_retries(request, settings)
        async with limit:
            return await _call_with_retries(request, settings)

    async def worker() -> None:
        # A fixed pool pulling from a shared iterator keeps memory flat for very large request lists.
        for index in next_index:
            result = await call(requests[index])
            results[index] = result
            if on_result is not None:
                on_result(result)

    try:
        async with asyncio.TaskGroup() as group:
            for _ in range(min(settings.max_concurrency, len(requests))):
                group.create_task(worker())
    except BaseExceptionGroup as group_error:
        # Only on_result can raise here (request errors become results): surface it unwrapped.
        raise group_error.exceptions[0] from group_error
    return [result for result in results if result is not None]


def run_concurrent(
    requests: list[ChatRequest],
    settings: EndpointSettings,
    on_result: ResultCallback | None = None,
) -> list[ChatResult]:
    """Synchronous ``arun_concurrent``; safe to call from code that already runs an event loop."""
    return run_sync(arun_concurrent(requests, settings, on_result))


def run_sync(coroutine: Coroutine[Any, Any, T]) -> T:
    """Run ``coroutine`` to the end from synchronous code, also from code that already runs an event loop."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coroutine)
    # Inside a running loop (an async Prefect task, a notebook) asyncio.run would fail: use a thread.
    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(asyncio.run, coroutine).result()
