"""Rows that never wait and the rollout fleet, without vLLM: a fake sampler and fake servers.

The async schedule (every row its own continuation) must give exactly the trajectories of the lockstep
one; a fleet of replicas exactly those of one replica, also when a replica dies mid-batch. The fake
sampler is a pure function of the call (its seed and ids), as vLLM's seeded sampling is, and sleeps a
random, unseeded time, as do the tools: arrival order differs from run to run, results must not.
The same properties against real `vllm serve` processes: tests/test_rollout_vllm.py.
"""

from __future__ import annotations

import math
import random
import threading
import time

import httpx
import pytest

from rubricem_core.rollout import ANSWERED, ERROR, TOOL_BUDGET, TRUNCATED, RolloutError, RolloutRequest, SamplingParams
from rubricem_core.rollout.vllm_engine import TurnCall, TurnSample, VLLMRolloutEngine
from rubricem_core.rollout.vllm_fleet import ReplicaRouter, VLLMFleet, call_cost
from rubricem_core.rollout.vllm_server_engine import VLLMServerEngine
from rubricem_core.scaffold import ToolSpec, format_tool_output
from rubricem_core.sim.world import WorldConfig, generate_world
from rubricem_core.testing.tiny_models import world_tokenizer
from rubricem_core.tools.base import Tool, ToolEnv, ToolResult
from rubricem_core.trajectory import TokenTrajectory

# What the fake policy writes in one call (each ends where vLLM's stop strings would end it).
FRAGMENTS = (
    '<call_tool name="search">{w}</call_tool>',
    '<call_tool name="search">hang {w}</call_tool>',  # a tool call that outlives tool_timeout_s
    "stray </call_tool>",
    "thinking about {w} and more words",  # no stop: the turn goes on in the next call
    "<answer>The answer is {w}.</answer>",
    "<answer>still open {w}",
)
WORDS = ("bridge", "river", "tower", "harbor", "mill")


@pytest.fixture(scope="module")
def tok():
    return world_tokenizer(generate_world(WorldConfig(seed=3, n_documents=50, n_queries=4)))


def fake_sampler(tok, jitter_s: float = 0.01):
    """A pure function of the call (its seed, ids and budget), after an unseeded random sleep."""
    eos = tok.eos_token_id

    def one(call: TurnCall) -> TurnSample:
        time.sleep(random.random() * jitter_s)
        rng = random.Random(call.seed)
        pick = rng.random()
        if pick < 0.05:
            ids = [eos]
        else:
            text = FRAGMENTS[rng.randrange(len(FRAGMENTS))].format(w=WORDS[rng.randrange(len(WORDS))])
            ids = tok.encode(text, add_special_tokens=False)
            if rng.random() < 0.1:
                ids = ids + [eos]
        ids = ids[: call.max_tokens]
        return TurnSample(ids, [-rng.random() for _ in ids])

    return one


class SleepyTool(Tool):
    """Answers after 0-``max_sleep_s`` (unseeded), or hangs past the timeout for a query starting 'hang'.
    Counts the answering calls running at once."""

    def __init__(self, max_sleep_s: float, hang_s: float):
        self.spec = ToolSpec("search", "test")
        self.max_sleep_s, self.hang_s = max_sleep_s, hang_s
        self.running = self.peak = 0
        self.lock = threading.Lock()

    def __call__(self, query: str) -> ToolResult:
        if query.startswith("hang"):  # abandoned at the timeout: it no longer holds a slot, so not counted
            time.sleep(self.hang_s)
            return ToolResult(format_tool_output([("D0", "late")]), ["D0"])
        with self.lock:
            self.running += 1
            self.peak = max(self.peak, self.running)
        try:
            time.sleep(random.random() * self.max_sleep_s)
            return ToolResult(format_tool_output([(f"D{len(query)}", f"about {query}")]), [f"D{len(query)}"])
        finally:
            with self.lock:
                self.running -= 1


def requests_for(tok, n_requests: int = 6, n: int = 4) -> list[RolloutRequest]:
    sampling = SamplingParams(temperature=1.0, max_new_tokens=24, max_total_tokens=260, seed=5)
    return [
        RolloutRequest(
            f"q{i}",
            tok.encode(f"question {i} about {WORDS[i % len(WORDS)]}", add_special_tokens=False),
            n=n,
            sampling=sampling,
            max_tool_calls=3,
        )
        for i in range(n_requests)
    ]


def same(a: list[list[TokenTrajectory]], b: list[list[TokenTrajectory]]) -> None:
    assert len(a) == len(b)
    for ga, gb in zip(a, b):
        for x, y in zip(ga, gb, strict=True):
            assert (x.token_ids, x.loss_mask, x.stage_ids) == (y.token_ids, y.loss_mask, y.stage_ids)
            assert (x.finish_reason, x.n_tool_calls, x.meta) == (y.finish_reason, y.n_tool_calls, y.meta)
            assert [s.text for s in x.segments] == [s.text for s in y.segments]
            assert all((math.isnan(p) and math.isnan(q)) or p == q for p, q in zip(x.logprobs, y.logprobs))


def test_async_rows_equal_lockstep_rows_whatever_the_arrival_order(tok):
    # the timeout is 20x the longest answering tool: a loaded machine must not push one past it
    tool = SleepyTool(max_sleep_s=0.03, hang_s=1.2)
    env = ToolEnv({"search": tool}, max_calls=3)
    requests = requests_for(tok)
    progress: list[tuple[int, int]] = []

    def engine(schedule: str, **kw) -> VLLMRolloutEngine:
        e = VLLMRolloutEngine(
            None, tok, ("search",), sampler=lambda calls: [fake_sampler(tok)(c) for c in calls], tool_timeout_s=0.6,
            schedule=schedule, **kw,
        )  # fmt: skip
        return e

    lockstep = engine("lockstep").generate(requests, env)
    tool.peak = 0
    fast = engine("async", max_in_flight=8, max_tool_concurrency=3)
    fast.on_progress = lambda done, total: progress.append((done, total))
    rows = fast.generate(requests, env)
    same(rows, lockstep)
    trajs = [t for g in rows for t in g]
    reasons = {t.finish_reason for t in trajs}
    assert reasons >= {ANSWERED, TRUNCATED, ERROR} and reasons <= {ANSWERED, TRUNCATED, ERROR, TOOL_BUDGET}
    outputs = [s.text for t in trajs for s in t.segments if s.kind == "tool_output"]
    assert any("tool timed out after 0.6 s" in o for o in outputs)  # the timeout semantics kept
    assert any("malformed tool call" in o for o in outputs) and any("about" in o for o in outputs)
    assert tool.peak <= 3  # within max_tool_concurrency
    assert fast.stats["turn_calls"] > len(trajs) and fast.stats["sampled_tokens"] > 0
    assert progress[-1] == (len(trajs), len(trajs)) and [d for d, _ in progress] == sorted(d for d, _ in progress)
    again = engine("async", max_in_flight=3, max_tool_concurrency=1).generate(requests, env)
    same(again, lockstep)


def test_async_needs_a_sampler_and_a_failing_call_fails_generate(tok, tmp_path):
    with pytest.raises(RolloutError, match="schedule='async' needs a sampler"):  # the offline LLM: lockstep only
        VLLMRolloutEngine(tmp_path, tok, ("search",), schedule="async")
    with pytest.raises(RolloutError, match="schedule must be one of"):
        VLLMRolloutEngine(None, tok, sampler=lambda c: [], schedule="eager")

    def broken(calls):
        raise RuntimeError("server said no")

    engine = VLLMRolloutEngine(None, tok, ("search",), sampler=broken, schedule="async")
    with pytest.raises(RuntimeError, match="server said no"):
        engine.generate(requests_for(tok, 2, 2), ToolEnv({"search": SleepyTool(0, 0)}, 3))


# ---- the router and the fleet -------------------------------------------------------------------


def call(rid: str, prompt: int, max_tokens: int) -> TurnCall:
    return TurnCall(rid, 0, 0, [1] * prompt, [], max_tokens, SamplingParams(), 1, (), (2,))


def test_router_keeps_a_group_on_one_replica_and_balances_outstanding_tokens():
    router = ReplicaRouter(3)
    a, b, c, d = call("a", 100, 50), call("b", 10, 10), call("c", 30, 10), call("d", 5, 5)
    assert [router.acquire(x) for x in (a, b, c)] == [0, 1, 2]
    assert router.outstanding == [150, 20, 40]
    assert router.acquire(d) == 1  # the least loaded replica (20)
    assert router.acquire(call("a", 200, 50)) == 0  # sticky: a's group stays where its prefix is cached
    router.release(0, a)
    router.release(0, call("a", 200, 50))
    assert router.outstanding == [0, 30, 40] and call_cost(a) == 150
    assert router.acquire(call("e", 1, 1)) == 0
    router.lose(0)
    assert router.live == [1, 2] and "a" not in router.placed
    assert router.acquire(call("a", 1, 1)) == 1  # placed again, on a live replica
    router.forget()
    assert router.placed == {}
    router.lose(1)
    router.lose(2)
    with pytest.raises(RolloutError, match="no live vLLM replica"):
        router.acquire(a)


class FakeProc:
    def __init__(self):
        self.returncode = None

    def poll(self):
        return self.returncode

    def wait(self, timeout=None):
        if self.returncode is None:
            raise __import__("subprocess").TimeoutExpired("vllm", timeout)
        return self.returncode


class FakeServer:
    """What VLLMFleet needs of a VLLMServer; ``die_after`` calls it dies (connection refused, process gone)."""

    def __init__(self, tok, name: str, die_after: int | None = None, max_concurrency: int = 4):
        self.sample = fake_sampler(tok, jitter_s=0.005)
        self.model_dir, self.n_workers, self.weight_transfer = "m", 1, None
        self.base_url, self.max_concurrency = f"http://{name}", max_concurrency
        self.die_after, self.served, self.proc, self.asleep = die_after, 0, FakeProc(), False
        self.lock = threading.Lock()

    def sample_one(self, call: TurnCall) -> TurnSample:
        with self.lock:
            if self.die_after is not None and self.served >= self.die_after:
                self.proc.returncode = -9
                raise httpx.ConnectError("connection refused")
            self.served += 1
        return self.sample(call)

    def dead(self, exc=None, wait_s=0.0) -> bool:
        return self.proc.poll() is not None

    def tail(self) -> str:
        return f"{self.base_url}: Killed"

    def lost_reason(self) -> str:
        return f"exited with code {self.proc.returncode}; last lines:\n{self.tail()}"

    def close(self):
        pass


def fleet_engine(tok, servers, schedule="async") -> VLLMServerEngine:
    return VLLMServerEngine(
        VLLMFleet(servers), tok, ("search",), schedule=schedule, tool_timeout_s=0.6, stop_token_ids=[tok.eos_token_id]
    )


def test_a_fleet_equals_one_replica_and_survives_a_replica_that_dies(tok):
    env = ToolEnv({"search": SleepyTool(max_sleep_s=0.02, hang_s=1.2)}, max_calls=3)
    requests = requests_for(tok, 8, 3)
    one = fleet_engine(tok, [FakeServer(tok, "a")], schedule="lockstep").generate(requests, env)
    servers = [FakeServer(tok, "a"), FakeServer(tok, "b"), FakeServer(tok, "c")]
    three = fleet_engine(tok, servers)
    same(three.generate(requests, env), one)
    assert all(s.served > 0 for s in servers) and three.fleet.live == [0, 1, 2]
    assert three.stats["resent_calls"] == 0

    # replica 1 dies after 5 calls: its calls (in flight and later) go to the others, same trajectories
    servers = [FakeServer(tok, "a"), FakeServer(tok, "b", die_after=5), FakeServer(tok, "c")]
    engine = fleet_engine(tok, servers)
    same(engine.generate(requests, env), one)
    assert engine.fleet.live == [0, 2] and engine.stats["resent_calls"] >= 1 and engine.stats["replicas_live"] == 2
    assert "exited with code -9" in engine.fleet.lost[1] and "http://b: Killed" in engine.fleet.lost[1]
    assert engine.fleet.base_urls == ["http://a", "http://c"]  # what the next weight push reaches
    lockstep = fleet_engine(tok, [FakeServer(tok, "a", die_after=3), FakeServer(tok, "b")], schedule="lockstep")
    same(lockstep.generate(requests, env), one)

    # every replica dead: the batch fails with each one's log tail
    doomed = fleet_engine(tok, [FakeServer(tok, "a", die_after=2), FakeServer(tok, "b", die_after=2)])
    with pytest.raises(RolloutError, match=r"every vLLM replica[\s\S]*replica 0[\s\S]*http://a: Killed[\s\S]*http://b"):
        doomed.generate(requests, env)


def test_a_refused_call_is_not_a_dead_replica(tok):
    class Refusing(FakeServer):
        def sample_one(self, call):
            raise RolloutError("vLLM server answered /v1/completions with HTTP 400")

    engine = fleet_engine(tok, [Refusing(tok, "a"), FakeServer(tok, "b")], schedule="lockstep")
    with pytest.raises(RolloutError, match="HTTP 400"):
        engine.generate(requests_for(tok, 2, 1), ToolEnv({"search": SleepyTool(0, 0)}, 3))
    assert engine.fleet.live == [0, 1] and engine.fleet.stats["resent_calls"] == 0


@pytest.mark.parametrize("finish_reason, fails", [("abort", True), ("error", True), ("length", False), ("stop", False)])
def test_a_completion_the_server_aborted_is_a_failed_call_not_a_short_sample(tmp_path, finish_reason, fails):
    """A stopping `vllm serve` answers its requests in flight with finish_reason "abort" and often no
    tokens: the client raises (so the fleet re-sends the call when the replica is gone) instead of handing
    the engine an empty sample, which would end the trajectory as an error."""
    import http.server
    import json

    from rubricem_core.rollout.vllm_server import ServerClient

    tokens = [] if fails else [7, 8]

    class Completions(http.server.BaseHTTPRequestHandler):
        def do_POST(self):
            self.rfile.read(int(self.headers["Content-Length"]))
            logprobs = {"tokens": [f"token_id:{t}" for t in tokens], "token_logprobs": [-0.5] * len(tokens)}
            body = json.dumps({"choices": [{"finish_reason": finish_reason, "logprobs": logprobs}]}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Completions)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    client = ServerClient(f"http://127.0.0.1:{server.server_address[1]}", api_key="k", model_dir=tmp_path)
    params = SamplingParams(temperature=1.0, max_new_tokens=4, max_total_tokens=64, seed=0)
    call = TurnCall("q", 0, 0, [1, 2], [], 4, params, 0, (), ())
    try:
        if fails:
            with pytest.raises(RolloutError, match=f"finish_reason '{finish_reason}'"):
                client.sample_one(call)
        else:
            assert client.sample_one(call) == TurnSample([7, 8], [-0.5, -0.5])
    finally:
        server.shutdown()
        client.http.close()


def test_one_transfer_group_over_the_fleet_gives_each_replica_its_ranks_and_fails_at_once():
    """FleetWeightSync: each replica's workers get their own rank offset in the one group; a replica that
    refuses the update fails the push at once, even while another is still receiving."""
    from rubricem_core.rollout.weight_transfer import FleetWeightSync, WeightTransferError, server_urls

    release = threading.Event()

    class Client:
        def __init__(self, url):
            self.url, self.calls = url, []

        def init_weight_transfer_engine(self, info):
            self.calls.append(("init", info))

        def update_weights(self, info):
            if self.url == "http://b":
                raise WeightTransferError("http://b answered /update_weights with HTTP 500")
            release.wait(30)  # a replica still in the broadcast

        def close(self):
            pass

    sync = FleetWeightSync([], n_workers=2, timeout_s=5)
    sync.clients = [Client(u) for u in ("http://a", "http://b", "http://c")]
    sync.init_weight_transfer_engine({"master_port": 1, "rank_offset": 1, "world_size": 7})
    assert [c.calls[0][1]["rank_offset"] for c in sync.clients] == [1, 3, 5]
    assert {c.calls[0][1]["world_size"] for c in sync.clients} == {7}
    started = time.monotonic()
    with pytest.raises(WeightTransferError, match="http://b"):
        sync.update_weights({"names": []})
    assert time.monotonic() - started < 5
    release.set()
    assert server_urls("http://a") == ("http://a",) and server_urls(["x", "y"]) == ("x", "y")
    with pytest.raises(WeightTransferError, match="no vLLM server"):
        server_urls([])
