"""Streaming judge vs batch judge: how long the judging holds a step up after its last rollout.

Rollouts: the transformers engine (a tiny random Qwen3 over the synthetic world, real local tools) with
forced scaffold traces (rubricem_core/testing/scaffold_writer.py), `--rows` rows decoded at a time so the groups
end one after another. Judge: an LLM judge over HTTP (a fake OpenAI-compatible server on 127.0.0.1
answering with the built-in judge's replies after a random latency). The streamed run submits each group
to a StreamingJudge as it ends; the batch run judges the same groups with judge_step afterwards; both
must give the same judgments (checked). Figure: streamed judging after the last rollout / batch judging.

    .venv/bin/python bench/judge_stream.py [--queries 8] [--rollouts 3] [--latency 1,2] [--concurrency 4]
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rubricem_core.offline import apply_offline_defaults  # noqa: E402

apply_offline_defaults()

import torch  # noqa: E402

from bench.common import fake_judge_settings  # noqa: E402
from rubricem_core.judge.buffer import RubricBuffer  # noqa: E402
from rubricem_core.judge.llm_judge import JudgeOptions, LLMJudge, judge_step  # noqa: E402
from rubricem_core.judge.stream import StreamingJudge  # noqa: E402
from rubricem_core.judge.types import JudgeQuery, JudgeRollout  # noqa: E402
from rubricem_core.rl.records import rollout_text  # noqa: E402
from rubricem_core.rollout import HFRolloutEngine  # noqa: E402
from rubricem_core.sim.judge import respond as builtin_judge_reply  # noqa: E402
from rubricem_core.sim.world import WorldConfig, generate_world  # noqa: E402
from rubricem_core.testing.openai_server import FakeOpenAIServer  # noqa: E402
from rubricem_core.testing.scaffold_writer import ScaffoldWriter, scaffold_requests  # noqa: E402
from rubricem_core.testing.tiny_models import tool_policy, world_tokenizer  # noqa: E402
from rubricem_core.tools import LocalBrowseTool, LocalSearchTool, ToolEnv  # noqa: E402

GOAL = 0.5  # streamed judging after the rollouts ≤ half the batch judge's


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--queries", type=int, default=8)
    parser.add_argument("--rollouts", type=int, default=3, help="rollouts per query")
    parser.add_argument("--rows", type=int, default=3, help="rows the engine decodes at a time")
    parser.add_argument("--latency", default="1,2", help="judge call latency range in seconds: low,high")
    parser.add_argument("--concurrency", type=int, default=4, help="judge calls in flight at most")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--quick", action="store_true", help="4 queries, latency 0.3-0.6 s")
    args = parser.parse_args()
    if args.quick:
        args.queries, args.latency = 4, "0.3,0.6"
    low, high = map(float, args.latency.split(","))
    torch.set_num_threads(args.threads)

    world = generate_world(WorldConfig(seed=3, n_documents=60, n_queries=args.queries, eval_fraction=0.0))
    tok = world_tokenizer(world)
    queries = world.queries_table().to_pylist()
    corpus = world.corpus_table()
    env = ToolEnv({"search": LocalSearchTool(corpus), "browse": LocalBrowseTool(corpus)}, max_calls=2)
    engine = HFRolloutEngine(
        tool_policy(tok), tok, forced_policy=ScaffoldWriter(tok, queries), max_batch_rows=args.rows
    )
    targets = [JudgeQuery(q["query_id"], q["question"], json.loads(q["spec"]), q["reference_answer"]) for q in queries]
    qids = [q["query_id"] for q in queries]
    n = args.rollouts

    def buffers() -> dict[str, RubricBuffer]:
        return {q["query_id"]: RubricBuffer.from_query(q["query_id"], q["rubrics"]) for q in queries}

    def rollouts(qid: str, group: list) -> list[JudgeRollout]:
        return [JudgeRollout(f"{qid}-r{i}", rollout_text(t)) for i, t in enumerate(group)]

    latency, lock, calls = random.Random(0), threading.Lock(), [0]

    def reply(body: dict) -> str:
        with lock:
            delay = latency.uniform(low, high)
            calls[0] += 1
        time.sleep(delay)
        return builtin_judge_reply(body["messages"], body)

    with FakeOpenAIServer(reply, api_key="bench") as server:
        settings = fake_judge_settings(server, "bench", args.concurrency)
        options = JudgeOptions(seed=0)  # what an LLM judge gets in the RL task
        stream = StreamingJudge(LLMJudge(settings, options), buffers(), 0)

        def on_group_done(index: int, group: list) -> None:
            stream.submit(targets[index], rollouts(qids[index], group), index=index, offset=index * n)

        engine.on_group_done = on_group_done
        t0 = time.monotonic()
        groups = engine.generate(scaffold_requests(tok, queries, n), env)
        rolled = time.monotonic()
        streamed = stream.collect(qids)
        streamed_tail = time.monotonic() - rolled
        streamed_calls, calls[0] = calls[0], 0
        t1 = time.monotonic()
        batch = judge_step(
            LLMJudge(settings, options), [(t, rollouts(t.query_id, g)) for t, g in zip(targets, groups)], buffers(), 0
        )
        batch_s = time.monotonic() - t1
    same = all(
        [j.scores for j in s.judgments] == [j.scores for j in b.judgments] and s.rubrics == b.rubrics
        for s, b in zip(streamed, batch)
    )
    ratio = streamed_tail / batch_s
    print(
        f"{args.queries} groups x {n} rollouts, {args.rows} rows at a time; judge latency {low:g}-{high:g} s, "
        f"{args.concurrency} calls in flight; {streamed_calls} judge calls (repairs included)"
    )
    print(f"rollouts: {rolled - t0:.1f}s; judging after them: streamed {streamed_tail:.1f}s, batch {batch_s:.1f}s")
    print(f"same judgments streamed and batch: {'yes' if same else 'NO'}")
    print(
        f"figure: judge_tail_ratio={ratio:.2f} x  goal: <= {GOAL} of the batch judge's time after the rollouts  "
        f"met: {'yes' if same and ratio <= GOAL else 'no'}"
    )


if __name__ == "__main__":
    main()
