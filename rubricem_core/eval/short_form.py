"""Short-answer benchmarks, each graded by its own protocol (prompts in ``grader_prompts/``).

- ``simpleqa``: simple-evals' SimpleQA grader rules (correct / incorrect / not attempted; hedged wrong
  answers are incorrect, numbers right to the gold target's last significant figure, obvious omissions and
  name typos forgiven). simple-evals replies with a letter; here the same three grades come as JSON.
- ``2wiki``: the judge DR Tulu evaluates 2WikiMultihopQA with (BrowseComp-style: the response's final
  answer extracted, then equivalent to the correct answer yes / no); beside it the release's own answer
  metrics on the extracted answer (``2wikimultihop_evaluate.py``: normalized exact match and token F1, the
  best over the gold answer and its aliases, a yes/no mismatch scoring 0).
- ``webwalkerqa``: the benchmark's evaluator, LangChain's ``cot_qa`` (a teacher grading a quiz: the
  question, the gold answer as CONTEXT, the STUDENT ANSWER; reasoning first, then CORRECT / INCORRECT).
  The policy is asked the question with the website's root URL, as WebWalker's agent is.

Every protocol's verdict maps onto ``types.SHORT_FORM_GRADES`` so the summary's rates (correct,
accuracy given attempted, F-score) mean the same for all three; score 1 only when correct.
"""

from __future__ import annotations

import json
import re
import string
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from rubricem_core.eval.prompts import (
    JUSTIFICATION_MAX_CHARS,
    TASK_LINE,
    TEXT_FIELD,
    conversation_text,
    gold_answers,
    grader_prompt,
    object_schema,
    section,
)
from rubricem_core.eval.types import SHORT_FORM_GRADES, EvalError
from rubricem_core.judge.prompts import escape_section_markers
from rubricem_core.llm.replies import checked_reply
from rubricem_core.readers.answer_benchmarks import BARE_QUESTION_KEY
from rubricem_core.schemas import Query

# Task-line markers of the three protocols (the built-in grader dispatches on them).
SIMPLE_EVALS_KIND = "short_form"
EQUIVALENCE_KIND = "short_form_equivalence"
COT_QA_KIND = "short_form_cot"
SHORT_FORM_KINDS: tuple[str, ...] = (SIMPLE_EVALS_KIND, EQUIVALENCE_KIND, COT_QA_KIND)

# benchmark → (task-line kind, prompt file, the protocol as the dry run and docs name it)
PROTOCOLS: dict[str, tuple[str, str, str]] = {
    "simpleqa": (
        SIMPLE_EVALS_KIND,
        "short_form_simpleqa",
        "simple-evals' SimpleQA grader rules: correct / incorrect / not attempted",
    ),
    "2wiki": (
        EQUIVALENCE_KIND,
        "short_form_equivalence",
        "DR Tulu's answer-equivalence judge, with 2Wiki's exact match and token F1 beside it",
    ),
    "webwalkerqa": (
        COT_QA_KIND,
        "short_form_cot",
        "WebWalkerQA's LangChain cot_qa grader: CORRECT / INCORRECT; the policy gets the root URL",
    ),
}


@dataclass(frozen=True)
class ShortFormGrade:
    """One short answer's grade: one of ``SHORT_FORM_GRADES``, the grader's reasoning, and the protocol's
    own numbers (2Wiki's exact match and F1 of the extracted answer)."""

    grade: str
    justification: str
    details: dict[str, Any]


def protocol_of(benchmark: str) -> tuple[str, str, str]:
    if benchmark not in PROTOCOLS:
        raise EvalError(f"benchmark {benchmark!r} has no short-answer grading protocol; known: {sorted(PROTOCOLS)}")
    return PROTOCOLS[benchmark]


def grader_question(query: Query) -> str:
    """The question as the benchmark's grader reads it (WebWalkerQA's without the website the policy gets)."""
    bare = query.metadata.get(BARE_QUESTION_KEY)
    return bare if isinstance(bare, str) and bare.strip() else conversation_text(query)


# ---- schemas -------------------------------------------------------------------------------------


def short_form_schema(kind: str) -> dict[str, Any]:
    """The reply schema of a protocol (by its task-line kind)."""
    if kind == SIMPLE_EVALS_KIND:
        return object_schema({"justification": TEXT_FIELD, "grade": {"enum": list(SHORT_FORM_GRADES)}})
    if kind == EQUIVALENCE_KIND:
        return object_schema(
            {
                "extracted_final_answer": {"type": ["string", "null"], "maxLength": JUSTIFICATION_MAX_CHARS},
                "reasoning": TEXT_FIELD,
                "correct": {"enum": ["yes", "no"]},
            }
        )
    if kind == COT_QA_KIND:
        return object_schema({"explanation": TEXT_FIELD, "grade": {"enum": ["CORRECT", "INCORRECT"]}})
    raise EvalError(f"unknown short-answer protocol {kind!r}")


# ---- prompts -------------------------------------------------------------------------------------


def short_form_messages(benchmark: str, query: Query, response: str) -> list[dict[str, str]]:
    """The benchmark's grading prompt: its protocol's rules as the system message; the question, gold answer
    and response in the sections that protocol names them by."""
    kind, prompt, _ = protocol_of(benchmark)
    system = grader_prompt(prompt).format(schema=json.dumps(short_form_schema(kind)))
    golds = gold_answers(query)
    question = section("QUESTION", escape_section_markers(grader_question(query)))
    if kind == SIMPLE_EVALS_KIND:
        body = [
            question,
            section("GOLD TARGET", escape_section_markers(json.dumps(golds, ensure_ascii=False))),
            section("RESPONSE", escape_section_markers(response)),
            section("END", "Grade the response: correct, incorrect or not_attempted."),
        ]
    elif kind == EQUIVALENCE_KIND:
        body = [
            question,
            section("RESPONSE", escape_section_markers(response)),
            section("CORRECT ANSWER", escape_section_markers(" / ".join(golds))),
            section("END", "Extract the final answer and say whether it is correct: yes or no."),
        ]
    else:
        body = [
            question,
            section("CONTEXT", escape_section_markers(" / ".join(golds))),
            section("STUDENT ANSWER", escape_section_markers(response)),
            section("END", "Explain step by step, then grade: CORRECT or INCORRECT."),
        ]
    user = "\n\n".join([f"{TASK_LINE}: is the short answer correct? ({kind})", section("BENCHMARK", benchmark), *body])
    return [{"role": "system", "content": system}, {"role": "user", "content": user}]


def short_form_parser(benchmark: str, query: Query) -> Callable[[str | None], ShortFormGrade]:
    """The reply parser of the benchmark's protocol (ReplyError on a reply off its schema)."""
    kind, _, _ = protocol_of(benchmark)
    schema = short_form_schema(kind)

    def parse(text: str | None) -> ShortFormGrade:
        data = checked_reply(text, schema)
        if kind == SIMPLE_EVALS_KIND:
            return ShortFormGrade(data["grade"], data["justification"].strip() or "-", {})
        if kind == COT_QA_KIND:
            grade = "correct" if data["grade"] == "CORRECT" else "incorrect"
            return ShortFormGrade(grade, data["explanation"].strip() or "-", {})
        extracted = data["extracted_final_answer"]
        extracted = extracted.strip() if isinstance(extracted, str) and extracted.strip() else None
        if extracted is None:
            grade = "not_attempted"
        else:
            grade = "correct" if data["correct"] == "yes" else "incorrect"
        em, f1 = answer_em_f1(extracted or "", gold_answers(query))
        details = {"extracted_final_answer": extracted, "answer_em": em, "answer_f1": f1}
        return ShortFormGrade(grade, data["reasoning"].strip() or "-", details)

    return parse


# ---- 2WikiMultihopQA's answer metrics ------------------------------------------------------------

_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCTUATION = set(string.punctuation)
_SPECIAL = ("yes", "no", "noanswer")


def normalize_2wiki(text: str) -> str:
    """The release's normalization, in its order: lower case, punctuation deleted, articles dropped,
    whitespace collapsed."""
    text = "".join(c for c in text.lower() if c not in _PUNCTUATION)
    return " ".join(_ARTICLES.sub(" ", text).split())


def _em_f1(prediction: str, gold: str) -> tuple[float, float]:
    pred, ref = normalize_2wiki(prediction), normalize_2wiki(gold)
    em = float(pred == ref)
    if (pred in _SPECIAL or ref in _SPECIAL) and pred != ref:
        return em, 0.0  # a yes/no answer is right or wrong, never partly
    common = Counter(pred.split()) & Counter(ref.split())
    overlap = sum(common.values())
    if overlap == 0:
        return em, 0.0
    precision, recall = overlap / len(pred.split()), overlap / len(ref.split())
    return em, 2 * precision * recall / (precision + recall)


def answer_em_f1(prediction: str, golds: list[str]) -> tuple[float, float]:
    """Exact match and token F1 of ``prediction``, each the best over the gold answer and its aliases
    (the release's v1.1 script)."""
    if not golds:
        raise EvalError("2Wiki's answer metrics need a gold answer")
    scores = [_em_f1(prediction, gold) for gold in golds]
    return max(em for em, _ in scores), max(f1 for _, f1 in scores)
