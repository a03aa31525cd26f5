"""The rollout tests' shared pieces: the tiny world and a tiny Qwen3 policy that every vLLM attention
backend can load (module fixtures ``world``, ``model_dir``, ``tok``), a prompt in the chat template,
and the field-by-field comparison of two trajectories that the engine-equivalence tests assert."""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from rubricem_core.rollout import RolloutRequest, SamplingParams
from rubricem_core.scaffold import EXAMPLE_TRACE
from rubricem_core.sim.tiny_policy import TinyPolicySpec, build_tiny_policy
from rubricem_core.sim.world import World, WorldConfig, generate_world
from rubricem_core.trajectory import TokenTrajectory

# forced policy texts: a plan up to its first tool call, and the stages after the research
PLAN = EXAMPLE_TRACE[: EXAMPLE_TRACE.index("<call_tool")]
FINISH = (
    "<state_evaluation>Evidence found. Verdict: ready</state_evaluation>\n<review>\n<rubric_review>Year -> {id}."
    "</rubric_review>\n<writing_plan><thesis>It opened.</thesis><outline>1. Opening.</outline></writing_plan>\n"
    '</review>\n<answer>The answer is <cite id="{id}">as the snippet says</cite>.</answer>'
)


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
