"""Tokens/s of HFRolloutEngine (one kept KV cache, batched ragged chunks) vs the naive per-turn
``model.generate`` loop (rubricem_core.rollout.baseline), on the same multi-turn workload.

Workload: a synthetic research world (rubricem_core.sim.world) with BM25 search/browse tools, a tiny
random-init Qwen3 and a byte-level BPE trained here on the world corpus. Random weights never write
a research trace, so the *choice* of each policy token is scripted (a forced-token schedule, the
only departure from real sampling): the built-in scripted teacher (rubricem_core.sim.teacher)
writes each turn from the chat so far — its plan and searches react to the real tool outputs — and
both systems feed those tokens through the same ``ForcedPolicy`` hook. The model still runs every
forward pass, the sampler still runs, tools really run, so the compute per token is that of real
sampling; both systems produce the same texts (checked below).

    .venv/bin/python bench/rollout_engine.py            # ~1-3 min on 2 CPU cores
    .venv/bin/python bench/rollout_engine.py --queries 4 --n 2 --layers 2   # quicker
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rubricem_core.offline import apply_offline_defaults  # noqa: E402

apply_offline_defaults()  # before litellm is imported (the teacher module imports it)

import torch  # noqa: E402
from transformers import Qwen3ForCausalLM  # noqa: E402

from rubricem_core.encoding import encode_prompt  # noqa: E402
from rubricem_core.policy.tokenizer import train_bpe_tokenizer  # noqa: E402
from rubricem_core.rollout import ForcedContext, HFRolloutEngine, RolloutRequest, SamplingParams  # noqa: E402
from rubricem_core.rollout.baseline import NaiveRolloutBaseline  # noqa: E402
from rubricem_core.scaffold import EXAMPLE_TRACE, TOOL_CALL_CLOSE, system_prompt  # noqa: E402
from rubricem_core.sim.teacher import ScriptedTeacher, TeacherRates  # noqa: E402
from rubricem_core.sim.world import WorldConfig, generate_world  # noqa: E402
from rubricem_core.testing.tiny_models import tiny_config  # noqa: E402
from rubricem_core.tools import LocalBrowseTool, LocalSearchTool, ToolEnv  # noqa: E402

ANSWER_CLOSE = "</answer>"


class TeacherSchedule:
    """Forced-token schedule: each turn is the scripted teacher's reply to the chat so far."""

    def __init__(self, tokenizer, questions: dict[str, str], max_tool_calls: int):
        self.tok = tokenizer
        self.questions = questions
        self.teacher = ScriptedTeacher(TeacherRates(max_tool_calls=max_tool_calls))
        self.turn_ids: dict[tuple[str, int, int], list[int]] = {}

    def _turn(self, ctx: ForcedContext) -> list[int]:
        messages = [{"role": "user", "content": self.questions[ctx.request_id]}]
        for i, turn in enumerate(ctx.policy_turns):
            messages.append({"role": "assistant", "content": turn})
            if i < len(ctx.tool_outputs):
                messages.append({"role": "user", "content": ctx.tool_outputs[i]})
        text = self.teacher.respond(messages, {"seed": 1000 * ctx.sample_index + ctx.turn})
        if ANSWER_CLOSE in text:
            return self.tok.encode(text[: text.index(ANSWER_CLOSE) + len(ANSWER_CLOSE)], add_special_tokens=False)
        if "<call_tool" in text.rsplit(TOOL_CALL_CLOSE, 1)[-1]:
            return self.tok.encode(text + TOOL_CALL_CLOSE, add_special_tokens=False)  # the stop string was cut
        return self.tok.encode(text, add_special_tokens=False) + [self.tok.eos_token_id]

    def __call__(self, ctx: ForcedContext) -> int | None:
        key = (ctx.request_id, ctx.sample_index, ctx.turn)
        if key not in self.turn_ids:
            self.turn_ids[key] = self._turn(ctx)
        ids = self.turn_ids[key]
        return ids[len(ctx.turn_ids)] if len(ctx.turn_ids) < len(ids) else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--queries", type=int, default=6)
    parser.add_argument("--n", type=int, default=2, help="samples per query")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--max-tool-calls", type=int, default=4)
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (1 is steadiest on a shared box)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    world = generate_world(WorldConfig(seed=0, n_documents=300, n_queries=max(args.queries, 4)))
    texts = [d.text for d in world.documents] + [q.question for q in world.queries] + [EXAMPLE_TRACE] * 8
    tok = train_bpe_tokenizer(texts, vocab_size=2048)
    torch.manual_seed(0)
    extra = dict(tie_word_embeddings=True, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
    config = tiny_config(
        len(tok), args.hidden, args.layers, intermediate_size=3 * args.hidden, max_position_embeddings=8192, **extra
    )
    model = Qwen3ForCausalLM(config).eval()
    table = world.corpus_table()
    tools = {
        "search": LocalSearchTool(table, top_k=3, snippet_chars=240),
        "browse": LocalBrowseTool(table, max_chars=800),
    }
    env = ToolEnv(tools, max_calls=args.max_tool_calls)

    queries = world.queries[: args.queries]
    questions = {q.query_id: q.question for q in queries}
    system = system_prompt()
    sampling = SamplingParams(temperature=1.0, max_new_tokens=600, max_total_tokens=8192, seed=0)
    requests = [
        RolloutRequest(
            q.query_id,
            encode_prompt(tok, [{"role": "system", "content": system}, {"role": "user", "content": q.question}]),
            n=args.n,
            sampling=sampling,
            max_tool_calls=args.max_tool_calls,
        )
        for q in queries
    ]
    print(
        f"workload: {len(requests)} queries x {args.n} samples, prompt ~{len(requests[0].prompt_ids)} tokens, "
        f"model {args.layers}x{args.hidden} (vocab {len(tok)}), torch threads {args.threads}"
    )

    engine = HFRolloutEngine(model, tok, forced_policy=TeacherSchedule(tok, questions, args.max_tool_calls))
    started = time.perf_counter()
    engine_out = [t for group in engine.generate(requests, env) for t in group]
    engine_s = time.perf_counter() - started
    engine_tokens = sum(t.n_policy_tokens for t in engine_out)

    baseline = NaiveRolloutBaseline(model, tok, forced_policy=TeacherSchedule(tok, questions, args.max_tool_calls))
    started = time.perf_counter()
    baseline_out = [r for group in baseline.generate(requests, env) for r in group]
    baseline_s = time.perf_counter() - started
    baseline_tokens = sum(r.n_generated for r in baseline_out)

    same = sum(
        tok.decode(t.token_ids[t.prompt_len :], skip_special_tokens=False, clean_up_tokenization_spaces=False) == r.text
        for t, r in zip(engine_out, baseline_out)
    )
    turns = sum(t.n_tool_calls + 1 for t in engine_out)
    reasons = sorted({t.finish_reason for t in engine_out})
    print(
        f"trajectories: {len(engine_out)}, turns {turns}, tool calls {sum(t.n_tool_calls for t in engine_out)}, "
        f"finish {reasons}, identical texts {same}/{len(engine_out)}"
    )
    stats = engine.stats
    print(
        f"engine:   {engine_tokens} policy tokens in {engine_s:.2f} s = {engine_tokens / engine_s:.1f} tok/s "
        f"({stats['forward_calls']} forward calls, {stats['real_slots'] / stats['chunk_slots']:.0%} of chunk "
        f"positions real, {stats.get('compactions', 0)} cache compactions)"
    )
    print(f"baseline: {baseline_tokens} policy tokens in {baseline_s:.2f} s = {baseline_tokens / baseline_s:.1f} tok/s")
    ratio = (engine_tokens / engine_s) / (baseline_tokens / baseline_s)
    print(
        f"figure: engine_speedup={ratio:.2f} x  goal: > 1 x the per-turn generate loop  met: {'yes' if ratio > 1 else 'no'}"
    )


if __name__ == "__main__":
    main()
