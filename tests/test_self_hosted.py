"""A self-hosted OpenAI-compatible server (e.g. `vllm serve` of an open model) for each of the four
endpoints a run calls: the teacher (Batch API and concurrent), the judge, the reflection judge and the
benchmark grader. Each endpoint section of the `research-drtulu` profile is pointed at a fake server on
127.0.0.1 with `api_base` and its own key variable, and its settings are built the way the tasks build
them (teacher.endpoint.endpoint_settings + tasks.secrets.resolve_api_key): the call reaches that server,
with the served model name and the key, through the same litellm client the tasks use."""

from __future__ import annotations

import pytest

from rubricem_core.config import load_config
from rubricem_core.llm.concurrent import run_concurrent
from rubricem_core.llm.types import ChatRequest
from rubricem_core.teacher.endpoint import endpoint_settings, run_round
from rubricem_core.testing.openai_server import FakeOpenAIServer
from tasks.secrets import resolve_api_key

KEY = "self-hosted-test-key"
SECTIONS = ("teacher", "judge", "reflection.judge", "eval.grader")


def _section(cfg, dotted: str):
    node = cfg
    for part in dotted.split("."):
        node = getattr(node, part)
    return node


def _config(section: str, base_url: str, **extra):
    return load_config(
        "research-drtulu",
        {
            f"{section}.model": "openai/Qwen3-32B",
            f"{section}.api_base": base_url,
            f"{section}.api_key_env": "RUBRICEM_SELF_HOSTED_KEY",
            **extra,
        },
    )


@pytest.mark.parametrize("section", SECTIONS)
def test_each_endpoint_reaches_a_self_hosted_server(section, monkeypatch):
    monkeypatch.setenv("RUBRICEM_SELF_HOSTED_KEY", KEY)
    with FakeOpenAIServer(lambda body: "served", api_key=KEY) as server:
        endpoint = _section(_config(section, server.base_url), section)
        settings = endpoint_settings(endpoint, api_key=resolve_api_key(endpoint))
        (result,) = run_concurrent([ChatRequest("c0", "", [{"role": "user", "content": "hi"}], max_tokens=8)], settings)
    assert result.ok and result.text == "served", result.error
    assert [call["model"] for call in server.chat_calls] == ["Qwen3-32B"]  # the served name, provider prefix removed


def test_the_teacher_batch_api_of_a_self_hosted_server(monkeypatch):
    """The teacher's default mode in research-drtulu is the Batch API: upload, create, poll, download."""
    monkeypatch.setenv("RUBRICEM_SELF_HOSTED_KEY", KEY)
    with FakeOpenAIServer(lambda body: "trace", api_key=KEY) as server:
        cfg = _config(
            "teacher",
            server.base_url,
            **{"teacher.batch_poll_interval_s": 0.05, "teacher.batch_poll_max_interval_s": 0.1},
        )
        assert cfg.teacher.mode == "batch"
        settings = endpoint_settings(cfg.teacher, api_key=resolve_api_key(cfg.teacher))
        requests = [ChatRequest(f"t{i}", "", [{"role": "user", "content": f"q{i}"}], max_tokens=8) for i in range(3)]
        results = run_round(requests, cfg.teacher, settings)
    assert [r.text for r in results] == ["trace"] * 3 and server.batch_custom_ids() == [["t0", "t1", "t2"]]
    assert {line["body"]["model"] for line in server.uploaded_lines} == {"Qwen3-32B"}


def test_a_wrong_key_fails_with_the_servers_answer(monkeypatch):
    monkeypatch.setenv("RUBRICEM_SELF_HOSTED_KEY", "not-the-key")
    with FakeOpenAIServer(lambda body: "served", api_key=KEY) as server:
        cfg = _config("judge", server.base_url, **{"judge.max_retries": 0})
        settings = endpoint_settings(cfg.judge, api_key=resolve_api_key(cfg.judge))
        (result,) = run_concurrent([ChatRequest("c0", "", [{"role": "user", "content": "hi"}])], settings)
    assert not result.ok and "401" in (result.error or "") + str(result.status)
