"""How the built-in judge reads a trajectory: its plan, searches and their snippets, review, answer and citations
(``TraceView``), and which values a sentence states for an entity's attribute (plain text matching)."""

from __future__ import annotations

import re
import string
from dataclasses import dataclass
from functools import cached_property

from rubricem_core.scaffold import STAGES, extract_citations, extract_plan, parse_segments, strip_tags
from rubricem_core.sim.facts import Fact, read_facts

_SNIPPET = re.compile(r'<snippet id="([^"]+)">(.*?)</snippet>', re.S)
_TITLE_PREFIX = re.compile(r"^[^.:<>]{1,80}:\s+")  # search snippets read "Title: text"
_CALL = re.compile(
    r'<call_tool(?:\s+name="([^"]*)")?[^>]*>(.*?)</call_tool>\s*(?:<tool_output>(.*?)</tool_output>)?', re.S
)
_CITE_ELEMENT = re.compile(r"<cite\b[^>]*>.*?</cite>", re.S)
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+")
_NUMBER = re.compile(r"\d[\d,]*")
_WORD = re.compile(r"[a-z0-9]+")
_NUMERIC_ATTRIBUTES = {"founded", "employees", "born", "acquired_in", "population"}
_YEAR_ATTRIBUTES = {"founded", "born", "acquired_in"}
# Words that tie a sentence to an attribute, for values stated in free phrasing.
_ATTRIBUTE_CUES: dict[str, tuple[str, ...]] = {
    "founded": ("found", "dates back", "establish", "year"),
    "employees": ("employ", "workforce", "staff", "people", "worker"),
    "headquarters": ("headquarter", "head office", "based in", "located"),
    "sector": ("sector", "business", "active in", "operates"),
    "founder_of": ("found", "establish"),
    "acquired_by": ("acquir", "took over", "bought"),
    "acquired_in": ("acquir", "took over"),
    "born": ("born",),
    "birthplace": ("born", "native"),
    "population": ("population", "residents", "live"),
}
_ATTRIBUTE_WORDS = {
    "founded": "founding year",
    "employees": "employee count",
    "headquarters": "headquarters city",
    "sector": "sector",
    "founder_of": "founded organization",
    "acquired_by": "acquirer",
    "acquired_in": "acquisition year",
    "born": "birth year",
    "birthplace": "birthplace",
    "population": "population",
}
_STOPWORDS = frozenset(
    "a an and are as at be by does do for from has have in is it its of on or that the their this to was were "
    "what which who with how when where why answer answers states stated mentions report question research "
    "should must not any all each every other than more most less least about into also been being whether "
    "there these those them they".split()
)


# ---- reading a trajectory -----------------------------------------------------------------------


def _mentions(text: str, name: str) -> bool:
    """``name`` occurs as a whole name: not inside a longer word or a longer capitalized name."""
    if not name:
        return False
    return re.search(rf"(?<![A-Za-z]){re.escape(name)}(?![A-Za-z])(?! [A-Z][a-z])", text) is not None


def _first_position(text: str, name: str) -> int | None:
    match = re.search(rf"(?<![A-Za-z]){re.escape(name)}(?![A-Za-z])(?! [A-Z][a-z])", text)
    return match.start() if match else None


def _numbers(text: str) -> list[str]:
    return [n.replace(",", "") for n in _NUMBER.findall(text)]


def _value_in(text: str, attribute: str, value: str) -> bool:
    if attribute in _NUMERIC_ATTRIBUTES or value.replace(",", "").isdigit():
        return value.replace(",", "") in _numbers(text)
    if value[:1].isupper():
        return _mentions(text, value)
    # a lower-case value ("precision optics") may open a sentence, but must not run into a name
    return _mentions(text, value) or _mentions(text, value[:1].upper() + value[1:])


def _poss(name: str) -> str:
    return f"{name}'" if name.endswith("s") else f"{name}'s"


def _sentences(text: str) -> list[str]:
    return [s.strip() for s in _SENTENCE_END.split(text) if s.strip()]


def _words(text: str) -> set[str]:
    return {w for w in _WORD.findall(text.lower()) if len(w) >= 3 and w not in _STOPWORDS}


@dataclass
class ToolCallView:
    name: str
    query: str
    output: str  # "" when no output followed

    @property
    def failed(self) -> bool:
        return "<error>" in self.output or not self.output


@dataclass
class TraceView:
    """Everything the criteria read from one trajectory's text, parsed once."""

    text: str

    @cached_property
    def segments(self):
        return parse_segments(self.text)

    @cached_property
    def stage_text(self) -> dict[str, str]:
        """Policy-written text per stage (tool outputs left out)."""
        out = {stage: "" for stage in STAGES}
        for segment in self.segments:
            if not segment.is_tool_output:
                out[segment.stage] += segment.text
        return out

    @cached_property
    def snippets(self) -> dict[str, str]:
        """doc id → snippet text (title prefix removed) of every snippet in a tool output."""
        out: dict[str, str] = {}
        for segment in self.segments:
            if segment.is_tool_output:
                for doc_id, body in _SNIPPET.findall(segment.text):
                    out[doc_id] = (out.get(doc_id, "") + " " + _TITLE_PREFIX.sub("", body, count=1)).strip()
        return out

    @cached_property
    def snippet_facts(self) -> dict[str, set[Fact]]:
        return {doc_id: set(read_facts(body)) for doc_id, body in self.snippets.items()}

    @cached_property
    def calls(self) -> list[ToolCallView]:
        return [
            ToolCallView((m.group(1) or "").strip(), m.group(2).strip(), m.group(3) or "")
            for m in _CALL.finditer(self.text)
        ]

    @cached_property
    def answer(self) -> str:
        """Inner text of the answer with cite tags kept ('' when there is no answer)."""
        match = re.search(r"<answer>(.*?)(?:</answer>|$)", self.stage_text["answer"], re.S)
        return match.group(1).strip() if match else ""

    @cached_property
    def answer_plain(self) -> str:
        return strip_tags(self.answer)

    @cached_property
    def citations(self):
        return extract_citations(self.text)

    @cached_property
    def conclusion(self) -> str:
        """The concluding sentence: the last sentence outside citations, else the last sentence."""
        outside = _sentences(strip_tags(_CITE_ELEMENT.sub(" ", self.answer)))
        outside = [s for s in outside if _WORD.search(s)]
        if outside:
            return outside[-1]
        sentences = _sentences(self.answer_plain)
        return sentences[-1] if sentences else ""

    @cached_property
    def plan(self):
        return extract_plan(self.text)

    @cached_property
    def rubric_review(self) -> str:
        match = re.search(r"<rubric_review>(.*?)</rubric_review>", self.stage_text["review"], re.S)
        return match.group(1) if match else ""

    def supports(self, doc_id: str, entity: str, attribute: str, value: str | None = None) -> bool:
        """The snippet ``doc_id`` (as retrieved in this trajectory) states entity.attribute (= value)."""
        return any(
            f.entity == entity and f.attribute == attribute and (value is None or _same(f.value, value))
            for f in self.snippet_facts.get(doc_id, ())
        )

    def found(self, entity: str, attribute: str) -> bool:
        return any(self.supports(doc_id, entity, attribute) for doc_id in self.snippets)


def _same(a: str, b: str) -> bool:
    return a.replace(",", "").strip().lower() == b.replace(",", "").strip().lower()


def _states(sentence: str, entity: str, attribute: str, value: str) -> bool:
    if any(
        f.entity == entity and f.attribute == attribute and _same(f.value, value)
        for f in read_facts(sentence if sentence.endswith(".") else sentence + ".")
    ):
        return True
    return _mentions(sentence, entity) and _value_in(sentence, attribute, value)


def _stated_values(view: TraceView, entity: str, attribute: str, others: set[str]) -> list[str]:
    """Values the answer attributes to entity.attribute: template sentences, or a sentence about
    only this entity with an attribute cue and a number of the attribute's shape."""
    values: list[str] = []
    pieces = _sentences(view.answer_plain) + [c.claim for c in view.citations]
    for sentence in pieces:
        parsed = [
            f
            for f in read_facts(sentence if sentence.endswith(".") else sentence + ".")
            if f.entity == entity and f.attribute == attribute
        ]
        if parsed:
            values += [f.value for f in parsed]
            continue
        if attribute not in _NUMERIC_ATTRIBUTES or not _mentions(sentence, entity):
            continue
        if any(_mentions(sentence, other) for other in others if other != entity):
            continue  # several entities in one sentence: which number is whose is unclear
        if not any(cue in sentence.lower() for cue in _ATTRIBUTE_CUES.get(attribute, ())):
            continue
        numbers = _numbers(sentence)
        if attribute in _YEAR_ATTRIBUTES:
            numbers = [n for n in numbers if len(n) == 4]
        values += numbers
    return values


def _plan_text(view: TraceView) -> str:
    plan = view.plan
    if plan is None:
        return ""
    return "\n".join([plan.deep_analysis, *plan.knowledge_checklist, *plan.research_plan])


def _id_like(view: TraceView) -> re.Pattern[str] | None:
    """Pattern of ids shaped like the retrieved ones (letters + digits), to spot invented ids."""
    prefixes = {doc_id[: len(doc_id) - len(doc_id.lstrip(string.ascii_letters))] for doc_id in view.snippets}
    prefixes.discard("")
    if not prefixes:
        return None
    return re.compile(rf"\b(?:{'|'.join(sorted(map(re.escape, prefixes)))})\d+\b")
