"""`rubricem ask`: the streamed pieces are the trajectory (joined, they give its text exactly, stage by
stage), the terminal view shows every stage and tool call, --json holds each stage, bad input is one
line and exit 2."""

from __future__ import annotations

import io
import json
import re

import pytest

from rubricem_core.ask import AskError, AskResult, LiveView, ask, resolve_checkpoint, run_tools
from rubricem_core.config import load_config
from rubricem_core.policy.loading import load_policy
from rubricem_core.rollout.hf_engine import HFRolloutEngine
from rubricem_core.rollout.types import ForcedContext
from rubricem_core.run_config import record_config
from rubricem_core.scaffold import EXAMPLE_TRACE
from rubricem_core.store import RunStore
from tests.untrained_run import UNTRAINED_TINY, write_untrained_run

PLAN = EXAMPLE_TRACE[: EXAMPLE_TRACE.index("<call_tool")]
QUESTION = "Which was founded earlier, the first company or the second?"


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    cfg = load_config("tiny", {**UNTRAINED_TINY, "rollout.max_new_tokens": 400, "rollout.max_total_tokens": 1600})
    run = tmp_path_factory.mktemp("ask") / "run"
    write_untrained_run(cfg, run)
    record_config(run, cfg, "test")
    return run, cfg


class Writer:
    """A forced policy: a plan and one search, then a review and a cited answer (the snippet's own id)."""

    def __init__(self, tok) -> None:
        self.tok = tok
        self.ids: dict[int, list[int]] = {}

    def __call__(self, ctx: ForcedContext) -> int | None:
        if ctx.turn not in self.ids:
            if ctx.turn == 0:
                text = PLAN + '<call_tool name="search">company founded</call_tool>'
            else:
                doc = (re.findall(r'<snippet id="([^"]+)"', ctx.tool_outputs[0]) or ["D0"])[0]
                text = (
                    "<state_evaluation>Found it. Verdict: ready</state_evaluation>\n<review>\n<rubric_review>"
                    f"year -> {doc}.</rubric_review>\n<writing_plan><thesis>t</thesis><outline>1.</outline>"
                    f'</writing_plan>\n</review>\n<answer><cite id="{doc}">It was founded first.</cite></answer>'
                )
            self.ids[ctx.turn] = self.tok.encode(text, add_special_tokens=False)
        ids = self.ids[ctx.turn]
        return ids[len(ctx.turn_ids)] if len(ctx.turn_ids) < len(ids) else None


def _forced_engine(run, cfg):
    model, tok = load_policy(str(run / "checkpoints" / "sft" / "final"), dtype="float32")
    return HFRolloutEngine(model, tok, forced_policy=Writer(tok)), tok


def test_the_streamed_pieces_are_the_trajectory_stage_by_stage(run):
    run_dir, cfg = run
    engine, tok = _forced_engine(run_dir, cfg)
    pieces = []
    result = ask(engine, tok, QUESTION, run_tools(RunStore(run_dir), cfg), cfg, on_text=pieces.append, seed=3)
    assert "".join(p.text for p in pieces) == result.text  # the stream is the text, nothing lost or doubled
    policy_stages = [p.stage for p in pieces if not p.in_tool_output]
    assert list(dict.fromkeys(policy_stages)) == ["plan", "research", "review", "answer"]
    outputs = [p.text for p in pieces if p.in_tool_output]
    assert outputs[0].startswith("<tool_output") and "<snippet id=" in "".join(outputs)
    assert result.finish_reason == "answered"
    assert [c["name"] for c in result.tool_calls] == ["search"]
    assert result.tool_calls[0]["query"] == "company founded" and "<snippet id=" in result.tool_calls[0]["output"]
    assert "It was founded first." in result.answer
    assert result.stages["plan"].startswith("<structured_plan>") and "<review>" in result.stages["review"]
    assert result.policy_tokens > 0


def test_the_terminal_view_shows_each_stage_and_tool_call_without_colour_off_a_terminal(run):
    run_dir, cfg = run
    engine, tok = _forced_engine(run_dir, cfg)
    out = io.StringIO()
    view = LiveView(file=out)
    view.header(QUESTION, "ckpt", None)
    result = ask(engine, tok, QUESTION, run_tools(RunStore(run_dir), cfg), cfg, on_text=view, seed=3)
    view.footer(result)
    text = out.getvalue()
    assert "\x1b[" not in text  # not a TTY: no escape codes
    positions = [text.index(title) for title in ("Plan ─", "Research ─", "Review ─", "Answer ─")]
    assert positions == sorted(positions)
    assert "→ search company founded" in text
    assert re.search(r"\n    \[[^\]]+\] ", text)  # each returned snippet on its own line, its id first
    assert "answered · 1 tool calls" in text


def test_result_json_holds_each_stage():
    result = AskResult(
        "q", "c", {"plan": "p", "research": "r", "review": "v", "answer": "a"}, [], "a", "answered", True, [], 3, 0.1
    )
    data = json.loads(result.to_json())
    assert set(data["stages"]) == {"plan", "research", "review", "answer"} and data["answer"] == "a"


def test_checkpoints_are_named_or_refused(run):
    run_dir, _ = run
    assert resolve_checkpoint(RunStore(run_dir), None) == run_dir / "checkpoints" / "sft" / "final"
    assert resolve_checkpoint(RunStore(run_dir), "sft") == run_dir / "checkpoints" / "sft" / "final"
    with pytest.raises(AskError, match="no policy checkpoint at .*step-000007"):
        resolve_checkpoint(RunStore(run_dir), "step:7")
    with pytest.raises(AskError, match="no policy checkpoint"):
        resolve_checkpoint(RunStore(run_dir), str(run_dir / "nowhere"))


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["   "], "the question is empty"),
        (["--run-dir", "{missing}", "a question"], "is not a run directory"),
        (["--run-dir", "{bare}", "a question"], "no policy checkpoint"),
        (["--checkpoint", "step:3", "a question"], "no policy checkpoint"),
        (["--retrieval", "cross", "a question"], "bank"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(run, tmp_path, capsys, argv, message):
    from flows.cli import main

    run_dir, cfg = run
    bare = tmp_path / "bare"
    record_config(bare, cfg, "test")  # a run directory with no policy yet
    argv = [a.format(missing=tmp_path / "missing", bare=bare) for a in argv]
    if "--run-dir" not in argv:
        argv = ["--run-dir", str(run_dir), *argv]
    assert main(["ask", "--engine", "hf", *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("rubricem: error:") and message in err[0], err


def test_the_command_answers_with_json(run, capsys):
    from flows.cli import main

    run_dir, _ = run
    assert main(["ask", "--run-dir", str(run_dir), "--engine", "hf", "--json", "--seed", "1", QUESTION]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["question"] == QUESTION and data["checkpoint"].endswith("final")
    assert set(data["stages"]) == {"plan", "research", "review", "answer"}
    assert data["finish_reason"] in ("answered", "truncated", "tool_budget", "error")
