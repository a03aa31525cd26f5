"""RowState on its own: tool-call detection, masks, stage ids, finish reasons, held-back text.

A character tokenizer (one token per character, id = code point) makes every expectation countable
by hand: ``'<call_tool name="search">q</call_tool>'`` is 38 tokens, its last ``>`` closes the call.
"""

from __future__ import annotations

import math
import time

import pytest

from rubricem_core.rollout import ANSWERED, ERROR, TOOL_BUDGET, TRUNCATED, RolloutRequest, SamplingParams
from rubricem_core.rollout.batch import RowBatch, allowed_tools, default_stop_ids
from rubricem_core.rollout.rows import MALFORMED_CALL_MESSAGE, RowState, checked_tool_result, run_tool_calls
from rubricem_core.scaffold import STAGE_IDS, ToolCall, format_tool_output
from rubricem_core.tools import Tool, ToolEnv, ToolResult, ToolSpec
from rubricem_core.trajectory import NO_STAGE

EOS = 1
HALF_A, HALF_B = 0x200000, 0x200001  # two tokens that together spell "é" (a byte-split character)
CALL = '<call_tool name="search">q</call_tool>'
PLAN, RESEARCH, ANSWER = STAGE_IDS["plan"], STAGE_IDS["research"], STAGE_IDS["answer"]


class CharTokenizer:
    eos_token_id = EOS

    def __len__(self) -> int:
        return 0x200002

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [ord(c) for c in text]

    def decode(self, ids: list[int], skip_special_tokens: bool = False, clean_up_tokenization_spaces: bool = False):
        out, i = [], 0
        while i < len(ids):
            if ids[i] == HALF_A:
                out.append("é" if i + 1 < len(ids) and ids[i + 1] == HALF_B else "\ufffd")
                i += 2 if out[-1] == "é" else 1
                continue
            out.append("" if ids[i] == EOS else chr(ids[i]) if 0 <= ids[i] < 0x110000 else "\ufffd")
            i += 1
        return "".join(out)


class Echo(Tool):
    spec = ToolSpec("search", "echo")

    def __call__(self, query: str) -> ToolResult:
        return ToolResult(format_tool_output([("D1", query)]), ["D1"])


TOK = CharTokenizer()


def _row(prompt: str = "P:", *, max_tool_calls: int = 3, scaffold: bool = True, tools=None, **sampling) -> RowState:
    params = SamplingParams(**{"max_new_tokens": 200, "max_total_tokens": 1000, **sampling})
    request = RolloutRequest("r", TOK.encode(prompt), sampling=params, max_tool_calls=max_tool_calls, scaffold=scaffold)
    env = ToolEnv(tools if tools is not None else {"search": Echo()}, max_tool_calls)
    return RowState.start(request, 0, env, TOK, frozenset({EOS}), vocab_size=len(TOK))


def _feed(row: RowState, text: str, logprob: float = -0.5) -> list[bool]:
    return [row.accept(t, logprob) for t in TOK.encode(text)]


# ---- starting a row ---------------------------------------------------------------------------------


def test_a_usable_prompt_queues_and_opens_a_turn():
    row = _row("P:")
    assert row.queue == [ord("P"), ord(":")] and row.length == 2 and row.turn is not None and not row.finished


@pytest.mark.parametrize(
    "prompt_ids, kw, detail",
    [
        ([], {}, "empty prompt"),
        ([80] * 5, {}, "prompt has 5 tokens; the context limit is 5"),
        ([80] * 5, {"max_model_len": 5, "limit": 9}, "prompt has 5 tokens; vLLM max_model_len is 5"),
        ([80, 10**7], {"limit": 9}, f"prompt has token ids outside the vocabulary (size {len(TOK)})"),
        ([-1, 80], {"limit": 9}, f"prompt has token ids outside the vocabulary (size {len(TOK)})"),
    ],
)
def test_unusable_prompts_finish_with_an_error(prompt_ids, kw, detail):
    limit = kw.pop("limit", 5)
    request = RolloutRequest("r", prompt_ids, sampling=SamplingParams(max_total_tokens=limit))
    row = RowState.start(request, 0, ToolEnv({}, 0), TOK, frozenset({EOS}), vocab_size=len(TOK), **kw)
    assert (row.finish_reason, row.detail, row.turn) == (ERROR, detail, None)
    traj = row.to_trajectory()
    assert traj.finish_reason == ERROR and traj.token_ids == prompt_ids and traj.n_policy_tokens == 0


# ---- tool calls ---------------------------------------------------------------------------------------


def test_the_closing_tag_of_a_call_is_detected_on_its_last_token():
    row = _row()
    closed = _feed(row, "hm" + CALL)
    assert closed == [False] * (len(closed) - 1) + [True] and len(closed) == 2 + 38
    assert row.turn is None and row.n_calls == 1 and not row.finished
    assert row.queue == [ord(">")]  # the closing token is the only one the model has not seen yet
    assert row.take_tool_call() == ToolCall("search", "q")
    assert row.take_tool_call() is None


def test_tool_output_is_appended_unmasked_and_the_next_turn_opens():
    row = _row("P:")
    _feed(row, "hm" + CALL)
    run_tool_calls([row], timeout_s=5)
    output = format_tool_output([("D1", "q")])
    assert row.n_outputs == 1 and row.tool_errors == 0 and row.env.budget.used == 1
    assert row.queue == [ord(">")] + TOK.encode(output)  # closing token, then the output ids
    assert row.turn is not None and row.turn.char_start == 2 + len(CALL) + len(output)
    _feed(row, "<answer>ok</answer>", logprob=-0.25)
    assert (row.finish_reason, row.detail) == (ANSWERED, "")

    traj = row.to_trajectory()
    n_call, n_out, n_answer = 2 + len(CALL), len(output), len("<answer>ok</answer>")
    assert traj.token_ids == TOK.encode("P:" + "hm" + CALL + output + "<answer>ok</answer>")
    assert traj.loss_mask == [0] * 2 + [1] * n_call + [0] * n_out + [1] * n_answer
    assert traj.stage_ids == (
        [NO_STAGE] * 2 + [PLAN] * 2 + [RESEARCH] * len(CALL) + [RESEARCH] * n_out + [ANSWER] * n_answer
    )
    assert [(s.kind, s.stage, s.text) for s in traj.segments] == [
        ("prompt", None, "P:"),
        ("policy", "plan", "hm"),
        ("policy", "research", CALL),
        ("tool_output", "research", output),
        ("policy", "answer", "<answer>ok</answer>"),
    ]
    assert traj.logprobs[2:4] == [-0.5, -0.5] and all(math.isnan(x) for x in traj.logprobs[2 + n_call :][:n_out])
    assert traj.logprobs[-1] == -0.25
    assert traj.n_tool_calls == 1 and traj.meta["tool_calls_written"] == 1 and traj.meta["tool_errors"] == 0


def test_a_stray_closing_tag_counts_against_the_budget_and_gets_an_error():
    row = _row(max_tool_calls=1)
    assert _feed(row, "x</call_tool>")[-1] is True
    assert row.take_tool_call() is None
    result = row.stray_call_result()
    assert result.error == MALFORMED_CALL_MESSAGE and row.env.budget.used == 1
    assert "budget exhausted (1 calls)" in row.stray_call_result().error


def test_the_call_after_the_budget_message_ends_the_row():
    row = _row(max_tool_calls=0)
    assert _feed(row, CALL)[-1] is True  # the first call over budget still runs: it is told so
    run_tool_calls([row], timeout_s=5)
    assert row.tool_errors == 1 and "budget exhausted" in row.blocks[-1].text
    assert _feed(row, CALL)[-1] is False
    assert (row.finish_reason, row.detail) == (TOOL_BUDGET, "2 tool calls with a budget of 0")


def test_free_text_requests_ignore_scaffold_tags():
    row = _row(scaffold=False, stop_texts=("</reflection>",))
    assert not any(_feed(row, CALL + "<answer>a</answer>"))
    assert not row.finished and row.n_calls == 0
    _feed(row, "</reflection>")
    assert (row.finish_reason, row.detail) == (ANSWERED, "stop text")


def test_hung_and_broken_tools_become_error_outputs():
    class Hang(Tool):
        spec = ToolSpec("search", "hangs")

        def __call__(self, query: str) -> ToolResult:
            time.sleep(2)
            return ToolResult(format_tool_output([("D1", query)]))

    row = _row(tools={"search": Hang()})
    _feed(row, CALL)
    run_tool_calls([row], timeout_s=0.05)
    assert row.tool_errors == 1 and "tool timed out after 0.05 s" in row.blocks[-1].text
    assert checked_tool_result("oops").error == "tool returned str, not a ToolResult"
    assert checked_tool_result(ToolResult("<tool_output>open")).error == "malformed tool output"


# ---- finish reasons -------------------------------------------------------------------------------


def test_eos_finishes_by_whether_an_answer_was_open():
    row = _row()
    row.accept(EOS, -1.0)
    assert (row.finish_reason, row.detail) == (ERROR, "the model stopped (eos) before writing an answer")
    row = _row()
    _feed(row, "<answer>a")
    row.accept(EOS, -1.0)
    assert (row.finish_reason, row.detail) == (ANSWERED, "eos inside the answer")
    row = _row(scaffold=False)
    row.accept(EOS, -1.0)
    assert (row.finish_reason, row.detail) == (ANSWERED, "eos")
    assert row.to_trajectory().token_ids[-1] == EOS  # the stop token stays in the trajectory


def test_length_limits_truncate():
    row = _row(max_new_tokens=3)
    assert not any(_feed(row, "abc"))
    assert (row.finish_reason, row.detail) == (TRUNCATED, "max_new_tokens 3 reached in turn 0")
    row = _row("P:", max_total_tokens=4)
    _feed(row, "ab")
    assert (row.finish_reason, row.detail) == (TRUNCATED, "context limit 4 reached")
    row = _row("P:", max_total_tokens=2 + len(CALL) + 5)  # the tool output does not fit
    _feed(row, CALL)
    run_tool_calls([row], timeout_s=5)
    assert row.finish_reason == TRUNCATED and row.n_outputs == 0
    assert row.detail.startswith("tool output of ") and row.detail.endswith(f"context limit {2 + len(CALL) + 5}")


def test_finish_keeps_the_first_reason():
    row = _row()
    row.finish(TRUNCATED, "first")
    row.finish(ERROR, "second")
    assert (row.finish_reason, row.detail) == (TRUNCATED, "first")


# ---- text bookkeeping ---------------------------------------------------------------------------


def test_a_split_character_waits_for_its_second_token():
    row = _row()
    row.accept(ord("a"), -0.1)
    row.accept(HALF_A, -0.2)
    assert row.turn.text == "a" and row.turn.chars == [0, 1]
    row.accept(HALF_B, -0.3)
    assert row.turn.text == "aé" and row.turn.chars == [0, 1, 1]  # both halves start at the held-back "é"
    row.finish(TRUNCATED)
    traj = row.to_trajectory()
    assert [s.text for s in traj.segments] == ["P:", "aé"] and traj.stage_ids[2:] == [PLAN] * 3


def test_a_turn_cut_mid_character_releases_its_text():
    row = _row(max_new_tokens=2)
    row.accept(ord("a"), -0.1)
    row.accept(HALF_A, -0.2)  # the turn ends on the first half: what it decodes to is released
    assert row.finished and row.blocks[-1].text == "a\ufffd"


def test_context_ids_and_forced_context():
    row = _row("P:")
    _feed(row, CALL)
    run_tool_calls([row], timeout_s=5)
    _feed(row, "ab")
    assert row.context_ids() == TOK.encode("P:" + CALL + format_tool_output([("D1", "q")]) + "ab")
    assert row.length == len(row.context_ids())
    ctx = row.forced_context()
    assert (ctx.turn, ctx.turn_ids, ctx.policy_turns) == (1, TOK.encode("ab"), [CALL])


# ---- the batch ------------------------------------------------------------------------------------


def test_row_batch_orders_rows_by_request_and_reports_progress():
    tools = {"search": Echo()}
    requests = [RolloutRequest("a", [80], n=2), RolloutRequest("b", [], n=1), RolloutRequest("c", [81], n=1)]
    batch = RowBatch(requests, tools, TOK, frozenset({EOS}), vocab_size=len(TOK))
    assert [(r.request.request_id, r.sample_index) for r in batch.rows] == [("a", 0), ("a", 1), ("b", 0), ("c", 0)]
    assert batch.rows[0].env is not batch.rows[1].env  # each sample has its own budget
    assert len(batch.live) == 3
    seen = []
    batch.report(lambda done, total: seen.append((done, total)))
    assert seen == [(1, 4)]
    out = batch.trajectories()
    assert [len(g) for g in out] == [2, 1, 1] and out[1][0].finish_reason == ERROR


def test_allowed_tools_and_default_stops():
    env = ToolEnv({"search": Echo()}, 1)
    assert list(allowed_tools(None, env)) == ["search"]
    with pytest.raises(ValueError, match="not in the ToolEnv"):
        allowed_tools(("browse",), env)
    assert default_stop_ids(TOK, [7, 8]) == {EOS, 7, 8} and default_stop_ids(TOK, 9) == {EOS, 9}
