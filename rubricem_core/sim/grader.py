"""The offline built-in benchmark grader: the grading prompts answered deterministically.

Registered as the litellm provider ``rubricem-grader`` so the offline profile travels the code path
of a real grader (prompts, response_format, run_concurrent, validation, repair). Like a real grader
it reads only the prompt.

- short form (each benchmark's protocol, ``eval/short_form.py``): the response is correct when a gold
  answer (or alias) appears in it after SQuAD-style normalization (lower case, no punctuation or
  articles) as a whole-word sequence; an empty response is not_attempted; anything else is incorrect.
  The 2Wiki judge's extracted answer is that gold answer, else the response's last sentence.
- rubric items: an item with a machine-checkable ``check`` is scored by the built-in judge's
  criterion; otherwise by the share of the criterion's content words found in the response
  (``sim.judge.score_rubric``'s lexical fallback), 0/1/2 mapped onto the family's scale.
- one criterion (HealthBench per_criterion): the same item score, met when it is 2 (as in the joint
  prompt, so both modes give the same numbers).
- ResearchRubrics' verdict: Satisfied when the item score is 2, Partially Satisfied (ternary) when 1; a
  chunk's evidence: its sentences naming a content word of the criterion.
- RACE (DeepResearchBench race): both articles scored as above, 0/1/2 → 0/5/10 each; the cleaning
  before it removes bracketed citation markers, URLs and a trailing references section.
- coverage (ResearchQA): the item score 0/1/2 → 1/3/5 (Not at all / Moderately / Completely).
- answer set (DeepSearchQA): the correct answer split into parts (a Set Answer at commas, semicolons,
  line breaks and "and"; a Single Answer is one part), each found when it occurs in the response as
  above; excessive answers: the response's own list items (split the same way) that contain no part.
The stagewise judge's provider (``rubricem-judge``) only reads its own two prompts, hence this one.
"""

from __future__ import annotations

import json
import re
import string
from typing import Any

from rubricem_core.eval.criteria import CHUNK_KIND, CRITERION_KIND, VERDICT_KIND
from rubricem_core.eval.drb import CLEAN_KIND
from rubricem_core.eval.prompts import ANSWER_SET_KIND, RACE_KIND, SCALES, TASK_LINE
from rubricem_core.eval.short_form import COT_QA_KIND, EQUIVALENCE_KIND, SIMPLE_EVALS_KIND
from rubricem_core.judge.prompts import split_sections, unescape_section_markers
from rubricem_core.sim.judge import Context, score_rubric
from rubricem_core.sim.provider import message_text, register_completion_provider
from rubricem_core.sim.trace_view import TraceView

PROVIDER = "rubricem-grader"
MODEL = f"{PROVIDER}/builtin"

_FAMILY = re.compile(
    rf"\((rubric_points|dimension_criteria|rubric_properties|rubric_coverage|{COT_QA_KIND}|{EQUIVALENCE_KIND}|"
    rf"{SIMPLE_EVALS_KIND}|{ANSWER_SET_KIND}|"
    rf"{CRITERION_KIND}|{VERDICT_KIND}|{CHUNK_KIND}|{CLEAN_KIND}|{RACE_KIND})\)"
)
_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCT = str.maketrans({c: " " for c in string.punctuation})


class BuiltinGraderError(ValueError):
    """The built-in grader got a prompt it cannot read (not one of the grading prompts)."""


def normalize_answer(text: str) -> list[str]:
    """SQuAD-style normalization, as tokens: lower case, punctuation and articles removed."""
    return _ARTICLES.sub(" ", text.lower().translate(_PUNCT)).split()


def contains_answer(response: str, gold: str) -> bool:
    """``gold`` occurs in ``response`` as a whole-token sequence after normalization."""
    needle, hay = normalize_answer(gold), normalize_answer(response)
    if not needle:
        return False
    return any(hay[i : i + len(needle)] == needle for i in range(len(hay) - len(needle) + 1))


def short_form_grade(response: str, golds: list[str]) -> tuple[str, str]:
    if not normalize_answer(response) or response.strip() == "(empty)":
        return "not_attempted", "The response gives no answer."
    for gold in golds:
        if contains_answer(response, gold):
            return "correct", f"The response states the gold answer {gold!r}."
    return "incorrect", f"The response does not state any of {golds[:3]!r}."


def _last_sentence(response: str) -> str:
    """The response's concluding sentence (where a final answer stands when no gold answer is found)."""
    parts = _sentences(response)
    return parts[-1] if parts else response.strip()


def _to_scale(family: str, score: int) -> int:
    if family == "rubric_points":
        return 1 if score == 2 else 0
    if family == "dimension_criteria":
        return 5 * score
    if family == "rubric_coverage":
        return 1 + 2 * score
    return score


_LIST_SEPARATORS = re.compile(r"[,;\n]|\band\b")


def _list_items(text: str) -> list[str]:
    return [part.strip() for part in _LIST_SEPARATORS.split(text) if normalize_answer(part)]


def answer_set_reply(response: str, correct: str, prompt_type: str) -> dict[str, Any]:
    """The answer-set grade of ``response``: each part of the correct answer found or not, and the excessive
    answers (the response's list items matching no part)."""
    parts = _list_items(correct) if prompt_type == "Set Answer" else [correct.strip()]
    parts = parts or [correct.strip()]
    found_parts = [contains_answer(response, p) for p in parts]
    details = [{"answer_part": p, "found": ok} for p, ok in zip(parts, found_parts)]
    excessive = []
    if prompt_type == "Set Answer":
        excessive = [item for item in _list_items(response) if not any(contains_answer(item, p) for p in parts)]
    found = sum(found_parts)
    why = f"{found} of {len(parts)} parts of the correct answer found; {len(excessive)} excessive answers."
    return {"explanation": why, "correctness_details": details, "excessive_answers": excessive}


def respond(messages: list[dict[str, Any]], params: dict[str, Any]) -> str:
    user = next((message_text(m.get("content")) for m in messages if m.get("role") == "user"), "")
    first = user.lstrip().split("\n", 1)[0]
    match = _FAMILY.search(first)
    if not first.startswith(TASK_LINE) or match is None:
        raise BuiltinGraderError(f"not a grading prompt (first line {first[:80]!r})")
    family = match.group(1)
    sections = {name: unescape_section_markers(body) for name, body in split_sections(user)}
    response = sections.get("RESPONSE", "")
    if family == SIMPLE_EVALS_KIND:
        grade, why = short_form_grade(response, json.loads(sections.get("GOLD TARGET", "[]")))
        return json.dumps({"justification": why, "grade": grade})
    if family == EQUIVALENCE_KIND:
        golds = sections.get("CORRECT ANSWER", "").split(" / ")
        grade, why = short_form_grade(response, golds)
        found = next((g for g in golds if contains_answer(response, g)), None)
        extracted = None if grade == "not_attempted" else (found or _last_sentence(response))
        return json.dumps({"extracted_final_answer": extracted, "reasoning": why, "correct": "yes" if found else "no"})
    if family == COT_QA_KIND:
        grade, why = short_form_grade(sections.get("STUDENT ANSWER", ""), sections.get("CONTEXT", "").split(" / "))
        return json.dumps({"explanation": why, "grade": "CORRECT" if grade == "correct" else "INCORRECT"})
    if family == ANSWER_SET_KIND:
        return json.dumps(
            answer_set_reply(response, sections.get("CORRECT ANSWER", ""), sections.get("PROMPT TYPE", "").strip())
        )
    if family == CRITERION_KIND:  # HealthBench: "[points] criterion" against the conversation's last turn
        criterion = re.sub(r"^\[[^\]]*\]\s*", "", sections.get("RUBRIC ITEM", "").strip())
        last_turn = sections.get("CONVERSATION", "").rsplit("\n\nassistant: ", 1)[-1]
        [score] = _item_scores(sections, [{"criterion": criterion}], last_turn)
        return json.dumps({"explanation": score[1], "criteria_met": _to_scale("rubric_points", score[0]) == 1})
    if family == CLEAN_KIND:
        return json.dumps({"article": clean_citations(sections.get("ARTICLE", ""))})
    if family in (VERDICT_KIND, CHUNK_KIND):
        return _rubric_verdict(family, sections, "Partially Satisfied" in message_text(messages[0].get("content")))
    items = [json.loads(line) for line in sections.get("RUBRIC ITEMS", "").splitlines() if line.strip()]
    if family == RACE_KIND:
        target = _item_scores(sections, items, sections.get("ARTICLE 1", ""))
        reference = _item_scores(sections, items, sections.get("ARTICLE 2", ""))
        return json.dumps(
            {
                "items": [
                    {
                        "id": item["id"],
                        "justification": f"article 1: {t[1]}; article 2: {r[1]}",
                        "article_1_score": 5 * t[0],
                        "article_2_score": 5 * r[0],
                    }
                    for item, t, r in zip(items, target, reference)
                ]
            }
        )
    if family not in SCALES:
        raise BuiltinGraderError(f"unknown grading family {family!r}")
    return json.dumps(
        {
            "items": [
                {"id": item["id"], "justification": why, "score": _to_scale(family, score)}
                for item, (score, why) in zip(items, _item_scores(sections, items, response))
            ]
        }
    )


_CITATION = re.compile(r"\s?\[(?:[^\]\n]{0,40}\d[^\]\n]{0,40})\]|\s?\(?https?://[^\s)]+\)?")
_REFERENCES = re.compile(
    r"\n\s*(?:#+\s*)?(?:references|bibliography|sources|参考文献|参考资料)\s*:?\s*\n.*\Z", re.I | re.S
)


def clean_citations(article: str) -> str:
    """DeepResearchBench's cleaning, by rule: bracketed markers holding a digit ([1], [D3], [2-4]), URLs and
    a trailing references section removed; the rest kept."""
    return _CITATION.sub("", _REFERENCES.sub("", article)).strip()


def _rubric_verdict(kind: str, sections: dict[str, str], ternary: bool) -> str:
    """ResearchRubrics: a criterion's verdict on the document (or on its chunks' evidence), or one chunk's
    evidence: the sentences that name a content word of the criterion."""
    title = sections.get("CRITERION", "").split("\n", 1)[0].removeprefix("Title: ")
    if kind == CHUNK_KIND:
        text = sections.get("CHUNK TEXT", "")
        [(score, why)] = _item_scores(sections, [{"criterion": title}], text)
        words = {w for w in normalize_answer(title) if len(w) > 4}
        evidence = [s for s in _sentences(text) if words & set(normalize_answer(s))][:5]
        reply = {"relevant_evidence": evidence, "satisfaction": score == 2, "confidence_for_chunk": 0.5, "notes": why}
        return json.dumps(reply)
    if "CHUNK EVIDENCE" in sections:
        text = " ".join(json.loads(sections["CHUNK EVIDENCE"] or "[]"))
    else:
        text = sections.get("DOCUMENT", "")
    [(score, why)] = _item_scores(sections, [{"criterion": title}], text)
    verdict, value = ("Satisfied", 1.0) if score == 2 else ("Not Satisfied", 0.0)
    if ternary and score == 1:
        verdict, value = "Partially Satisfied", 0.5
    reply = {"verdict": verdict, "score": value, "confidence": 0.5, "reasoning": why}
    return json.dumps({**reply, "evidence_quotes": [], "missing_elements": []})


def _sentences(text: str) -> list[str]:
    return [p.strip() for p in re.split(r"(?<=[.!?])\s+|\n+", text) if p.strip()]


def _item_scores(sections: dict[str, str], items: list[dict[str, Any]], response: str) -> list[tuple[int, str]]:
    """The built-in judge's 0/1/2 score and reason of every item against ``response``."""
    rubrics = [
        {"stage": "answer", "title": "", "description": item["criterion"], "check": item.get("check")} for item in items
    ]
    ctx = Context(sections.get("QUESTION", ""), {}, rubrics)
    view = TraceView(f"<answer>{response}</answer>")
    return [score_rubric(view, rubric, ctx) for rubric in rubrics]


def register_builtin_grader() -> str:
    """Register (idempotently) the built-in grader as litellm provider ``rubricem-grader``; returns its model."""
    register_completion_provider(PROVIDER, respond)
    return MODEL
