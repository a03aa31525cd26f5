"""The rollout tests' shared pieces: the tiny world, its tools and a tiny Qwen3 policy that every vLLM
attention backend can load (module fixtures ``world``, ``env``, ``model_dir``, ``tok``; ``one_thread``, autouse
where imported), a prompt in the chat template, a forced policy (``Script``), the check that a trajectory's
token views agree with its segments, and the field-by-field comparison of two trajectories that the
engine-equivalence tests assert."""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer

from rubricem_core.rollout import ANSWERED, ERROR, TOOL_BUDGET, TRUNCATED, ForcedContext, RolloutRequest, SamplingParams
from rubricem_core.scaffold import EXAMPLE_TRACE, STAGE_IDS, parse_segments
from rubricem_core.sim.tiny_policy import TinyPolicySpec, build_tiny_policy
from rubricem_core.sim.world import World, WorldConfig, generate_world
from rubricem_core.tools import LocalBrowseTool, LocalSearchTool, ToolEnv
from rubricem_core.trajectory import NO_STAGE, TokenTrajectory

# forced policy texts: a plan up to its first tool call, and the stages after the research
PLAN = EXAMPLE_TRACE[: EXAMPLE_TRACE.index("<call_tool")]
FINISH = (
    "<state_evaluation>Evidence found. Verdict: ready</state_evaluation>\n<review>\n<rubric_review>Year -> {id}."
    "</rubric_review>\n<writing_plan><thesis>It opened.</thesis><outline>1. Opening.</outline></writing_plan>\n"
    '</review>\n<answer>The answer is <cite id="{id}">as the snippet says</cite>.</answer>'
)


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    # Tiny matmuls: one thread is faster and steadier on a shared 2-core machine.
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def world() -> World:
    return generate_world(WorldConfig(seed=3, n_documents=60, n_queries=6))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory, world: World) -> Path:
    texts = [d.text for d in world.documents] + [q.question for q in world.queries] + [EXAMPLE_TRACE] * 4
    # head_dim 64 (128 / 2 heads): a size every vLLM attention backend supports
    spec = TinyPolicySpec(vocab_size=600, hidden_size=128, n_layers=2, n_heads=2, n_kv_heads=1, intermediate_size=256)
    return build_tiny_policy(texts, tmp_path_factory.mktemp("policy") / "tiny", spec)


@pytest.fixture(scope="module")
def env(world: World) -> ToolEnv:
    table = world.corpus_table()
    return ToolEnv({"search": LocalSearchTool(table), "browse": LocalBrowseTool(table)}, max_calls=4)


@pytest.fixture(scope="module")
def tok(model_dir: Path):
    return AutoTokenizer.from_pretrained(model_dir)


def prompt_ids(tok, text: str) -> list[int]:
    """``text`` as the user's turn in the tokenizer's chat template, ready for the assistant."""
    rendered = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False)
    return tok.encode(rendered, add_special_tokens=False)


def assert_same_trajectory(a: TokenTrajectory, b: TokenTrajectory) -> None:
    """Token for token, mask for mask, segment for segment; logprobs within 1e-4 (NaN where neither sampled)."""
    assert a.token_ids == b.token_ids
    assert (a.loss_mask, a.stage_ids, a.prompt_len) == (b.loss_mask, b.stage_ids, b.prompt_len)
    assert [(s.kind, s.stage, s.start, s.end, s.text) for s in a.segments] == [
        (s.kind, s.stage, s.start, s.end, s.text) for s in b.segments
    ]
    assert (a.finish_reason, a.n_tool_calls, a.meta) == (b.finish_reason, b.n_tool_calls, b.meta)
    for x, y in zip(a.logprobs, b.logprobs):
        assert (math.isnan(x) and math.isnan(y)) or abs(x - y) < 1e-4, (x, y)


def flat_groups(groups: list[list[TokenTrajectory]]) -> list[TokenTrajectory]:
    return [t for g in groups for t in g]


def finish_reason_requests(prompt: list[int], sampling: Callable[..., SamplingParams]) -> list[RolloutRequest]:
    """One request per way a trajectory ends that both engines must end alike (their forced scripts are the
    tests' own): an answer, a tag left open, EOS early or inside the answer, a prompt over the context,
    an empty prompt, the tool budget, the context filled mid-turn, a tool output too big to fit."""
    return [
        RolloutRequest("answer", prompt, sampling=sampling(max_new_tokens=400)),
        RolloutRequest("open-tag", prompt, sampling=sampling(max_new_tokens=30)),
        RolloutRequest("eos-early", prompt, sampling=sampling(max_new_tokens=400)),
        RolloutRequest("too-long", prompt * 40, sampling=sampling(max_total_tokens=len(prompt) * 40)),
        RolloutRequest("empty", [], sampling=sampling()),
        RolloutRequest("eos-in-answer", prompt, sampling=sampling()),
        RolloutRequest("budget", prompt, sampling=sampling(), max_tool_calls=1),
        RolloutRequest("context", prompt, sampling=sampling(max_new_tokens=400, max_total_tokens=len(prompt) + 150)),
        RolloutRequest("output-too-big", prompt, sampling=sampling(max_total_tokens=len(prompt) + 40)),
    ]


# how each of finish_reason_requests' trajectories ends, in either engine
FINISH_REASONS = {
    "answer": ANSWERED,
    "open-tag": TRUNCATED,
    "eos-early": ERROR,
    "too-long": ERROR,
    "empty": ERROR,
    "eos-in-answer": ANSWERED,
    "budget": TOOL_BUDGET,
    "context": TRUNCATED,
    "output-too-big": TRUNCATED,
}


class Script:
    """A forced policy: per request, per turn, a text (or ids) fed as if sampled; None → sample."""

    def __init__(self, tok, turns: dict[str, list[str | list[int]]]):
        self.turns = {
            rid: [t if isinstance(t, list) else tok.encode(t, add_special_tokens=False) for t in texts]
            for rid, texts in turns.items()
        }
        self.seen: list[ForcedContext] = []

    def __call__(self, ctx: ForcedContext) -> int | None:
        self.seen.append(ctx)
        turns = self.turns.get(ctx.request_id, [])
        if ctx.turn < len(turns) and len(ctx.turn_ids) < len(turns[ctx.turn]):
            return turns[ctx.turn][len(ctx.turn_ids)]
        return None


def tool_texts(traj: TokenTrajectory) -> list[str]:
    return [s.text for s in traj.segments if s.kind == "tool_output"]


def check_views(tok, traj: TokenTrajectory) -> None:
    """Ids decode to the segment texts; masks and stage ids agree with segment kinds and the parser."""
    assert len(traj.token_ids) == len(traj.loss_mask) == len(traj.stage_ids) == len(traj.logprobs)
    decode = lambda ids: tok.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)  # noqa: E731
    assert traj.segments[0].kind == "prompt" and traj.segments[0].end == traj.prompt_len
    covered = 0
    for seg in traj.segments:
        assert seg.start == covered
        covered = seg.end
        assert decode(traj.token_ids[seg.start : seg.end]) == seg.text
        assert traj.loss_mask[seg.start : seg.end] == [1 if seg.kind == "policy" else 0] * (seg.end - seg.start)
        lps = traj.logprobs[seg.start : seg.end]
        assert all(v <= 0 for v in lps) if seg.kind == "policy" else all(math.isnan(v) for v in lps)
        if seg.kind == "prompt":
            assert set(traj.stage_ids[seg.start : seg.end]) <= {NO_STAGE}
        if seg.kind == "tool_output":
            assert set(traj.stage_ids[seg.start : seg.end]) == {STAGE_IDS["research"]}
    assert covered == len(traj.token_ids)
    gen = decode(traj.token_ids[traj.prompt_len :])
    assert gen == "".join(s.text for s in traj.segments[1:])
    # Stage of each generated token = parse_segments' stage of its first character in the decoded text.
    segments = parse_segments(gen)
    starts = [s.start for s in segments]
    checked = 0
    for i in range(traj.prompt_len, len(traj.token_ids)):
        prefix = decode(traj.token_ids[traj.prompt_len : i])
        if prefix.endswith("\ufffd") or len(prefix) >= len(gen):
            continue  # mid-character, or a token that adds no character: no offset to check against
        k = max(j for j, s in enumerate(starts) if s <= len(prefix))
        assert traj.stage_ids[i] == STAGE_IDS[segments[k].stage], (i, prefix[-40:])
        checked += 1
    # random weights sample lone UTF-8 bytes; most tokens still have a clean offset
    assert checked >= (len(traj.token_ids) - traj.prompt_len) // 2
