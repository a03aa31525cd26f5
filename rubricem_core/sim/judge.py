"""The offline built-in judge: the same two JSON calls, answered by deterministic, checkable criteria.

Registered as the litellm provider ``rubricem-judge`` so it travels the code path of a real judge
(prompts, response_format, run_concurrent, validation, repair). Like a real judge it reads only the
prompt: the question and spec, the rubrics (with their ``check`` JSON), and the trajectories split
by stage. It never sees the world's ground truth beyond what the rubrics state. It does need the
QUERY SPEC section (``JudgeOptions.show_reference``, on by default): the spec names the subjects a
``final`` check chooses between; the config refuses ``judge.show_reference: false`` with this judge.

Scoring, by ``check`` type:
  fact           answer: the fact is stated in a <cite> claim whose snippet states it (2), stated
                 without such support (1), absent (0)
  final          answer: the conclusion gives the right value / order (2), partly (1), not (0)
  wrong_value    negative, answer: a different value is attributed to the entity (2), the
                 look-alike's value appears (1), neither (0)
  search_hit     research: a search for the entity returned a snippet stating the attribute
  plan_covers    plan: the plan targets the entity and attribute
  review_maps    review: rubric_review maps the entity to a retrieved id whose snippet supports it
  cites_unretrieved / review_unretrieved / cites_distractor / cited_claims_supported /
  repeated_search / tool_errors / terms      see ``_CHECKS`` below
  (none)         generic lexical overlap of the rubric's words with the stage text

Rubric generation contrasts the group: candidate rubrics are derived from the query's facts (or,
for non-synthetic queries, its key terms), each is scored on every rollout, and only those whose
scores differ across the group are proposed, most discriminative first.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import numpy as np

from rubricem_core.judge.prompts import (
    generation_limits,
    split_sections,
    unescape_section_markers,
)
from rubricem_core.judge.types import normalize_title
from rubricem_core.scaffold import STAGES
from rubricem_core.sim.provider import message_text, register_completion_provider
from rubricem_core.sim.trace_view import (
    _ATTRIBUTE_CUES,
    _ATTRIBUTE_WORDS,
    _SNIPPET,
    _STOPWORDS,
    _WORD,
    TraceView,
    _first_position,
    _id_like,
    _mentions,
    _numbers,
    _plan_text,
    _poss,
    _same,
    _sentences,
    _stated_values,
    _states,
    _value_in,
    _words,
)

PROVIDER = "rubricem-judge"
MODEL = f"{PROVIDER}/builtin"


class BuiltinJudgeError(ValueError):
    """The built-in judge got a prompt it cannot read (not one of the judge's two prompts)."""


# ---- criteria -----------------------------------------------------------------------------------

Score = tuple[int, str]


@dataclass
class Context:
    """What the prompt says about the query, shared by all criteria of one call."""

    question: str
    spec: dict[str, Any]
    rubrics: list[dict[str, Any]]

    @cached_property
    def facts(self) -> list[dict[str, Any]]:
        return [r["check"] for r in self.rubrics if (r.get("check") or {}).get("type") == "fact"]

    @cached_property
    def distractors(self) -> list[str]:
        out = []
        for rubric in self.rubrics:
            confusable = (rubric.get("check") or {}).get("confusable") or {}
            if confusable.get("entity") and confusable["entity"] not in out:
                out.append(confusable["entity"])
        return out

    @cached_property
    def entities(self) -> set[str]:
        names = set(self.spec.get("subjects") or []) | set(self.distractors)
        names |= {f["entity"] for f in self.facts} | {f["value"] for f in self.facts if str(f["value"])[:1].isupper()}
        return names


def _fact(view: TraceView, check: dict, ctx: Context) -> Score:
    entity, attribute, value = check["entity"], check["attribute"], str(check["value"])
    unsupported = None
    for citation in view.citations:
        if not _states(citation.claim, entity, attribute, value):
            continue
        if view.supports(citation.doc_id, entity, attribute, value):
            return 2, f'<cite id="{citation.doc_id}"> states "{citation.claim}" and that snippet supports it.'
        unsupported = citation.doc_id
    if unsupported is not None:
        return 1, f"The fact is cited to {unsupported}, but that retrieved snippet does not state it."
    if any(_states(s, entity, attribute, value) for s in _sentences(view.answer_plain)):
        return (
            1,
            f"The answer states {_poss(entity)} {_ATTRIBUTE_WORDS.get(attribute, attribute)} ({value}) without a supporting citation.",
        )
    return 0, f"The answer never states that {_poss(entity)} {_ATTRIBUTE_WORDS.get(attribute, attribute)} is {value}."


def _final(view: TraceView, check: dict, ctx: Context) -> Score:
    conclusion = view.conclusion
    if not conclusion:
        return 0, "There is no answer to conclude from."
    order = check.get("order")
    if order:
        positions = [(_first_position(conclusion, name), name) for name in order]
        present = [(p, name) for p, name in positions if p is not None]
        in_order = [p for p, _ in present] == sorted(p for p, _ in present)
        if len(present) == len(order) and in_order:
            return 2, f'The conclusion "{conclusion}" lists all {len(order)} in the right order.'
        if len(present) >= 2 and in_order:
            return 1, f'The conclusion "{conclusion}" orders {len(present)} of {len(order)} correctly.'
        return 0, f'The conclusion "{conclusion}" does not give the order {", ".join(order)}.'
    value = str(check["value"])
    subjects = list(ctx.spec.get("subjects") or [])
    if value in subjects:  # a choice between subjects: the one the conclusion names first
        named = sorted((p, s) for s in subjects if (p := _first_position(conclusion, s)) is not None)
        if named and named[0][1] == value:
            return 2, f'The conclusion "{conclusion}" picks {value}.'
        return 0, f'The conclusion "{conclusion}" does not pick {value}.'
    if _value_in(conclusion, "", value):
        return 2, f'The conclusion "{conclusion}" gives {value}.'
    if _value_in(view.answer_plain, "", value):
        return 1, f"{value} appears in the answer but not in its conclusion."
    return 0, f'The conclusion "{conclusion}" does not give {value}.'


def _wrong_value(view: TraceView, check: dict, ctx: Context) -> Score:
    entity, attribute, value = check["entity"], check["attribute"], str(check["value"])
    wrong = [v for v in _stated_values(view, entity, attribute, ctx.entities) if not _same(v, value)]
    if wrong:
        return (
            2,
            f"The answer gives {wrong[0]} as {_poss(entity)} {_ATTRIBUTE_WORDS.get(attribute, attribute)}; the source gives {value}.",
        )
    confusable = check.get("confusable") or {}
    twin_value = str(confusable.get("value") or "")
    if twin_value and not _same(twin_value, value) and _value_in(view.answer_plain, attribute, twin_value):
        return 1, f"The answer mentions {twin_value}, the value of {confusable.get('entity')}."
    return 0, f"No other value than {value} is given for {entity}."


def _search_hit(view: TraceView, check: dict, ctx: Context) -> Score:
    entity, attribute = check["entity"], check["attribute"]
    targeted = [c for c in view.calls if entity.lower() in c.query.lower()]
    if not targeted:
        return 0, f"No search targets {entity}."
    for call in targeted:
        for doc_id, _ in _SNIPPET.findall(call.output):
            if view.supports(doc_id, entity, attribute):
                return (
                    2,
                    f'The search "{call.query}" returned {doc_id}, which states the {_ATTRIBUTE_WORDS.get(attribute, attribute)}.',
                )
    return (
        1,
        f'Searched for {entity} ("{targeted[0].query}") but no result stated the {_ATTRIBUTE_WORDS.get(attribute, attribute)}.',
    )


def _plan_covers(view: TraceView, check: dict, ctx: Context) -> Score:
    entity, attribute = check["entity"], check["attribute"]
    text = _plan_text(view)
    if not text:
        return 0, "There is no plan."
    lines = [line for line in text.splitlines() if entity.lower() in line.lower()]
    cues = _ATTRIBUTE_CUES.get(attribute, ()) + tuple(_ATTRIBUTE_WORDS.get(attribute, attribute).split())
    if any(any(cue in line.lower() for cue in cues) for line in lines):
        return 2, f"The plan targets {_poss(entity)} {_ATTRIBUTE_WORDS.get(attribute, attribute)}."
    if lines:
        return 1, f"The plan names {entity} but not the {_ATTRIBUTE_WORDS.get(attribute, attribute)}."
    return 0, f"The plan does not mention {entity}."


def _review_maps(view: TraceView, check: dict, ctx: Context) -> Score:
    entity, attribute = check["entity"], check["attribute"]
    lines = [line for line in view.rubric_review.splitlines() if entity.lower() in line.lower()]
    if not lines:
        return 0, f"The rubric review does not cover {entity}."
    for line in lines:
        for doc_id in view.snippets:
            if re.search(rf"(?<![\w]){re.escape(doc_id)}(?![\w])", line) and view.supports(doc_id, entity, attribute):
                return 2, f"The rubric review maps {entity} to {doc_id}, which supports it."
    return 1, f"The rubric review covers {entity} without a supporting evidence id."


def _review_unretrieved(view: TraceView, check: dict, ctx: Context) -> Score:
    pattern = _id_like(view)
    mentioned = set(pattern.findall(view.rubric_review)) if pattern else set()
    bad = sorted(mentioned - set(view.snippets))
    if bad:
        return 2, f"The rubric review names ids never retrieved: {', '.join(bad[:3])}."
    return 0, "Every id in the rubric review was retrieved."


def _cites_unretrieved(view: TraceView, check: dict, ctx: Context) -> Score:
    bad = sorted({c.doc_id for c in view.citations} - set(view.snippets))
    if bad:
        return 2, f"The answer cites ids never retrieved: {', '.join(bad[:3])}."
    return 0, "Every cited id was retrieved."


def _cites_distractor(view: TraceView, check: dict, ctx: Context) -> Score:
    entity = check["entity"]
    for citation in view.citations:
        if any(f.entity == entity for f in view.snippet_facts.get(citation.doc_id, ())):
            if not any(f.entity in ctx.entities - {entity} for f in view.snippet_facts.get(citation.doc_id, ())):
                return 2, f"The answer cites {citation.doc_id}, a document about {entity}."
    if _mentions(view.answer_plain, entity):
        return 1, f"The answer mentions {entity}."
    return 0, f"The answer does not rely on {entity}."


def _cited_claims_supported(view: TraceView, check: dict, ctx: Context) -> Score:
    cited = view.citations
    if not cited:
        return 0, "The answer has no citations."
    good = 0
    for citation in cited:
        snippet = view.snippets.get(citation.doc_id, "")
        values = _numbers(citation.claim)
        if snippet and all(v in _numbers(snippet) for v in values):
            good += 1
    if good == len(cited):
        return 2, f"All {len(cited)} cited claims match the numbers of their snippets."
    if good:
        return 1, f"{len(cited) - good} of {len(cited)} cited claims state numbers their snippet does not."
    return 0, "No cited claim is backed by its snippet."


def _repeated_search(view: TraceView, check: dict, ctx: Context) -> Score:
    queries = [normalize_title(c.query) for c in view.calls if c.query]
    repeats = len(queries) - len(set(queries))
    if repeats:
        return 2, f"{repeats} search(es) repeat an earlier query verbatim."
    return 0, "No search is repeated."


def _tool_errors(view: TraceView, check: dict, ctx: Context) -> Score:
    failed = [c for c in view.calls if c.failed]
    if len(failed) >= 2:
        return 2, f"{len(failed)} tool calls failed."
    if failed:
        return 1, "One tool call failed."
    return 0, "No tool call failed."


def _terms(view: TraceView, check: dict, ctx: Context) -> Score:
    stage, terms = check.get("stage", "answer"), [t.lower() for t in check.get("terms") or []]
    text = " ".join(c.query for c in view.calls) if stage == "research" else view.stage_text.get(stage, "")
    words = set(_WORD.findall(text.lower()))
    hits = [t for t in terms if t in words]
    if terms and len(hits) == len(terms):
        return 2, f"The {stage} stage covers {', '.join(terms)}."
    if hits:
        return 1, f"The {stage} stage covers {', '.join(hits)} but not all of {', '.join(terms)}."
    return 0, f"The {stage} stage does not cover {', '.join(terms)}."


def _review_grounded(view: TraceView, check: dict, ctx: Context) -> Score:
    ids = [
        doc_id for doc_id in view.snippets if re.search(rf"(?<![\w]){re.escape(doc_id)}(?![\w])", view.rubric_review)
    ]
    if not ids:
        return 0, "The rubric review maps no criterion to a retrieved id."
    bad = _review_unretrieved(view, check, ctx)[0]
    return (
        (1, "The rubric review also names ids never retrieved.")
        if bad
        else (2, f"The rubric review maps criteria to retrieved ids ({', '.join(ids[:3])}).")
    )


_CHECKS: dict[str, Callable[[TraceView, dict, Context], Score]] = {
    "fact": _fact,
    "final": _final,
    "wrong_value": _wrong_value,
    "search_hit": _search_hit,
    "plan_covers": _plan_covers,
    "review_maps": _review_maps,
    "review_unretrieved": _review_unretrieved,
    "cites_unretrieved": _cites_unretrieved,
    "cites_distractor": _cites_distractor,
    "cited_claims_supported": _cited_claims_supported,
    "repeated_search": _repeated_search,
    "tool_errors": _tool_errors,
    "terms": _terms,
    "review_grounded": _review_grounded,
}


def _lexical(view: TraceView, rubric: dict[str, Any]) -> Score:
    """No machine check: the share of the rubric's content words found in its stage's text."""
    stage = rubric.get("stage", "answer")
    words = _words(f"{rubric.get('title', '')} {rubric.get('description', '')}")
    text = view.stage_text.get(stage, "")
    if stage == "research":
        text += " ".join(view.snippets.values())
    present = words & _words(text)
    share = len(present) / len(words) if words else 0.0
    score = 2 if share >= 0.6 else 1 if share >= 0.3 else 0
    return score, f"Lexical match: {len(present)} of {len(words)} rubric words appear in the {stage} stage."


def score_rubric(view: TraceView, rubric: dict[str, Any], ctx: Context) -> Score:
    check = rubric.get("check")
    if not isinstance(check, dict) or (criterion := _CHECKS.get(check.get("type", ""))) is None:
        return _lexical(view, rubric)
    try:
        return criterion(view, check, ctx)
    except (KeyError, TypeError) as exc:  # a check missing a field: fall back rather than fail
        score, why = _lexical(view, rubric)
        return score, f"check unusable ({type(exc).__name__}: {exc}); {why}"


# ---- rubric generation by contrast -----------------------------------------------------------------


@dataclass
class Candidate:
    stage: str
    polarity: str
    title: str
    description: str
    weight: int
    check: dict[str, Any]

    def as_reply(self) -> dict[str, Any]:
        return {
            "polarity": self.polarity,
            "title": self.title,
            "description": self.description,
            "weight": self.weight,
            "check": self.check,
        }


def _synthetic_candidates(ctx: Context) -> list[Candidate]:
    out: list[Candidate] = []
    for fact in ctx.facts:
        entity, attribute = fact["entity"], fact["attribute"]
        words = _ATTRIBUTE_WORDS.get(attribute, attribute)
        target = {"entity": entity, "attribute": attribute}
        out += [
            Candidate(
                "plan",
                "positive",
                f"Plans to find {_poss(entity)} {words}",
                f"The plan's checklist or research steps target the {words} of {entity}.",
                2,
                {"type": "plan_covers", **target},
            ),
            Candidate(
                "research",
                "positive",
                f"Searches for {_poss(entity)} {words}",
                f"A search targets {entity} and returns a snippet stating its {words}.",
                3,
                {"type": "search_hit", **target},
            ),
            Candidate(
                "review",
                "positive",
                f"Maps {_poss(entity)} {words} to supporting evidence",
                f"The rubric review links {_poss(entity)} {words} to a retrieved document that states it.",
                2,
                {"type": "review_maps", **target},
            ),
        ]
    for distractor in ctx.distractors:
        out.append(
            Candidate(
                "answer",
                "negative",
                f"Relies on documents about {distractor}",
                f"The answer cites or uses {distractor}, a similarly named entity the question is not about.",
                3,
                {"type": "cites_distractor", "entity": distractor},
            )
        )
    return out


_QUESTION_WORD = re.compile(r"[A-Za-z][A-Za-z\-]{3,}")


def _generic_candidates(ctx: Context) -> list[Candidate]:
    terms = []
    for word in _QUESTION_WORD.findall(ctx.question):
        lower = word.lower()
        if lower not in _STOPWORDS and lower not in terms:
            terms.append(lower)
    out = []
    for term in terms[:8]:
        out.append(
            Candidate(
                "research",
                "positive",
                f"Searches for '{term}'",
                f"At least one search query includes the key term '{term}' of the question.",
                2,
                {"type": "terms", "stage": "research", "terms": [term]},
            )
        )
        out.append(
            Candidate(
                "answer",
                "positive",
                f"Addresses '{term}' in the report",
                f"The report discusses '{term}', which the question asks about.",
                1,
                {"type": "terms", "stage": "answer", "terms": [term]},
            )
        )
        out.append(
            Candidate(
                "plan",
                "positive",
                f"Plans research on '{term}'",
                f"The plan names '{term}' among the things to find.",
                1,
                {"type": "terms", "stage": "plan", "terms": [term]},
            )
        )
    return out


_COMMON_CANDIDATES = [
    Candidate(
        "research",
        "negative",
        "Repeats an identical search query",
        "The agent sends the same search query more than once instead of refining it.",
        1,
        {"type": "repeated_search"},
    ),
    Candidate(
        "research",
        "negative",
        "Makes tool calls that fail",
        "Tool calls come back with errors (malformed call, unknown tool, exhausted budget).",
        1,
        {"type": "tool_errors"},
    ),
    Candidate(
        "review",
        "positive",
        "Maps criteria to retrieved evidence ids",
        "The rubric review links criteria to ids of documents that were actually retrieved.",
        2,
        {"type": "review_grounded"},
    ),
    Candidate(
        "review",
        "negative",
        "Maps criteria to evidence ids never retrieved",
        "The rubric review names document ids that no search returned.",
        2,
        {"type": "review_unretrieved"},
    ),
    Candidate(
        "answer",
        "positive",
        "Cited claims match their sources",
        "Every number in a cited claim appears in the cited snippet.",
        3,
        {"type": "cited_claims_supported"},
    ),
    Candidate(
        "answer",
        "negative",
        "Cites document ids that were never retrieved",
        "The report cites ids that no tool output returned.",
        3,
        {"type": "cites_unretrieved"},
    ),
]


def generate_by_contrast(
    ctx: Context, views: list[TraceView], limits: dict[str, int]
) -> dict[str, list[dict[str, Any]]]:
    """The most discriminative candidates of each stage, at most ``limits[stage]`` (none for a stage not listed)."""
    existing = {normalize_title(r.get("title", "")) for r in ctx.rubrics}
    candidates = (_synthetic_candidates(ctx) if ctx.facts else _generic_candidates(ctx)) + _COMMON_CANDIDATES
    ranked: dict[str, list[tuple[float, int, Candidate]]] = {stage: [] for stage in STAGES}
    for order, candidate in enumerate(candidates):
        if normalize_title(candidate.title) in existing:
            continue
        scores = [score_rubric(view, {"stage": candidate.stage, "check": candidate.check}, ctx)[0] for view in views]
        if len(set(scores)) > 1:  # discriminative within this group
            ranked[candidate.stage].append((float(np.std(scores)), order, candidate))
    out: dict[str, list[dict[str, Any]]] = {}
    for stage in STAGES:
        best = sorted(ranked[stage], key=lambda item: (-item[0], item[1]))[: limits.get(stage, 0)]
        out[stage] = [candidate.as_reply() for _, _, candidate in best]
    return out


# ---- the provider -----------------------------------------------------------------------------------


@dataclass
class ParsedPrompt:
    task: str  # "generate" | "score"
    question: str = ""
    spec: dict[str, Any] = field(default_factory=dict)
    rubrics: list[dict[str, Any]] = field(default_factory=list)
    trajectories: list[str] = field(default_factory=list)
    limits: dict[str, int] = field(default_factory=lambda: {stage: 3 for stage in STAGES})


def _rubric_lines(body: str) -> list[dict[str, Any]]:
    if body.strip() == "(none)":
        return []
    out = []
    for line in body.splitlines():
        if line.strip():
            out.append(json.loads(unescape_section_markers(line)))
    return out


def parse_prompt(content: str) -> ParsedPrompt:
    first = content.lstrip().split("\n", 1)[0]
    if first.startswith("TASK: write new rubrics"):
        parsed = ParsedPrompt("generate")
    elif first.startswith("TASK: score"):
        parsed = ParsedPrompt("score")
    else:
        raise BuiltinJudgeError(f"not a judge prompt (first line {first[:80]!r})")
    pieces: dict[int, list[str]] = {}
    for name, body in split_sections(content):
        if name == "QUESTION":
            parsed.question = unescape_section_markers(body)
        elif name == "QUERY SPEC":
            parsed.spec = json.loads(body)
        elif name in ("RUBRICS", "EXISTING RUBRICS"):
            parsed.rubrics = _rubric_lines(body)
        elif match := re.fullmatch(r"(?:ROLLOUT (\d+) |TRAJECTORY )STAGE (\w+)", name):
            index = int(match.group(1) or 0)
            pieces.setdefault(index, []).append(unescape_section_markers(body))
    parsed.trajectories = ["\n".join(pieces[index]) for index in sorted(pieces)]
    parsed.limits = generation_limits(content) or parsed.limits
    return parsed


def respond(messages: list[dict[str, Any]], params: dict[str, Any]) -> str:
    """The built-in judge's reply to either judge prompt (a repair turn gets the same, valid reply)."""
    user = next((message_text(m.get("content")) for m in messages if m.get("role") == "user"), "")
    prompt = parse_prompt(user)
    ctx = Context(prompt.question, prompt.spec, prompt.rubrics)
    views = [TraceView(text) for text in prompt.trajectories]
    if prompt.task == "generate":
        return json.dumps(generate_by_contrast(ctx, views, prompt.limits))
    view = views[0] if views else TraceView("")
    scores = []
    for rubric in prompt.rubrics:
        score, why = score_rubric(view, rubric, ctx)
        scores.append({"rubric_id": rubric["id"], "justification": why, "score": score})
    return json.dumps({"scores": scores})


def register_builtin_judge() -> str:
    """Register (idempotently) the built-in judge as litellm provider ``rubricem-judge``; returns its model."""
    register_completion_provider(PROVIDER, respond)
    return MODEL
