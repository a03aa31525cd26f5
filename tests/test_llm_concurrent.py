"""Concurrent runner against the fake OpenAI server and an in-process provider."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from typing import Any

import pytest

from rubricem_core.llm.concurrent import arun_concurrent, run_concurrent
from rubricem_core.llm.types import EndpointSettings, LLMRequestError
from rubricem_core.sim.provider import register_completion_provider
from rubricem_core.testing.openai_server import FakeOpenAIServer
from tests.llm_endpoints import API_KEY, echo, make_requests, make_settings


def test_results_come_back_in_request_order_with_usage_and_cost() -> None:
    finished: list[str] = []
    with FakeOpenAIServer(echo, api_key=API_KEY) as server:
        results = run_concurrent(
            make_requests(6, stop=["never"]),
            make_settings(server),
            on_result=lambda result: finished.append(result.custom_id),
        )
        assert len(server.chat_calls) == 6
        assert all(call["stop"] == ["never"] for call in server.chat_calls)
    assert [result.custom_id for result in results] == [f"r{i}" for i in range(6)]
    assert all(result.ok and result.attempts == 1 for result in results)
    assert results[3].text == "echo: question 3"
    assert results[3].prompt_tokens == 2 and results[3].completion_tokens == 3
    assert results[3].cost_usd == pytest.approx(2 * 1e-6 + 3 * 2e-6)
    assert results[3].batch_id is None
    assert sorted(finished) == sorted(result.custom_id for result in results)


def test_rate_limit_and_server_error_are_retried_then_succeed() -> None:
    with FakeOpenAIServer(echo, api_key=API_KEY, http_errors=[429, 500]) as server:
        [result] = run_concurrent(make_requests(1), make_settings(server))
        assert len(server.chat_calls) == 3
    assert result.ok
    assert result.attempts == 3
    assert result.text == "echo: question 0"


def test_persistent_server_errors_fail_after_max_retries_without_raising() -> None:
    with FakeOpenAIServer(echo, api_key=API_KEY, http_errors=[503] * 10) as server:
        results = run_concurrent(make_requests(1), make_settings(server, max_retries=2, max_concurrency=1))
        assert len(server.chat_calls) == 3
    assert results[0].status == "failed"
    assert results[0].attempts == 3
    assert "503" in results[0].error and "gave up after 3 attempts" in results[0].error


def test_bad_request_fails_at_once_naming_the_request() -> None:
    with FakeOpenAIServer(echo, api_key=API_KEY, http_errors=[400]) as server:
        results = run_concurrent(make_requests(2), make_settings(server, max_concurrency=1))
        assert len(server.chat_calls) == 2  # one 400, one success: the 400 was not retried
    failed = [result for result in results if not result.ok]
    assert len(failed) == 1
    assert failed[0].attempts == 1
    assert f"request {failed[0].custom_id!r}" in failed[0].error
    assert "400" in failed[0].error
    assert [result for result in results if result.ok][0].attempts == 1


def test_wrong_api_key_fails_at_once_and_never_leaks_the_key() -> None:
    with FakeOpenAIServer(echo, api_key="the-right-key") as server:
        settings = make_settings(server)
        [result] = run_concurrent(make_requests(1), settings)
        assert len(server.chat_calls) == 0
        assert len([entry for entry in server.request_log if entry[1] == "/v1/chat/completions"]) == 1
    assert result.status == "failed" and result.attempts == 1
    assert "401" in result.error
    assert API_KEY not in result.error
    assert API_KEY not in repr(settings)


def test_timeout_is_retried_and_reported() -> None:
    with FakeOpenAIServer(echo, api_key=API_KEY, delay_s=1.0) as server:
        started = time.monotonic()
        [result] = run_concurrent(make_requests(1), make_settings(server, timeout_s=0.2, max_retries=1))
        elapsed = time.monotonic() - started
        assert len(server.chat_calls) == 2
    assert result.status == "failed"
    assert result.attempts == 2
    assert "Timeout" in result.error
    assert elapsed < 3.0


def test_concurrency_is_bounded() -> None:
    lock = threading.Lock()
    in_flight = [0, 0]  # current, peak

    def slow(body: dict[str, Any]) -> str:
        with lock:
            in_flight[0] += 1
            in_flight[1] = max(in_flight[1], in_flight[0])
        time.sleep(0.15)
        with lock:
            in_flight[0] -= 1
        return "done"

    with FakeOpenAIServer(slow, api_key=API_KEY) as server:
        results = run_concurrent(make_requests(6), make_settings(server, max_concurrency=2))
    assert all(result.ok for result in results)
    assert in_flight[1] == 2


def test_unparseable_json_content_is_retried_for_json_requests() -> None:
    answers = iter(['{"score": ', '{"score": 2}'])
    register_completion_provider("rubricem_test_json", lambda messages, params: next(answers))
    settings = EndpointSettings(model="rubricem_test_json/judge", max_retries=2, backoff_base_s=0.0)
    [result] = run_concurrent(make_requests(1, response_format={"type": "json_object"}), settings)
    assert result.ok and json.loads(result.text) == {"score": 2}
    assert result.attempts == 2


def test_in_process_provider_runs_inside_a_running_event_loop() -> None:
    register_completion_provider("rubricem_test_loop", lambda messages, params: "x y z")
    settings = EndpointSettings(model="rubricem_test_loop/teacher")

    async def caller() -> list:
        sync_results = run_concurrent(make_requests(2), settings)  # must not trip over the running loop
        async_results = await arun_concurrent(make_requests(3), settings)
        return sync_results + async_results

    results = asyncio.run(caller())
    assert [result.text for result in results] == ["x y z"] * 5
    assert all(result.cost_usd == 0.0 for result in results)  # unknown model, no prices


def test_duplicate_custom_ids_are_rejected_before_any_call() -> None:
    requests = make_requests(2)
    requests[1].custom_id = "r0"
    with pytest.raises(ValueError, match="duplicate custom_id 'r0'"):
        run_concurrent(requests, EndpointSettings(model="rubricem_test_loop/teacher"))
    assert issubclass(LLMRequestError, ValueError)


def test_callback_errors_propagate() -> None:
    register_completion_provider("rubricem_test_cb", lambda messages, params: "ok")

    def explode(result: Any) -> None:
        raise RuntimeError("progress bar broke")

    with pytest.raises(RuntimeError, match="progress bar broke"):
        run_concurrent(make_requests(2), EndpointSettings(model="rubricem_test_cb/m"), on_result=explode)
