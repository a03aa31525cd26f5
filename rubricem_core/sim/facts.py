"""The world's facts in text: the sentence templates a document states an entity's attribute with, and
``read_facts``, which reads them back from any text (a snippet, a trajectory) by the same templates."""

from __future__ import annotations

import re
from typing import NamedTuple


class Fact(NamedTuple):
    entity: str
    attribute: str
    value: str


# ---- sentence templates ------------------------------------------------------------------------
# Each group lists alternative renderings; one alternative is a list of sentences that together state
# the group's facts. Placeholders other than {subj} are attributes of the subject entity.

ORG_GROUPS: dict[str, list[list[str]]] = {
    "founding": [
        ["{subj} was founded in {founded} by {founder}."],
        ["Founded by {founder} in {founded}, {subj} grew steadily."],
        ["{subj} was founded in {founded}.", "The founder of {subj} is {founder}."],
        ["{subj} dates back to {founded}.", "{subj} was founded by {founder}."],
    ],
    "place": [
        ["{subj} is a {sector} company based in {headquarters}."],
        ["{subj} is headquartered in {headquarters}.", "{subj} operates in the {sector} sector."],
        ["The headquarters of {subj} are located in {headquarters}.", "The main business of {subj} is {sector}."],
        ["{subj} has its head office in {headquarters}.", "{subj} is active in {sector}."],
    ],
    "staff": [
        ["{subj} employs {employees} people."],
        ["{subj} has a workforce of {employees}."],
        ["The staff of {subj} numbers {employees}."],
    ],
    "acquisition": [
        ["In {acquired_in}, {acquired_by} acquired {subj}."],
        ["{subj} was acquired by {acquired_by} in {acquired_in}."],
        ["{acquired_by} took over {subj} in {acquired_in}."],
    ],
}
PERSON_GROUPS: dict[str, list[list[str]]] = {
    "birth": [
        ["{subj} was born in {birthplace} in {born}."],
        ["Born in {born} in {birthplace}, {subj} grew up there."],
        ["{subj} was born in {born}.", "{subj} is a native of {birthplace}."],
    ],
    "work": [
        ["{subj} founded {founder_of}."],
        ["{subj} is the founder of {founder_of}."],
        ["{subj} established {founder_of}."],
    ],
}
CITY_GROUPS: dict[str, list[list[str]]] = {
    "population": [
        ["{subj} has a population of {population}."],
        ["{subj} is home to {population} residents."],
        ["{population} people live in {subj}."],
    ],
}
# Fact-free sentences: realistic filler that read_facts must ignore.
FILLER: dict[str, list[str]] = {
    "org": ["{subj} publishes an annual report.", "Analysts follow {subj} closely."],
    "person": ["{subj} rarely gives interviews.", "{subj} has written about management."],
    "city": ["{subj} lies on a river.", "{subj} is known for its markets."],
}

_NAME = r"[A-Z][a-z]+(?: [A-Z][a-z]+)*"
_VALUE_PATTERNS: dict[str, str] = {
    "subj": _NAME,
    "founder": _NAME,
    "headquarters": _NAME,
    "acquired_by": _NAME,
    "birthplace": _NAME,
    "founder_of": _NAME,
    "founded": r"\d{4}",
    "acquired_in": r"\d{4}",
    "born": r"\d{4}",
    "employees": r"\d{1,3}(?:,\d{3})*",
    "population": r"\d{1,3}(?:,\d{3})*",
    "sector": r"[a-z]+(?: [a-z]+)*",
}
_NUMERIC = {"employees", "population"}
_PLACEHOLDER = re.compile(r"\{(\w+)\}")


def _compile_template(template: str) -> tuple[re.Pattern[str], str]:
    """Template -> (full-sentence regex with one named group per placeholder, longest literal)."""
    parts, literals, pos = [], [], 0
    for match in _PLACEHOLDER.finditer(template):
        literal = template[pos : match.start()]
        parts.append(re.escape(literal))
        literals.append(literal)
        name = match.group(1)
        parts.append(f"(?P<{name}>{_VALUE_PATTERNS[name]})")
        pos = match.end()
    parts.append(re.escape(template[pos:]))
    literals.append(template[pos:])
    return re.compile("".join(parts)), max(literals, key=len).strip()


def _all_templates() -> list[str]:
    seen: list[str] = []
    for groups in (ORG_GROUPS, PERSON_GROUPS, CITY_GROUPS):
        for options in groups.values():
            for option in options:
                for sentence in option:
                    if sentence not in seen:
                        seen.append(sentence)
    return seen


_COMPILED = [_compile_template(t) for t in _all_templates()]
_SENTENCE_SPLIT = re.compile(r"(?<=\.)\s+|\n+")
# Words that appear capitalized in templates must never be generated as names (parsing ambiguity).
_RESERVED_WORDS = {w for t in _all_templates() for w in re.findall(r"\b[A-Z][a-z]+\b", _PLACEHOLDER.sub("", t))}


def read_facts(text: str) -> list[Fact]:
    """Parse rendered passages or snippets back into facts, in reading order.

    Only whole template sentences count: a truncated sentence at a snippet edge yields nothing.
    """
    facts: list[Fact] = []
    for sentence in _SENTENCE_SPLIT.split(text):
        sentence = sentence.strip()
        if not sentence:
            continue
        for pattern, keyword in _COMPILED:
            if keyword and keyword not in sentence:
                continue
            match = pattern.fullmatch(sentence)
            if match is None:
                continue
            subject = match.group("subj")
            for name, value in match.groupdict().items():
                if name != "subj":
                    facts.append(Fact(subject, name, value.replace(",", "") if name in _NUMERIC else value))
            break
    return facts
