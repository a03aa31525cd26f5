"""Multi-turn, tool-augmented rollouts with a Hugging Face causal LM and one KV cache kept across turns.

Design: one batch, one cache. Every sample of every request is a *row*. Each row owns a queue of
tokens the model has not seen yet: first its prompt, later its last sampled token, and after a tool
call that token plus the tool output ids. Every forward call takes up to ``max_chunk_tokens`` queued
tokens from every live row, right-padded into one ``[rows, L]`` chunk:

    row 0 (prompt / tool output)  t t t t t t      ← ingested in one call
    row 1 (sampling)              t . . . . .      ← '.' = hole: attention_mask 0
    row 2 (sampling)              t . . . . .

The cache grows by ``L`` slots for every row; holes stay masked forever (the 2-D attention mask
keeps one bit per cache slot), and ``position_ids`` count only a row's real tokens, so RoPE sees
each row as one contiguous sequence. A row whose queue empties in the call samples its next token
from the logits at its last real position. So a 300-token tool output is ingested in one call while
the other rows keep sampling, and no prefix is ever re-encoded. Finished rows are dropped from the
batch dimension of the cache; when holes make the cache much longer than the longest row, every
row's real slots are gathered to the front (keys already carry their rotary positions, and the
causal mask only orders past slots before new ones, so moving past slots is exact). With
``max_batch_rows`` set, waiting rows join the running batch as others finish (continuous batching):
a joining row gets zero-filled, masked past slots and its prompt arrives through its queue. The
cache is transformers' ``DynamicCache`` with its layers swapped for a growing buffer that appends in
place (the stock layer concatenates the whole cache every step).

Invariants that keep the numbers right: a row's first chunk starts with real tokens (right padding),
so no query ever sees only masked keys (that would put NaNs into hole slots, and 0 x NaN poisons
later attention); a row's forward is the same function of its real tokens whatever the holes are,
which ``tests/test_rollout_hf.py`` checks by recomputing every sampled logprob without a cache.

Per token the engine records: the id as sampled, the sampling logprob (log-softmax of the
temperature-scaled, top-k/top-p-filtered distribution it was drawn from; for temperature 0 the
plain T=1 log-softmax of the argmax token), and the stage id. Text is decoded incrementally
(prefix/read offsets, so a token that ends mid-character waits for the next); a token's stage is the
stage :class:`scaffold.StreamParser` gives the first character it contributes, which equals
``scaffold.parse_segments`` on the decoded generated text. Tool outputs are encoded once with
``encoding.encode_tool_output`` (the SFT path) and appended with mask 0, stage research.

Turns end at ``</call_tool>`` (the tool runs, its output is appended, the row goes on), ``</answer>``
(answered), eos (answered if an ``<answer>`` was open, else error), ``max_new_tokens`` in the turn
or the context limit (truncated; a tool output that would overflow the context is not appended).
Tool budget, as in the teacher's rounds: the first call over ``max_tool_calls`` gets a
budget-exhausted error as its output; calling again after that ends the row (tool_budget).

Sampling is by inverse CDF with one uniform number per row per step, drawn from a per-row
``random.Random`` seeded by (seed, request_id, sample index): a row's draws do not depend on the
other rows. Tool calls of one step run in parallel daemon threads, each bounded by
``tool_timeout_s``; a hung tool's thread is abandoned (Python cannot kill it) and the row gets a
timeout error as its tool output.
"""
from __future__ import annotations

import bisect
import inspect
import random
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

import torch

from rubricem_core.encoding import encode_tool_output
from rubricem_core.rollout.types import (
    ANSWERED,
    ERROR,
    TOOL_BUDGET,
    TRUNCATED,
    ForcedContext,
    ForcedPolicy,
    RolloutError,
    RolloutRequest,
)
from rubricem_core.scaffold import TOOL_CALL_CLOSE, TOOL_OUTPUT_CLOSE, StreamParser, ToolCall, format_tool_output
from rubricem_core.tools.base import ToolEnv, ToolResult, error_result
from rubricem_core.trajectory import TokenTrajectory

TOOL_OUTPUT_STAGE = "research"
_TOOL_OUTPUT_OPEN = "<tool_output>"
MALFORMED_CALL_MESSAGE = 'malformed tool call; write <call_tool name="search">query</call_tool>'


# ---- one row: a trajectory being generated --------------------------------------------------------


@dataclass
class _Block:
    """A run of trajectory tokens of one kind: a policy turn or one tool output."""

    kind: str  # "policy" | "tool_output"
    char_start: int  # offset in the generated text (everything after the prompt)
    ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    chars: list[int] = field(default_factory=list)  # per policy token: offset of its first char
    text: str = ""


@dataclass
class _Row:
    request: RolloutRequest
    sample_index: int
    env: ToolEnv
    rng: random.Random
    length: int  # tokens in the trajectory so far (prompt + generated + tool output)
    queue: list[int] = field(default_factory=list)  # tokens the model has not seen yet
    n_real: int = 0  # real tokens in the cache = next position id
    parser: StreamParser = field(default_factory=StreamParser)
    piece_ends: list[int] = field(default_factory=list)  # parser pieces: char end offsets …
    piece_stages: list[str] = field(default_factory=list)  # … and their stages
    gen_len: int = 0  # chars of generated text so far
    blocks: list[_Block] = field(default_factory=list)
    turn: _Block | None = None
    prefix_offset: int = 0  # incremental detokenization offsets into turn.ids
    read_offset: int = 0
    answer_opened: bool = False
    n_calls: int = 0  # tool calls the policy wrote (closed)
    n_outputs: int = 0
    tool_errors: int = 0
    finish_reason: str | None = None
    detail: str = ""

    @property
    def sampling(self):
        return self.request.sampling

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def finish(self, reason: str, detail: str = "") -> None:
        if self.finish_reason is None:
            self.finish_reason, self.detail = reason, detail


# ---- the engine -----------------------------------------------------------------------------------


def _ends_with_stop(text: str, stops: Sequence[str]) -> bool:
    """A stop text just completed (the newest token may carry a few characters after it)."""
    tail = text[-(max(len(s) for s in stops) + 8):]
    return any(s in tail for s in stops)


class HFRolloutEngine:
    """Batched multi-turn sampling with a kept KV cache over a transformers causal LM.

    ``model`` may be the trainer's own module (on CPU the engine and trainer share it; ``sync_from``
    is then a no-op). ``tool_names`` are the tools the policy may call (they must exist in the
    ``ToolEnv`` given to ``generate``); None allows every tool of the env. ``max_chunk_tokens``
    bounds the tokens one row feeds per forward call; ``max_batch_rows`` bounds the rows in the batch
    (None: all at once); ``compact_min_slots`` is the fewest cache slots a compaction must free.
    ``forced_policy`` is a test/benchmark hook (see ``types.ForcedPolicy``).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        tokenizer: Any,
        tool_names: Sequence[str] | None = ("search", "browse"),
        *,
        stop_token_ids: Sequence[int] | None = None,
        max_chunk_tokens: int = 256,
        tool_timeout_s: float = 60.0,
        compact_min_slots: int = 64,
        max_batch_rows: int | None = None,
        forced_policy: ForcedPolicy | None = None,
    ):
        if max_chunk_tokens < 1:
            raise RolloutError(f"max_chunk_tokens must be >= 1, got {max_chunk_tokens}")
        if max_batch_rows is not None and max_batch_rows < 1:
            raise RolloutError(f"max_batch_rows must be >= 1 (or None for all rows), got {max_batch_rows}")
        if not tool_timeout_s > 0:
            raise RolloutError(f"tool_timeout_s must be > 0, got {tool_timeout_s}")
        layer_types = getattr(model.config, "layer_types", None) or []
        if any(t != "full_attention" for t in layer_types):
            raise RolloutError(
                f"HFRolloutEngine needs full-attention layers only; {type(model).__name__} has "
                f"{sorted(set(layer_types))}"
            )
        self.model = model
        self.tokenizer = tokenizer
        self.tool_names = None if tool_names is None else tuple(tool_names)
        self.max_chunk_tokens = int(max_chunk_tokens)
        self.tool_timeout_s = float(tool_timeout_s)
        self.compact_min_slots = int(compact_min_slots)
        self.max_batch_rows = max_batch_rows
        self.forced_policy = forced_policy
        self.stop_token_ids = frozenset(self._default_stops() if stop_token_ids is None else map(int, stop_token_ids))
        if not self.stop_token_ids:
            raise RolloutError("no stop token: the tokenizer has no eos_token_id and none was given")
        self._decoder = getattr(model, model.base_model_prefix)
        self._lm_head = model.get_output_embeddings()
        self._softcap = getattr(model.config, "final_logit_softcapping", None)
        params = inspect.signature(self._decoder.forward).parameters
        self._cache_kwarg = "cache" if "cache" in params else "past_key_values"
        self.stats: dict[str, float] = {}
        # called as (finished trajectories, all trajectories) while generate runs: the task's progress line
        self.on_progress: Callable[[int, int], None] | None = None
        self._all_rows: list[_Row] = []

    def _default_stops(self) -> set[int]:
        stops = set()
        eos = getattr(self.tokenizer, "eos_token_id", None)
        if eos is not None:
            stops.add(int(eos))
        gen_eos = getattr(getattr(self.model, "generation_config", None), "eos_token_id", None)
        if gen_eos is not None:
            stops.update(int(t) for t in ([gen_eos] if isinstance(gen_eos, int) else gen_eos))
        return stops

    # ---- weights --------------------------------------------------------------------------------
    def update_weights(self, state_dict: Mapping[str, torch.Tensor]) -> None:
        with torch.no_grad():
            self.model.load_state_dict(dict(state_dict), strict=True)

    def sync_from(self, model: torch.nn.Module) -> None:
        if model is self.model:
            return  # shared module: the engine already sees the trainer's weights
        self.update_weights(model.state_dict())

    # ---- text -------------------------------------------------------------------------------------
    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)

    # ---- public entry ---------------------------------------------------------------------------
    def generate(self, requests: list[RolloutRequest], tools: ToolEnv) -> list[list[TokenTrajectory]]:
        self.stats = {}
        allowed = self._allowed_tools(tools)
        rows: list[_Row] = []
        for request in requests:
            for k in range(request.n):
                rows.append(self._new_row(request, k, ToolEnv(allowed, request.max_tool_calls)))
        live = [row for row in rows if not row.finished]
        self._all_rows = rows
        started = time.perf_counter()
        was_training = self.model.training
        self.model.eval()
        try:
            with torch.inference_mode():
                self._run(live)
        finally:
            self.model.train(was_training)
        self.stats["generate_s"] = time.perf_counter() - started
        out: list[list[TokenTrajectory]] = []
        index = 0
        for request in requests:
            out.append([self._trajectory(rows[index + k]) for k in range(request.n)])
            index += request.n
        return out

    def _report_progress(self) -> None:
        if self.on_progress is not None:
            self.on_progress(sum(row.finished for row in self._all_rows), len(self._all_rows))

    def _allowed_tools(self, tools: ToolEnv) -> dict:
        if self.tool_names is None:
            return dict(tools.tools)
        missing = [name for name in self.tool_names if name not in tools.tools]
        if missing:
            raise RolloutError(f"tool_names {missing} are not in the ToolEnv (it has {sorted(tools.tools)})")
        return {name: tools.tools[name] for name in self.tool_names}

    def _new_row(self, request: RolloutRequest, k: int, env: ToolEnv) -> _Row:
        seed = request.sampling.seed
        rng = random.Random(f"{seed}:{request.request_id}:{k}") if seed is not None else random.Random()
        row = _Row(request=request, sample_index=k, env=env, rng=rng, length=len(request.prompt_ids))
        limit = request.sampling.max_total_tokens
        if not request.prompt_ids:
            row.finish(ERROR, "empty prompt")
        elif len(request.prompt_ids) >= limit:
            row.finish(ERROR, f"prompt has {len(request.prompt_ids)} tokens; the context limit is {limit}")
        elif max(request.prompt_ids) >= self._lm_head.weight.shape[0] or min(request.prompt_ids) < 0:
            row.finish(ERROR, f"prompt has token ids outside the vocabulary (size {self._lm_head.weight.shape[0]})")
        else:
            row.queue = list(request.prompt_ids)
            row.turn = _Block("policy", 0)
        return row

    # ---- the loop ---------------------------------------------------------------------------------
    def _run(self, waiting: list[_Row]) -> None:
        device = self._lm_head.weight.device
        cache = self._new_cache()
        limit = self.max_batch_rows or len(waiting)
        rows, waiting = waiting[:limit], waiting[limit:]
        mask = torch.zeros((len(rows), 0), dtype=torch.bool, device=device)
        n_forward = n_slots = n_real_slots = 0
        while rows:
            # 1. one chunk: up to max_chunk_tokens queued tokens per row, right-padded with holes
            width = min(max(len(r.queue) for r in rows), self.max_chunk_tokens)
            ids = torch.zeros((len(rows), width), dtype=torch.long)
            pos = torch.zeros((len(rows), width), dtype=torch.long)
            real = torch.zeros((len(rows), width), dtype=torch.bool)
            last = []
            for i, row in enumerate(rows):
                take = min(len(row.queue), width)
                ids[i, :take] = torch.tensor(row.queue[:take])
                pos[i, :] = row.n_real + torch.arange(width).clamp_max(max(take - 1, 0))
                real[i, :take] = True
                row.queue = row.queue[take:]
                row.n_real += take
                last.append(take - 1)
            mask = torch.cat([mask, real.to(device)], dim=1)
            hidden = self._forward(ids.to(device), pos.to(device), mask, cache)
            n_forward += 1
            n_slots += len(rows) * width
            n_real_slots += int(real.sum())

            # 2. rows whose queue is empty sample their next token
            ready = [i for i, row in enumerate(rows) if not row.queue]
            if ready:
                at = torch.tensor([last[i] for i in ready], device=device)
                picked = hidden[torch.tensor(ready, device=device), at]
                tokens, logprobs = self._sample([rows[i] for i in ready], self._logits(picked))
                calls = []
                for i, token, logprob in zip(ready, tokens, logprobs):
                    if self._accept(rows[i], token, logprob):
                        calls.append(rows[i])
                self._run_tools(calls)

            # 3. drop finished rows; compact the cache when holes make it much longer than needed
            keep = [i for i, row in enumerate(rows) if not row.finished]
            if len(keep) < len(rows):
                index = torch.tensor(keep, dtype=torch.long, device=device)
                self._select_rows(cache, index)
                mask = mask[index]
                rows = [rows[i] for i in keep]
            if not rows:  # start the next rows on a fresh cache
                cache = self._new_cache()
                mask = torch.zeros((0, 0), dtype=torch.bool, device=device)
            if waiting and len(rows) < limit:
                admitted, waiting = waiting[:limit - len(rows)], waiting[limit - len(rows):]
                mask = self._admit(cache, mask, len(admitted))
                rows = rows + admitted
            if rows:
                mask = self._maybe_compact(cache, mask, rows)
            self._report_progress()
        self.stats.update(forward_calls=n_forward, chunk_slots=n_slots, real_slots=n_real_slots)

    def _accept(self, row: _Row, token: int, logprob: float) -> bool:
        """Record one sampled token; returns True when it closed a tool call that must run now."""
        turn = row.turn
        assert turn is not None
        turn.ids.append(token)
        turn.logprobs.append(logprob)
        turn.chars.append(row.gen_len)
        row.length += 1
        closed_call = self._feed_policy_text(row, self._next_text(row))
        row.queue = [token]
        sampling = row.sampling
        scaffold = row.request.scaffold
        if token in self.stop_token_ids:
            self._end_turn(row)
            if row.answer_opened or not scaffold:
                row.finish(ANSWERED, "eos inside the answer" if scaffold else "eos")
            else:
                row.finish(ERROR, "the model stopped (eos) before writing an answer")
        elif sampling.stop_texts and _ends_with_stop(turn.text, sampling.stop_texts):
            self._end_turn(row)
            row.finish(ANSWERED, "stop text")
        elif scaffold and row.parser.finished:
            self._end_turn(row)
            row.finish(ANSWERED)
        elif scaffold and closed_call:
            self._end_turn(row)
            row.n_calls += 1
            if row.n_calls > row.request.max_tool_calls + 1:
                # It was already told the budget is spent (the previous output) and called again.
                row.finish(TOOL_BUDGET, f"{row.n_calls} tool calls with a budget of {row.request.max_tool_calls}")
            else:
                return True
        elif row.length >= sampling.max_total_tokens:
            self._end_turn(row)
            row.finish(TRUNCATED, f"context limit {sampling.max_total_tokens} reached")
        elif len(turn.ids) >= sampling.max_new_tokens:
            self._end_turn(row)
            row.finish(TRUNCATED, f"max_new_tokens {sampling.max_new_tokens} reached in turn {row.n_outputs}")
        return False

    # ---- text bookkeeping -----------------------------------------------------------------------
    def _next_text(self, row: _Row) -> str:
        """Text the newest token adds, decoded with a little left context (prefix/read offsets), so
        byte-level pieces of one character wait until the character is complete."""
        turn = row.turn
        prefix = self._decode(turn.ids[row.prefix_offset:row.read_offset])
        full = self._decode(turn.ids[row.prefix_offset:])
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            row.prefix_offset, row.read_offset = row.read_offset, len(turn.ids)
            return full[len(prefix):]
        return ""

    def _feed_policy_text(self, row: _Row, text: str) -> bool:
        """Feed generated text to the row's parser; True when a ``</call_tool>`` tag closed."""
        if not text:
            return False
        row.turn.text += text
        row.gen_len += len(text)
        closed = False
        for piece, stage, is_tool in row.parser.feed(text):
            self._add_piece(row, piece, stage)
            if stage == "answer":
                row.answer_opened = True
            if piece == TOOL_CALL_CLOSE and not is_tool:
                closed = True
        return closed

    @staticmethod
    def _add_piece(row: _Row, piece: str, stage: str) -> None:
        end = (row.piece_ends[-1] if row.piece_ends else 0) + len(piece)
        row.piece_ends.append(end)
        row.piece_stages.append(stage)

    def _end_turn(self, row: _Row) -> None:
        """Close the current policy turn: release any text held back mid-character."""
        turn = row.turn
        if turn is None:
            return
        if row.read_offset < len(turn.ids):
            prefix = self._decode(turn.ids[row.prefix_offset:row.read_offset])
            full = self._decode(turn.ids[row.prefix_offset:])
            self._feed_policy_text(row, full[len(prefix):])
        if turn.ids:
            row.blocks.append(turn)
        row.turn = None

    def _append_tool_output(self, row: _Row, text: str) -> None:
        ids = encode_tool_output(self.tokenizer, text)
        if row.length + len(ids) > row.sampling.max_total_tokens:
            row.finish(TRUNCATED, f"tool output of {len(ids)} tokens does not fit the context limit "
                                  f"{row.sampling.max_total_tokens}")
            return
        row.blocks.append(_Block("tool_output", row.gen_len, ids=ids, text=text))
        for piece, stage, _ in row.parser.feed(text):
            self._add_piece(row, piece, stage)
        row.gen_len += len(text)
        row.length += len(ids)
        row.n_outputs += 1
        row.queue.extend(ids)  # after the token that closed the call
        if row.length >= row.sampling.max_total_tokens:
            row.finish(TRUNCATED, f"context limit {row.sampling.max_total_tokens} reached by a tool output")
            return
        row.turn = _Block("policy", row.gen_len)
        row.prefix_offset = row.read_offset = 0

    # ---- tools ----------------------------------------------------------------------------------
    def _run_tools(self, rows: list[_Row]) -> None:
        """Run the calls of this step in parallel threads, each bounded by tool_timeout_s."""
        if not rows:
            return
        results: list[ToolResult | None] = [None] * len(rows)
        threads: list[threading.Thread | None] = []
        for i, row in enumerate(rows):
            call = row.parser.take_tool_call()
            while row.parser.take_tool_call() is not None:  # only the last call of a turn runs
                pass
            if call is None:  # a stray </call_tool>: still an attempt against the budget
                results[i] = error_result(MALFORMED_CALL_MESSAGE) if row.env.budget.try_consume() else \
                    error_result(f"tool call budget exhausted ({row.env.budget.max_calls} calls)")
                threads.append(None)
                continue

            def work(i: int = i, env: ToolEnv = row.env, call: ToolCall = call) -> None:
                results[i] = env.execute(call)

            thread = threading.Thread(target=work, name=f"rollout-tool-{i}", daemon=True)
            thread.start()
            threads.append(thread)
        deadline = time.monotonic() + self.tool_timeout_s
        for i, (row, thread) in enumerate(zip(rows, threads)):
            if thread is not None:
                thread.join(max(0.0, deadline - time.monotonic()))
                if thread.is_alive():
                    results[i] = error_result(f"tool timed out after {self.tool_timeout_s:g} s")
            result = _checked(results[i])
            if result.error is not None:
                row.tool_errors += 1
            self._append_tool_output(row, result.text)

    # ---- model ------------------------------------------------------------------------------------
    def _new_cache(self) -> Any:
        from transformers import DynamicCache

        cache = DynamicCache(config=self.model.config)
        cache.layers = [_growing_layer_class()() for _ in cache.layers]
        return cache

    def _forward(self, ids: torch.Tensor, pos: torch.Tensor, mask: torch.Tensor, cache: Any) -> torch.Tensor:
        out = self._decoder(
            input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True, **{self._cache_kwarg: cache}
        )
        return out.last_hidden_state

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self._lm_head(hidden).float()
        if self._softcap:
            logits = torch.tanh(logits / self._softcap) * self._softcap
        if not torch.isfinite(logits).all():
            raise RuntimeError("non-finite logits in rollout: the model weights or the cache are corrupt")
        return logits

    def _sample(self, rows: list[_Row], logits: torch.Tensor) -> tuple[list[int], list[float]]:
        """Draw one token per row; return the tokens and their logprobs under the sampled distribution."""
        device = logits.device
        temps = torch.tensor([r.sampling.temperature for r in rows], device=device)
        greedy = temps == 0
        scaled = logits / torch.where(greedy, torch.ones_like(temps), temps)[:, None]
        scaled = _filter_top_k_top_p(
            scaled, [r.sampling.top_k for r in rows], [r.sampling.top_p for r in rows]
        )
        logp = torch.log_softmax(scaled, dim=-1)
        cdf = logp.exp().cumsum(dim=-1)
        uniforms = torch.tensor([r.rng.random() for r in rows], device=device, dtype=cdf.dtype)
        drawn = torch.searchsorted(cdf, (uniforms * cdf[:, -1])[:, None], right=True).squeeze(1)
        tokens = torch.where(greedy, scaled.argmax(dim=-1), drawn.clamp_max(logits.shape[-1] - 1))
        if self.forced_policy is not None:
            tokens = self._force(rows, tokens, logits.shape[-1])
        chosen = logp.gather(1, tokens[:, None]).squeeze(1)
        return tokens.tolist(), chosen.tolist()

    def _force(self, rows: list[_Row], tokens: torch.Tensor, vocab: int) -> torch.Tensor:
        tokens = tokens.clone()
        for i, row in enumerate(rows):
            context = ForcedContext(
                request_id=row.request.request_id, sample_index=row.sample_index, turn=row.n_outputs,
                turn_ids=list(row.turn.ids), policy_turns=[b.text for b in row.blocks if b.kind == "policy"],
                tool_outputs=[b.text for b in row.blocks if b.kind == "tool_output"],
            )
            forced = self.forced_policy(context)
            if forced is not None:
                if not 0 <= int(forced) < vocab:
                    raise RolloutError(f"forced_policy returned token id {forced}, outside the vocabulary "
                                       f"(size {vocab})")
                tokens[i] = int(forced)
        return tokens

    # ---- cache surgery (on the engine's own growing layers) -------------------------------------------
    @staticmethod
    def _layers(cache: Any) -> list[Any]:
        return [layer for layer in cache.layers if layer.get_seq_length() > 0]

    def _admit(self, cache: Any, mask: torch.Tensor, count: int) -> torch.Tensor:
        """Add ``count`` rows to a running batch: their past slots are zero-filled holes (never NaN,
        always masked); their prompts arrive through the queue like any other forced tokens."""
        for layer in self._layers(cache):
            layer.add_rows(count)
        self.stats["admitted"] = self.stats.get("admitted", 0) + count
        return torch.cat([mask, mask.new_zeros((count, mask.shape[1]))], dim=0)

    def _select_rows(self, cache: Any, index: torch.Tensor) -> None:
        for layer in self._layers(cache):
            layer.select_rows(index)

    def _maybe_compact(self, cache: Any, mask: torch.Tensor, rows: list[_Row]) -> torch.Tensor:
        slots = mask.shape[1]
        longest = max(row.n_real for row in rows)
        if slots - longest < max(self.compact_min_slots, slots // 8):
            return mask
        # Per row: indices of its real slots (in order), padded with slot 0 (masked) up to `longest`.
        counts = mask.sum(dim=1)
        order = torch.argsort((~mask).to(torch.int8), dim=1, stable=True)[:, :longest]
        new_mask = torch.arange(longest, device=mask.device)[None, :] < counts[:, None]
        order = torch.where(new_mask, order, torch.zeros_like(order))
        for layer in self._layers(cache):
            layer.gather_slots(order)
        self.stats["compactions"] = self.stats.get("compactions", 0) + 1
        return new_mask

    # ---- output -----------------------------------------------------------------------------------
    def _trajectory(self, row: _Row) -> TokenTrajectory:
        if row.turn is not None:  # a row cut by a budget mid-turn (already finished) keeps its tokens
            self._end_turn(row)
        for piece, stage, _ in row.parser.flush():
            self._add_piece(row, piece, stage)
        prompt = row.request.prompt_ids
        traj = TokenTrajectory.empty()
        traj.append("prompt", None, list(prompt), self._decode(list(prompt)))
        traj.prompt_len = len(prompt)
        for index, block in enumerate(row.blocks):
            if block.kind == "tool_output":
                traj.append("tool_output", TOOL_OUTPUT_STAGE, block.ids, block.text)
                continue
            stages = [self._stage_at(row, c) for c in block.chars]
            start = 0
            for i in range(1, len(block.ids) + 1):
                if i == len(block.ids) or stages[i] != stages[start]:
                    lo = block.chars[start] - block.char_start if start else 0
                    hi = block.chars[i] - block.char_start if i < len(block.ids) else len(block.text)
                    traj.append("policy", stages[start], block.ids[start:i], block.text[lo:hi],
                                block.logprobs[start:i])
                    start = i
        traj.n_tool_calls = row.n_outputs
        traj.finish_reason = row.finish_reason or ERROR
        traj.meta = {
            **row.request.meta,
            "request_id": row.request.request_id,
            "sample_index": row.sample_index,
            "finish_detail": row.detail,
            "tool_errors": row.tool_errors,
            "tool_calls_written": row.n_calls,
        }
        return traj

    @staticmethod
    def _stage_at(row: _Row, char: int) -> str:
        if not row.piece_stages:
            return "plan"  # the stage machine's start state
        k = bisect.bisect_right(row.piece_ends, char)
        return row.piece_stages[min(k, len(row.piece_stages) - 1)]


# ---- helpers ------------------------------------------------------------------------------------


def _checked(result: Any) -> ToolResult:
    """The environment's reply as a well-formed ``<tool_output>`` block, whatever the tool returned."""
    if not isinstance(result, ToolResult) or not isinstance(result.text, str):
        return error_result(f"tool returned {type(result).__name__}, not a ToolResult")
    text = result.text
    if not (text.startswith(_TOOL_OUTPUT_OPEN) and text.endswith(TOOL_OUTPUT_CLOSE)
            and text.count(TOOL_OUTPUT_CLOSE) == 1):
        # A block the parser would misread (unclosed, or closed early) must not enter the trajectory.
        return ToolResult(format_tool_output(error="the tool returned a malformed output block"), [],
                          error="malformed tool output")
    return result


def _filter_top_k_top_p(scaled: torch.Tensor, top_k: list[int], top_p: list[float]) -> torch.Tensor:
    """Set logits outside each row's top-k and top-p (nucleus) set to -inf; at least one token stays."""
    vocab = scaled.shape[-1]
    if all(k == 0 or k >= vocab for k in top_k) and all(p >= 1.0 for p in top_p):
        return scaled
    device = scaled.device
    sorted_logits, order = scaled.sort(dim=-1, descending=True)
    rank = torch.arange(vocab, device=device)[None, :]
    ks = torch.tensor([k if 0 < k < vocab else vocab for k in top_k], device=device)
    drop = rank >= ks[:, None]
    probs = torch.softmax(sorted_logits.masked_fill(drop, float("-inf")), dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs
    ps = torch.tensor(top_p, device=device, dtype=probs.dtype)
    drop |= (mass_before >= ps[:, None]) & (rank > 0)
    return scaled.scatter(1, order, sorted_logits.masked_fill(drop, float("-inf")))


_GROWING_LAYER: type | None = None


def _growing_layer_class() -> type:
    """A transformers ``DynamicLayer`` that appends in place into a buffer doubling when full.

    The stock layer concatenates the whole cache on every step (a full copy per token per layer);
    writing into spare capacity makes a decode step cost what attention costs (about 2x faster on
    CPU at a few thousand slots). ``keys``/``values`` are views of the used part of the buffers.
    Built lazily so importing this module does not import transformers' cache code.
    """
    global _GROWING_LAYER
    if _GROWING_LAYER is not None:
        return _GROWING_LAYER
    from transformers.cache_utils import DynamicLayer

    class GrowingLayer(DynamicLayer):
        def __init__(self, **kwargs: Any):
            super().__init__(**kwargs)
            self._k: torch.Tensor | None = None
            self._v: torch.Tensor | None = None
            self._len = 0

        def _reserve(self, need: int) -> None:
            capacity = 0 if self._k is None else self._k.shape[-2]
            if need <= capacity:
                return
            capacity = max(need + need // 2, 64)
            k, v = self._k, self._v
            self._k = k.new_zeros((*k.shape[:2], capacity, k.shape[-1]))
            self._v = v.new_zeros((*v.shape[:2], capacity, v.shape[-1]))
            self._k[..., :self._len, :] = k[..., :self._len, :]
            self._v[..., :self._len, :] = v[..., :self._len, :]

        def _expose(self) -> None:
            self.keys = self._k[..., :self._len, :]
            self.values = self._v[..., :self._len, :]

        def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any):
            if not self.is_initialized:
                self.lazy_initialization(key_states, value_states)
            if self._k is None:
                self._k, self._v = key_states[..., :0, :], value_states[..., :0, :]
            end = self._len + key_states.shape[-2]
            self._reserve(end)
            self._k[..., self._len:end, :] = key_states
            self._v[..., self._len:end, :] = value_states
            self._len = end
            self._expose()
            return self.keys, self.values

        def get_seq_length(self) -> int:
            return self._len

        # surgery used by the engine; each keeps the spare capacity where it can
        def select_rows(self, index: torch.Tensor) -> None:
            self._k, self._v = self._k[index], self._v[index]
            self._expose()

        def add_rows(self, count: int) -> None:
            self._k = torch.cat([self._k, self._k.new_zeros((count, *self._k.shape[1:]))], dim=0)
            self._v = torch.cat([self._v, self._v.new_zeros((count, *self._v.shape[1:]))], dim=0)
            self._expose()

        def gather_slots(self, order: torch.Tensor) -> None:
            def pick(cache: torch.Tensor) -> torch.Tensor:
                b, h, _, d = cache.shape
                return torch.gather(cache, 2, order[:, None, :, None].expand(b, h, order.shape[1], d))

            self._k, self._v = pick(self.keys), pick(self.values)
            self._len = order.shape[1]
            self._expose()

        def crop(self, tokens_to_remove: int) -> None:
            raise NotImplementedError("the rollout cache is never cropped")

    _GROWING_LAYER = GrowingLayer
    return GrowingLayer
