"""The multi-round teacher loop, as pure functions over trajectory states.

A trajectory is a chat: system prompt, the query, then alternating assistant turns (the teacher's
scaffold text, each ending at ``</call_tool>`` or ``</answer>``) and user turns holding the
environment's ``<tool_output>``. One round = one request per unfinished trajectory (one Batch API job);
tools run between rounds. States are plain dicts so a round's result is one Parquet partition and a
rerun resumes from the last completed round.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from rubricem_core.llm.types import ChatRequest, ChatResult
from rubricem_core.rollout.types import ANSWERED, ERROR, TOOL_BUDGET, TRUNCATED
from rubricem_core.scaffold import ToolCall, extract_tool_calls, format_tool_output, system_prompt
from rubricem_core.seeds import TEACHER_REQUEST, TEACHER_TRAJECTORY, derive_seed

CALL_CLOSE = "</call_tool>"
ANSWER_CLOSE = "</answer>"
_OPEN_CALL = re.compile(r"<call_tool\b[^>]*>")

# finish reasons: the rollout engine's, plus the teacher loop's own round budget
MAX_ROUNDS = "max_rounds"
TEACHER_ERROR = ERROR


@dataclass
class TrajectoryState:
    trajectory_id: str
    query_id: str
    sample_index: int
    seed: int
    messages: list[dict[str, str]]
    text: str = ""  # the scaffold text: assistant turns + tool outputs, concatenated
    n_tool_calls: int = 0
    n_rounds: int = 0
    finished: bool = False
    finish_reason: str | None = None
    error: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cost_usd: float = 0.0
    tool_errors: int = 0
    extra: dict[str, Any] = field(default_factory=dict)

    def to_row(self) -> dict[str, Any]:
        row = asdict(self)
        row["messages"] = json.dumps(self.messages, ensure_ascii=False)
        row["extra"] = json.dumps(self.extra, ensure_ascii=False)
        return row

    @classmethod
    def from_row(cls, row: dict[str, Any]) -> TrajectoryState:
        data = dict(row)
        data["messages"] = json.loads(data["messages"])
        data["extra"] = json.loads(data.get("extra") or "{}")
        known = {f for f in cls.__dataclass_fields__}
        return cls(**{k: v for k, v in data.items() if k in known})


def initial_states(
    queries: list[dict[str, Any]], trajectories_per_query: int, seed: int, system: str | None = None
) -> list[TrajectoryState]:
    """One state per (query, sample); the chat starts with the scaffold's system prompt and the query."""
    system = system or system_prompt()
    states = []
    for qi, q in enumerate(queries):
        prompt_messages = (
            json.loads(q["messages"]) if q.get("messages") else [{"role": "user", "content": q["question"]}]
        )
        for s in range(trajectories_per_query):
            states.append(
                TrajectoryState(
                    trajectory_id=f"{q['query_id']}-t{s}",
                    query_id=q["query_id"],
                    sample_index=s,
                    seed=derive_seed(seed, TEACHER_TRAJECTORY, qi, s),
                    messages=[{"role": "system", "content": system}, *prompt_messages],
                )
            )
    return states


def request_id(state: TrajectoryState, round_index: int) -> str:
    return f"{state.trajectory_id}:r{round_index:02d}"


def tool_outputs(state: TrajectoryState) -> list[str]:
    """The environment's ``<tool_output>`` turns so far: the user turns that answer a tool call (never the
    query's own conversation, nor text the teacher wrote)."""
    return [
        m["content"]
        for prev, m in zip(state.messages, state.messages[1:])
        if m["role"] == "user" and prev["role"] == "assistant" and prev["content"].endswith(CALL_CLOSE)
    ]


def build_requests(
    states: list[TrajectoryState], round_index: int, model: str, max_tokens: int, temperature: float
) -> list[ChatRequest]:
    """One request per unfinished trajectory; generation stops at the end of a tool call."""
    return [
        ChatRequest(
            custom_id=request_id(s, round_index),
            model=model,
            messages=s.messages,
            stop=[CALL_CLOSE],
            max_tokens=max_tokens,
            temperature=temperature,
            seed=derive_seed(s.seed, TEACHER_REQUEST, round_index),  # the built-in teacher relies on it
            metadata={"trajectory_id": s.trajectory_id, "round": round_index},
        )
        for s in states
        if not s.finished
    ]


def _ends_in_open_call(text: str) -> bool:
    last_open = None
    for m in _OPEN_CALL.finditer(text):
        last_open = m
    return last_open is not None and CALL_CLOSE not in text[last_open.end() :]


def apply_result(
    state: TrajectoryState,
    result: ChatResult,
    run_tool: Callable[[ToolCall], str],
    round_index: int,
    max_rounds: int,
    max_tool_calls: int,
) -> None:
    """Append the teacher's turn, run its tool call (if any), and decide whether the trace is done.

    ``run_tool`` returns the ``<tool_output>`` text and never raises (ToolEnv guarantees that).
    """
    state.n_rounds = round_index + 1
    state.prompt_tokens += result.prompt_tokens or 0
    state.completion_tokens += result.completion_tokens or 0
    state.cost_usd += result.cost_usd or 0.0
    if result.status != "ok" or result.text is None:
        state.finished, state.finish_reason = True, TEACHER_ERROR
        state.error = result.error or "teacher request failed"
        return
    turn = result.text
    if ANSWER_CLOSE in turn:  # everything after the answer is dropped, as a stop sequence would
        turn = turn[: turn.index(ANSWER_CLOSE) + len(ANSWER_CLOSE)]
        state.messages.append({"role": "assistant", "content": turn})
        state.text += turn
        state.finished, state.finish_reason = True, ANSWERED
        return
    called = _ends_in_open_call(turn)
    if called:
        turn += CALL_CLOSE  # the provider strips the stop sequence; the scaffold needs it
    state.messages.append({"role": "assistant", "content": turn})
    state.text += turn
    if not called:
        # A turn that neither calls a tool nor answers: the model stopped (length or gave up).
        state.finished = True
        state.finish_reason = TRUNCATED if result.finish_reason == "length" else TEACHER_ERROR
        state.error = f"turn ended without a tool call or answer (finish_reason={result.finish_reason})"
        return
    state.n_tool_calls += 1
    calls = extract_tool_calls(turn)
    over_budget = state.n_tool_calls > max_tool_calls
    if over_budget:
        output = format_tool_output(error=f"tool call budget exhausted ({max_tool_calls} calls); write your answer now")
        state.tool_errors += 1
    elif calls:
        output = run_tool(calls[-1])
    else:  # malformed call: the environment answers with an error, as it would for a real model
        output = format_tool_output(error='malformed tool call; write <call_tool name="search">query</call_tool>')
        state.tool_errors += 1
    state.messages.append({"role": "user", "content": output})
    state.text += output
    if state.n_rounds >= max_rounds:
        state.finished, state.finish_reason = True, MAX_ROUNDS
    elif over_budget and state.n_tool_calls > max_tool_calls + 1:
        # it was told the budget is spent and still called a tool
        state.finished, state.finish_reason = True, TOOL_BUDGET
