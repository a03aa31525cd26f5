"""The offline built-in reflection judge (litellm provider ``rubricem-reflection-judge``).

It reads the prompt of ``rubricem_core.reflection.judge`` and scores deterministically from the
privileged inputs: coverage of the failed rubrics by the candidate's items (lexical overlap of key
terms and entity names), specificity, actionable takeaways, and a penalty for redundant items.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from rubricem_core.judge.prompts import split_sections, unescape_section_markers
from rubricem_core.reflection.format import Reflection, parse_reflection
from rubricem_core.reflection.judge import TASK_LINE
from rubricem_core.sim.provider import message_text, register_completion_provider

PROVIDER = "rubricem-reflection-judge"
MODEL = f"{PROVIDER}/builtin"

_WORD = re.compile(r"[A-Za-z0-9][A-Za-z0-9'\-]*")
_DIGITS = re.compile(r"\d")
_SENTENCE_START = re.compile(r"(?:^|[.!?:;]\s+|\n\s*(?:[-*\u2022]\s*)?)$")
_STOPWORDS = frozenset(
    "a an and are as at be by does do for from has have in is it its of on or that the their this to was were "
    "what which who with how when where why should must not any all each every other than more most less least "
    "about into also been being whether there these those them they then only one two both per next time "
    "your you our we us it's its' don't can could would will may might".split()
)
# Words every research reflection uses: they say nothing about this question.
_GENERIC = frozenset(
    "search searches searched searching query queries answer answers report reports evidence source sources "
    "claim claims cite cites cited citation citations fact facts information info result results question "
    "questions attempt attempts research researching thorough thoroughly careful carefully verify verifying "
    "check checking double make sure good better best important relevant accurate accuracy complete clear "
    "clearly correct correctly detail details detailed quality step steps final well write writing written "
    "use using used find finding found read reading document documents data mention mentions mentioned "
    "state states stated include includes including criteria criterion plan planning review improve "
    "strong weak lesson lessons future again look looking sure always never rubric rubrics".split()
)
_ACTIONS = (
    "search",
    "query",
    "queri",
    "brows",
    "read",
    "verif",
    "check",
    "compar",
    "confirm",
    "distinguish",
    "cite",
    "look",
    "find",
    "use",
    "avoid",
    "state",
    "map",
    "cross",
    "prefer",
    "record",
    "note",
    "open",
    "separat",
    "list",
    "comput",
    "calculat",
    "rank",
    "order",
    "quote",
    "attribut",
    "name",
    "report",
    "includ",
    "ask",
    "start",
    "follow",
    "trac",
    "match",
    "identif",
    "tie",
    "link",
)


def _stem(word: str) -> str:
    for suffix in ("ing", "ed", "es", "s"):
        if word.endswith(suffix) and len(word) - len(suffix) >= 4:
            return word[: -len(suffix)]
    return word


def _words(text: str) -> list[str]:
    return [w.lower().strip("'-") for w in _WORD.findall(text)]


def _terms(text: str) -> set[str]:
    return {_stem(w) for w in _words(text) if len(w) >= 3 and w not in _STOPWORDS}


def _entities(text: str) -> set[str]:
    """Lower-cased capitalized words that do not open a sentence or list item, and numbers."""
    out = set()
    for match in _WORD.finditer(text):
        word = match.group(0).strip("'-")
        if any(ch.isdigit() for ch in word):
            out.add(word.lower())
        elif word[:1].isupper() and not _SENTENCE_START.search(text[: match.start()]):
            lowered = word.lower()
            if lowered not in _STOPWORDS:
                out.add(lowered.removesuffix("'s"))
    return out


@dataclass
class _RubricView:
    weight: float
    credit: int | None
    title: str
    terms: set[str]
    entities: set[str]


def _coverage(rubric: _RubricView, words: set[str], terms: set[str]) -> float:
    """How much of one rubric an item set addresses: key terms (saturating at 4) and entity names."""
    if not rubric.terms and not rubric.entities:
        return 0.0
    term_hit = min(1.0, len(rubric.terms & terms) / max(1, min(len(rubric.terms), 4))) if rubric.terms else 0.0
    if not rubric.entities:
        return term_hit
    entity_hit = len({e for e in rubric.entities if e in words}) / len(rubric.entities)
    return 0.5 * term_hit + 0.5 * entity_hit


def builtin_score(reflection: Reflection, question: str, rubrics: Sequence[dict[str, Any]]) -> tuple[float, str]:
    """Deterministic usefulness of a parsed reflection given the rubric records of the prompt."""
    views = []
    for record in rubrics:
        text = f"{record.get('title', '')}. {record.get('description', '')}"
        views.append(
            _RubricView(
                float(record.get("weight") or 1.0),
                record.get("credit"),
                str(record.get("title", "")),
                _terms(text) - _GENERIC,
                _entities(text),
            )
        )
    failed = [v for v in views if v.credit is not None and v.credit < 2]
    # Nothing failed: a reflection can still restate what mattered; no rubrics: the question is the target.
    targets = (
        failed or views or [_RubricView(1.0, None, "the question", _terms(question) - _GENERIC, _entities(question))]
    )
    # (the targets are the failed views, all with a credit, when any failed)
    weights = [v.weight * (2 - v.credit) if failed and v.credit is not None else v.weight for v in targets]

    items = list(reflection.items)
    all_text = "\n".join(items)
    words = set(_words(all_text)) | {w.removesuffix("'s") for w in _words(all_text)}
    terms = _terms(all_text)
    coverages = [_coverage(v, words, terms) for v in targets]
    coverage = sum(w * c for w, c in zip(weights, coverages)) / sum(weights)

    vocab_entities = set().union(_entities(question), *(v.entities for v in views))
    vocab_terms = (_terms(question) | set().union(*(v.terms for v in views))) - _GENERIC

    def specific(item: str) -> bool:
        item_words = set(_words(item))
        return bool(item_words & vocab_entities) or bool(_DIGITS.search(item)) or len(_terms(item) & vocab_terms) >= 2

    specific_flags = [specific(item) for item in items]
    specificity = sum(specific_flags) / len(items)
    takeaways = list(reflection.takeaways)
    actionable = sum(
        1 for item in takeaways if specific(item) and any(w.startswith(_ACTIONS) for w in _words(item))
    ) / len(takeaways)
    item_terms = [_terms(item) for item in items]
    redundant = 0
    for j in range(1, len(items)):
        for i in range(j):
            union = item_terms[i] | item_terms[j]
            if union and len(item_terms[i] & item_terms[j]) / len(union) >= 0.6:
                redundant += 1
                break
    redundancy = redundant / len(items)
    score = (0.6 * coverage + 0.25 * specificity + 0.15 * actionable) * (1.0 - 0.5 * redundancy)
    score = round(min(1.0, max(0.0, score)), 4)
    covered = [v.title for v, c in zip(targets, coverages) if c >= 0.5]
    kind = "failed rubrics" if failed else ("rubrics" if views else "question terms")
    why = (
        f"addresses {len(covered)}/{len(targets)} {kind}"
        + (f" ({'; '.join(t[:60] for t in covered[:3])})" if covered else "")
        + f"; coverage {coverage:.2f}; {sum(specific_flags)}/{len(items)} items specific; "
        f"{round(actionable * len(takeaways))}/{len(takeaways)} takeaways actionable; {redundant} redundant"
    )
    return score, why


def _read_prompt(content: str) -> tuple[str, list[dict[str, Any]], dict[int, str], list[int]]:
    first = content.lstrip().split("\n", 1)[0]
    if not first.startswith(TASK_LINE):
        raise ValueError(f"not a reflection-judge prompt (first line {first[:80]!r})")
    question, rubrics, candidates = "", [], {}
    for name, body in split_sections(content):
        if name == "QUESTION":
            question = unescape_section_markers(body)
        elif name == "JUDGE RUBRICS AND SCORES" and body.strip() != "(none)":
            rubrics = [json.loads(unescape_section_markers(line)) for line in body.splitlines() if line.strip()]
        elif match := re.fullmatch(r"CANDIDATE (\d+)", name):
            candidates[int(match.group(1))] = unescape_section_markers(body)
    return question, rubrics, candidates, sorted(candidates)


def respond(messages: list[dict[str, Any]], params: dict[str, Any]) -> str:
    """The built-in reflection judge's reply (a repair turn gets the same, valid reply)."""
    user = next((message_text(m.get("content")) for m in messages if m.get("role") == "user"), "")
    question, rubrics, candidates, order = _read_prompt(user)
    scores = []
    for index in order:
        reflection = parse_reflection(candidates[index])
        if reflection is None or not reflection.rubrics or not reflection.takeaways:
            score, why = 0.0, "not a complete reflection"
        else:
            score, why = builtin_score(reflection, question, rubrics)
        scores.append({"candidate": index, "justification": why, "score": score})
    return json.dumps({"scores": scores})


def register_builtin_reflection_judge() -> str:
    """Register (idempotently) the built-in reflection judge as a litellm provider; returns its model."""
    register_completion_provider(PROVIDER, respond)
    return MODEL
