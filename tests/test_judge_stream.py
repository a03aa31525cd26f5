"""The streaming judge ≡ the batch judge, and the engines' per-group hook that feeds it.

Rollouts come from the transformers engine (a tiny random Qwen3 over a synthetic world, real search and
browse tools) with a forced policy writing traces of three kinds per group (rubricem_core/testing/scaffold_writer.py:
a grounded answer, a wrong uncited one, free sampling), so the judge has something to tell apart. Each
query's group is submitted to a ``StreamingJudge`` from ``engine.on_group_done`` while the later groups still sample; the
same trajectories judged by ``judge_step`` after the last one must give the same judge tables row for
row (the judge task's own table code), the same buffers and the same usage figures.
"""

from __future__ import annotations

import hashlib
import json
import random
import threading
import time

import numpy as np
import pytest

from rubricem_core.judge.buffer import RubricBuffer
from rubricem_core.judge.llm_judge import JudgeOptions, LLMJudge, judge_step
from rubricem_core.judge.stream import StreamingJudge
from rubricem_core.judge.types import JudgeError, JudgeQuery, JudgeRollout
from rubricem_core.llm.types import EndpointSettings
from rubricem_core.recipes import get_recipe
from rubricem_core.rl.records import rollout_text
from rubricem_core.rl.steps import judge_tables
from rubricem_core.rollout import HFRolloutEngine, RolloutRequest, SamplingParams
from rubricem_core.rollout.batch import RowBatch
from rubricem_core.sim.judge import register_builtin_judge
from rubricem_core.sim.judge import respond as builtin_judge_reply
from rubricem_core.sim.world import WorldConfig, generate_world
from rubricem_core.testing.openai_server import FakeOpenAIServer
from rubricem_core.testing.scaffold_writer import KINDS, ScaffoldWriter, scaffold_requests
from rubricem_core.testing.tiny_models import tool_policy, world_tokenizer
from rubricem_core.tools import LocalBrowseTool, LocalSearchTool, ToolEnv
from tests.tiny_models import one_thread  # noqa: F401 (an autouse fixture)

N = KINDS  # rollouts per group: one of each kind
LAM = get_recipe("ss_grpo").lam()


@pytest.fixture(scope="module")
def world():
    return generate_world(WorldConfig(seed=3, n_documents=60, n_queries=4, eval_fraction=0.0))


@pytest.fixture(scope="module")
def tok(world):
    return world_tokenizer(world)


@pytest.fixture(scope="module")
def queries(world):
    return world.queries_table().to_pylist()


@pytest.fixture(scope="module")
def env(world):
    table = world.corpus_table()
    return ToolEnv({"search": LocalSearchTool(table), "browse": LocalBrowseTool(table)}, max_calls=2)


def requests_for(tok, queries) -> list[RolloutRequest]:
    return scaffold_requests(tok, queries, N)


def judge_query(q) -> JudgeQuery:
    return JudgeQuery(q["query_id"], q["question"], json.loads(q["spec"]), q["reference_answer"])


def fresh_buffers(queries) -> dict[str, RubricBuffer]:
    return {q["query_id"]: RubricBuffer.from_query(q["query_id"], q["rubrics"], cap_per_stage=2) for q in queries}


def group_rollouts(qid: str, group) -> list[JudgeRollout]:
    return [JudgeRollout(f"{qid}-r{i}", rollout_text(t)) for i, t in enumerate(group)]


def tables(step, results, buffers):
    """The judge task's rows; NaN-free and comparable with == (R/G/A are floats or None)."""
    out = judge_tables(step, results, buffers, LAM)
    return out.rubric_rows, out.score_rows, out.reward_rows, out.errors


def stream_rollouts(engine, tok, queries, env, stream: StreamingJudge | None = None):
    """Sample every group; each is submitted to ``stream`` from the group hook. Returns the groups, the
    fired (index, trajectories) in firing order and when generate returned."""
    targets = [judge_query(q) for q in queries]
    fired = []

    def on_group_done(index, group):
        fired.append((index, group))
        if stream is not None:
            qid = targets[index].query_id
            stream.submit(targets[index], group_rollouts(qid, group), index=index, offset=index * N)

    engine.on_group_done = on_group_done
    try:
        groups = engine.generate(requests_for(tok, queries), env)
    finally:
        engine.on_group_done = None
    return groups, fired, time.monotonic()


@pytest.fixture(scope="module")
def engine(tok, queries):
    # three rows at a time: the groups end one after another, the later ones still sample
    return HFRolloutEngine(tool_policy(tok), tok, forced_policy=ScaffoldWriter(tok, queries), max_batch_rows=N)


# ---- the hook -------------------------------------------------------------------------------------


def test_row_batch_fires_each_group_once_when_its_last_row_ends(tok):
    requests = [RolloutRequest(f"q{i}", [5, 6, 7], n=n) for i, n in enumerate([2, 1, 3])]
    batch = RowBatch(requests, {}, tok, frozenset({tok.eos_token_id}), vocab_size=len(tok))
    fired: list[tuple[int, int]] = []
    progress: list[int] = []

    def hook(index, group):
        fired.append((index, len(group)))

    def finish(*rows):
        for r in rows:
            batch.rows[r].finish("length")
        batch.report(lambda done, total: progress.append(done), hook)

    finish(0)  # half of request 0
    finish(3, 5)  # two of request 2's three rows
    finish(2)  # request 1 (one row)
    finish(1, 4)  # request 0 and request 2 end in the same report: request order among them
    finish()  # nothing new: nothing fires again
    assert fired == [(1, 1), (0, 2), (2, 3)]
    assert progress == [1, 3, 4, 6, 6]
    # the trajectories the hook got are the ones generate returns (built once)
    got = []
    batch2 = RowBatch(requests, {}, tok, frozenset({tok.eos_token_id}), vocab_size=len(tok))
    for row in batch2.rows:
        row.finish("length")
    batch2.report(None, lambda i, group: got.append(group))
    assert [[t is u for t, u in zip(g, h)] for g, h in zip(got, batch2.trajectories())] == [
        [True] * 2,
        [True],
        [True] * 3,
    ]


def test_engine_fires_every_group_once_with_its_trajectories(engine, tok, queries, env):
    groups, fired, _ = stream_rollouts(engine, tok, queries, env)
    assert sorted(i for i, _ in fired) == list(range(len(queries)))  # each group exactly once
    for index, group in fired:
        assert [t.token_ids for t in group] == [t.token_ids for t in groups[index]]
        assert [rollout_text(t) for t in group] == [rollout_text(t) for t in groups[index]]
    # three rows at a time, admitted in request order: the groups end in that order
    assert [i for i, _ in fired] == list(range(len(queries)))
    kinds = [t.finish_reason for g in groups for t in g]
    assert "answered" in kinds and len(set(kinds)) > 1, kinds  # the judge gets groups that differ


@pytest.mark.parametrize("schedule", ["lockstep", "async"])
def test_vllm_engine_fires_each_group_once_when_its_last_row_ends(tok, env, schedule):
    """The vLLM engines (in-process, server) share RowBatch: a request fires after its slowest row, and
    under the async schedule as soon as that row ends, while the other rows still sample."""
    from rubricem_core.rollout.vllm_engine import TurnSample, VLLMRolloutEngine

    calls_needed = {("a", 0): 1, ("a", 1): 4, ("b", 0): 2, ("b", 1): 2, ("c", 0): 3, ("c", 1): 1}
    seen: dict[tuple[str, int], int] = {}
    word = tok.encode(" x", add_special_tokens=False)[0]

    def sampler(calls):
        out = []
        for call in calls:
            key = (call.request_id, call.sample_index)
            seen[key] = seen.get(key, 0) + 1
            time.sleep(0.15 if schedule == "async" else 0.0)  # one call's time: rows end in call-count order
            out.append(TurnSample([word, tok.eos_token_id] if seen[key] >= calls_needed[key] else [word], [-1.0] * 2))
        return [TurnSample(s.token_ids, s.logprobs[: len(s.token_ids)]) for s in out]

    engine = VLLMRolloutEngine(None, tok, sampler=sampler, schedule=schedule)
    fired, fired_at = [], []
    engine.on_group_done = lambda index, group: (fired.append((index, group)), fired_at.append(time.monotonic()))
    sampling = SamplingParams(temperature=1.0, max_new_tokens=50, max_total_tokens=200, seed=1)
    requests = [RolloutRequest(rid, [5, 6, 7], n=2, sampling=sampling) for rid in "abc"]
    groups = engine.generate(requests, env)
    returned = time.monotonic()
    assert [i for i, _ in fired] == [1, 2, 0]  # b ends after 2 calls, c after 3, a after 4
    if schedule == "async":  # b's group went out about two calls before the last row ended
        assert returned - fired_at[0] > 0.2
    assert all(t is u for i, group in fired for t, u in zip(group, groups[i]))  # the very trajectories returned


# ---- streaming ≡ batch ----------------------------------------------------------------------------


def _same(a, b) -> None:
    rubrics_a, scores_a, rewards_a, errors_a = a
    rubrics_b, scores_b, rewards_b, errors_b = b
    assert rubrics_a == rubrics_b
    assert scores_a == scores_b
    assert rewards_a == rewards_b
    assert errors_a == errors_b


def test_streaming_judge_equals_batch_judge_with_the_builtin_judge(engine, tok, queries, env):
    model = register_builtin_judge()
    settings = EndpointSettings(model=model, max_concurrency=3, max_retries=0, timeout_s=60)
    options = JudgeOptions(seed=0)
    qids = [q["query_id"] for q in queries]
    streamed_buffers, batch_buffers = fresh_buffers(queries), fresh_buffers(queries)
    streamed_judge, batch_judge = LLMJudge(settings, options), LLMJudge(settings, options)
    groups = None
    for step in (0, 1):  # step 1 starts from the buffers step 0 evolved (adaptive rubrics, pruning)
        stream = StreamingJudge(streamed_judge, streamed_buffers, step)
        if groups is None:  # groups submitted by the engine as they end
            groups, _, _ = stream_rollouts(engine, tok, queries, env, stream)
        else:  # the same groups ending in the reverse order
            for index in reversed(range(len(queries))):
                q = queries[index]
                stream.submit(
                    judge_query(q), group_rollouts(q["query_id"], groups[index]), index=index, offset=index * N
                )
        streamed = stream.collect(qids)
        batch = judge_step(
            batch_judge,
            [(judge_query(q), group_rollouts(q["query_id"], g)) for q, g in zip(queries, groups)],
            batch_buffers,
            step,
        )
        _same(tables(step, streamed, streamed_buffers), tables(step, batch, batch_buffers))
        for s, b in zip(streamed, batch):
            np.testing.assert_array_equal(s.R, b.R)
            assert s.usage == b.usage and s.added == b.added and s.pruned == b.pruned
        assert streamed_judge.usage == batch_judge.usage
        assert {q: b.to_dict() for q, b in streamed_buffers.items()} == {
            q: b.to_dict() for q, b in batch_buffers.items()
        }
    assert streamed_judge.usage.calls["generate"] == 2 * len(queries)
    added = sum(len(g.added) for g in streamed)
    scores = {r["score"] for r in tables(1, streamed, streamed_buffers)[1]}
    assert added > 0 or len(scores) > 1, "the groups must give the judge something to tell apart"


def test_streaming_llm_judge_overlaps_rollouts_and_equals_batch(engine, tok, queries, env):
    """An LLM judge over HTTP with random latency: streamed calls start before the last rollout ends,
    and the tables, failed judgments (errors quote the call ids) and usage equal the batch judge's."""
    starts: list[float] = []
    lock = threading.Lock()
    latency = random.Random(0)

    def reply(body):
        with lock:
            starts.append(time.monotonic())
            delay = latency.uniform(0.02, 0.2)
        time.sleep(delay)
        # some scoring calls fail for good, chosen by their prompt (a repair keeps it): the same in both runs
        prompt = next(m["content"] for m in body["messages"] if m["role"] == "user")
        pick = hashlib.sha1(prompt.encode()).digest()[0]
        if "rubric_scores" in json.dumps(body.get("response_format")):
            if pick < 25:
                raise RuntimeError("overloaded")  # a 500: the error quotes the call's id
            if pick < 50:
                return "not json"  # unusable even after the repair
        return builtin_judge_reply(body["messages"], body)

    qids = [q["query_id"] for q in queries]
    with FakeOpenAIServer(reply, api_key="sk-stream") as server:
        settings = EndpointSettings(
            model="openai/judge",
            api_base=server.base_url,
            api_key="sk-stream",
            max_concurrency=4,
            max_retries=0,
            timeout_s=30,
            input_cost_per_token=1e-6,
            output_cost_per_token=2e-6,
        )
        options = JudgeOptions(seed=0)  # what an LLM judge gets in the RL task
        streamed_buffers = fresh_buffers(queries)
        judge = LLMJudge(settings, options)
        stream = StreamingJudge(judge, streamed_buffers, 0)
        t0 = time.monotonic()
        groups, _, rollouts_done = stream_rollouts(engine, tok, queries, env, stream)
        streamed = stream.collect(qids)
        streamed_wait = time.monotonic() - rollouts_done  # the judging left once the last rollout ended
        streamed_calls = sorted(starts)
        starts.clear()
        batch_buffers = fresh_buffers(queries)
        batch_judge = LLMJudge(settings, options)
        t1 = time.monotonic()
        batch = judge_step(
            batch_judge,
            [(judge_query(q), group_rollouts(q["query_id"], g)) for q, g in zip(queries, groups)],
            batch_buffers,
            0,
        )
        batch_wait = time.monotonic() - t1
    _same(tables(0, streamed, streamed_buffers), tables(0, batch, batch_buffers))
    assert judge.usage == batch_judge.usage and judge.usage.cost_usd > 0
    errors = tables(0, streamed, streamed_buffers)[3]
    assert any("'score:" in e for e in errors.values()), errors  # failures kept, quoting the batch's call ids
    assert len(errors) < len(queries) * N
    early = [t for t in streamed_calls if t < rollouts_done]
    print(
        f"rollouts {rollouts_done - t0:.2f}s; {len(early)} of {len(streamed_calls)} judge calls started before "
        f"the last rollout ended, the first {streamed_calls[0] - t0:.2f}s in; judging after the rollouts: "
        f"{streamed_wait:.2f}s streamed, {batch_wait:.2f}s batch"
    )
    assert len(early) >= 2, "the first groups' generation and scoring calls run while later groups sample"


def test_streaming_judge_rejects_a_group_twice_and_unknown_or_missing_groups(queries):
    judge = LLMJudge(EndpointSettings(model=register_builtin_judge(), max_concurrency=2, max_retries=0))
    buffers = fresh_buffers(queries[:1])
    q = judge_query(queries[0])
    with StreamingJudge(judge, buffers, 0) as stream:
        with pytest.raises(JudgeError, match="no RubricBuffer"):
            stream.submit(judge_query(queries[1]), [], index=1, offset=N)
        stream.submit(q, [JudgeRollout("a", "x"), JudgeRollout("b", "y")], index=0, offset=0)
        with pytest.raises(JudgeError, match="twice"):
            stream.submit(q, [JudgeRollout("a", "x")], index=0, offset=0)
        with pytest.raises(JudgeError, match="not submitted"):
            stream.collect([q.query_id, "other"])
    with StreamingJudge(judge, fresh_buffers(queries[:1]), 0) as stream:
        stream.submit(q, [JudgeRollout("a", "x"), JudgeRollout("b", "y")], index=0, offset=0)
        [group] = stream.collect([q.query_id])
        assert group.rollout_ids == ["a", "b"] and judge.usage.calls["score"] == 2
        with pytest.raises(JudgeError, match="after collect"):
            stream.submit(q, [JudgeRollout("a", "x")], index=0, offset=0)


def test_judge_task_takes_a_stream_only_for_its_step_and_the_sessions_buffers(queries):
    """The judge task uses the rollout task's stream only when the session still holds the buffers the
    stream started from, those after the step before (else it closes it and judges from the tables)."""
    from rubricem_core.rl.curriculum import StepPlan
    from rubricem_core.rl.session import RLSession, StepBuffers
    from rubricem_core.rl.steps import take_streamed

    judge = LLMJudge(EndpointSettings(model=register_builtin_judge(), max_concurrency=2, max_retries=0))
    plan = StepPlan(step=3, window=0, phase="new", retrieval="none", query_ids=(queries[0]["query_id"],))

    def session_with_stream(step: int) -> tuple[RLSession, StreamingJudge]:
        before = StepBuffers(step - 1, fresh_buffers(queries[:1]))
        session = RLSession("unused", 2, None, None, None, before)
        session.pending_judge = StreamingJudge(judge, before.for_step(step, {}, [], 2), step)
        return session, session.pending_judge

    session, stream = session_with_stream(3)
    assert take_streamed(session, plan) is stream and session.pending_judge is None
    stream.close()
    assert take_streamed(session, plan) is None  # taken once
    for change in ("step", "buffers"):
        session, stream = session_with_stream(2 if change == "step" else 3)
        if change == "buffers":  # the session moved to another step's buffers meanwhile
            session.buffers = StepBuffers(3, fresh_buffers(queries[:1]))
        assert take_streamed(session, plan) is None and session.pending_judge is None, change
        with pytest.raises(JudgeError, match="after collect or close"):  # closed: nothing runs on
            stream.submit(judge_query(queries[0]), [JudgeRollout("a", "x")], index=0, offset=0)


def test_a_steps_judge_changes_copies_so_a_failed_judge_leaves_the_sessions_buffers(engine, tok, queries, env):
    """StepBuffers.for_step: the judge of step N changes copies of its queries' buffers (a new one for a
    query judged the first time) and shares the others; the buffers after N−1 stay as they were."""
    from rubricem_core.rl.session import StepBuffers

    held, other, new = queries[0], queries[1], queries[2]
    before = StepBuffers(4, fresh_buffers([held, other]))
    saved = {qid: b.to_dict() for qid, b in before.by_query.items()}
    working = before.for_step(5, {new["query_id"]: new}, [held["query_id"], new["query_id"]], 2)
    assert working[held["query_id"]] is not before.by_query[held["query_id"]]
    assert working[held["query_id"]].to_dict() == saved[held["query_id"]]
    assert working[other["query_id"]] is before.by_query[other["query_id"]]  # not judged at step 5
    assert new["query_id"] in working and new["query_id"] not in before.by_query

    judge = LLMJudge(EndpointSettings(model=register_builtin_judge(), max_concurrency=2, max_retries=0))
    (group,), _, _ = stream_rollouts(engine, tok, [held], env)
    judge_step(judge, [(judge_query(held), group_rollouts(held["query_id"], group))], working, 5)
    assert working[held["query_id"]].to_dict() != saved[held["query_id"]]  # the judge changed its copy...
    assert {qid: b.to_dict() for qid, b in before.by_query.items()} == saved  # ...not the session's
    with pytest.raises(RuntimeError, match="buffers after step 5, not 4"):
        before.for_step(6, {}, [], 2)
