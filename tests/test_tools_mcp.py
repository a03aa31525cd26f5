"""MCPTool against a real fastmcp server on 127.0.0.1 (streamable HTTP in a thread, and stdio)."""

from __future__ import annotations

import socket
import sys
import threading
import time

import pytest

pytest.importorskip("fastmcp")

from rubricem_core.tools import ToolCall, ToolEnv, ToolError  # noqa: E402
from rubricem_core.tools.mcp import MCPTool, result_to_snippets  # noqa: E402
from rubricem_core.tools.registry import build_tools  # noqa: E402
from tests.threads import run_in_threads  # noqa: E402

CORPUS = [
    {"id": "K1", "title": "Hekla", "text": "Hekla is an active volcano in Iceland."},
    {"id": "K2", "title": "Coral", "text": "Coral reefs bleach when the ocean warms."},
    {"id": "K3", "title": "Glaciers", "text": "Alpine glaciers retreat as the climate warms."},
]

SERVER_SOURCE = '''
from fastmcp import FastMCP

CORPUS = {corpus!r}
mcp = FastMCP("tiny-corpus")


@mcp.tool
def search(query: str, top_k: int = 2) -> list[dict]:
    """Documents sharing a word with the query, most shared words first."""
    words = set(query.lower().split())
    scored = [(len(words & set((d["title"] + " " + d["text"]).lower().replace(".", "").split())), d) for d in CORPUS]
    return [d for score, d in sorted(scored, key=lambda s: -s[0]) if score > 0][:top_k]


@mcp.tool
def note(query: str) -> str:
    return "A note about " + query


@mcp.tool
def fail(query: str) -> str:
    raise ValueError("index unavailable")


@mcp.tool
def odd_ids(query: str) -> dict:
    return {{"results": [{{"id": "has space", "title": "T", "text": "first"}}, {{"title": "U", "snippet": "second"}}]}}
'''


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_server(port: int):
    """The test server (same source as the stdio test) under uvicorn in a thread; returns a stop()."""
    import uvicorn

    namespace: dict = {}
    exec(SERVER_SOURCE.format(corpus=CORPUS), namespace)
    server = uvicorn.Server(uvicorn.Config(namespace["mcp"].http_app(), host="127.0.0.1", port=port, log_level="error"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "MCP test server did not start"
        time.sleep(0.02)

    def stop() -> None:
        server.should_exit = True
        thread.join(10)

    return stop


@pytest.fixture(scope="module")
def server_url():
    port = free_port()
    stop = start_server(port)
    yield f"http://127.0.0.1:{port}/mcp"
    stop()


def test_search_results_become_snippets(server_url):
    with MCPTool(server_url, "search", name="kb") as tool:
        assert tool.spec.name == "kb"
        result = tool("active volcano Iceland")
        assert result.ok and result.snippet_ids == ["K1"]
        assert (
            result.text
            == '<tool_output><snippet id="K1">Hekla: Hekla is an active volcano in Iceland.</snippet></tool_output>'
        )
        two = tool("the ocean warms")
        assert two.snippet_ids == ["K2", "K3"]
        empty = tool("zzz")
        assert empty.ok and empty.snippet_ids == [] and "no results for 'zzz'" in empty.text


def test_extra_arguments_and_text_content(server_url):
    with MCPTool(server_url, "search", extra_arguments={"top_k": 1}) as one:
        assert one("the ocean warms").snippet_ids == ["K2"]
    with MCPTool(server_url, "note") as note:
        result = note("lava")
        assert result.ok and len(result.snippet_ids) == 1 and result.snippet_ids[0].startswith("M")
        assert "A note about lava" in result.text
        assert note("lava").snippet_ids == result.snippet_ids  # hashed ids are stable


def test_unsafe_or_missing_ids_are_replaced_by_stable_hashes(server_url):
    with MCPTool(server_url, "odd_ids", id_prefix="X") as tool:
        result = tool("q")
        assert result.ok and len(result.snippet_ids) == 2
        assert all(i.startswith("X") and " " not in i for i in result.snippet_ids)
        assert "U: second" in result.text


def test_unknown_tool_and_tool_error(server_url):
    with MCPTool(server_url, "nonexistent") as missing:
        result = missing("q")
        assert not result.ok and "has no tool 'nonexistent'" in result.error
        assert "search" in result.error  # the available tools are listed
    with MCPTool(server_url, "fail") as failing:
        result = failing("q")
        assert not result.ok and "index unavailable" in result.error


def test_server_down_is_an_error_result():
    url = f"http://127.0.0.1:{free_port()}/mcp"
    with MCPTool(url, "search", timeout_s=5) as tool:
        start = time.monotonic()
        result = tool("q")
        assert time.monotonic() - start < 5
        assert not result.ok and "unreachable" in result.error
        assert not tool("q").ok  # still an error, not an exception, on the next call


def test_server_restart_reconnects():
    port = free_port()
    stop = start_server(port)
    with MCPTool(f"http://127.0.0.1:{port}/mcp", "search", timeout_s=10) as tool:
        assert tool("coral").snippet_ids == ["K2"]
        stop()
        stop = start_server(port)  # the old session is gone; the call retries on a new connection
        assert tool("coral").snippet_ids == ["K2"]
        stop()
        down = tool("coral")
        assert not down.ok and ("unreachable" in down.error or "call failed" in down.error)


def test_concurrent_calls_share_one_connection(server_url):
    tool = build_tools(
        [
            {
                "name": "kb",
                "kind": "mcp",
                "server": server_url,
                "tool_name": "search",
                "max_concurrency": 4,
                "timeout_s": 15,
            }
        ]
    )["kb"]
    assert tool.timeout_s == 15 and tool.inner.timeout_s == 15
    env = ToolEnv({"kb": tool}, max_calls=100)
    results = [None] * 16
    queries = ["volcano Iceland", "coral reefs", "glaciers retreat", "ocean warms"]

    def work(i: int) -> None:
        results[i] = env.execute(ToolCall("kb", queries[i % 4]))

    run_in_threads(work, 16)
    assert all(r.ok for r in results)
    assert [r.snippet_ids[0] for r in results[:4]] == ["K1", "K2", "K3", "K2"]
    assert tool.stats()["calls"] == 16 and tool.stats()["errors"] == 0
    tool.close()


def test_stdio_server(tmp_path):
    script = tmp_path / "server.py"
    script.write_text(
        SERVER_SOURCE.format(corpus=CORPUS) + "\nif __name__ == '__main__':\n    mcp.run(show_banner=False)\n"
    )
    with MCPTool(f"{sys.executable} {script}", "search", timeout_s=60) as tool:
        result = tool("Hekla volcano")
        assert result.ok and result.snippet_ids == ["K1"]


def test_missing_fastmcp_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "fastmcp", None)
    with pytest.raises(ToolError, match=r"rubricem\[mcp\]"):
        MCPTool("http://127.0.0.1:1/mcp", "search")


@pytest.mark.parametrize(
    "data, texts, expected",
    [
        ([{"id": "A1", "title": "t", "text": "x"}], [], [("A1", "t", "x")]),
        ({"results": [{"doc_id": "B2", "snippet": "y"}]}, [], [("B2", "", "y")]),
        ({"result": [{"id": "C3", "text": "z", "url": "http://u"}]}, [], [("C3", "", "z\nURL: http://u")]),
        (None, ['[{"id": "D4", "title": "j", "text": "json in text"}]'], [("D4", "j", "json in text")]),
        ([{"id": "E5", "text": "dup"}, {"id": "E5", "text": "dup again"}], [], [("E5", "", "dup")]),
        ([{"id": "F6", "title": "no text"}], [], []),
        (None, ["   "], []),
    ],
)
def test_result_to_snippets_shapes(data, texts, expected):
    assert result_to_snippets(data, texts) == expected


def test_bad_arguments():
    with pytest.raises(ToolError, match="server"):
        MCPTool("  ", "search")
    with pytest.raises(ToolError, match="id_prefix"):
        MCPTool("http://127.0.0.1:1/mcp", "search", id_prefix="bad prefix")
