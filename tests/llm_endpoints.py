"""An endpoint on the fake OpenAI server and chat requests for it, shared by the LLM client tests."""

from __future__ import annotations

from typing import Any

from rubricem_core.llm.types import ChatRequest, EndpointSettings
from rubricem_core.testing.openai_server import FakeOpenAIServer

API_KEY = "sk-test-secret-0123456789"


def echo(body: dict[str, Any]) -> str:
    return "echo: " + body["messages"][-1]["content"]


def make_settings(server: FakeOpenAIServer, **overrides: Any) -> EndpointSettings:
    values: dict[str, Any] = dict(
        model="openai/fake-model",
        api_base=server.base_url,
        api_key=API_KEY,
        timeout_s=5.0,
        max_retries=3,
        backoff_base_s=0.01,
        backoff_max_s=0.05,
        max_concurrency=4,
        input_cost_per_token=1e-6,
        output_cost_per_token=2e-6,
    )
    values.update(overrides)
    return EndpointSettings(**values)


def make_requests(n: int, **fields: Any) -> list[ChatRequest]:
    return [
        ChatRequest(custom_id=f"r{i}", model="", messages=[{"role": "user", "content": f"question {i}"}], **fields)
        for i in range(n)
    ]
