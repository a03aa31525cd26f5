"""Rate-limit-aware calls (issue #34) against a loopback OpenAI-compatible server: Retry-After (seconds,
milliseconds, HTTP-date) waited out before the retry, the in-flight limit halved under 429s and grown
back by successes, the tokens-per-minute budget, no answered request sent twice, and the ``llm_*``
counts in results, usage metrics, teacher rounds and the Batch path."""

from __future__ import annotations

import email.utils
import time
from typing import Any

import pytest

from rubricem_core.config import TeacherConfig
from rubricem_core.judge.types import SCORE, JudgeUsage
from rubricem_core.llm.batch import BatchClient
from rubricem_core.llm.concurrent import TokenBudget, endpoint_state, estimate_tokens, run_concurrent
from rubricem_core.llm.types import ChatRequest, EndpointSettings, RetryStats
from rubricem_core.teacher.endpoint import run_round
from rubricem_core.testing.openai_server import FakeOpenAIServer, RateLimit, messages_digest
from tests.llm_endpoints import API_KEY, echo, make_requests, make_settings


def settings_for(server: FakeOpenAIServer, **overrides: Any) -> EndpointSettings:
    """test_llm_concurrent's endpoint with room for rate limits: more calls at once, more retries, longer waits."""
    values: dict[str, Any] = dict(timeout_s=10.0, max_retries=5, backoff_max_s=5.0, max_concurrency=16)
    return make_settings(server, **{**values, **overrides})


def http_date_in(seconds: float) -> Any:
    return lambda: email.utils.formatdate(time.time() + seconds, usegmt=True)


@pytest.mark.parametrize(
    "headers",
    [
        {"Retry-After": "1"},
        {"Retry-After": "1", "retry-after-ms": "700"},
        {"Retry-After": http_date_in(1.5)},
    ],
    ids=["seconds", "milliseconds", "http-date"],
)
def test_retry_after_is_waited_out_before_the_retry(headers: dict[str, Any]) -> None:
    # backoff_max_s below every hint: the hint, not the backoff cap, decides the wait
    with FakeOpenAIServer(echo, api_key=API_KEY, http_errors=[(429, headers)]) as server:
        [result] = run_concurrent(make_requests(1), settings_for(server, backoff_max_s=2.0, backoff_base_s=0.01))
        refused, retried = server.chat_events
    assert result.ok and result.attempts == 2 and result.rate_limited == 1 and result.retries == 1
    assert refused.status == 429 and retried.status == 200
    assert refused.retry_at is not None and refused.retry_after_s >= 0.5
    assert retried.arrived >= refused.retry_at - 1e-3  # no earlier than the server asked
    # it slept the hint (counted from when the 429 reached it, a moment after the server sent it)
    assert refused.retry_at - refused.ended - 0.05 <= result.wait_s <= retried.arrived - refused.ended


def test_a_retry_after_past_backoff_max_fails_the_call_unsent() -> None:
    # the first call is told to come back in 2 minutes: it fails at once and does not pause the others
    with FakeOpenAIServer(echo, api_key=API_KEY, http_errors=[(429, {"Retry-After": "120"})]) as server:
        results = run_concurrent(make_requests(3), settings_for(server, backoff_max_s=5.0, max_concurrency=1))
        assert [e.status for e in server.chat_events] == [429, 200, 200]
    assert results[0].status == "failed" and results[0].attempts == 1 and results[0].rate_limited == 1
    assert "asks to wait 120s, more than backoff_max_s=5" in results[0].error
    assert all(r.ok and r.wait_s == 0 for r in results[1:])


def test_a_429_delays_its_own_retry_and_no_other_call() -> None:
    # the first call to arrive is refused with Retry-After: 1; the other calls start and finish meanwhile
    requests = make_requests(6)
    with FakeOpenAIServer(echo, api_key=API_KEY, http_errors=[(429, {"Retry-After": "1"})]) as server:
        results = run_concurrent(requests, settings_for(server, max_concurrency=2, backoff_base_s=0.01))
        events = server.chat_events
    refused = events[0]
    assert refused.status == 429 and all(r.ok for r in results)
    retried = [e for e in events[1:] if e.arrived >= refused.retry_at - 1e-3]
    served_meanwhile = [e for e in events[1:] if e.status == 200 and e.ended < refused.retry_at]
    assert len(retried) == 1 and len(served_meanwhile) == 5  # the five others did not wait for the hint
    # which request arrived first is the thread pool's choice, not always r0: find it by its messages
    (refused_index,) = [
        i for i, r in enumerate(requests) if messages_digest({"messages": r.messages}) == refused.digest
    ]
    assert retried[0].digest == refused.digest
    waits = [r.wait_s for r in results]
    assert waits.pop(refused_index) >= 0.9 and sum(waits) == 0


def slow_echo(body: dict[str, Any]) -> str:
    time.sleep(0.03)
    return echo(body)


@pytest.mark.parametrize("adaptive", [True, False])
def test_in_flight_limit_falls_under_429s_and_recovers(adaptive: bool) -> None:
    # an endpoint that serves 3 calls at a time and answers the rest 429 (retry-after-ms 20)
    with FakeOpenAIServer(slow_echo, api_key=API_KEY, concurrency_limit=3) as server:
        settings = settings_for(server, adaptive_concurrency=adaptive, max_retries=50)
        results = run_concurrent(make_requests(60), settings)
        assert all(r.ok for r in results)
        refused = [e for e in server.chat_events if e.status == 429]
        assert sum(r.rate_limited for r in results) == len(refused)
        state = endpoint_state(settings)
        assert state is not None
        if not adaptive:
            assert state.limit == 16 and len(refused) > 20  # 16 at once against 3: many calls are refused
            return
        # the limit fell to what the endpoint serves; refusals are a few per halving, not per call
        assert int(state.limit) <= 4  # calls at once: about the 3 it serves (the sawtooth: +-30%)
        assert len(refused) < 20
        late = [e for e in server.chat_events[len(server.chat_events) // 2 :]]
        assert sum(e.status == 429 for e in late) <= 6

        # the endpoint stops limiting: successes grow the shared limit back to max_concurrency
        server.concurrency_limit = None
        server.max_in_flight = 0
        more = [ChatRequest(f"s{i}", "", [{"role": "user", "content": f"again {i}"}]) for i in range(300)]
        assert all(r.ok for r in run_concurrent(more, settings))
        assert state.limit == 16
        # calls at once grew past what the limiting endpoint served (exactly 16 needs the calls to overlap
        # fully, which a loaded machine does not promise)
        assert server.max_in_flight > 6


def test_token_budget_arithmetic() -> None:
    now = [0.0]
    budget = TokenBudget(6000, clock=lambda: now[0])  # 100 tokens/s, one minute held
    assert budget.wait_s(5000) == 0.0
    budget.take(5000)
    assert budget.wait_s(2000) == pytest.approx(10.0)  # 1000 left, 1000 more at 100/s
    budget.settle(5000, 500)  # the call used 500 of its 5000: 4500 come back
    assert budget.wait_s(2000) == 0.0 and budget.level == pytest.approx(5500)
    budget.take(5500)
    now[0] = 3.0
    assert budget.wait_s(600) == pytest.approx(3.0)
    assert budget.wait_s(10**6) == pytest.approx(57.0)  # larger than a minute: waits for a full bucket
    request = ChatRequest("a", "", [{"role": "user", "content": "x" * 40}], max_tokens=90)
    assert estimate_tokens(request) == 100


def test_tokens_per_minute_budget_spaces_calls() -> None:
    # 6000 tokens/min = 100/s. A first call estimated at 2 tokens (no max_tokens) uses 6000: its usage
    # empties the budget; then calls estimated and using 97 tokens each start ~0.97 s apart.
    def reply(body: dict[str, Any]) -> str:
        return " ".join(["word"] * (95 if body.get("max_tokens") else 5998))

    big = ChatRequest("big", "", [{"role": "user", "content": "question big"}])
    small = make_requests(3, max_tokens=95)
    assert estimate_tokens(big) == 3 and {estimate_tokens(r) for r in small} == {97}
    with FakeOpenAIServer(reply, api_key=API_KEY) as server:
        settings = settings_for(server, max_tokens_per_minute=6000, max_concurrency=4)
        [first] = run_concurrent([big], settings)
        assert first.prompt_tokens + first.completion_tokens == 6000
        results = run_concurrent(small, settings)
        arrivals = sorted(e.arrived for e in server.chat_events)
    assert all(r.ok and r.prompt_tokens + r.completion_tokens == 97 for r in results)
    gaps = [later - earlier for earlier, later in zip(arrivals, arrivals[1:])]
    assert all(gap >= 0.9 for gap in gaps), gaps
    assert sum(r.wait_s for r in results) >= 0.9 + 1.9 + 2.8


def test_no_answered_request_is_sent_twice_and_every_call_is_counted() -> None:
    limit = RateLimit(per_second=200, burst=5, retry_after="ms")
    with FakeOpenAIServer(slow_echo, api_key=API_KEY, rate_limit=limit, server_error_rate=0.05, seed=3) as server:
        results = run_concurrent(make_requests(80), settings_for(server, max_concurrency=32, max_retries=20))
        events = server.chat_events
        assert server.answered_twice() == []
    assert all(r.ok for r in results)
    statuses = [e.status for e in events]
    assert statuses.count(200) == 80
    assert statuses.count(429) > 0 and statuses.count(500) > 0
    assert sum(r.attempts for r in results) == len(events)
    assert sum(r.retries for r in results) == len(events) - 80
    assert sum(r.rate_limited for r in results) == statuses.count(429)

    usage = JudgeUsage()
    for result in results:
        usage.add_call(SCORE, result)
    metrics = usage.metrics()
    assert metrics["judge/llm_retries"] == len(events) - 80
    assert metrics["judge/llm_rate_limited"] == statuses.count(429)
    assert metrics["judge/llm_wait_seconds"] == pytest.approx(sum(r.wait_s for r in results))
    assert metrics["judge/llm_wait_seconds"] > 0
    merged = JudgeUsage().merge(usage)
    assert merged.metrics() == metrics


def test_teacher_round_reports_retries_rate_limits_and_waits() -> None:
    with FakeOpenAIServer(echo, api_key=API_KEY, http_errors=[(429, {"Retry-After": "0.2"}), 503]) as server:
        cfg = TeacherConfig(model="openai/fake-model", api_base=server.base_url, mode="concurrent")
        stats = RetryStats()
        results = run_round(make_requests(3), cfg, settings_for(server, max_concurrency=1), stats=stats)
    assert all(r.ok for r in results)
    assert stats.retries == 2 and stats.rate_limited == 1
    assert stats.wait_s >= 0.2
    assert stats.retry_metrics("teacher/") == {
        "teacher/llm_retries": 2.0,
        "teacher/llm_rate_limited": 1.0,
        "teacher/llm_wait_seconds": stats.wait_s,
    }


def test_batch_path_reports_its_retries_and_waits() -> None:
    slept: list[float] = []
    with FakeOpenAIServer(
        echo,
        api_key=API_KEY,
        upload_errors=[(429, {"Retry-After": "3"})],
        fail_times={"r1": 1},
        failure_style="status_500",
        fail_status=429,
        polls_in_progress=1,
    ) as server:
        settings = settings_for(server, model="openai/fake-model", batch_poll_interval_s=0.01)
        client = BatchClient(settings, sleep=slept.append)
        results = client.run(make_requests(3))
    assert all(r.ok for r in results)
    # the upload's 429 waited its Retry-After (at least 3 s, slept through the injected sleep)
    assert client.stats.rate_limited == 1 and client.stats.retries == 1
    assert 3.0 <= client.stats.wait_s <= 3.3 and client.stats.wait_s in slept
    # r1's line was rate limited once and went into a second batch
    by_id = {r.custom_id: r for r in results}
    assert by_id["r1"].rate_limited == 1 and by_id["r1"].attempts == 2 and by_id["r1"].retries == 1
    assert by_id["r0"].rate_limited == 0 and by_id["r0"].attempts == 1
    stats = RetryStats()
    stats.add_retries(client.stats.retries, client.stats.rate_limited, client.stats.wait_s)
    for result in results:
        stats.add_result_retries(result)
    assert (stats.retries, stats.rate_limited) == (2, 2)
