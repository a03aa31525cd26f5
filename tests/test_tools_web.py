"""Web search adapters against a fake HTTP server on 127.0.0.1 (never the real internet)."""

from __future__ import annotations

import ipaddress
import re
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest

from rubricem_core.testing.web_search_server import FakeWebSearchServer
from rubricem_core.tools import ToolError, ToolResult
from rubricem_core.tools.cache import ToolCache
from rubricem_core.tools.registry import build_tools
from rubricem_core.tools.robust import RobustTool
from rubricem_core.tools.web import (
    SemanticScholarSearchTool,
    SerperSearchTool,
    UrlBook,
    WebBrowseTool,
    html_to_text,
    url_id,
)

KEY = "sk-test-SECRET-4242"
LOOPBACK = ["127.0.0.0/8"]  # the fake pages are on this machine: browse refuses loopback unless allowed
S2_KEY = "s2-SECRET-9999"
SNIPPET = re.compile(r'<snippet id="([^"]+)">')


@pytest.fixture
def server():
    with FakeWebSearchServer(api_key=KEY, s2_api_key=S2_KEY, slow_s=1.0) as fake:
        yield fake


@pytest.fixture
def keys(monkeypatch):
    monkeypatch.setenv("SERPER_API_KEY", KEY)
    monkeypatch.setenv("S2_API_KEY", S2_KEY)


def serper(server, **kwargs) -> SerperSearchTool:
    return SerperSearchTool(base_url=server.base_url, backoff_s=0.0, timeout_s=5, **kwargs)


def s2(server, **kwargs) -> SemanticScholarSearchTool:
    return SemanticScholarSearchTool(base_url=f"{server.base_url}/graph/v1", backoff_s=0.0, timeout_s=5, **kwargs)


def assert_no_key(result) -> None:
    for secret in (KEY, S2_KEY):
        assert secret not in result.text and secret not in (result.error or "")


# ---- keys ------------------------------------------------------------------------------------
def test_missing_serper_key_names_the_variable(monkeypatch):
    monkeypatch.delenv("MY_SERPER", raising=False)
    with pytest.raises(ToolError, match="environment variable MY_SERPER is not set"):
        SerperSearchTool(api_key_env="MY_SERPER")


def test_s2_key_is_optional(server, monkeypatch):
    monkeypatch.delenv("S2_API_KEY", raising=False)
    server.s2_api_key = None
    result = s2(server)("graph neural networks")
    assert result.ok
    assert "x-api-key" not in server.requests[-1][2]


# ---- Serper ----------------------------------------------------------------------------------
def test_serper_results_ids_and_key_header(server, keys):
    tool = serper(server, top_k=3)
    result = tool("volcano eruptions")
    assert result.ok and len(result.snippet_ids) == 3
    method, path, headers, body = server.requests[-1]
    assert (method, path) == ("POST", "/search")
    assert headers["x-api-key"] == KEY and body == {"q": "volcano eruptions", "num": 3}
    urls = [server.page_url(f"volcano-{i}") for i in range(3)]
    assert result.snippet_ids == [url_id(u) for u in urls]
    assert all(re.fullmatch(r"W[0-9a-f]{10}", i) for i in result.snippet_ids)
    assert SNIPPET.findall(result.text) == result.snippet_ids
    assert "Result 0 about volcano eruptions: Snippet 0" in result.text and f"URL: {urls[0]}" in result.text
    assert_no_key(result)
    assert KEY not in repr(tool)
    # ids are stable across calls and instances: the same page keeps its id
    assert serper(server, top_k=3)("volcano eruptions").snippet_ids == result.snippet_ids
    assert tool.urls.url(result.snippet_ids[1]) == urls[1]


def test_serper_429_then_200_is_retried(server, keys):
    server.faults.extend([429, 429])
    result = serper(server, max_retries=3)("retry me")
    assert result.ok
    assert sum(1 for r in server.requests if r[1] == "/search") == 3


@pytest.mark.parametrize("retries", [0, 2])
def test_serper_persistent_500_gives_error_after_bounded_retries(server, keys, retries):
    server.faults.extend([500] * 10)
    result = serper(server, max_retries=retries)("q")
    assert not result.ok and "HTTP 500" in result.error
    assert len(server.requests) == retries + 1
    assert result.text.startswith("<tool_output><error>web search: HTTP 500")


def test_serper_malformed_json(server, keys):
    server.faults.append("malformed")
    result = serper(server)("q")
    assert not result.ok and result.error == "web search: malformed JSON in the response"


def test_serper_slow_response_times_out(server, keys):
    server.faults.append("slow")
    tool = SerperSearchTool(base_url=server.base_url, timeout_s=0.2, max_retries=0)
    start = time.monotonic()
    result = tool("q")
    assert time.monotonic() - start < 0.9
    assert not result.ok and result.error == "web search: request timed out"


def test_key_echoed_by_server_is_scrubbed(server, keys):
    server.faults.append("echo_key")
    result = serper(server)("q")
    assert not result.ok and "HTTP 403" in result.error and "***" in result.error
    assert_no_key(result)


def test_wrong_key_is_an_error_without_the_key(server, monkeypatch):
    monkeypatch.setenv("SERPER_API_KEY", "wrong-key-123")
    result = serper(server)("q")
    assert not result.ok and "HTTP 401" in result.error
    assert "wrong-key-123" not in result.text


def test_server_down_is_an_error(keys):
    with FakeWebSearchServer() as fake:
        url = fake.base_url
    with SerperSearchTool(base_url=url, max_retries=1, backoff_s=0.0, timeout_s=2) as tool:
        result = tool("q")
    assert not result.ok and result.error.startswith("web search: request failed: ConnectError")


def test_no_results(server, keys):
    server.results_for = lambda q, n: []
    result = serper(server)("nothing here")
    assert result.ok and result.snippet_ids == [] and "no results" in result.text


# ---- Semantic Scholar ------------------------------------------------------------------------
def test_s2_papers_become_snippets(server, keys):
    result = s2(server, top_k=2)("protein folding")
    assert result.ok and len(result.snippet_ids) == 2
    assert all(re.fullmatch(r"S2:[0-9a-f]{40}", i) for i in result.snippet_ids)
    method, path, headers, params = server.requests[-1]
    assert (method, path) == ("GET", "/graph/v1/paper/search")
    assert headers["x-api-key"] == S2_KEY
    assert params == {"query": "protein folding", "limit": "2", "fields": "title,abstract,year,url,paperId"}
    assert "Result 0 about protein folding (2020): Snippet 0" in result.text
    assert_no_key(result)


def test_s2_429_then_200_and_malformed(server, keys):
    server.faults.extend([429, "malformed"])
    result = s2(server, max_retries=1)("q")
    assert not result.ok and "malformed JSON" in result.error
    server.faults.extend([503])
    assert s2(server, max_retries=1)("q").ok


# ---- browsing --------------------------------------------------------------------------------
def test_html_to_text_strips_tags_scripts_and_entities():
    title, text = html_to_text(
        "<html><head><title> A &amp; B </title><style>p{}</style></head><body><nav>Menu</nav>"
        "<p>First <b>bold</b> line.</p><script>alert(1)</script><ul><li>one</li><li>two</li></ul></body></html>"
    )
    assert title == "A & B"
    assert text == "Menu\nFirst bold line.\none\ntwo"


def test_browse_opens_a_search_result_by_id_or_url(server, keys):
    book = UrlBook()
    search = serper(server, urls=book)
    browse = WebBrowseTool(allow_networks=LOOPBACK, urls=book, backoff_s=0.0)
    hit = search("glaciers")
    page = browse(hit.snippet_ids[0])
    assert page.ok and page.snippet_ids == [hit.snippet_ids[0]]
    assert (
        f'<snippet id="{hit.snippet_ids[0]}">Page glaciers-0: Heading glaciers-0\nBody text of glaciers-0.' in page.text
    )
    assert "var x" not in page.text
    assert browse(server.page_url("glaciers-1")).snippet_ids == [hit.snippet_ids[1]]
    unknown = browse("W0000000000")
    assert not unknown.ok and "unknown page id 'W0000000000'" in unknown.error
    assert not browse(server.page_url("never-returned")).ok  # only pages a search returned


def test_browse_truncates_and_rejects_binary(server, keys):
    server.pages["long-0"] = ("text/html", "<p>" + "word " * 5000 + "</p>")
    server.pages["long-1"] = ("application/pdf", "%PDF-1.4 binary")
    book = UrlBook()
    hit = serper(server, urls=book, top_k=2)("long")
    browse = WebBrowseTool(allow_networks=LOOPBACK, urls=book, max_chars=500)
    page = browse(hit.snippet_ids[0])
    assert page.ok and len(page.text) < 650 and "…</snippet>" in page.text
    pdf = browse(hit.snippet_ids[1])
    assert not pdf.ok and "unsupported content type 'application/pdf'" in pdf.error


def test_browse_retries_and_http_errors(server, keys):
    book = UrlBook()
    hit = serper(server, urls=book)("pages")
    server.page_faults.extend([503])
    assert WebBrowseTool(allow_networks=LOOPBACK, urls=book, backoff_s=0.0, max_retries=1)(hit.snippet_ids[0]).ok
    server.page_faults.extend([404])
    missing = WebBrowseTool(allow_networks=LOOPBACK, urls=book, backoff_s=0.0)(hit.snippet_ids[0])
    assert not missing.ok and missing.error.endswith("HTTP 404")


def test_url_book_is_bounded_and_maps_both_ways():
    book = UrlBook(max_entries=2)
    for i in range(3):
        book.add(f"W{i}", f"http://h/{i}")
    assert len(book) == 2 and book.url("W0") is None and book.id_for_url("http://h/0") is None
    assert book.url("W2") == "http://h/2" and book.id_for_url("http://h/1") == "W1"


def test_browse_unknown_charset_falls_back_to_utf8(server, keys):
    server.pages["odd-0"] = ("text/plain; charset=no-such-charset", "caf\u00e9 text")
    book = UrlBook()
    hit = serper(server, urls=book, top_k=1)("odd")
    page = WebBrowseTool(allow_networks=LOOPBACK, urls=book)(hit.snippet_ids[0])
    assert page.ok and "café text" in page.text


def test_cached_search_refills_the_browse_map(server, keys, tmp_path):
    specs = [
        {"name": "search", "kind": "serper", "cache": True, "base_url": server.base_url, "backoff_s": 0.0},
        {"name": "browse", "kind": "web_browse", "backoff_s": 0.0, "allow_networks": LOOPBACK},
    ]
    first = build_tools(specs, cache_dir=tmp_path)
    hit = first["search"]("lakes")
    searches = sum(1 for r in server.requests if r[1] == "/search")
    # a restart: new tools, empty URL book; the search is served from the cache
    second = build_tools(specs, cache_dir=tmp_path)
    assert second["search"]("lakes") == hit
    assert sum(1 for r in server.requests if r[1] == "/search") == searches
    assert second["search"].stats()["cache_hits"] == 1
    page = second["browse"](hit.snippet_ids[2])
    assert page.ok and "Body text of lakes-2." in page.text


def test_a_resumed_teacher_round_browses_what_an_earlier_process_searched(server, keys, tmp_path):
    """Teacher rounds resume in a new process (the Batch API is resumable): the search ran in round r, the
    browse of one of its ids in round r+1 with freshly built tools. The round replays the trajectory's
    tool outputs into the env (ToolEnv.observe), never the teacher's own text (it could invent a URL)."""
    from rubricem_core.scaffold import ToolCall
    from rubricem_core.teacher.rounds import TrajectoryState, tool_outputs
    from rubricem_core.tools.base import ToolEnv

    specs = [
        {"name": "search", "kind": "serper", "base_url": server.base_url, "backoff_s": 0.0},
        {"name": "browse", "kind": "web_browse", "backoff_s": 0.0, "allow_networks": LOOPBACK},
    ]
    first = ToolEnv(build_tools(specs, cache_dir=tmp_path), max_calls=10)
    found = first.execute(ToolCall("search", "lakes"))
    invented = f'<snippet id="Wdeadbeef00">x\nURL: {server.page_url("secret")}</snippet>'
    state = TrajectoryState(
        trajectory_id="t",
        query_id="q",
        sample_index=0,
        seed=0,
        messages=[
            {"role": "system", "content": "s"},
            {"role": "user", "content": f"question {invented}"},
            {"role": "assistant", "content": f'{invented} <call_tool name="search">lakes</call_tool>'},
            {"role": "user", "content": found.text},
        ],
    )
    assert tool_outputs(state) == [found.text]
    second = ToolEnv(build_tools(specs, cache_dir=tmp_path), max_calls=10)  # the rerun's process
    assert "unknown page id" in second.execute(ToolCall("browse", found.snippet_ids[1])).text
    for output in tool_outputs(state):
        second.observe(output)
    page = second.execute(ToolCall("browse", found.snippet_ids[1]))
    assert page.ok and "Body text of lakes-1." in page.text
    assert "unknown page id" in second.execute(ToolCall("browse", "Wdeadbeef00")).text


def test_registry_web_kinds(server, keys):
    tools = build_tools(
        [
            {"name": "web", "kind": "serper", "base_url": server.base_url, "top_k": 2, "timeout_s": 3},
            {"name": "papers", "kind": "semantic_scholar", "base_url": f"{server.base_url}/graph/v1"},
            {"name": "open", "kind": "web_browse", "max_chars": 300, "timeout_s_http": 1.5, "allow_networks": LOOPBACK},
        ]
    )
    assert all(isinstance(t, RobustTool) for t in tools.values())
    assert tools["web"].spec.name == "web" and tools["web"].inner.top_k == 2
    assert tools["open"].inner._client.timeout.read == 1.5
    paper = tools["papers"]("q")
    assert tools["open"](paper.snippet_ids[0]).ok  # one URL book for all web tools of a build
    with pytest.raises(ToolError, match=r"tools\[0\] \(web\)\.q: unknown argument for kind 'serper'"):
        build_tools([{"name": "web", "kind": "serper", "q": 1}])


def test_registry_missing_key_names_spec_and_variable(monkeypatch):
    monkeypatch.delenv("NOPE_KEY", raising=False)
    with pytest.raises(ToolError, match=r"tools\[0\] \(web\): SerperSearchTool: environment variable NOPE_KEY"):
        build_tools([{"name": "web", "kind": "serper", "api_key_env": "NOPE_KEY"}])


def test_cache_file_never_holds_the_key(server, keys, tmp_path):
    tool = RobustTool(serper(server), cache=ToolCache(tmp_path))
    assert tool("q").ok
    assert KEY.encode() not in (tmp_path / "tool_cache.sqlite").read_bytes()
    assert KEY not in tool.fingerprint


# ---- what the web tools refuse to reach -----------------------------------------------------------
def test_browse_refuses_loopback_private_and_metadata_addresses_unless_allowed():
    from rubricem_core.tools.web import RefusedURL, public_only

    check = public_only()
    for url in (
        "http://127.0.0.1:8080/",
        "http://localhost/",
        "http://10.0.0.5/",
        "http://192.168.1.1/",
        "http://169.254.169.254/latest/meta-data/",  # cloud metadata
        "http://[::1]/",
        "http://[::ffff:127.0.0.1]/",
        "file:///etc/passwd",
    ):
        with pytest.raises(RefusedURL):
            check(url)
    public_only([ipaddress.ip_network("127.0.0.0/8")])("http://127.0.0.1:8080/")  # allowed by name


@contextmanager
def _redirect(target_host: str, body: str, path: str) -> Iterator[tuple[Any, Any]]:
    """A page (``body``) on ``target_host``, and a server on 127.0.0.1 that redirects every request to its
    ``path``: (target, hop), both recording the requests they get."""
    from rubricem_core.testing.redirect_server import RecordingServer

    with RecordingServer(target_host, body=body) as target:
        with RecordingServer("127.0.0.1", redirect_to=target.url(path)) as hop:
            yield target, hop


def _browse(url: str, snippet_id: str, allow_network: str) -> ToolResult:
    """Browse ``url`` as the search result ``snippet_id``, with one named network allowed."""
    book = UrlBook()
    book.add(snippet_id, url)
    return WebBrowseTool(urls=book, allow_networks=[allow_network], backoff_s=0.0)(snippet_id)


def test_a_page_that_redirects_to_an_internal_address_is_refused_before_anything_reaches_it():
    with _redirect("127.0.0.2", "internal-only metadata", "/secret") as (internal, hostile):
        # the page's own address is allowed (it stands for a public site); the target is not
        result = _browse(hostile.url("/page"), "Wevil", "127.0.0.1/32")
    assert not result.ok and "127.0.0.2" in result.text and "non-public" in result.text
    assert "internal-only metadata" not in result.text
    assert internal.requests == [] and len(hostile.requests) == 1


def test_an_api_key_never_follows_a_redirect_to_another_host(monkeypatch):
    monkeypatch.setenv("SERPER_API_KEY", KEY)
    with _redirect("127.0.0.2", "{}", "/search") as (elsewhere, api):
        result = SerperSearchTool(base_url=api.url("").rstrip("/"), backoff_s=0.0, max_retries=0)("a query")
    assert not result.ok and "another host" in result.text and KEY not in result.text
    assert elsewhere.requests == []  # the key header went nowhere but its own host
    assert api.requests[0][2]["x-api-key"] == KEY


def test_browse_follows_a_redirect_to_an_allowed_address():
    with _redirect("127.0.0.1", "plain text page", "/moved") as (site, first):
        page = _browse(first.url("/old"), "Wmoved", "127.0.0.0/8")
    assert page.ok and "plain text page" in page.text and site.requests[0][1] == "/moved"
