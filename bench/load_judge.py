"""One judge step against a limiting endpoint: does the concurrent runner finish every judgment, pay
for few calls beyond those needed, and take about the time the limit allows?

The endpoint is the fake OpenAI-compatible server (rubricem_core/testing/openai_server.py) on 127.0.0.1, in one of
two shapes (`--shape`, default both, one after the other):
- `rate`: a token bucket admits `--rate` calls/s (a burst of one second's worth) and answers the excess 429
  with the time to the next token (`Retry-After`, and `retry-after-ms` as OpenAI sends it); ideal wall time:
  calls needed / rate;
- `slots`: `--slots` calls are answered at a time and every call beyond them gets 429 with `Retry-After: 1`
  (a self-hosted server or a provider's concurrency cap); ideal wall time: calls needed × mean latency /
  slots.
Either answers 1% of admitted calls 500 and the rest with the built-in judge's reply after a latency
(`--latency`, an LLM's seconds).
The judge is the project's: `judge_step` over `--queries` × `--rollouts` rollouts (written by the built-in
teacher with its tools, as in bench/judge_calls.py), `LLMJudge` with the `judge` section's defaults and
`max_concurrency` 64 (the gpu/research profiles'), litellm pointed at the server by `api_base`.

Calls needed: the judge's logical calls (one per query and per rollout, plus repairs); the limit's ideal
wall time: calls needed / rate. The "before" run repeats the step with `adaptive_concurrency` off (a fixed
pool of 64 calls, each backing off alone: the runner before issue #34) against a fresh server.

    .venv/bin/python bench/load_judge.py [--queries 32] [--rollouts 8] [--rate 10] [--slots 10] [--no-before]
    .venv/bin/python bench/load_judge.py --quick       # 8 queries, latency 0.2-0.6 s: seconds
    .venv/bin/python bench/load_judge.py --no-adaptive # the before run alone
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from rubricem_core.offline import apply_offline_defaults  # noqa: E402

apply_offline_defaults()

from judge_calls import write_rollouts  # noqa: E402

from rubricem_core.config import JudgeConfig  # noqa: E402
from rubricem_core.judge.buffer import RubricBuffer  # noqa: E402
from rubricem_core.judge.llm_judge import JudgeOptions, LLMJudge, judge_step  # noqa: E402
from rubricem_core.judge.types import JudgeQuery, JudgeRollout  # noqa: E402
from rubricem_core.llm.concurrent import reset_endpoint_states  # noqa: E402
from rubricem_core.llm.endpoints import endpoint_settings  # noqa: E402
from rubricem_core.sim.judge import respond as builtin_judge_reply  # noqa: E402
from rubricem_core.sim.world import WorldConfig, generate_world  # noqa: E402
from rubricem_core.testing.openai_server import FakeOpenAIServer, RateLimit  # noqa: E402
from rubricem_core.tools.local import LocalBrowseTool, LocalSearchTool  # noqa: E402

CALLS_GOAL = 1.05  # calls made per call needed
WALL_GOAL = 1.3  # wall time per the limit's ideal
CONCURRENCY = 64


@dataclass
class Outcome:
    wall_s: float
    needed: int
    made: int
    rate_limited: int
    server_errors: int
    failed: int  # judgments and rubric generations that failed
    peak_in_flight: int
    wait_s: float

    def ideal_s(self, rate: float) -> float:
        """``rate``: the calls per second the endpoint sustains (a slots endpoint: slots / mean latency)."""
        return self.needed / rate

    def line(self, label: str, rate: float) -> str:
        ideal = self.ideal_s(rate)
        return (
            f"{label}: wall {self.wall_s:.1f}s vs ideal {ideal:.1f}s ({self.wall_s / ideal:.2f}x); calls made "
            f"{self.made} / needed {self.needed} ({self.made / self.needed:.3f}x); 429s {self.rate_limited}; "
            f"500s {self.server_errors}; failures {self.failed}; most in flight {self.peak_in_flight}; "
            f"waited {self.wait_s:.0f}s over all calls"
        )

    def met(self, rate: float) -> bool:
        return (
            self.failed == 0 and self.made <= CALLS_GOAL * self.needed and self.wall_s <= WALL_GOAL * self.ideal_s(rate)
        )


def judge_under_load(
    groups: list[tuple[JudgeQuery, list[JudgeRollout]]],
    queries: list[dict],
    *,
    rate: float,
    latency: tuple[float, float],
    error_rate: float,
    adaptive: bool,
    seed: int,
    slots: int | None = None,
) -> Outcome:
    rng, lock = random.Random(seed), threading.Lock()

    def reply(body: dict) -> str:
        with lock:
            delay = rng.uniform(*latency)
        time.sleep(delay)
        return builtin_judge_reply(body["messages"], body)

    shape: dict[str, Any] = (
        {"rate_limit": RateLimit(per_second=rate, retry_after="ms")}
        if slots is None
        else {"concurrency_limit": slots, "concurrency_retry_after": {"Retry-After": "1"}}
    )
    with FakeOpenAIServer(reply, api_key="bench", server_error_rate=error_rate, seed=seed, **shape) as server:
        cfg = JudgeConfig(model="openai/judge", api_base=server.base_url, max_concurrency=CONCURRENCY)
        settings = endpoint_settings(cfg, api_key="bench")
        settings.adaptive_concurrency = adaptive
        judge = LLMJudge(settings, JudgeOptions.from_config(cfg, seed=seed))
        buffers = {q["query_id"]: RubricBuffer.from_query(q["query_id"], q["rubrics"]) for q in queries}
        reset_endpoint_states()  # every run starts from the endpoint's first call
        started = time.monotonic()
        results = judge_step(judge, groups, buffers, step=0)
        wall = time.monotonic() - started
        statuses = [event.status for event in server.chat_events]
        peak = server.max_in_flight
    usage = judge.usage
    failed = sum(g.n_failed for g in results) + sum(g.generation.failed for g in results)
    return Outcome(
        wall_s=wall,
        needed=usage.total_calls,
        made=len(statuses),
        rate_limited=statuses.count(429),
        server_errors=statuses.count(500),
        failed=failed,
        peak_in_flight=peak,
        wait_s=usage.wait_s,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--queries", type=int, default=32)
    parser.add_argument("--rollouts", type=int, default=8, help="rollouts per query")
    parser.add_argument("--rate", type=float, default=10.0, help="rate shape: calls per second the endpoint admits")
    parser.add_argument("--slots", type=int, default=10, help="slots shape: calls the endpoint answers at a time")
    parser.add_argument("--shape", choices=["rate", "slots", "both"], default="both")
    parser.add_argument("--latency", default="0.5,1.5", help="seconds an admitted call takes: low,high")
    parser.add_argument("--error-rate", type=float, default=0.01, help="share of admitted calls answered 500")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-before", action="store_true", help="skip the run without adaptive concurrency")
    parser.add_argument("--no-adaptive", action="store_true", help="only the run without adaptive concurrency")
    parser.add_argument("--quick", action="store_true", help="8 queries, latency 0.2-0.6 s")
    args = parser.parse_args()
    if args.quick:
        args.queries, args.rate, args.latency = 8, 10.0, "0.2,0.6"
    low, high = map(float, args.latency.split(","))

    world = generate_world(WorldConfig(seed=args.seed, n_documents=400, n_queries=args.queries, eval_fraction=0.0))
    corpus = world.corpus_table()
    tools = {"search": LocalSearchTool(corpus, top_k=5), "browse": LocalBrowseTool(corpus)}
    queries = world.queries_table().to_pylist()
    rollouts = write_rollouts(queries, tools, args.rollouts, args.seed)
    groups = [
        (
            JudgeQuery(q["query_id"], q["question"], json.loads(q["spec"]), q["reference_answer"]),
            rollouts[q["query_id"]],
        )
        for q in queries
    ]
    mean_latency = (low + high) / 2
    figures = []
    for shape in ("rate", "slots") if args.shape == "both" else (args.shape,):
        slots = args.slots if shape == "slots" else None
        # the calls per second the endpoint sustains: its rate, or its slots each busy for a mean latency
        rate = args.rate if slots is None else args.slots / mean_latency
        limit = (
            f"admits {args.rate:g} calls/s (burst {args.rate:g}), 429 + retry-after-ms beyond"
            if slots is None
            else f"answers {args.slots} calls at a time, 429 + Retry-After: 1 beyond"
        )
        print(
            f"\n[{shape}] one judge step: {args.queries} queries x {args.rollouts} rollouts, max_concurrency "
            f"{CONCURRENCY}; endpoint {limit}, {args.error_rate:.0%} 500s, latency {low:g}-{high:g}s"
        )
        common = dict(rate=args.rate, latency=(low, high), error_rate=args.error_rate, seed=args.seed, slots=slots)
        before = None
        if args.no_adaptive or not args.no_before:
            before = judge_under_load(groups, queries, adaptive=False, **common)
            print(before.line("before (fixed 64, each call backs off alone)", rate))
        after = None if args.no_adaptive else judge_under_load(groups, queries, adaptive=True, **common)
        shown = after or before
        assert shown is not None
        if after is not None:
            print(after.line("adaptive (AIMD in-flight limit; a 429 delays only its own retry)", rate))
        figures.append((shape, shown, rate))
    for shape, shown, rate in figures:
        ratio = shown.wall_s / shown.ideal_s(rate)
        print(
            f"figure: load_judge_wall_{shape}={ratio:.2f} x ideal  goal: <= {WALL_GOAL} x ideal, <= {CALLS_GOAL} calls "
            f"per call needed ({shown.made}/{shown.needed}), every judgment done ({shown.failed} failed)  "
            f"met: {'yes' if shown.met(rate) else 'no'}"
        )


if __name__ == "__main__":
    main()
