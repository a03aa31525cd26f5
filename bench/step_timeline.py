"""One RL step's rollout and judge phases, today's schedule against the pipelined one, in one run.

    lockstep rows, then the batch judge   (rollout.schedule: lockstep, judge.stream: false)
    async rows, each group judged as it ends  (rollout.schedule: async, judge.stream: true)

The step is the synthetic world's: ``--queries`` × ``--n`` rows through the real VLLMRolloutEngine turn
loop and tool env, and the real LLMJudge (rubric generation per query, one scoring call per rollout,
buffer updates) over HTTP. Latencies are injected on loopback, as a real cluster meets them:
- sampling: a stand-in for the vLLM fleet that answers each call after ``--call-s`` + ``--token-s``
  per token, any number at once (a batching server), with text drawn from the call's seed (search
  calls, reasoning, answers), so both schedules sample the very same tokens;
- tools: a search answering after a delay drawn from ``--tool-s`` (default 0.5–3 s, a web search);
- judge: a fake OpenAI-compatible server on 127.0.0.1 answering with the built-in judge's logic after a
  delay drawn from ``--judge-s`` (default 2–5 s, a hosted model), ``--judge-concurrency`` at once.
Engine idle share: the part of the phase (first call to the last judgment) with no sampling call in
flight, and the same over the rollouts alone. The judge after the last rollout (the last group's
generation and scoring calls) leaves the engine idle in any on-policy step: only sampling the next
step meanwhile (asynchronous RL) would fill it. Checks that both schedules give the same trajectories and the same judge tables. Last lines:
wall time ratio (goal ≤ 0.5) and the new schedule's engine idle share (goal ≤ 20%).

    .venv/bin/python bench/step_timeline.py --quick    # 8 queries × 4 rows (~1 min)
    .venv/bin/python bench/step_timeline.py            # 16 queries × 8 rows (~2 min)
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

from rubricem_core.offline import apply_offline_defaults  # noqa: E402

apply_offline_defaults()

from rollout_schedule import FRAGMENTS, WORDS, FakeSearch  # noqa: E402
from run_all import figure_line  # noqa: E402

from bench.common import fake_judge_settings  # noqa: E402
from rubricem_core.judge.buffer import RubricBuffer  # noqa: E402
from rubricem_core.judge.llm_judge import JudgeOptions, LLMJudge, judge_step  # noqa: E402
from rubricem_core.judge.stream import StreamingJudge  # noqa: E402
from rubricem_core.judge.types import JudgeQuery, JudgeRollout  # noqa: E402
from rubricem_core.policy.tokenizer import train_bpe_tokenizer  # noqa: E402
from rubricem_core.rl.records import rollout_text  # noqa: E402
from rubricem_core.rollout import RolloutRequest, SamplingParams  # noqa: E402
from rubricem_core.rollout.vllm_engine import TurnCall, TurnSample, VLLMRolloutEngine  # noqa: E402
from rubricem_core.scaffold import EXAMPLE_TRACE  # noqa: E402
from rubricem_core.sim.judge import respond as builtin_judge_reply  # noqa: E402
from rubricem_core.sim.world import WorldConfig, generate_world  # noqa: E402
from rubricem_core.testing.openai_server import FakeOpenAIServer  # noqa: E402
from rubricem_core.tools.base import ToolEnv  # noqa: E402


class BusyClock:
    """Intervals during which at least one sampling call is in flight."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.in_flight = 0
        self.since = 0.0
        self.busy = 0.0
        self.first: float | None = None

    def start(self) -> None:
        with self.lock:
            now = time.perf_counter()
            self.first = now if self.first is None else self.first
            if self.in_flight == 0:
                self.since = now
            self.in_flight += 1

    def stop(self) -> None:
        with self.lock:
            self.in_flight -= 1
            if self.in_flight == 0:
                self.busy += time.perf_counter() - self.since


def run(schedule: str, stream: bool, args, world, tok, server) -> dict:
    clock = BusyClock()
    weights = [w for _, w in FRAGMENTS]

    def sample(call: TurnCall) -> TurnSample:
        rng = random.Random(call.seed)
        text = rng.choices([f for f, _ in FRAGMENTS], weights)[0].format(w=rng.choice(WORDS))
        ids = tok.encode(text, add_special_tokens=False)[: call.max_tokens]
        clock.start()
        try:
            time.sleep(args.call_s + args.token_s * len(ids))
        finally:
            clock.stop()
        return TurnSample(ids, [-rng.random() for _ in ids])

    def sampler(calls: list[TurnCall]) -> list[TurnSample]:
        if len(calls) == 1:
            return [sample(calls[0])]
        threads, out = [], [None] * len(calls)
        for i, c in enumerate(calls):  # a lockstep turn: every call at once, as the server batches them
            t = threading.Thread(target=lambda i=i, c=c: out.__setitem__(i, sample(c)))
            t.start()
            threads.append(t)
        for t in threads:
            t.join()
        return out  # type: ignore[return-value]

    queries = world.queries_table().to_pylist()[: args.queries]
    sampling = SamplingParams(temperature=1.0, max_new_tokens=64, max_total_tokens=4000, seed=0)
    requests = [
        RolloutRequest(q["query_id"], tok.encode(q["question"], add_special_tokens=False), n=args.n, sampling=sampling)
        for q in queries
    ]
    env = ToolEnv({"search": FakeSearch(*args.tool_s)}, max_calls=4)
    engine = VLLMRolloutEngine(
        None,
        tok,
        ("search",),
        sampler=sampler,
        schedule=schedule,
        max_in_flight=len(requests) * args.n,
        max_tool_concurrency=len(requests) * args.n,
    )
    settings = fake_judge_settings(server, "sk-bench", args.judge_concurrency)
    # a judge that writes the rubric counts it is asked for: no repair round (the stand-in's replies, the
    # built-in judge's, propose only rubrics that separate the group, often fewer than the paper's fewest)
    judge = LLMJudge(settings, JudgeOptions(seed=0))
    buffers = {q["query_id"]: RubricBuffer.from_query(q["query_id"], q["rubrics"], 8, step=0) for q in queries}
    targets = [JudgeQuery(q["query_id"], q["question"], json.loads(q["spec"]), q["reference_answer"]) for q in queries]

    def rollouts_of(index: int, group) -> list[JudgeRollout]:
        qid = targets[index].query_id
        return [JudgeRollout(f"{qid}-r{i}", rollout_text(t)) for i, t in enumerate(group)]

    streaming = StreamingJudge(judge, buffers, 0) if stream else None
    if streaming is not None:
        engine.on_group_done = lambda i, g: streaming.submit(targets[i], rollouts_of(i, g), index=i, offset=i * args.n)
    started = time.perf_counter()
    groups = engine.generate(requests, env)
    rollouts_s = time.perf_counter() - started
    if streaming is not None:
        results = streaming.collect([q["query_id"] for q in queries])
    else:
        results = judge_step(
            judge, [(t, rollouts_of(i, g)) for i, (t, g) in enumerate(zip(targets, groups))], buffers, 0
        )
    wall = time.perf_counter() - started
    tables = (
        [r for qid in sorted(buffers) for r in buffers[qid].rows(0)],
        [[s for j in g.judgments if not j.failed for s in j.rows(0, g.query_id)] for g in results],
        [[[None if v != v else v for v in row] for row in g.R.tolist()] for g in results],  # NaN → None: comparable
    )
    return {
        "wall": wall,
        "rollouts": rollouts_s,
        "idle": 1.0 - clock.busy / wall,
        "idle_rollouts": 1.0 - clock.busy / rollouts_s,
        "groups": groups,
        "tables": tables,
        "tool_calls": sum(t.n_tool_calls for g in groups for t in g),
        "calls": int(engine.stats["turn_calls"]),
        "judged": sum(len(g.judgments) for g in results),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--queries", type=int, default=16)
    parser.add_argument("--n", type=int, default=8, help="rows per query (the group)")
    parser.add_argument("--call-s", type=float, default=0.05, help="fixed seconds per sampling call")
    parser.add_argument(
        "--token-s", type=float, default=0.02, help="seconds per sampled token (50 tok/s: one of ~200 batched rows)"
    )
    parser.add_argument("--tool-s", type=float, nargs=2, default=(0.5, 3.0), help="tool latency range (s)")
    parser.add_argument("--judge-s", type=float, nargs=2, default=(2.0, 5.0), help="judge call latency range (s)")
    parser.add_argument("--judge-concurrency", type=int, default=64, help="judge.max_concurrency")
    parser.add_argument("--quick", action="store_true", help="8 queries × 4 rows")
    args = parser.parse_args()
    if args.quick:
        args.queries, args.n = 8, 4
    world = generate_world(WorldConfig(seed=0, n_documents=60, n_queries=max(args.queries, 4), eval_fraction=0.0))
    tok = train_bpe_tokenizer(
        [EXAMPLE_TRACE] * 4 + [" ".join(WORDS)] * 4 + [q.question for q in world.queries], vocab_size=600
    )
    delays = random.Random(0)
    delay_lock = threading.Lock()

    def reply(body: dict) -> str:
        with delay_lock:
            delay = delays.uniform(*args.judge_s)
        time.sleep(delay)
        return builtin_judge_reply(body["messages"], body)

    out = {}
    with FakeOpenAIServer(reply, api_key="sk-bench") as server:
        for name, schedule, stream in (("today", "lockstep", False), ("pipelined", "async", True)):
            r = out[name] = run(schedule, stream, args, world, tok, server)
            print(
                f"{name:>9} ({schedule} rows, {'streaming' if stream else 'batch'} judge): {r['wall']:6.1f} s "
                f"(rollouts {r['rollouts']:.1f} s, judging after them {r['wall'] - r['rollouts']:.1f} s); "
                f"engine idle {r['idle']:.0%} ({r['idle_rollouts']:.0%} of the rollouts); {r['calls']} sampling calls, {r['tool_calls']} tool calls, "
                f"{r['judged']} judgments"
            )
    same_rows = all(
        (a.token_ids, a.loss_mask, a.finish_reason) == (b.token_ids, b.loss_mask, b.finish_reason)
        for ga, gb in zip(out["today"]["groups"], out["pipelined"]["groups"])
        for a, b in zip(ga, gb)
    )
    same_tables = out["today"]["tables"] == out["pipelined"]["tables"]
    print(
        f"same trajectories: {same_rows}; same judge tables: {same_tables}. Injected on loopback: sampling "
        f"{args.call_s} s + {args.token_s} s/token per call, tools {args.tool_s[0]}–{args.tool_s[1]} s, judge calls "
        f"{args.judge_s[0]}–{args.judge_s[1]} s ({args.judge_concurrency} at once); {args.queries} queries × {args.n}"
    )
    if not (same_rows and same_tables):
        raise SystemExit("the two schedules differ")
    ratio = out["pipelined"]["wall"] / out["today"]["wall"]
    idle = out["pipelined"]["idle"]
    print(f"today's engine idle {out['today']['idle']:.0%} → {idle:.0%}")
    print(figure_line("step_timeline.pipelined_over_today", ratio, "x wall time", "<= 0.5", ratio <= 0.5))
    print(figure_line("step_timeline.engine_idle", idle, "share", "<= 0.2", idle <= 0.2))


if __name__ == "__main__":
    main()
