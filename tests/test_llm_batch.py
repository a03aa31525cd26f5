"""Batch API client end to end against the fake OpenAI server, plus call costs."""

from __future__ import annotations

import json
from typing import Any

import litellm
import pytest

from rubricem_core.llm.batch import BatchClient, BatchError, BatchTimeoutError
from rubricem_core.llm.cost import call_cost
from rubricem_core.llm.types import ChatRequest, EndpointSettings
from rubricem_core.testing.openai_server import FakeOpenAIServer
from tests.llm_endpoints import make_settings as endpoint_settings

API_KEY = "sk-batch-test-key"


def answer(body: dict[str, Any]) -> str:
    return "answer to " + body["messages"][-1]["content"] + " END ignored tail"


def make_settings(server: FakeOpenAIServer, **overrides: Any) -> EndpointSettings:
    batch = dict(
        batch_poll_interval_s=0.01, batch_poll_max_interval_s=0.03, batch_timeout_s=10.0, max_batch_resubmits=2
    )
    values = {"api_key": API_KEY, "max_retries": 2, "output_cost_per_token": 4e-6, **batch, **overrides}
    return endpoint_settings(server, **values)


def make_requests(ids: list[str], **fields: Any) -> list[ChatRequest]:
    return [
        ChatRequest(
            custom_id=custom_id,
            model="openai/fake-model",
            stop=["END"],
            max_tokens=100,
            temperature=0.5,
            seed=1,
            messages=[{"role": "user", "content": f"q-{custom_id}"}],
            metadata={"trajectory_id": custom_id},
            **fields,
        )
        for custom_id in ids
    ]


def test_happy_path_uploads_one_jsonl_and_returns_results_in_order() -> None:
    submitted: list[str] = []
    with FakeOpenAIServer(answer, api_key=API_KEY) as server:
        client = BatchClient(make_settings(server))
        results = client.run(make_requests(["c", "a", "b"]), on_submitted=submitted.append)
        assert server.batch_custom_ids() == [["c", "a", "b"]]
        line = server.uploaded_lines[0]
        assert line["custom_id"] == "c" and line["method"] == "POST" and line["url"] == "/v1/chat/completions"
        assert line["body"]["model"] == "fake-model"  # litellm provider prefix stripped
        assert line["body"]["stop"] == ["END"] and line["body"]["seed"] == 1
        assert "metadata" not in line["body"]
        assert submitted == [server.batches[0]["id"]]
    assert [result.custom_id for result in results] == ["c", "a", "b"]
    first = results[0]
    assert first.ok and first.text == "answer to q-c " and first.finish_reason == "stop"
    assert first.prompt_tokens == 1 and first.completion_tokens == 3
    assert first.cost_usd == pytest.approx((1 * 1e-6 + 3 * 4e-6) * 0.5)
    assert first.attempts == 1 and first.batch_id == submitted[0]


@pytest.mark.parametrize("failure_style", ["error_file", "status_500"])
def test_transient_failure_is_resubmitted_alone(failure_style: str) -> None:
    with FakeOpenAIServer(answer, api_key=API_KEY, fail_times={"b": 1}, failure_style=failure_style) as server:
        submitted: list[str] = []
        results = BatchClient(make_settings(server)).run(make_requests(["a", "b", "c"]), on_submitted=submitted.append)
        assert server.batch_custom_ids() == [["a", "b", "c"], ["b"]]
        assert [line["custom_id"] for line in server.uploaded_lines] == ["a", "b", "c", "b"]
    assert all(result.ok for result in results)
    by_id = {result.custom_id: result for result in results}
    assert by_id["b"].attempts == 2 and by_id["b"].batch_id == submitted[1]
    assert by_id["a"].attempts == 1 and by_id["a"].batch_id == submitted[0]


def test_permanent_failure_is_returned_after_max_resubmits() -> None:
    with FakeOpenAIServer(answer, api_key=API_KEY, fail_custom_ids={"b"}) as server:
        results = BatchClient(make_settings(server, max_batch_resubmits=2)).run(make_requests(["a", "b"]))
        assert server.batch_custom_ids() == [["a", "b"], ["b"], ["b"]]
    failed = results[1]
    assert results[0].ok
    assert failed.status == "failed" and failed.text is None
    assert "injected failure" in failed.error and "'b'" in failed.error
    assert "gave up after 3 batches" in failed.error
    assert failed.attempts == 3


def test_client_error_lines_are_not_resubmitted() -> None:
    with FakeOpenAIServer(answer, api_key=API_KEY, bad_request_ids={"a"}) as server:
        results = BatchClient(make_settings(server)).run(make_requests(["a", "b"]))
        assert len(server.batches) == 1
    assert results[0].status == "failed" and "status 400" in results[0].error
    assert results[1].ok


def test_expired_batch_keeps_partial_output_and_resubmits_the_rest() -> None:
    with FakeOpenAIServer(answer, api_key=API_KEY, expire_next_batch=True) as server:
        results = BatchClient(make_settings(server)).run(make_requests(["a", "b", "c", "d"]))
        assert server.batches[0]["status"] == "expired"
        assert server.batch_custom_ids() == [["a", "b", "c", "d"], ["c", "d"]]
    assert all(result.ok for result in results)
    assert [result.attempts for result in results] == [1, 1, 2, 2]


def test_failed_batch_is_resubmitted_whole() -> None:
    with FakeOpenAIServer(answer, api_key=API_KEY, fail_next_batch=True) as server:
        results = BatchClient(make_settings(server)).run(make_requests(["a", "b"]))
        assert [batch["status"] for batch in server.batches] == ["failed", "completed"]
    assert all(result.ok and result.attempts == 2 for result in results)


def test_cancelled_batch_fails_the_rest_without_resubmitting() -> None:
    with FakeOpenAIServer(answer, api_key=API_KEY, polls_in_progress=50) as server:
        settings = make_settings(server)

        def cancel(batch_id: str) -> None:
            litellm.cancel_batch(
                batch_id=batch_id, custom_llm_provider="openai", api_base=settings.api_base, api_key=settings.api_key
            )

        results = BatchClient(settings).run(make_requests(["a", "b"]), on_submitted=cancel)
        assert len(server.batches) == 1 and server.batches[0]["status"] == "cancelled"
    assert all(result.status == "failed" and "cancelled" in result.error for result in results)


def test_truncated_output_line_is_resubmitted() -> None:
    with FakeOpenAIServer(answer, api_key=API_KEY, malformed_ids={"b"}) as server:

        def heal_after_first(batch_id: str) -> None:
            if len(server.batches) == 2:
                server.malformed_ids.clear()

        results = BatchClient(make_settings(server)).run(make_requests(["a", "b"]), on_submitted=heal_after_first)
        assert server.batch_custom_ids() == [["a", "b"], ["b"]]
    assert all(result.ok for result in results)


def test_unparseable_json_content_fails_json_requests() -> None:
    def answer_json(body: dict[str, Any]) -> str:
        return json.dumps({"scores": [2, 0]})

    with FakeOpenAIServer(answer_json, api_key=API_KEY, malformed_ids={"b"}, malformed_style="bad_content") as server:
        results = BatchClient(make_settings(server, max_batch_resubmits=1)).run(
            make_requests(["a", "b"], response_format={"type": "json_object"})
        )
        assert server.uploaded_lines[0]["body"]["response_format"] == {"type": "json_object"}
        assert server.batch_custom_ids() == [["a", "b"], ["b"]]
    by_id = {result.custom_id: result for result in results}
    assert by_id["a"].ok and json.loads(by_id["a"].text) == {"scores": [2, 0]}
    assert by_id["b"].status == "failed" and "does not parse" in by_id["b"].error
    assert by_id["b"].text == '{"scores": [1, 2'
    assert by_id["b"].cost_usd > 0  # the unusable answers were still paid for


def test_resume_reattaches_without_uploading_again() -> None:
    class Crash(Exception):
        pass

    saved: list[str] = []

    def persist_then_crash(batch_id: str) -> None:
        saved.append(batch_id)
        raise Crash()

    with FakeOpenAIServer(answer, api_key=API_KEY) as server:
        settings = make_settings(server)
        with pytest.raises(Crash):
            BatchClient(settings).run(make_requests(["a", "b"]), on_submitted=persist_then_crash)
        results = BatchClient(settings).run(
            make_requests(["a", "b"]), resume_batch_id=saved[0], on_submitted=persist_then_crash
        )
        assert len(server.uploads) == 1 and len(server.batches) == 1
    assert all(result.ok and result.batch_id == saved[0] for result in results)


def test_resume_sends_requests_missing_from_the_resumed_batch() -> None:
    with FakeOpenAIServer(answer, api_key=API_KEY) as server:
        settings = make_settings(server)
        [first] = BatchClient(settings).run(make_requests(["a"]))
        results = BatchClient(settings).run(make_requests(["a", "b"]), resume_batch_id=first.batch_id)
        assert server.batch_custom_ids() == [["a"], ["b"]]
    assert all(result.ok for result in results)


def test_timeout_raises_with_the_batch_id_for_resuming() -> None:
    with FakeOpenAIServer(answer, api_key=API_KEY, polls_in_progress=10_000) as server:
        with pytest.raises(BatchTimeoutError) as caught:
            BatchClient(make_settings(server, batch_timeout_s=0.2)).run(make_requests(["a"]))
        assert caught.value.batch_id == server.batches[0]["id"]
        assert caught.value.last_status == "in_progress"


def test_unknown_batch_id_raises_batch_error() -> None:
    with FakeOpenAIServer(answer, api_key=API_KEY) as server:
        with pytest.raises(BatchError, match="polling batch batch-missing"):
            BatchClient(make_settings(server)).run(make_requests(["a"]), resume_batch_id="batch-missing")


def test_empty_request_list_submits_nothing() -> None:
    with FakeOpenAIServer(answer, api_key=API_KEY) as server:
        assert BatchClient(make_settings(server)).run([]) == []
        assert server.request_log == []


def test_duplicate_custom_ids_raise_before_uploading() -> None:
    with FakeOpenAIServer(answer, api_key=API_KEY) as server:
        with pytest.raises(ValueError, match="duplicate custom_id 'a'"):
            BatchClient(make_settings(server)).run(make_requests(["a", "a"]))
        assert server.uploads == []


def test_cost_uses_litellm_price_map_for_known_models() -> None:
    settings = EndpointSettings(model="openai/gpt-4o-mini", input_cost_per_token=1.0, output_cost_per_token=1.0)
    entry = litellm.model_cost["gpt-4o-mini"]
    expected = 1000 * entry["input_cost_per_token"] + 200 * entry["output_cost_per_token"]
    assert expected > 0
    assert call_cost("openai/gpt-4o-mini", 1000, 200, settings) == pytest.approx(expected)
    assert call_cost("gpt-4o-mini", 1000, 200, settings) == pytest.approx(expected)
    batch_expected = 1000 * entry["input_cost_per_token_batches"] + 200 * entry["output_cost_per_token_batches"]
    assert call_cost("openai/gpt-4o-mini", 1000, 200, settings, batch=True) == pytest.approx(batch_expected)


def test_cost_discounts_map_prices_when_no_batch_price_is_listed() -> None:
    name, entry = next(
        (name, entry)
        for name, entry in litellm.model_cost.items()
        if isinstance(entry, dict)
        and (entry.get("input_cost_per_token") or 0) > 0
        and (entry.get("output_cost_per_token") or 0) > 0
        and "input_cost_per_token_batches" not in entry
    )
    settings = EndpointSettings(model=name, batch_discount=0.25)
    full = 10 * entry["input_cost_per_token"] + 10 * entry["output_cost_per_token"]
    assert call_cost(name, 10, 10, settings, batch=True) == pytest.approx(full * 0.25)


def test_cost_falls_back_to_settings_prices_then_zero() -> None:
    priced = EndpointSettings(model="mycorp/unlisted-model", input_cost_per_token=2e-6, output_cost_per_token=8e-6)
    assert call_cost("mycorp/unlisted-model", 100, 50, priced) == pytest.approx(100 * 2e-6 + 50 * 8e-6)
    assert call_cost("mycorp/unlisted-model", 100, 50, priced, batch=True) == pytest.approx(
        (100 * 2e-6 + 50 * 8e-6) * 0.5
    )
    assert call_cost("mycorp/unlisted-model", 100, 50, EndpointSettings(model="mycorp/unlisted-model")) == 0.0


def test_settings_validation_names_the_field() -> None:
    with pytest.raises(ValueError, match="max_concurrency"):
        EndpointSettings(model="m", max_concurrency=0)
    with pytest.raises(ValueError, match="batch_discount"):
        EndpointSettings(model="m", batch_discount=1.5)
    with pytest.raises(ValueError, match="model"):
        EndpointSettings(model="")


def test_jsonl_is_one_request_per_line() -> None:
    client = BatchClient(EndpointSettings(model="openai/gpt-4o-mini"))
    data = client.jsonl_bytes(make_requests(["x", "y"]))
    lines = [json.loads(line) for line in data.decode().splitlines()]
    assert [line["custom_id"] for line in lines] == ["x", "y"]
    assert lines[0]["body"]["model"] == "fake-model"
    assert lines[0]["body"]["max_tokens"] == 100 and lines[0]["body"]["temperature"] == 0.5
