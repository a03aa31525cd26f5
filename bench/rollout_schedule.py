"""Rows that never wait: wall time of one rollout batch under `lockstep` vs `async` (rollout.schedule).

No model: a fake sampler stands in for the vLLM fleet (a pure function of each call's seed, answered
after ``call_s`` + ``token_s`` per token, any number at once, as a batching server does) and a fake
search tool answers after a latency drawn uniformly from ``--tool-s`` (default 0.5-3 s, what a web search
costs). The same VLLMRolloutEngine turn loop runs both schedules; the trajectories must be identical.
Last line: async wall time over lockstep's (goal ≤ 0.5: issue #29).

    .venv/bin/python bench/rollout_schedule.py --quick     # 8 queries × 4 rows (~30 s)
    .venv/bin/python bench/rollout_schedule.py             # 32 queries × 8 rows, the paper's step (~1-2 min)
"""

from __future__ import annotations

import argparse
import collections
import random
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

from run_all import figure_line  # noqa: E402

from rubricem_core.policy.tokenizer import train_bpe_tokenizer  # noqa: E402
from rubricem_core.rollout import RolloutRequest, SamplingParams  # noqa: E402
from rubricem_core.rollout.vllm_engine import TurnCall, TurnSample, VLLMRolloutEngine  # noqa: E402
from rubricem_core.scaffold import EXAMPLE_TRACE, ToolSpec, format_tool_output  # noqa: E402
from rubricem_core.tools.base import Tool, ToolEnv, ToolResult  # noqa: E402

# One call's text: a search (about half), some reasoning that does not end the turn, or the answer.
FRAGMENTS = (
    ('<call_tool name="search">{w}</call_tool>', 0.45),
    ("<state_evaluation>more about {w} is needed</state_evaluation>", 0.25),
    ("<answer>The answer is {w}.</answer>", 0.30),
)
WORDS = ("bridge", "river", "tower", "harbor", "mill", "canal", "market")


class FakeSearch(Tool):
    def __init__(self, low_s: float, high_s: float) -> None:
        self.spec = ToolSpec("search", "fake web search")
        self.low_s, self.high_s = low_s, high_s

        self.busy: dict[str, float] = collections.defaultdict(float)  # seconds per tool thread (a row, under async)

    def __call__(self, query: str) -> ToolResult:
        seconds = random.uniform(self.low_s, self.high_s)
        self.busy[threading.current_thread().name] += seconds
        time.sleep(seconds)
        return ToolResult(format_tool_output([("D1", f"{query}: a snippet")]), ["D1"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--queries", type=int, default=32)
    parser.add_argument("--n", type=int, default=8, help="rows per query (the group)")
    parser.add_argument("--call-s", type=float, default=0.05, help="fixed seconds per sampling call")
    parser.add_argument("--token-s", type=float, default=0.005, help="seconds per sampled token")
    parser.add_argument("--tool-s", type=float, nargs=2, default=(0.5, 3.0), help="tool latency range")
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    if args.quick:
        args.queries, args.n = 8, 4
    tok = train_bpe_tokenizer([EXAMPLE_TRACE] * 4 + [" ".join(WORDS)] * 4, vocab_size=400)
    weights = [w for _, w in FRAGMENTS]

    busy: dict[tuple[str, int], float] = collections.defaultdict(float)  # sampling seconds per row

    def sample(call: TurnCall) -> TurnSample:
        rng = random.Random(call.seed)
        text = rng.choices([f for f, _ in FRAGMENTS], weights)[0].format(w=rng.choice(WORDS))
        ids = tok.encode(text, add_special_tokens=False)[: call.max_tokens]
        busy[call.request_id, call.sample_index] += args.call_s + args.token_s * len(ids)
        time.sleep(args.call_s + args.token_s * len(ids))
        return TurnSample(ids, [-rng.random() for _ in ids])

    sampling = SamplingParams(temperature=1.0, max_new_tokens=64, max_total_tokens=4000, seed=0)
    requests = [
        RolloutRequest(f"q{i}", tok.encode(f"question {i}", add_special_tokens=False), n=args.n, sampling=sampling)
        for i in range(args.queries)
    ]
    search = FakeSearch(*args.tool_s)
    env = ToolEnv({"search": search}, max_calls=10)
    results, seconds = {}, {}
    for schedule in ("lockstep", "async"):
        busy.clear()
        search.busy.clear()
        engine = VLLMRolloutEngine(
            None,
            tok,
            ("search",),
            sampler=lambda calls: [sample(c) for c in calls] if len(calls) == 1 else _parallel(sample, calls),
            schedule=schedule,
            max_in_flight=args.queries * args.n,
            max_tool_concurrency=args.queries * args.n,
        )
        started = time.perf_counter()
        results[schedule] = engine.generate(requests, env)
        seconds[schedule] = time.perf_counter() - started
        trajs = [t for g in results[schedule] for t in g]
        print(
            f"{schedule:>8}: {seconds[schedule]:6.1f} s for {len(trajs)} rows, "
            f"{int(engine.stats['turn_calls'])} calls, {sum(t.n_tool_calls for t in trajs)} tool calls"
        )
    # under async a tool thread is named after its row (rollout-tool-<row index>): the slowest row's own
    # chain of calls and tools is the floor no schedule can beat
    rows = [(r.request_id, k) for r in requests for k in range(r.n)]
    floor = max(busy[row] + search.busy.get(f"rollout-tool-{i}", 0.0) for i, row in enumerate(rows))
    print(
        f"the slowest row's own calls and tools: {floor:.1f} s (async's floor); async is {seconds['async'] / floor:.2f}× it"
    )
    same = all(
        a.token_ids == b.token_ids
        and [x for x in a.logprobs if x == x] == [x for x in b.logprobs if x == x]  # NaN: not sampled
        and (a.loss_mask, a.finish_reason) == (b.loss_mask, b.finish_reason)
        for ga, gb in zip(results["lockstep"], results["async"])
        for a, b in zip(ga, gb)
    )
    print(f"same trajectories: {same}; tool latency {args.tool_s[0]}-{args.tool_s[1]} s, sampling "
          f"{args.call_s} s + {args.token_s} s/token per call")  # fmt: skip
    if not same:
        raise SystemExit("async and lockstep trajectories differ")
    ratio = seconds["async"] / seconds["lockstep"]
    print(figure_line("rollout_schedule.async_over_lockstep", ratio, "x wall time", "<= 0.5", ratio <= 0.5))


def _parallel(sample, calls: list[TurnCall]) -> list[TurnSample]:
    """A lockstep turn: every call at once, as the server batches them."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=len(calls)) as pool:
        return list(pool.map(sample, calls))


if __name__ == "__main__":
    main()
