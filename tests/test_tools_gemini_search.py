"""Google Search through Gemini's grounding (the paper's search tool) against a loopback server speaking the
Gemini API's wire format: sources from the grounding metadata, the key only in its header, Google's 429
body (RetryInfo) waited out and retried, a blocked prompt and a bad key as errors, and the registry kind."""

from __future__ import annotations

import pytest

from rubricem_core.testing.web_search_server import FakeWebSearchServer
from rubricem_core.tools.base import ToolError
from rubricem_core.tools.gemini_search import GeminiGroundedSearchTool
from rubricem_core.tools.registry import build_tools
from rubricem_core.tools.web import UrlBook, WebBrowseTool

KEY = "AIzaSy-test-key-0123456789abcdef"


@pytest.fixture()
def server(monkeypatch):
    monkeypatch.setenv("GEMINI_API_KEY", KEY)
    with FakeWebSearchServer(gemini_api_key=KEY) as fake:
        yield fake


def gemini(server, **kwargs) -> GeminiGroundedSearchTool:
    return GeminiGroundedSearchTool(base_url=f"{server.base_url}/v1beta", backoff_s=0.0, timeout_s=5, **kwargs)


def test_sources_come_from_the_grounding_metadata(server):
    urls = UrlBook()
    tool = gemini(server, top_k=3, urls=urls)
    result = tool("founding year of Fozo Group")
    assert result.error is None and len(result.snippet_ids) == 3
    method, path, headers, body = server.requests[-1]
    assert (method, path) == ("POST", "/v1beta/models/gemini-3-flash-preview:generateContent")
    assert headers["x-goog-api-key"] == KEY and KEY not in path
    assert body["tools"] == [{"google_search": {}}]
    assert body["contents"][0]["parts"][0]["text"] == "founding year of Fozo Group"
    # each snippet: the sentence that cites its chunk, the chunk's page as URL, the URL in the browse book
    assert "Snippet 0: facts on founding year of Fozo Group with number 100." in result.text
    assert "Snippet 3" not in result.text
    first = result.snippet_ids[0]
    assert urls.url(first) == server.page_url("founding-0")
    browse = WebBrowseTool(urls=urls, timeout_s=5, allow_networks=["127.0.0.0/8"])
    assert "Body text of founding-0" in browse(first).text


def test_a_429_with_googles_retry_info_is_retried_and_errors_are_results(server):
    server.faults.extend([429])
    result = gemini(server)("anything")
    assert result.error is None and result.snippet_ids
    assert [r[1] for r in server.requests].count("/v1beta/models/gemini-3-flash-preview:generateContent") == 2
    server.faults.extend(["blocked"])
    blocked = gemini(server)("anything")
    assert blocked.error is not None and "blocked: SAFETY" in blocked.text
    server.faults.extend([429] * 5)
    exhausted = gemini(server, max_retries=2)("anything")
    assert "HTTP 429" in exhausted.text and "RESOURCE_EXHAUSTED" in exhausted.text


def test_a_bad_key_is_an_error_without_the_key(server, monkeypatch):
    monkeypatch.setenv("GEMINI_API_KEY", "AIzaSy-wrong-key-000000000000000")
    result = gemini(server)("anything")
    assert "HTTP 400" in result.text and "API key not valid" in result.text
    assert "AIzaSy-wrong-key" not in result.text


def test_missing_key_and_bad_model_are_named(monkeypatch):
    monkeypatch.delenv("MY_GEMINI", raising=False)
    with pytest.raises(ToolError, match="environment variable MY_GEMINI is not set"):
        GeminiGroundedSearchTool(api_key_env="MY_GEMINI")
    monkeypatch.setenv("GEMINI_API_KEY", KEY)
    with pytest.raises(ToolError, match="is not a model id"):
        GeminiGroundedSearchTool(model="../../v1/other")


def test_the_registry_builds_it_beside_browse_with_one_url_book(server):
    tools = build_tools(
        [
            {
                "name": "google_search",
                "kind": "gemini_google_search",
                "base_url": f"{server.base_url}/v1beta",
                "backoff_s": 0.0,
                "top_k": 2,
            },
            {"name": "browse", "kind": "web_browse", "allow_networks": ["127.0.0.0/8"]},
        ]
    )
    found = tools["google_search"]("query words")
    assert len(found.snippet_ids) == 2
    assert "Body text of query-1" in tools["browse"](found.snippet_ids[1]).text
