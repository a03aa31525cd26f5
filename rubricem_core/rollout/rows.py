"""One row of a rollout batch: a trajectory being generated, token by token, by any engine.

Both engines (transformers and vLLM) feed every sampled token through :meth:`RowState.accept`, so
turn cutting, stage ids, tool calls, the tool budget and finish reasons are the same code for both.

Per token a row records: the id as sampled, its sampling logprob, and the offset of the first
character it contributes to the generated text. Text is decoded incrementally (prefix/read
offsets, so a token that ends mid-character waits for the next); a token's stage is the stage
:class:`scaffold.StreamParser` gives that first character, which equals ``scaffold.parse_segments``
on the decoded generated text. Tool outputs are encoded once with ``encoding.encode_tool_output``
(the SFT path) and appended with mask 0, stage research.

Turns end at ``</call_tool>`` (the tool runs, its output is appended, the row goes on), ``</answer>``
(answered), eos (answered if an ``<answer>`` was open, else error), ``max_new_tokens`` in the turn
or the context limit (truncated; a tool output that would overflow the context is not appended).
Tool budget, as in the teacher's rounds: the first call over ``max_tool_calls`` gets a
budget-exhausted error as its output; calling again after that ends the row (tool_budget).
Requests with ``scaffold=False`` (free text, e.g. reflections) end only at eos, a stop text or a limit.
"""

from __future__ import annotations

import bisect
import logging
import math
import random
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from rubricem_core.encoding import TOOL_OUTPUT_STAGE, encode_tool_output
from rubricem_core.redact import redact_text
from rubricem_core.rollout.types import (
    ANSWERED,
    ERROR,
    TOOL_BUDGET,
    TRUNCATED,
    ForcedContext,
    RolloutRequest,
    SamplingParams,
    TextPiece,
)
from rubricem_core.scaffold import TOOL_CALL_CLOSE, TOOL_OUTPUT_CLOSE, StreamParser, ToolCall, format_tool_output
from rubricem_core.tools.base import ToolEnv, ToolResult, error_result
from rubricem_core.trajectory import TokenTrajectory

log = logging.getLogger(__name__)

_TOOL_OUTPUT_OPEN = "<tool_output>"
MALFORMED_CALL_MESSAGE = 'malformed tool call; write <call_tool name="search">query</call_tool>'


def decode_ids(tokenizer: Any, ids: list[int]) -> str:
    """Exact text of ``ids``: special tokens kept (the parser must see every tag), no clean-up."""
    return tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)


@dataclass
class Block:
    """A run of trajectory tokens of one kind: a policy turn or one tool output."""

    kind: str  # "policy" | "tool_output"
    char_start: int  # offset in the generated text (everything after the prompt)
    ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    chars: list[int] = field(default_factory=list)  # per policy token: offset of its first char
    text: str = ""


@dataclass
class RowState:
    """One sample of one request: its tokens, text, stage pieces, tool calls and finish reason.

    ``tokenizer`` decodes the sampled ids and encodes tool outputs; a token in ``stop_token_ids``
    ends the row. ``rng`` is the row's own sampler stream (None when the engine
    draws elsewhere, as vLLM does). ``queue`` holds tokens the model has not seen yet, for engines
    that feed tokens incrementally: the prompt, then each sampled token, then tool-output ids.
    """

    request: RolloutRequest
    sample_index: int
    env: ToolEnv
    tokenizer: Any
    stop_token_ids: frozenset[int]
    rng: random.Random | None = None
    length: int = 0  # tokens in the trajectory so far (prompt + generated + tool output)
    queue: list[int] = field(default_factory=list)
    parser: StreamParser = field(default_factory=StreamParser)
    piece_ends: list[int] = field(default_factory=list)  # parser pieces: char end offsets …
    piece_stages: list[str] = field(default_factory=list)  # … and their stages
    gen_len: int = 0  # chars of generated text so far
    blocks: list[Block] = field(default_factory=list)
    turn: Block | None = None
    prefix_offset: int = 0  # incremental detokenization offsets into turn.ids
    read_offset: int = 0
    answer_opened: bool = False
    n_calls: int = 0  # tool calls the policy wrote (closed)
    n_outputs: int = 0
    tool_errors: int = 0
    finish_reason: str | None = None
    detail: str = ""

    @classmethod
    def start(
        cls,
        request: RolloutRequest,
        sample_index: int,
        env: ToolEnv,
        tokenizer: Any,
        stop_token_ids: frozenset[int],
        *,
        vocab_size: int,
        rng: random.Random | None = None,
        max_model_len: int | None = None,
    ) -> RowState:
        """A row ready for its first turn, or already finished (error) when the prompt is unusable."""
        prompt = request.prompt_ids
        row = cls(
            request=request,
            sample_index=sample_index,
            env=env,
            tokenizer=tokenizer,
            stop_token_ids=stop_token_ids,
            rng=rng,
            length=len(prompt),
        )
        limit = request.sampling.max_total_tokens
        if not prompt:
            row.finish(ERROR, "empty prompt")
        elif len(prompt) >= limit:
            row.finish(ERROR, f"prompt has {len(prompt)} tokens; the context limit is {limit}")
        elif max_model_len is not None and len(prompt) >= max_model_len:
            row.finish(ERROR, f"prompt has {len(prompt)} tokens; vLLM max_model_len is {max_model_len}")
        elif max(prompt) >= vocab_size or min(prompt) < 0:
            row.finish(ERROR, f"prompt has token ids outside the vocabulary (size {vocab_size})")
        else:
            row.queue = list(prompt)
            row.turn = Block("policy", 0)
        return row

    def decode(self, ids: list[int]) -> str:
        return decode_ids(self.tokenizer, ids)

    @property
    def sampling(self) -> SamplingParams:
        return self.request.sampling

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def finish(self, reason: str, detail: str = "") -> None:
        if self.finish_reason is None:
            self.finish_reason, self.detail = reason, detail

    def context_ids(self) -> list[int]:
        """Every token so far: prompt, finished blocks and the open turn (what a stateless engine sends)."""
        ids = list(self.request.prompt_ids)
        for block in self.blocks:
            ids.extend(block.ids)
        if self.turn is not None:
            ids.extend(self.turn.ids)
        return ids

    # ---- sampled tokens ---------------------------------------------------------------------------
    def accept(self, token: int, logprob: float) -> bool:
        """Record one sampled token; returns True when it closed a tool call that must run now."""
        turn = self.turn
        assert turn is not None
        turn.ids.append(token)
        turn.logprobs.append(logprob)
        turn.chars.append(self.gen_len)
        self.length += 1
        closed_call = self._feed_policy_text(self._next_text())
        self.queue = [token]
        sampling = self.sampling
        scaffold = self.request.scaffold
        if token in self.stop_token_ids:
            self.end_turn()
            if self.answer_opened or not scaffold:
                self.finish(ANSWERED, "eos inside the answer" if scaffold else "eos")
            else:
                self.finish(ERROR, "the model stopped (eos) before writing an answer")
        elif sampling.stop_texts and _ends_with_stop(turn.text, sampling.stop_texts):
            self.end_turn()
            self.finish(ANSWERED, "stop text")
        elif scaffold and self.parser.finished:
            self.end_turn()
            self.finish(ANSWERED)
        elif scaffold and closed_call:
            self.end_turn()
            self.n_calls += 1
            if self.n_calls > self.request.max_tool_calls + 1:
                # It was already told the budget is spent (the previous output) and called again.
                self.finish(TOOL_BUDGET, f"{self.n_calls} tool calls with a budget of {self.request.max_tool_calls}")
            else:
                return True
        elif self.length >= sampling.max_total_tokens:
            self.end_turn()
            self.finish(TRUNCATED, f"context limit {sampling.max_total_tokens} reached")
        elif len(turn.ids) >= sampling.max_new_tokens:
            self.end_turn()
            self.finish(TRUNCATED, f"max_new_tokens {sampling.max_new_tokens} reached in turn {self.n_outputs}")
        return False

    def end_turn(self) -> None:
        """Close the current policy turn: release any text held back mid-character."""
        turn = self.turn
        if turn is None:
            return
        if self.read_offset < len(turn.ids):
            prefix = self.decode(turn.ids[self.prefix_offset : self.read_offset])
            full = self.decode(turn.ids[self.prefix_offset :])
            self._feed_policy_text(full[len(prefix) :])
        if turn.ids:
            self.blocks.append(turn)
        self.turn = None

    def uniform(self) -> float:
        """The row's next uniform draw from its own stream (engines that sample in-process give every row one)."""
        if self.rng is None:
            raise RuntimeError(f"row {self.request.request_id}/{self.sample_index} has no sampler stream (rng)")
        return self.rng.random()

    def open_turn(self) -> Block:
        """The policy turn being sampled (there is one from the prompt until the row ends or calls a tool)."""
        if self.turn is None:
            raise RuntimeError(f"row {self.request.request_id}/{self.sample_index} has no open policy turn")
        return self.turn

    def _next_text(self) -> str:
        """Text the newest token adds, decoded with a little left context (prefix/read offsets), so
        byte-level pieces of one character wait until the character is complete."""
        turn = self.open_turn()
        prefix = self.decode(turn.ids[self.prefix_offset : self.read_offset])
        full = self.decode(turn.ids[self.prefix_offset :])
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            self.prefix_offset, self.read_offset = self.read_offset, len(turn.ids)
            return full[len(prefix) :]
        return ""

    def _feed_policy_text(self, text: str) -> bool:
        """Feed generated text to the parser; True when a ``</call_tool>`` tag closed."""
        if not text:
            return False
        self.open_turn().text += text
        self.gen_len += len(text)
        closed = False
        for piece, stage, is_tool in self.parser.feed(text):
            self._add_piece(piece, stage, is_tool)
            if stage == "answer":
                self.answer_opened = True
            if piece == TOOL_CALL_CLOSE and not is_tool:
                closed = True
        return closed

    def _add_piece(self, piece: str, stage: str, in_tool_output: bool) -> None:
        end = (self.piece_ends[-1] if self.piece_ends else 0) + len(piece)
        self.piece_ends.append(end)
        self.piece_stages.append(stage)
        if self.request.on_text is not None:  # a live view (rubricem ask): each labelled piece as it is known
            self.request.on_text(TextPiece(self.sample_index, piece, stage, in_tool_output))

    # ---- tools ------------------------------------------------------------------------------------
    def take_tool_call(self) -> ToolCall | None:
        """The call the turn just closed (only the last call of a turn runs); None for a stray
        ``</call_tool>`` with no opening tag."""
        call = self.parser.take_tool_call()
        while self.parser.take_tool_call() is not None:
            pass
        return call

    def stray_call_result(self) -> ToolResult:
        """What a stray ``</call_tool>`` gets back: still an attempt against the budget."""
        if self.env.budget.try_consume():
            return error_result(MALFORMED_CALL_MESSAGE)
        return error_result(f"tool call budget exhausted ({self.env.budget.max_calls} calls)")

    def add_tool_result(self, result: Any) -> None:
        """Append the environment's reply (whatever the tool returned) and open the next turn."""
        result = checked_tool_result(result)
        if result.error is not None:
            self.tool_errors += 1
        self.append_tool_output(result.text)

    def append_tool_output(self, text: str) -> None:
        ids = encode_tool_output(self.tokenizer, text)
        if self.length + len(ids) > self.sampling.max_total_tokens:
            self.finish(
                TRUNCATED,
                f"tool output of {len(ids)} tokens does not fit the context limit {self.sampling.max_total_tokens}",
            )
            return
        self.blocks.append(Block("tool_output", self.gen_len, ids=ids, text=text))
        for piece, stage, in_tool_output in self.parser.feed(text):
            self._add_piece(piece, stage, in_tool_output)
        self.gen_len += len(text)
        self.length += len(ids)
        self.n_outputs += 1
        self.queue.extend(ids)  # after the token that closed the call
        if self.length >= self.sampling.max_total_tokens:
            self.finish(TRUNCATED, f"context limit {self.sampling.max_total_tokens} reached by a tool output")
            return
        self.turn = Block("policy", self.gen_len)
        self.prefix_offset = self.read_offset = 0

    # ---- hooks and output -------------------------------------------------------------------------
    def forced_context(self) -> ForcedContext:
        """What a ``forced_policy`` hook sees before this row's next token."""
        return ForcedContext(
            request_id=self.request.request_id,
            sample_index=self.sample_index,
            turn=self.n_outputs,
            turn_ids=list(self.open_turn().ids),
            policy_turns=[b.text for b in self.blocks if b.kind == "policy"],
            tool_outputs=[b.text for b in self.blocks if b.kind == "tool_output"],
        )

    def stage_at(self, char: int) -> str:
        """The parser's stage at a character offset of the generated text."""
        if not self.piece_stages:
            return "plan"  # the stage machine's start state
        k = bisect.bisect_right(self.piece_ends, char)
        return self.piece_stages[min(k, len(self.piece_stages) - 1)]

    def to_trajectory(self) -> TokenTrajectory:
        """The finished row as a TokenTrajectory: one segment per run of (kind, stage)."""
        if self.turn is not None:  # a row cut by a budget mid-turn (already finished) keeps its tokens
            self.end_turn()
        for piece, stage, in_tool_output in self.parser.flush():
            self._add_piece(piece, stage, in_tool_output)
        prompt = self.request.prompt_ids
        traj = TokenTrajectory.empty()
        traj.append("prompt", None, list(prompt), self.decode(list(prompt)))
        traj.prompt_len = len(prompt)
        for block in self.blocks:
            if block.kind == "tool_output":
                traj.append("tool_output", TOOL_OUTPUT_STAGE, block.ids, block.text)
                continue
            stages = [self.stage_at(c) for c in block.chars]
            start = 0
            for i in range(1, len(block.ids) + 1):
                if i == len(block.ids) or stages[i] != stages[start]:
                    lo = block.chars[start] - block.char_start if start else 0
                    hi = block.chars[i] - block.char_start if i < len(block.ids) else len(block.text)
                    traj.append("policy", stages[start], block.ids[start:i], block.text[lo:hi], block.logprobs[start:i])
                    start = i
        traj.n_tool_calls = self.n_outputs
        traj.finish_reason = self.finish_reason or ERROR
        traj.meta = {
            **self.request.meta,
            "request_id": self.request.request_id,
            "sample_index": self.sample_index,
            "finish_detail": self.detail,
            "tool_errors": self.tool_errors,
            "tool_calls_written": self.n_calls,
        }
        return traj


def run_tool_calls(rows: Sequence[RowState], timeout_s: float) -> None:
    """Run the calls rows closed in one step in parallel daemon threads, each bounded by ``timeout_s``.

    A tool that has not finished by the deadline gets a timeout error as its output, judged by when it
    finished (a result that came late is not kept because this thread joined it late); a hung tool's
    thread is abandoned (Python cannot kill it). Every row then gets its output appended, in order.
    """
    if not rows:
        return
    results: list[Any] = [None] * len(rows)
    finished_at = [math.inf] * len(rows)
    threads: list[threading.Thread | None] = []
    for i, row in enumerate(rows):
        call = row.take_tool_call()
        if call is None:
            results[i] = row.stray_call_result()
            threads.append(None)
            continue

        def work(i: int = i, env: ToolEnv = row.env, call: ToolCall = call) -> None:
            results[i] = execute_call(env, call)
            finished_at[i] = time.monotonic()

        thread = threading.Thread(target=work, name=f"rollout-tool-{i}", daemon=True)
        thread.start()
        threads.append(thread)
    deadline = time.monotonic() + timeout_s
    for i, (row, worker) in enumerate(zip(rows, threads)):
        if worker is not None:
            worker.join(max(0.0, deadline - time.monotonic()))
            if finished_at[i] > deadline:  # still running, or finished after the deadline
                results[i] = tool_timeout_result(timeout_s)
        row.add_tool_result(results[i])


def tool_timeout_result(timeout_s: float) -> ToolResult:
    """A row's tool output when its call had not finished ``timeout_s`` after it started (both schedules)."""
    return error_result(f"tool timed out after {timeout_s:g} s")


def execute_call(env: ToolEnv, call: ToolCall) -> ToolResult:
    """``env.execute(call)``; an exception escaping it (a bug: tools report trouble as error results) is
    logged with its traceback and becomes the row's tool error naming it, not a bare ``None``."""
    try:
        return env.execute(call)
    except Exception as exc:
        log.warning("tool call %r (%r) raised", call.name, call.query[:80], exc_info=True)
        return error_result(redact_text(f"tool {call.name or '?'} raised {type(exc).__name__}: {exc}")[:500])


def checked_tool_result(result: Any) -> ToolResult:
    """The environment's reply as a well-formed ``<tool_output>`` block, whatever the tool returned."""
    if not isinstance(result, ToolResult) or not isinstance(result.text, str):
        return error_result(f"tool returned {type(result).__name__}, not a ToolResult")
    text = result.text
    if not (
        text.startswith(_TOOL_OUTPUT_OPEN) and text.endswith(TOOL_OUTPUT_CLOSE) and text.count(TOOL_OUTPUT_CLOSE) == 1
    ):
        # A block the parser would misread (unclosed, or closed early) must not enter the trajectory.
        return ToolResult(
            format_tool_output(error="the tool returned a malformed output block"), [], error="malformed tool output"
        )
    return result


def _ends_with_stop(text: str, stops: Sequence[str]) -> bool:
    """A stop text just completed (the newest token may carry a few characters after it)."""
    tail = text[-(max(len(s) for s in stops) + 8) :]
    return any(s in tail for s in stops)
