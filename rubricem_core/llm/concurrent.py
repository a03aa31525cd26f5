"""Many chat calls at once through ``litellm.acompletion``, for providers without a Batch API.

Bounded concurrency (a fixed pool of workers), a per-call timeout, and retries with exponential
backoff and full jitter on transient errors (429, 5xx, timeouts, connection errors). Client errors
(400, 401, 403, 404, ...) fail at once. One bad request never raises: it comes back as a
``ChatResult`` with status "failed". Results are returned in request order.

Rate limits (``EndpointSettings.adaptive_concurrency``, on by default): all calls to one endpoint (base URL,
provider, model and key) share an ``EndpointState``. Its in-flight limit starts at ``SLOW_START_LIMIT``,
grows by one per success until the first 429 and by about one per ``limit`` successes after it, and halves
on a 429 (once per round of calls; never below 1 nor above ``max_concurrency``): an endpoint that limits
sees fewer calls at once instead of retries piling up. A 429's ``retry-after-ms`` or ``Retry-After``
(seconds or an HTTP-date) delays the refused call's retry until then and nothing else: the calls the
endpoint is serving go on, and the lower limit is what keeps new ones from piling up (a shared pause
stalled a concurrency-capped endpoint's every slot for each 429, 1.8x the ideal wall time). A hint longer
than ``backoff_max_s`` fails the call at once (a quota, not a burst). An
optional ``max_tokens_per_minute`` budget spaces calls by their estimated tokens. Each result reports its
429s and the seconds it slept (``rate_limited``, ``wait_s``); callers sum them into ``llm_*`` metrics.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import datetime
import email.utils
import hashlib
import logging
import math
import random
import threading
import time
import weakref
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any, TypeVar

import httpx
import openai

from rubricem_core.llm._litellm import litellm
from rubricem_core.llm.cost import call_cost
from rubricem_core.llm.types import (
    ChatRequest,
    ChatResult,
    EndpointSettings,
    content_problem,
    message_text,
    validate_requests,
)
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


def _headers(exc: BaseException) -> Any:
    """The HTTP response headers an error carries (litellm keeps them on ``response`` or apart)."""
    headers = getattr(getattr(exc, "response", None), "headers", None)
    if headers is None:
        headers = getattr(exc, "litellm_response_headers", None)
    return headers


def retry_after_s(exc: BaseException, now: float | None = None) -> float | None:
    """How long the server asks to wait before the next call, from ``retry-after-ms`` (milliseconds) or
    ``Retry-After`` (seconds, or an HTTP-date); None when the error says nothing usable."""
    headers = _headers(exc)
    if headers is None:
        return None
    try:
        millis = headers.get("retry-after-ms")
        if millis is not None:
            return max(float(millis) / 1000.0, 0.0)
    except (TypeError, ValueError, AttributeError):
        pass
    try:
        value = headers.get("retry-after")
    except AttributeError:
        return None
    if value is None:
        return None
    try:
        return max(float(value), 0.0)
    except (TypeError, ValueError):
        pass
    try:
        when = email.utils.parsedate_to_datetime(str(value))
    except (TypeError, ValueError, IndexError):
        return None
    if when.tzinfo is None:  # an HTTP-date is GMT by definition
        when = when.replace(tzinfo=datetime.UTC)
    return max(when.timestamp() - (time.time() if now is None else now), 0.0)


def retry_delay(exc: BaseException, attempt: int, settings: EndpointSettings, hint: float | None) -> float:
    """Seconds before retry ``attempt`` of a failed call: the server's hint, up to 10% later so the calls
    it held back do not all come back at once, else full-jitter exponential backoff."""
    if hint is not None:
        return hint * random.uniform(1.0, 1.1)
    return backoff_delay(attempt, settings)


def estimate_tokens(request: ChatRequest) -> int:
    """A call's tokens before it is made, for the tokens-per-minute budget: prompt characters / 4 plus
    the completion budget (corrected with the usage the answer reports)."""
    chars = sum(len(message_text(message.get("content"))) for message in request.messages)
    return chars // 4 + (request.max_tokens or 0)


class TokenBudget:
    """Tokens per minute as a bucket that holds one minute's tokens and refills continuously. A call
    starts when the bucket holds its estimate (or is full, for a call larger than a minute's budget);
    its answer's usage then replaces the estimate."""

    def __init__(self, tokens_per_minute: int, clock: Callable[[], float] = time.monotonic) -> None:
        self.capacity = float(tokens_per_minute)
        self.rate = tokens_per_minute / 60.0
        self.level = self.capacity
        self._clock = clock
        self._updated = clock()

    def _refill(self) -> None:
        now = self._clock()
        self.level = min(self.capacity, self.level + (now - self._updated) * self.rate)
        self._updated = now

    def wait_s(self, tokens: int) -> float:
        """Seconds until a call of ``tokens`` may start (0: now)."""
        self._refill()
        need = min(float(tokens), self.capacity)
        return 0.0 if self.level >= need else (need - self.level) / self.rate

    def take(self, tokens: int) -> None:
        self._refill()
        self.level -= tokens

    def settle(self, estimated: int, used: int) -> None:
        """Replace a call's estimate with what it used."""
        self._refill()
        self.level = min(self.capacity, self.level + estimated - used)


SLOW_START_LIMIT = 8  # in-flight calls an endpoint starts at
SLOW_START_STEP = 1.0  # growth per success until the first 429 (x2 per round of calls)
SLOW_START_EXIT_FACTOR = 0.5  # the first decrease
DECREASE_FACTOR = 0.7  # every later one (a sawtooth of +-15% around what the endpoint serves)


@dataclass
class EndpointState:
    """What every caller of one endpoint learns and shares, across event loops (so a run's later steps
    start where the earlier ones left off): the in-flight limit and the token budget."""

    ceiling: int
    adaptive: bool
    limit: float
    budget: TokenBudget | None = None
    slow_start: bool = True
    last_decrease: float = -math.inf

    def on_success(self, in_flight: int) -> None:
        """Additive increase: +1 per success in slow start, +1/limit after it (about +1 per limit calls),
        only while the limit is what holds calls back."""
        if not self.adaptive or in_flight < int(self.limit):
            return
        step = SLOW_START_STEP if self.slow_start else 1.0 / self.limit
        self.limit = min(float(self.ceiling), self.limit + step)

    def on_rate_limited(self, sent_at: float, in_flight: int, now: float) -> None:
        """Multiplicative decrease, once for all calls sent before the last decrease."""
        if not self.adaptive:
            return
        if sent_at >= self.last_decrease:
            # slow start may have overshot twofold within one round of calls: halve; later, gentler
            factor = SLOW_START_EXIT_FACTOR if self.slow_start else DECREASE_FACTOR
            self.limit = max(1.0, min(self.limit, float(in_flight)) * factor)
            self.last_decrease = now
            self.slow_start = False


class EndpointGate:
    """The calls in flight to one endpoint from one event loop, under its shared ``EndpointState``."""

    def __init__(self, state: EndpointState) -> None:
        self.state = state
        self.in_flight = 0
        self.peak_in_flight = 0
        self._released = asyncio.Event()  # replaced by a fresh one at each release

    async def acquire(self, tokens: int) -> float:
        """Wait until a call may start (a slot free, the budget there); returns the seconds spent on the
        budget (waiting for a slot is queueing, not counted)."""
        state = self.state
        waited = 0.0
        while True:
            if self.in_flight >= max(int(state.limit), 1):
                await self._released.wait()
                continue
            budget_wait = state.budget.wait_s(tokens) if state.budget is not None else 0.0
            if budget_wait > 0:
                await asyncio.sleep(budget_wait)
                waited += budget_wait
                continue
            if state.budget is not None:
                state.budget.take(tokens)
            self.in_flight += 1
            self.peak_in_flight = max(self.peak_in_flight, self.in_flight)
            return waited

    def release(self) -> None:
        self.in_flight -= 1
        released, self._released = self._released, asyncio.Event()
        released.set()


_STATES: dict[tuple[Any, ...], EndpointState] = {}
_GATES: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, dict[tuple[Any, ...], EndpointGate]] = (
    weakref.WeakKeyDictionary()
)
_REGISTRY_LOCK = threading.Lock()


def _endpoint_key(settings: EndpointSettings) -> tuple[Any, ...]:
    # One rate limit per key and model at a provider; the key enters only as a digest.
    key_digest = hashlib.sha256(settings.api_key.encode()).hexdigest() if settings.api_key else None
    return (
        settings.api_base,
        settings.custom_llm_provider,
        settings.model,
        key_digest,
        settings.adaptive_concurrency,
        settings.max_tokens_per_minute,
    )


def endpoint_gate(settings: EndpointSettings) -> EndpointGate:
    """The gate of ``settings``' endpoint on the running loop (one per endpoint and loop, sharing the
    endpoint's state with other loops)."""
    loop = asyncio.get_running_loop()
    key = _endpoint_key(settings)
    with _REGISTRY_LOCK:
        state = _STATES.get(key)
        if state is None:
            adaptive = settings.adaptive_concurrency
            tpm = settings.max_tokens_per_minute
            state = _STATES[key] = EndpointState(
                ceiling=settings.max_concurrency,
                adaptive=adaptive,
                limit=float(min(settings.max_concurrency, SLOW_START_LIMIT) if adaptive else settings.max_concurrency),
                budget=TokenBudget(tpm) if tpm else None,
                slow_start=adaptive,
            )
        elif settings.max_concurrency > state.ceiling:
            state.ceiling = settings.max_concurrency
            if not state.adaptive:
                state.limit = float(state.ceiling)
        gates = _GATES.setdefault(loop, {})
        gate = gates.get(key)
        if gate is None:
            gate = gates[key] = EndpointGate(state)
        return gate


def endpoint_state(settings: EndpointSettings) -> EndpointState | None:
    """What calls to ``settings``' endpoint have learned so far (None: no call yet)."""
    with _REGISTRY_LOCK:
        return _STATES.get(_endpoint_key(settings))


def reset_endpoint_states() -> None:
    """Forget every endpoint's learned limit and budget (tests and benchmarks start afresh)."""
    with _REGISTRY_LOCK:
        _STATES.clear()
        _GATES.clear()


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
    """One request to its outcome. A call that got an answer is never sent again, except an unusable
    reply resampled (counted in ``attempts``); a 429's Retry-After is waited out before the retry, and
    one longer than ``backoff_max_s`` fails the request at once instead."""
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
    gate = endpoint_gate(settings)
    state = gate.state
    estimate = estimate_tokens(request) if state.budget is not None else 0
    started = time.monotonic()
    attempts = rate_limited = 0
    waited = 0.0
    paid_usd = 0.0  # answered-but-unusable attempts cost money too

    def failed(error: str) -> ChatResult:
        return ChatResult(
            custom_id=request.custom_id,
            status="failed",
            error=error,
            cost_usd=paid_usd,
            attempts=attempts,
            latency_s=time.monotonic() - started,
            rate_limited=rate_limited,
            wait_s=waited,
        )

    while True:
        waited += await gate.acquire(estimate)
        attempts += 1
        sent_at = time.monotonic()
        try:
            # wait_for bounds in-process providers too, which ignore the timeout kwarg.
            response = await asyncio.wait_for(litellm.acompletion(**kwargs), timeout=settings.timeout_s)
        except asyncio.CancelledError:
            gate.release()
            raise
        except Exception as exc:
            retryable = is_retryable_error(exc)
            hint = None
            if error_status(exc) == 429:
                rate_limited += 1
                hint = retry_after_s(exc)
                state.on_rate_limited(sent_at, gate.in_flight, time.monotonic())
            if state.budget is not None:
                state.budget.settle(estimate, 0)  # a refused call used no tokens
            gate.release()
            if not retryable or attempts > settings.max_retries:
                suffix = f" (gave up after {attempts} attempts)" if retryable else ""
                return failed(error_text(exc, settings, context=f"request {request.custom_id!r}: ") + suffix)
            if hint is not None and hint > settings.backoff_max_s:
                return failed(
                    error_text(exc, settings, context=f"request {request.custom_id!r}: ")
                    + f" (the endpoint asks to wait {hint:.0f}s, more than backoff_max_s={settings.backoff_max_s:g})"
                )
            delay = retry_delay(exc, attempts, settings, hint)
            log.debug(
                "request %r attempt %d failed (%s); retrying in %.2fs",
                request.custom_id,
                attempts,
                type(exc).__name__,
                delay,
            )
            await asyncio.sleep(delay)
            waited += delay
            continue
        result = _result_from_response(request, response, settings, model, attempts, started)
        if state.budget is not None:
            state.budget.settle(estimate, result.prompt_tokens + result.completion_tokens)
        state.on_success(gate.in_flight)
        gate.release()
        paid_usd += result.cost_usd
        result.cost_usd = paid_usd
        result.rate_limited, result.wait_s = rate_limited, waited
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
