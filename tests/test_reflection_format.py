"""Reflection prompt, output format, parsing, validation codes and guidance text."""

from __future__ import annotations

import pytest

from rubricem_core.reflection.format import (
    COPIES_TRAJECTORY,
    EMPTY_RUBRICS,
    EMPTY_TAKEAWAYS,
    MAX_ITEMS,
    MENTIONS_SCORES,
    MISSING_REFLECTION,
    MISSING_RUBRICS,
    MISSING_TAKEAWAYS,
    REFLECTION_CODES,
    REPEATED_TAG,
    SCAFFOLD_TAGS,
    STRUCTURAL_CODES,
    TEXT_OUTSIDE_TAGS,
    TOO_LONG,
    TOO_MANY_ITEMS,
    Reflection,
    clip_middle,
    guidance_text,
    parse_reflection,
    reflection_messages,
    validate_reflection,
)
from rubricem_core.scaffold import system_prompt

QUESTION = "Which was founded earlier, Voralis Labs or Keto Works?"
TRAJECTORY = (
    "<structured_plan><deep_analysis>Two founding years are needed.</deep_analysis><rubric>"
    "<knowledge_checklist>- the founding year of Voralis Labs</knowledge_checklist>"
    "<analytical_criteria>- compare the years</analytical_criteria>"
    "<negative_constraints>- no look-alike companies</negative_constraints></rubric>"
    "<research_plan>1. Search both.</research_plan></structured_plan>\n"
    '<call_tool name="search">Voralis Labs founded</call_tool>'
    '<tool_output><snippet id="D1">Voralis Labs: the instrument maker Voralis Labs was founded in 1950 by a '
    "group of physicists in the northern harbour district of the old city.</snippet></tool_output>"
    "<state_evaluation>Found D1. Verdict: ready</state_evaluation>\n"
    "<review><rubric_review>- founding year → D1</rubric_review><writing_plan><thesis>t</thesis>"
    "<outline>o</outline></writing_plan></review>\n"
    '<answer><cite id="D1">Voralis Labs was founded in 1950</cite>, so it is older.</answer>'
)
GOOD = """<reflection>
<reflection_rubrics>
- States the founding year of Keto Works with a citation
- Keeps Voralis Labs apart from Voralis Group
</reflection_rubrics>
<takeaways>
- Search "Keto Works founded" before writing the answer
- Compare both years explicitly
</takeaways>
</reflection>"""


def test_parse_reads_both_lists_and_strips_bullets():
    reflection = parse_reflection(GOOD)
    assert reflection == Reflection(
        ("States the founding year of Keto Works with a citation", "Keeps Voralis Labs apart from Voralis Group"),
        ('Search "Keto Works founded" before writing the answer', "Compare both years explicitly"),
    )
    assert validate_reflection(GOOD, TRAJECTORY, QUESTION) == []


@pytest.mark.parametrize("body", ["1. one\n2) two", "* one\n\u2022 two", "one\n\n   two  "])
def test_parse_accepts_any_bullet_style(body):
    text = f"<reflection><reflection_rubrics>{body}</reflection_rubrics><takeaways>- t</takeaways></reflection>"
    assert parse_reflection(text).rubrics == ("one", "two")


def test_missing_closing_tag_is_accepted_when_the_engine_strips_the_stop_string():
    text = GOOD.removesuffix("</reflection>")
    assert parse_reflection(text) == parse_reflection(GOOD)
    assert validate_reflection(text) == []


def test_render_round_trips():
    reflection = parse_reflection(GOOD)
    assert parse_reflection(reflection.render()) == reflection
    assert validate_reflection(reflection.render()) == []


def _wrap(rubrics: str = "- r", takeaways: str = "- t") -> str:
    return (
        f"<reflection><reflection_rubrics>{rubrics}</reflection_rubrics><takeaways>{takeaways}</takeaways></reflection>"
    )


@pytest.mark.parametrize(
    "text, code",
    [
        ("just some notes, no tags", MISSING_REFLECTION),
        ("<reflection><takeaways>- t</takeaways></reflection>", MISSING_RUBRICS),
        ("<reflection><reflection_rubrics>- r</reflection_rubrics></reflection>", MISSING_TAKEAWAYS),
        (_wrap(rubrics="  \n - \n"), EMPTY_RUBRICS),
        (_wrap(takeaways=""), EMPTY_TAKEAWAYS),
        (_wrap(takeaways="- " + "x" * 500), TOO_LONG),
        (_wrap(rubrics="\n".join(f"- item {i}" for i in range(MAX_ITEMS + 1))), TOO_MANY_ITEMS),
        ("Sure! " + _wrap(), TEXT_OUTSIDE_TAGS),
        (_wrap() + " trailing", TEXT_OUTSIDE_TAGS),
        (
            "<reflection>preamble<reflection_rubrics>- r</reflection_rubrics><takeaways>- t</takeaways></reflection>",
            TEXT_OUTSIDE_TAGS,
        ),
        (_wrap(rubrics="- a</reflection_rubrics><reflection_rubrics>- b"), REPEATED_TAG),
        (_wrap(takeaways="- write <answer>Keto Works</answer>"), SCAFFOLD_TAGS),
        (_wrap(takeaways='- wrap claims in <cite id="D1">'), SCAFFOLD_TAGS),
        (_wrap(takeaways="- the answer scored 1/2 on the year"), MENTIONS_SCORES),
        (_wrap(takeaways="- aim for a higher reward next time"), MENTIONS_SCORES),
        (_wrap(rubrics="- the judge wants both years"), MENTIONS_SCORES),
        (
            _wrap(
                takeaways="- the instrument maker Voralis Labs was founded in 1950 by a group of physicists in the "
                "northern harbour"
            ),
            COPIES_TRAJECTORY,
        ),
    ],
)
def test_validation_codes(text, code):
    codes = validate_reflection(text, TRAJECTORY, QUESTION)
    assert code in codes
    assert set(codes) <= set(REFLECTION_CODES)
    # the paper's structural check keeps the format codes and drops this project's stricter ones
    structural = validate_reflection(text, TRAJECTORY, QUESTION, validity="structural")
    assert (code in structural) == (code in STRUCTURAL_CODES)
    assert set(structural) == set(codes) & STRUCTURAL_CODES


def test_structural_validity_accepts_what_only_strict_refuses():
    text = _wrap(takeaways="- the answer scored 1/2 on the year\n- write <answer>Keto Works</answer>")
    assert validate_reflection(text, TRAJECTORY, QUESTION) == [SCAFFOLD_TAGS, MENTIONS_SCORES]
    assert validate_reflection(text, TRAJECTORY, QUESTION, validity="structural") == []
    with pytest.raises(ValueError, match="validity must be one of"):
        validate_reflection(text, validity="loose")


@pytest.mark.parametrize("validity", ["strict", "structural"])
def test_reflection_validity_and_attempt_cut_come_from_the_config(validity):
    from rubricem_core.config import load_config
    from rubricem_core.reflection.step import reflection_judge

    cfg = load_config("tiny", {"reflection.validity": validity, "reflection.judge.max_attempt_chars": None})
    options = reflection_judge(cfg, None).options
    assert options.validity == validity and options.max_trajectory_chars is None
    assert reflection_judge(load_config("tiny", {}), None).options.max_trajectory_chars == 20_000
    assert load_config("research", {}).reflection.judge.max_attempt_chars is None


def test_missing_structure_parses_to_none_but_empty_lists_parse():
    assert parse_reflection("no tags") is None
    assert parse_reflection(None) is None
    assert parse_reflection("<reflection><takeaways>- t</takeaways></reflection>") is None
    assert parse_reflection(_wrap(takeaways="")) == Reflection(("r",), ())


def test_total_length_limit_is_configurable():
    text = _wrap(takeaways="\n".join(f"- lesson number {i}" for i in range(5)))
    assert TOO_LONG not in validate_reflection(text)
    assert TOO_LONG in validate_reflection(text, max_chars=50)


def test_score_words_from_the_question_are_not_score_talk():
    question = "What was the final score of the 1998 Varn cup final?"
    text = _wrap(rubrics="- states the final score of the 1998 Varn cup final")
    assert MENTIONS_SCORES not in validate_reflection(text, question=question)
    assert MENTIONS_SCORES in validate_reflection(text, question=QUESTION)


def test_short_shared_phrases_are_not_copies():
    # entity names and short phrases from the attempt are expected in a reflection
    text = _wrap(takeaways="- Voralis Labs was founded in 1950 according to D1; find the Keto Works year too")
    assert COPIES_TRAJECTORY not in validate_reflection(text, TRAJECTORY, QUESTION)
    assert COPIES_TRAJECTORY not in validate_reflection(text)  # no trajectory: no copy check


def test_restating_the_question_is_not_copying_the_attempt():
    # a first search is often the question verbatim; a reflection that names the question again is fine,
    # while the same run of words taken from the attempt's own text still counts as a copy
    question = "Which company founded in the northern harbour by a group of physicists makes instruments today?"
    trajectory = f'<call_tool name="search">{question}</call_tool>' + TRAJECTORY
    restated = _wrap(takeaways=f"- search for {question.lower()} and then browse both documents")
    assert COPIES_TRAJECTORY not in validate_reflection(restated, trajectory, question)
    assert COPIES_TRAJECTORY in validate_reflection(restated, trajectory, "another question")
    copied = _wrap(
        takeaways="- the instrument maker Voralis Labs was founded in 1950 by a group of physicists in the "
        "northern harbour"
    )
    assert COPIES_TRAJECTORY in validate_reflection(copied, TRAJECTORY, question)


# ---- the prompt -----------------------------------------------------------------------------------


def test_messages_hold_the_question_and_trajectory_only():
    messages = reflection_messages(QUESTION, TRAJECTORY)
    assert [m["role"] for m in messages] == ["system", "user"]
    user = messages[1]["content"]
    assert QUESTION in user and TRAJECTORY in user
    assert "omitted" not in user
    assert "<reflection_rubrics>" in messages[0]["content"] and "<takeaways>" in messages[0]["content"]


@pytest.mark.parametrize("max_chars", [200, 201, 1000])
def test_long_trajectories_are_cut_in_the_middle_and_say_so(max_chars):
    long_text = "PLAN-START " + "research filler. " * 400 + " ANSWER-END"
    user = reflection_messages(QUESTION, long_text, max_chars=max_chars)[1]["content"]
    omitted = len(long_text) - max_chars
    assert f"{omitted} characters" in user
    assert "PLAN-START" in user and "ANSWER-END" in user
    shown, dropped = clip_middle(long_text, max_chars)
    assert dropped == omitted
    assert len(shown) - len(f"\n[... {omitted} characters of the attempt omitted here ...]\n") == max_chars


def test_the_attempt_cannot_close_its_delimiters():
    user = reflection_messages(QUESTION, "text <<<END OF ATTEMPT>>> more")[1]["content"]
    assert user.count("<<<END OF ATTEMPT>>>") == 1


@pytest.mark.parametrize("question, trajectory", [("", TRAJECTORY), (QUESTION, "  "), (None, TRAJECTORY)])
def test_empty_inputs_are_rejected(question, trajectory):
    with pytest.raises(ValueError, match="must be a non-empty string"):
        reflection_messages(question, trajectory)


# ---- guidance -------------------------------------------------------------------------------------


def test_guidance_lands_in_the_system_prompt_guidance_block():
    reflection = parse_reflection(GOOD)
    guidance = guidance_text(reflection)
    prompt = system_prompt(guidance=guidance)
    block = prompt.split("=== BEGIN GUIDANCE")[1].split("=== END GUIDANCE ===")[0]
    for item in reflection.items:
        assert f"- {item}" in block
    assert "similar question" not in guidance


def test_cross_guidance_names_the_source_question_and_escapes_tags():
    reflection = Reflection(('cite <cite id="D1">claims</cite>',), ("close with </answer>",))
    guidance = guidance_text(reflection, source_question="Which  city is\nolder?")
    assert 'similar question: "Which city is older?"' in guidance
    assert "<cite" not in guidance and "</answer>" not in guidance and "&lt;cite" in guidance


def test_guidance_of_an_empty_reflection_is_an_error():
    with pytest.raises(ValueError, match="no items"):
        guidance_text(Reflection((), ()))
