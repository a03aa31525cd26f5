"""The transformers rollout engine: token views, logprobs vs a cache-free recompute, tools, finish reasons.

A tiny random Qwen3 and a byte-level BPE trained on a small synthetic world. A random model emits
scaffold tags by chance (they are ~7% of this vocabulary), so free sampling already produces calls,
answers and stray closing tags; ``Script`` forces exact texts where a test needs a known path.
"""

from __future__ import annotations

import math
import threading

import pytest
import torch
from transformers import Qwen3ForCausalLM

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
from rubricem_core.scaffold import ToolCall, validate
from rubricem_core.testing.tiny_models import tool_policy, world_tokenizer
from rubricem_core.tools import Tool, ToolEnv, ToolResult, ToolSpec
from rubricem_core.trajectory import TokenTrajectory
from tests.rollout_fixtures import (  # noqa: F401  (module fixtures)
    FINISH,
    FINISH_REASONS,
    PLAN,
    Script,
    check_views,
    env,
    finish_reason_requests,
    one_thread,
    prompt_ids,
    tool_texts,
    world,
)

# ---- fixtures -------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tok(world):
    return world_tokenizer(world)


def _model(tok, attn: str = "sdpa", seed: int = 0) -> Qwen3ForCausalLM:
    return tool_policy(tok, seed=seed, attn=attn)


@pytest.fixture(scope="module")
def model(tok):
    return _model(tok)


def _gen_text(tok, traj: TokenTrajectory) -> str:
    return tok.decode(traj.token_ids[traj.prompt_len :], skip_special_tokens=False, clean_up_tokenization_spaces=False)


def _sampling(**kw) -> SamplingParams:
    base = dict(temperature=1.0, max_new_tokens=40, max_total_tokens=1500, seed=7)
    base.update(kw)
    return SamplingParams(**base)


def _recomputed_logprobs(model, traj: TokenTrajectory) -> torch.Tensor:
    """Teacher-forced log-softmax at temperature 1, no cache: logprob of token i given tokens < i."""
    with torch.no_grad():
        logits = model(torch.tensor([traj.token_ids])).logits[0].float()
    logp = torch.log_softmax(logits, dim=-1)
    ids = torch.tensor(traj.token_ids)
    out = torch.full((len(ids),), float("nan"))
    out[1:] = logp[:-1].gather(1, ids[1:, None]).squeeze(1)
    return out


# ---- the contract ---------------------------------------------------------------------------------


def test_engine_satisfies_protocol(model, tok):
    assert isinstance(HFRolloutEngine(model, tok), RolloutEngine)


@pytest.mark.parametrize(
    "field,value",
    [
        ("temperature", -0.5),
        ("top_p", 0.0),
        ("top_p", 1.5),
        ("top_k", -1),
        ("max_new_tokens", 0),
        ("max_total_tokens", 0),
    ],
)
def test_bad_sampling_params_name_the_field(field, value):
    with pytest.raises(RolloutError, match=field):
        SamplingParams(**{field: value})


def test_bad_request_and_tool_names(model, tok, env):
    with pytest.raises(RolloutError, match="n must be"):
        RolloutRequest("q", [1, 2], n=0)
    with pytest.raises(RolloutError, match="request_id"):
        RolloutRequest("", [1, 2])
    engine = HFRolloutEngine(model, tok, tool_names=("search", "websearch"))
    with pytest.raises(RolloutError, match="websearch"):
        engine.generate([RolloutRequest("q", [1, 2])], env)


# ---- equivalence: cached, holed, chunked sampling == one cache-free forward -------------------------


@pytest.mark.parametrize(
    "attn,chunk,compact_min,max_rows",
    [("sdpa", 256, 64, None), ("eager", 256, 64, None), ("sdpa", 16, 4, None), ("sdpa", 64, 64, 3)],
    ids=["sdpa", "eager", "sdpa-chunk16-compact", "sdpa-3-rows-admit"],
)
def test_sampling_logprobs_match_cache_free_recompute(tok, env, world, attn, chunk, compact_min, max_rows):
    model = _model(tok, attn)
    # Different prompt lengths (holes from the first chunk on) and first calls at different steps
    # ("b" calls at once, "a" after a long plan): tool outputs are ingested while other rows sample.
    script = Script(
        tok,
        {
            "a": [PLAN + '<call_tool name="search">founded</call_tool>'],
            "b": ['<structured_plan>x</structured_plan><call_tool name="search">headquarters city</call_tool>'],
        },
    )
    engine = HFRolloutEngine(
        model, tok, forced_policy=script, max_chunk_tokens=chunk, compact_min_slots=compact_min, max_batch_rows=max_rows
    )
    requests = [
        RolloutRequest("a", prompt_ids(tok, world.queries[0].question), n=2, sampling=_sampling(max_new_tokens=260)),
        RolloutRequest("b", prompt_ids(tok, world.queries[1].question * 3), n=2, sampling=_sampling()),
        RolloutRequest("c", prompt_ids(tok, "hi"), n=2, sampling=_sampling(max_new_tokens=60)),
    ]
    out = engine.generate(requests, env)
    trajs = [t for group in out for t in group]
    assert [len(g) for g in out] == [2, 2, 2]
    assert sum(t.n_tool_calls for t in trajs) >= 4  # the scripted calls at least
    assert engine.stats["chunk_slots"] > engine.stats["real_slots"]  # the holes path really ran
    if compact_min < 64:
        assert engine.stats.get("compactions", 0) > 0
    if max_rows:  # rows joined a running batch as others finished
        assert engine.stats.get("admitted", 0) == 6 - max_rows
    worst = 0.0
    for traj in trajs:
        check_views(tok, traj)
        want = _recomputed_logprobs(model, traj)
        for i, bit in enumerate(traj.loss_mask):
            if bit:
                worst = max(worst, abs(traj.logprobs[i] - float(want[i])))
    assert worst < 2e-4, worst


def test_greedy_and_top_k_one_record_the_argmax(model, tok, env):
    prompt = prompt_ids(tok, "greedy")
    engine = HFRolloutEngine(model, tok)
    greedy_params = _sampling(temperature=0.0, max_new_tokens=25)
    greedy = engine.generate([RolloutRequest("g", prompt, sampling=greedy_params)], env)[0][0]
    topk1_params = _sampling(top_k=1, max_new_tokens=25, seed=99)
    topk1 = engine.generate([RolloutRequest("g", prompt, sampling=topk1_params)], env)[0][0]
    assert greedy.token_ids[: greedy.prompt_len + 25] == topk1.token_ids[: topk1.prompt_len + 25]
    want = _recomputed_logprobs(model, greedy)
    with torch.no_grad():
        logits = model(torch.tensor([greedy.token_ids])).logits[0]
    for i, bit in enumerate(greedy.loss_mask):
        if bit and greedy.segments[-1].kind == "policy" and i < greedy.prompt_len + 20:
            assert greedy.token_ids[i] == int(logits[i - 1].argmax())
            assert greedy.logprobs[i] == pytest.approx(float(want[i]), abs=2e-4)  # T=1 log-softmax
            assert topk1.logprobs[i] == pytest.approx(0.0, abs=1e-6)  # a one-token distribution


@pytest.mark.parametrize("top_k,top_p", [(0, 1.0), (5, 1.0), (0, 0.3), (7, 0.6), (1, 0.9)])
def test_top_k_top_p_filter_matches_reference(top_k, top_p):
    torch.manual_seed(1)
    logits = torch.randn(3, 50) * 3
    out = _filter_top_k_top_p(logits, [top_k] * 3, [top_p] * 3)
    for row in range(3):
        order = sorted(range(50), key=lambda j: -float(logits[row, j]))
        keep = order[:top_k] if top_k else order
        probs = torch.softmax(logits[row, keep], dim=0).tolist()
        kept, mass = [], 0.0
        for j, p in zip(keep, probs):
            if kept and mass >= top_p:
                break
            kept.append(j)
            mass += p
        assert sorted(j for j in range(50) if math.isfinite(float(out[row, j]))) == sorted(kept)
        assert all(float(out[row, j]) == float(logits[row, j]) for j in kept)
    changed = (out != logits).any().item()
    assert changed == (top_k not in (0,) or top_p < 1.0)


# ---- the tool round trip --------------------------------------------------------------------------


def test_forced_tool_round_trip_gives_a_valid_answered_trace(model, tok, env, world):
    query = world.documents[0].title
    reply = env.fork().execute(ToolCall("search", query))
    doc_id = reply.snippet_ids[0]
    turn0 = PLAN + f'<call_tool name="search">{query}</call_tool>'
    turn1 = FINISH.format(id=doc_id)
    script = Script(tok, {"r": [turn0, turn1]})
    engine = HFRolloutEngine(model, tok, forced_policy=script)
    request = RolloutRequest("r", prompt_ids(tok, "When did it open?"), sampling=_sampling(max_new_tokens=400))
    traj = engine.generate([request], env)[0][0]
    assert traj.finish_reason == ANSWERED
    assert traj.n_tool_calls == 1
    assert tool_texts(traj) == [reply.text]
    assert _gen_text(tok, traj) == turn0 + reply.text + turn1
    assert validate(_gen_text(tok, traj)) == []
    check_views(tok, traj)
    kinds = [s.kind for s in traj.segments]
    assert kinds.count("tool_output") == 1 and kinds[0] == "prompt"
    policy_stages = [s.stage for s in traj.segments if s.kind == "policy"]
    assert policy_stages == ["plan", "research", "research", "review", "answer"]
    # the hook saw the finished turn and the tool output when the second turn began
    second = [c for c in script.seen if c.turn == 1][0]
    assert second.policy_turns == [turn0] and second.tool_outputs == [reply.text] and second.turn_ids == []


class _Raising(Tool):
    spec = ToolSpec("search", "raises")

    def __call__(self, query: str) -> ToolResult:
        raise RuntimeError("index offline")


class _Hanging(Tool):
    spec = ToolSpec("search", "hangs")

    def __init__(self):
        self.release = threading.Event()

    def __call__(self, query: str) -> ToolResult:
        self.release.wait(30)
        return ToolResult("<tool_output><error>late</error></tool_output>")


class _Garbage(Tool):
    spec = ToolSpec("search", "returns a string")

    def __call__(self, query: str):
        return "not a result"


class _Malformed(Tool):
    spec = ToolSpec("search", "returns a broken block")

    def __call__(self, query: str) -> ToolResult:
        return ToolResult('<tool_output><snippet id="D1">cut off')


@pytest.mark.parametrize(
    "tool_cls,call,expected",
    [
        (_Raising, '<call_tool name="search">q</call_tool>', "tool failed: RuntimeError: index offline"),
        (_Hanging, '<call_tool name="search">q</call_tool>', "tool timed out after 0.3 s"),
        (_Garbage, '<call_tool name="search">q</call_tool>', "returned str, not a ToolResult"),
        (_Malformed, '<call_tool name="search">q</call_tool>', "malformed output block"),
        (_Raising, '<call_tool name="browse">D1</call_tool>', "unknown tool 'browse'"),
        (_Raising, "</call_tool>", "malformed tool call"),
    ],
    ids=["raises", "hangs", "garbage", "malformed-block", "unknown-tool", "stray-close"],
)
def test_tool_failures_become_error_outputs_and_the_row_continues(model, tok, tool_cls, call, expected):
    tool = tool_cls()
    env = ToolEnv({"search": tool}, max_calls=3)
    script = Script(tok, {"r": [call, FINISH.format(id="D1")]})
    engine = HFRolloutEngine(model, tok, tool_names=None, forced_policy=script, tool_timeout_s=0.3)
    traj = engine.generate([RolloutRequest("r", prompt_ids(tok, "q"), sampling=_sampling(max_new_tokens=300))], env)[0][
        0
    ]
    if isinstance(tool, _Hanging):
        tool.release.set()
    outputs = tool_texts(traj)
    assert len(outputs) == 1 and outputs[0].startswith("<tool_output><error>"), outputs
    assert expected in outputs[0]
    assert traj.finish_reason == ANSWERED and traj.meta["tool_errors"] == 1
    check_views(tok, traj)


def test_an_exception_out_of_the_environment_is_logged_and_named_in_the_row(model, tok, caplog, monkeypatch):
    def broken(self, call):  # a bug in the environment itself, not a tool's failure (tools report those)
        raise KeyError("lost the budget")

    monkeypatch.setattr(ToolEnv, "execute", broken)  # rows run a copy of the environment: patch the class
    env = ToolEnv({"search": _Raising()}, max_calls=3)
    script = Script(tok, {"r": ['<call_tool name="search">q</call_tool>', FINISH.format(id="D1")]})
    engine = HFRolloutEngine(model, tok, tool_names=None, forced_policy=script, tool_timeout_s=5)
    with caplog.at_level("WARNING", logger="rubricem_core.rollout.rows"):
        traj = engine.generate(
            [RolloutRequest("r", prompt_ids(tok, "q"), sampling=_sampling(max_new_tokens=300))], env
        )[0][0]
    [output] = tool_texts(traj)
    assert "tool search raised KeyError: 'lost the budget'" in output and "NoneType" not in output
    assert any(r.exc_info and "raised" in r.getMessage() for r in caplog.records)


# ---- finish reasons -------------------------------------------------------------------------------


def test_mixed_batch_each_row_gets_its_own_outcome(model, tok, env, world):
    eos = tok.eos_token_id
    never_closes = "<answer>" + "the bridge opened " * 40
    call = '<call_tool name="search">Varn bridge</call_tool>'
    script = Script(
        tok,
        {
            "answer": [PLAN + call, FINISH.format(id="D1")],
            "open-tag": [never_closes],
            "eos-early": [tok.encode(PLAN, add_special_tokens=False) + [eos]],
            "eos-in-answer": [tok.encode("<answer>done", add_special_tokens=False) + [eos]],
            "budget": [call, call, call, call],
            "context": [PLAN + call],
            "output-too-big": [f'<call_tool name="search">{world.documents[0].title}</call_tool>'],
        },
    )
    engine = HFRolloutEngine(model, tok, forced_policy=script)
    prompt = prompt_ids(tok, "Varn bridge")
    requests = finish_reason_requests(prompt, _sampling)
    out = {r.request_id: g[0] for r, g in zip(requests, engine.generate(requests, env))}
    reasons = {rid: t.finish_reason for rid, t in out.items()}
    assert reasons == FINISH_REASONS
    assert "max_new_tokens 30" in out["open-tag"].meta["finish_detail"]
    assert len(out["open-tag"]) == len(prompt) + 30
    assert "context limit" in out["too-long"].meta["finish_detail"] and len(out["too-long"]) == len(prompt) * 40
    assert out["empty"].token_ids == [] and "empty prompt" in out["empty"].meta["finish_detail"]
    assert out["eos-early"].token_ids[-1] == eos and out["eos-early"].loss_mask[-1] == 1
    # budget 1: the first call runs, the second is told the budget is spent, the third ends the row
    budget = out["budget"]
    assert budget.n_tool_calls == 2 and budget.meta["tool_calls_written"] == 3
    assert "budget exhausted" in tool_texts(budget)[1]
    assert len(out["context"]) == len(prompt) + 150 and "context limit" in out["context"].meta["finish_detail"]
    too_big = out["output-too-big"]  # the call is kept, the output that would overflow is not appended
    assert "does not fit" in too_big.meta["finish_detail"] and too_big.n_tool_calls == 0
    assert _gen_text(tok, too_big).endswith("</call_tool>")
    for traj in out.values():
        if traj.token_ids:
            check_views(tok, traj)
        assert traj.meta["request_id"] in reasons


def test_free_sampling_never_crashes_and_records_a_reason(model, tok, env):
    # Random weights write tags by chance: stray closes, calls with odd names, answers, eos.
    engine = HFRolloutEngine(model, tok)
    requests = [
        RolloutRequest(
            f"q{i}",
            prompt_ids(tok, f"question {i}"),
            n=4,
            sampling=_sampling(seed=i, max_new_tokens=30, max_total_tokens=300),
            max_tool_calls=2,
        )
        for i in range(3)
    ]
    trajs = [t for g in engine.generate(requests, env) for t in g]
    assert {t.finish_reason for t in trajs} <= {ANSWERED, TRUNCATED, TOOL_BUDGET, ERROR}
    assert sum(t.n_tool_calls for t in trajs) > 0  # some rows closed a call by chance
    assert len({tuple(t.token_ids) for t in trajs}) == len(trajs)  # samples differ
    for traj in trajs:
        assert len(traj) <= 300
        check_views(tok, traj)


# ---- determinism and weights ----------------------------------------------------------------------


def test_same_seed_same_rollouts_other_seed_differs(model, tok, env):
    engine = HFRolloutEngine(model, tok)

    def run(seed: int) -> list[TokenTrajectory]:
        reqs = [
            RolloutRequest("d", prompt_ids(tok, "determinism"), n=3, sampling=_sampling(seed=seed, max_new_tokens=30))
        ]
        return engine.generate(reqs, env)[0]

    first, again, other = run(11), run(11), run(12)
    assert [t.token_ids for t in first] == [t.token_ids for t in again]
    assert [t.logprobs for t in first] == [t.logprobs for t in again]
    assert [t.token_ids for t in first] != [t.token_ids for t in other]


def test_update_weights_and_sync_from(tok, env):
    policy, other = _model(tok, seed=0), _model(tok, seed=1)
    engine = HFRolloutEngine(policy, tok)
    reqs = [RolloutRequest("w", prompt_ids(tok, "weights"), n=2, sampling=_sampling(seed=5, max_new_tokens=30))]
    before = engine.generate(reqs, env)[0]
    engine.sync_from(policy)  # shared module: no-op
    assert [t.token_ids for t in engine.generate(reqs, env)[0]] == [t.token_ids for t in before]
    engine.sync_from(other)
    after = engine.generate(reqs, env)[0]
    reference = HFRolloutEngine(other, tok).generate(reqs, env)[0]
    assert [t.token_ids for t in after] == [t.token_ids for t in reference]
    assert [t.token_ids for t in after] != [t.token_ids for t in before]
    engine.update_weights(_model(tok, seed=0).state_dict())
    assert [t.token_ids for t in engine.generate(reqs, env)[0]] == [t.token_ids for t in before]
    with pytest.raises(RuntimeError, match="Missing key"):
        engine.update_weights({})


@pytest.mark.parametrize("scaffold", [True, False])
def test_free_text_requests_end_at_their_stop_text_not_at_the_scaffold(model, tok, env, scaffold):
    """A reflection (scaffold=False, stop text </reflection>) runs past a literal </answer> and a
    </call_tool> and ends at </reflection>; a research request ends at the </answer>."""
    body = (
        '<reflection>the search for X found nothing</answer> and <call_tool name="search">x</call_tool> '
        "were mentioned</reflection> and trailing text"
    )
    script = Script(tok, {"r": [body]})
    engine = HFRolloutEngine(model, tok, forced_policy=script)
    sampling = _sampling(max_new_tokens=200, stop_texts=("</reflection>",))
    request = RolloutRequest("r", prompt_ids(tok, "Reflect."), sampling=sampling, max_tool_calls=0, scaffold=scaffold)
    traj = engine.generate([request], env)[0][0]
    text = _gen_text(tok, traj)
    assert traj.finish_reason == ANSWERED and traj.n_tool_calls == 0
    if scaffold:
        assert text.endswith("</answer>") and "</reflection>" not in text
    else:
        assert text.startswith(body[: body.index("</reflection>")]) and "</reflection>" in text
        assert "trailing" not in text
