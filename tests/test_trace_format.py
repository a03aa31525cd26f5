"""The unstructured ReAct trace format beside the scaffold (issue #46, item 5: the paper's Fig. 6a/6b):
``policy.prompt_style: react`` prompts for tool calls with free text between them and one cited answer,
the validator checks that format, the built-in teacher writes it, and the scaffold-vs-ReAct comparison
runs end to end (teacher, SFT, answer-only RL, evaluation) and prints its table."""

from __future__ import annotations

import pytest

from rubricem_core.config import ConfigError, load_config
from rubricem_core.environment import policy_system_prompt, trace_format
from rubricem_core.scaffold import EXAMPLE_TRACE, PLAIN_PROMPT_OPENING, validate
from rubricem_core.sim.teacher import without_stage_text

SNIPPET = '<tool_output><snippet id="D1">Acme was founded in 1901.</snippet></tool_output>'
REACT = (
    "I should look up when Acme was founded.\n"
    f'<call_tool name="search">Acme founding year</call_tool>{SNIPPET}\n'
    'The snippet answers it.\n<answer><cite id="D1">Acme was founded in 1901</cite>.</answer>'
)


def codes(text: str, trace_format: str = "react") -> list[str]:
    return [v.code for v in validate(text, trace_format=trace_format)]


def test_a_react_trace_is_valid_as_react_and_not_as_the_scaffold():
    assert codes(REACT) == []
    assert {"missing_plan", "missing_review", "text_outside_tags"} <= set(codes(REACT, "scaffold"))
    assert codes(EXAMPLE_TRACE, "scaffold") == []


@pytest.mark.parametrize(
    "text,code",
    [
        ('<answer><cite id="D1">Acme was founded in 1901</cite>.</answer>', "missing_research"),
        (f'<call_tool name="search">Acme</call_tool>{SNIPPET} No answer.', "missing_answer"),
        (REACT + "<answer>again</answer>", "repeated_stage"),
        (REACT + f'<call_tool name="search">more</call_tool>{SNIPPET}', "stage_order"),
        (REACT.replace('<cite id="D1">', '<cite id="D9">'), "citation_not_retrieved"),
        (REACT.replace('name="search"', 'name="shell"'), "unknown_tool"),
    ],
)
def test_what_breaks_a_react_trace(text, code):
    assert code in codes(text)


def test_an_unknown_format_is_refused():
    with pytest.raises(ValueError, match="unknown trace format"):
        validate(REACT, trace_format="xml")


def test_the_react_prompt_and_format_follow_the_prompt_style():
    assert policy_system_prompt("react").startswith(PLAIN_PROMPT_OPENING)
    assert "GUIDANCE" in policy_system_prompt("react", guidance="search both names")
    assert [trace_format(s) for s in ("full", "compact", "react")] == ["scaffold", "scaffold", "react"]
    assert load_config("tiny", {"policy.prompt_style": "react"}).policy.prompt_style == "react"
    with pytest.raises(ConfigError, match="prompt_style"):
        load_config("tiny", {"policy.prompt_style": "freeform"})


def test_the_builtin_teacher_drops_only_the_stage_text():
    plain = without_stage_text(EXAMPLE_TRACE)
    assert "<structured_plan>" not in plain and "<review>" not in plain and "<state_evaluation>" not in plain
    assert plain.count("<call_tool") == 2 and plain.rstrip().endswith("</answer>")
    assert codes(plain) == []


@pytest.mark.slow
def test_scaffold_vs_react_through_sft_and_answer_only_rl_prints_its_table(tmp_path, capsys, prefect_harness):
    from bench.trace_format_ablation import main

    assert main(["--quick", "--work-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    lines = [line for line in out.splitlines() if line.startswith("| react |") or line.startswith("| scaffold |")]
    assert [line.split(" | ")[1] for line in lines] == ["sft", "rl-step-000001", "sft", "rl-step-000001"]
    assert out.strip().splitlines()[-1].startswith("figure: react_minus_scaffold_rl_score=")
    from rubricem_core.sql import run_sql

    react_rollouts = run_sql(tmp_path / "react", "SELECT count(*) FROM rollouts", fmt="csv")
    assert int(react_rollouts.splitlines()[1]) > 0  # answer-only RL ran on the react policy
    recipe = run_sql(tmp_path / "react", "SELECT DISTINCT stage FROM stage_rewards WHERE R IS NOT NULL", fmt="csv")
    assert recipe.splitlines()[1:] == ["answer"]  # only the answer is judged (rl.recipe baseline)
