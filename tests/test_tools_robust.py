"""RobustTool (timeout, concurrency, validation, caps, counters), ToolCache, and the registry's local kinds."""

from __future__ import annotations

import multiprocessing
import threading
import time

import pyarrow as pa
import pytest

from rubricem_core import scaffold
from rubricem_core.tools import ToolCall, ToolEnv, ToolError, ToolResult, ToolSpec, error_result, format_search_results
from rubricem_core.tools.base import Tool
from rubricem_core.tools.cache import ToolCache, cache_key, normalize_query
from rubricem_core.tools.registry import build_tools
from rubricem_core.tools.robust import RobustTool, cap_output, validate_result
from tests.threads import PeakGauge, run_in_threads


class FakeTool(Tool):
    """Answers with one snippet per query word; counts calls; can block, fail or return garbage."""

    def __init__(self, name: str = "search", respond=None):
        self.spec = ToolSpec(name, "fake")
        self.calls = 0
        self.respond = respond
        self._lock = threading.Lock()

    def __call__(self, query: str) -> ToolResult:
        with self._lock:
            self.calls += 1
        if self.respond is not None:
            return self.respond(query)
        words = query.split()
        ids = [f"D{i}" for i in range(len(words))]
        return ToolResult(format_search_results([(i, w, f"about {w}") for i, w in zip(ids, words)]), ids)


def ok(ids=("D1",), body="text") -> ToolResult:
    return ToolResult(format_search_results([(i, "T", body) for i in ids]), list(ids))


# ---- ToolCache --------------------------------------------------------------------------------
def test_cache_roundtrip_survives_restart_and_keys_on_fingerprint(tmp_path):
    cache = ToolCache(tmp_path / "c")
    result = ok(("D1", "D2"))
    assert cache.get("search", "q", "v1") is None
    assert cache.put("search", "q", "v1", result)
    again = ToolCache(tmp_path / "c")  # a new process would open the same file
    assert again.get("search", "q", "v1") == result
    assert again.get("search", "  q \n", "v1") == result  # whitespace-normalized
    assert again.get("search", "Q", "v1") is None  # case is kept (URLs, ids)
    assert again.get("search", "q", "v2") is None
    assert again.get("browse", "q", "v1") is None
    assert len(again) == 1


def test_cache_never_stores_errors(tmp_path):
    cache = ToolCache(tmp_path)
    assert not cache.put("search", "q", "v", error_result("boom"))
    assert cache.get("search", "q", "v") is None and len(cache) == 0


def test_cache_max_age(tmp_path):
    ToolCache(tmp_path).put("search", "q", "v", ok())
    assert ToolCache(tmp_path, max_age_s=60).get("search", "q", "v") == ok()
    time.sleep(0.05)
    assert ToolCache(tmp_path, max_age_s=0.01).get("search", "q", "v") is None
    with pytest.raises(ToolError, match="max_age_s"):
        ToolCache(tmp_path, max_age_s=0)


def test_normalize_and_key():
    assert normalize_query(" a\t b\n") == "a b"
    assert normalize_query("e\u0301") == "\u00e9"  # NFC
    assert cache_key("s", "a  b", "f") == cache_key("s", "a b", "f") != cache_key("s", "a b", "g")


def test_cache_threads(tmp_path):
    cache = ToolCache(tmp_path)
    errors = []

    def work(t: int) -> None:
        try:
            for i in range(25):
                cache.put("search", f"q{t}-{i}", "v", ok((f"D{t}x{i}",)))
                assert cache.get("search", f"q{t}-{i}", "v").snippet_ids == [f"D{t}x{i}"]
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(exc)

    run_in_threads(work, 8)
    assert not errors
    assert len(cache) == 200


def _child_writes(directory: str, worker: int) -> None:
    cache = ToolCache(directory)
    for i in range(20):
        cache.put("search", f"p{worker}-{i}", "v", ok((f"P{worker}x{i}",)))


def test_cache_processes_share_the_file(tmp_path):
    cache = ToolCache(tmp_path)
    cache.put("search", "parent", "v", ok())  # the parent holds an open connection across the fork
    ctx = multiprocessing.get_context("fork")
    procs = [ctx.Process(target=_child_writes, args=(str(tmp_path), w)) for w in range(3)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(30)
        assert p.exitcode == 0
    assert len(cache) == 61
    assert cache.get("search", "p2-19", "v").snippet_ids == ["P2x19"]


# ---- validation and caps ----------------------------------------------------------------------
@pytest.mark.parametrize(
    "garbage, message",
    [
        ("<tool_output>x</tool_output>", "returned str, not a ToolResult"),
        (None, "returned NoneType"),
        (ToolResult(text=123), "non-string text"),  # type: ignore[arg-type]
        (ToolResult(text="plain words", snippet_ids=[]), "not a <tool_output> block"),
        (ToolResult(ok().text, ["bad id"]), "invalid snippet ids"),
        (ToolResult(ok().text, ["D99"]), "not in its output"),
        (ToolResult(ok().text, "D1"), "not a list of strings"),  # type: ignore[arg-type]
        (ToolResult(ok().text, [1]), "not a list of strings"),  # type: ignore[list-item]
    ],
)
def test_garbage_becomes_error_result(garbage, message):
    tool = RobustTool(FakeTool(respond=lambda q: garbage), timeout_s=5)
    result = tool("anything")
    assert not result.ok and message in result.error
    assert result.text.startswith("<tool_output><error>")
    assert tool.stats()["errors"] == 1
    assert validate_result(ok(), "x") == ok()


@pytest.mark.parametrize("max_chars", [300, 2_000, 9_000])
def test_cap_drops_whole_snippets_and_stays_well_formed(max_chars):
    big = ok(tuple(f"D{i}" for i in range(40)), body="word " * 40)
    assert len(big.text) > max_chars
    capped, cut = cap_output(big, max_chars)
    assert cut and len(capped.text) <= max_chars
    ids = [m for m in scaffold.extract_snippet_ids(capped.text)]
    assert sorted(ids) == sorted(capped.snippet_ids) and len(ids) >= 1
    assert capped.snippet_ids == big.snippet_ids[: len(capped.snippet_ids)]
    assert capped.text.startswith("<tool_output><snippet") and capped.text.endswith("</snippet></tool_output>")
    # a trajectory that carries the capped block still parses as a valid tool output
    assert scaffold.extract_snippet_ids('<call_tool name="search">q</call_tool>' + capped.text) == set(ids)


def test_cap_shortens_one_giant_snippet_and_giant_error():
    giant = ok(("D1",), body="x" * 200 + " " + "y" * 100_000)
    capped, cut = cap_output(giant, 1_000)
    assert cut and len(capped.text) <= 1_000 and capped.snippet_ids == ["D1"]
    assert capped.text.endswith("…</snippet></tool_output>")
    err, cut = cap_output(error_result("e" * 50_000), 500)
    assert cut and len(err.text) <= 500 and err.text.endswith("…</error></tool_output>") and not err.ok
    small, cut = cap_output(ok(), 10_000)
    assert not cut and small == ok()


def test_robust_caps_enormous_output_and_counts_it():
    tool = RobustTool(FakeTool(), max_output_chars=400)
    result = tool(" ".join(f"w{i}" for i in range(200)))
    assert result.ok and len(result.text) <= 400 and 0 < len(result.snippet_ids) < 200
    assert tool.stats()["truncated"] == 1


# ---- timeout, exceptions, concurrency ---------------------------------------------------------
def test_hung_tool_times_out_and_caller_moves_on():
    release = threading.Event()
    tool = RobustTool(
        FakeTool(respond=lambda q: (release.wait(10), ok())[1]), timeout_s=0.2, max_concurrency=1, wait_timeout_s=0.3
    )
    start = time.monotonic()
    result = tool("q")
    assert time.monotonic() - start < 1.0
    assert not result.ok and result.error == "tool 'search' timed out after 0.2s"
    # the hung call still holds the only slot: the next caller is told the tool is busy
    busy = tool("q2")
    assert not busy.ok and "busy" in busy.error
    assert tool.stats() == {"calls": 2, "cache_hits": 0, "timeouts": 1, "errors": 1, "truncated": 0, "in_flight": 1}
    release.set()
    deadline = time.monotonic() + 5
    while tool.stats()["in_flight"] and time.monotonic() < deadline:
        time.sleep(0.01)
    assert tool("q3").ok  # the slot came back when the hung call really ended


def test_exception_becomes_error_result():
    def boom(query):
        raise ValueError("backend exploded")

    tool = RobustTool(FakeTool(respond=boom))
    result = tool("q")
    assert not result.ok and result.error == "tool 'search' failed: ValueError: backend exploded"
    assert tool.stats()["errors"] == 1 and tool.stats()["calls"] == 1


@pytest.mark.parametrize("limit", [1, 3])
def test_concurrency_limit_is_shared_across_threads(limit):
    gauge = PeakGauge()

    def slow(query):
        with gauge.running():
            time.sleep(0.03)
        return ok()

    tool = RobustTool(FakeTool(respond=slow), timeout_s=5, max_concurrency=limit)
    results = []
    run_in_threads(lambda _: results.append(tool("q")), 12)
    assert len(results) == 12 and all(r.ok for r in results)
    assert gauge.peak == limit
    assert tool.stats()["calls"] == 12 and tool.stats()["in_flight"] == 0


def test_bad_wrapper_arguments():
    with pytest.raises(ToolError, match="timeout_s"):
        RobustTool(FakeTool(), timeout_s=0)
    with pytest.raises(ToolError, match="max_concurrency"):
        RobustTool(FakeTool(), max_concurrency=0)
    with pytest.raises(ToolError, match="wraps a Tool"):
        RobustTool(object())  # type: ignore[arg-type]


# ---- cache through the wrapper ----------------------------------------------------------------
def test_cache_hits_skip_the_tool_and_survive_a_restart(tmp_path):
    inner = FakeTool()
    tool = RobustTool(inner, cache=ToolCache(tmp_path))
    first = tool("alpha beta")
    assert tool("  alpha   beta ") == first
    assert inner.calls == 1 and tool.stats()["cache_hits"] == 1
    restarted_inner = FakeTool()
    restarted = RobustTool(restarted_inner, cache=ToolCache(tmp_path))
    assert restarted("alpha beta") == first and restarted_inner.calls == 0
    other = RobustTool(FakeTool(), cache=ToolCache(tmp_path), fingerprint="v2")
    other("alpha beta")
    assert other.stats()["cache_hits"] == 0


def test_errors_and_timeouts_are_not_cached(tmp_path):
    outcomes = iter([error_result("rate limited"), "garbage", ok()])
    inner = FakeTool(respond=lambda q: next(outcomes))
    tool = RobustTool(inner, cache=ToolCache(tmp_path))
    assert not tool("q").ok and not tool("q").ok
    assert tool("q").ok and tool("q").ok
    assert inner.calls == 3 and tool.stats()["cache_hits"] == 1

    release = threading.Event()
    hung = RobustTool(FakeTool(respond=lambda q: (release.wait(5), ok())[1]), timeout_s=0.1, cache=ToolCache(tmp_path))
    assert not hung("slow").ok
    release.set()
    time.sleep(0.05)
    assert ToolCache(tmp_path).get("search", "slow", hung.fingerprint) is None


def test_observe_replays_on_cache_hit(tmp_path):
    class Observing(FakeTool):
        seen: list = []

        def observe(self, result):
            self.seen.append(result.snippet_ids)

    RobustTool(Observing(), cache=ToolCache(tmp_path))("a b")
    inner = Observing()
    inner.seen = []
    RobustTool(inner, cache=ToolCache(tmp_path))("a b")
    assert inner.calls == 0 and inner.seen == [["D0", "D1"]]


def test_tool_env_with_robust_tool_never_raises():
    def boom(query):
        raise RuntimeError("x")

    env = ToolEnv({"search": RobustTool(FakeTool(respond=boom))}, max_calls=3)
    result = env.execute(ToolCall("search", "q"))
    assert not result.ok and "RuntimeError" in result.error


# ---- registry: local kinds and validation -----------------------------------------------------
def corpus(text: str = "Hekla is an active volcano in Iceland.") -> pa.Table:
    return pa.table({"doc_id": ["D1", "D2"], "title": ["Hekla", "Coral"], "text": [text, "Coral reefs bleach."]})


def test_build_local_tools_wrapped_and_cached(tmp_path):
    specs = [
        {"name": "search", "kind": "local_search", "top_k": 1, "cache": True, "timeout_s": 5},
        {"name": "browse", "kind": "local_browse", "max_chars": 500, "max_concurrency": 2},
    ]
    tools = build_tools(specs, corpus=corpus(), cache_dir=tmp_path)
    assert set(tools) == {"search", "browse"} and all(isinstance(t, RobustTool) for t in tools.values())
    assert tools["search"].timeout_s == 5 and tools["browse"].max_concurrency == 2
    assert tools["search"].cache is not None and tools["browse"].cache is None
    hit = tools["search"]("volcano Iceland")
    assert hit.snippet_ids == ["D1"] and tools["browse"]("D1").snippet_ids == ["D1"]
    again = build_tools(specs, corpus=corpus(), cache_dir=tmp_path)["search"]
    again("volcano Iceland")
    assert again.stats()["cache_hits"] == 1
    changed = build_tools(specs, corpus=corpus("Hekla volcano Iceland erupted in 2000."), cache_dir=tmp_path)["search"]
    assert "2000" in changed("volcano Iceland").text and changed.stats()["cache_hits"] == 0


@pytest.mark.parametrize(
    "spec, kwargs, message",
    [
        ({"name": "s", "kind": "bing"}, {}, r"tools\[0\] \(s\)\.kind: unknown kind 'bing'"),
        ({"kind": "local_search"}, {}, r"tools\[0\]\.name: required"),
        ({"name": "s", "kind": "local_search", "topk": 3}, {}, r"tools\[0\] \(s\)\.topk: unknown argument"),
        ({"name": "s", "kind": "local_search", "cache": True}, {}, r"\.cache: true needs a cache directory"),
        ({"name": "s", "kind": "local_search", "cache": "yes"}, {"cache_dir": "x"}, r"\.cache: expected true or false"),
        ({"name": "s", "kind": "local_search", "top_k": 0}, {}, r"tools\[0\] \(s\): top_k"),
        ({"name": "s", "kind": "local_search", "timeout_s": -1}, {}, r"tools\[0\] \(s\): .*timeout_s"),
        ({"name": "s", "kind": "mcp", "tool_name": "x"}, {}, r"tools\[0\] \(s\)\.server: required"),
    ],
)
def test_registry_errors_name_the_field(spec, kwargs, message):
    with pytest.raises(ToolError, match=message):
        build_tools([spec], corpus=corpus(), **kwargs)


def test_registry_rejects_duplicates_and_missing_corpus():
    with pytest.raises(ToolError, match=r"tools\[1\] \(s\)\.name: duplicate"):
        build_tools([{"name": "s", "kind": "local_browse"}] * 2, corpus=corpus())
    with pytest.raises(ToolError, match="needs a corpus"):
        build_tools([{"name": "s", "kind": "local_browse"}])
