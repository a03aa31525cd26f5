"""Seeded synthetic research world: entities, a rendered corpus, and multi-search queries.

The world is the offline stand-in for the web. Organizations, people and cities get generated,
pronounceable names; some organizations and people are *confusable distractors* whose names share a
word with a real entity ("Voralis Labs" vs "Voralis Systems"). Every fact is rendered into
passages from a fixed set of sentence templates (several phrasings per fact), so `read_facts` can
parse any passage or snippet back into facts — that is how the built-in teacher "reads" search
results without touching the ground truth kept on `World`.

Attributes (all values are strings in `Fact`):
  organization: founded (year), founder (person), headquarters (city), employees (int), sector,
                acquired_by (organization), acquired_in (year)
  person:       born (year), birthplace (city), founder_of (organization)
  city:         population (int)

Rubric `check` objects written here (the built-in judge evaluates them):
  {"type": "fact", "entity", "attribute", "value", "doc_ids"}        positive, one per required fact
  {"type": "final", "value", ["order"]}                               positive, the final answer
  {"type": "wrong_value", "entity", "attribute", "value", "confusable": {"entity", "value"} | null}
      negative: the answer states a value for entity.attribute other than `value`
"""

from __future__ import annotations

import json
import math
import random
import re
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import pyarrow as pa

from rubricem_core.config import WorldConfig  # the profile's section; config/ owns every section
from rubricem_core.schemas import CORPUS_SCHEMA, Query, queries_to_table


class Fact(NamedTuple):
    entity: str
    attribute: str
    value: str


@dataclass(frozen=True)
class Document:
    doc_id: str
    title: str
    text: str


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


# ---- entities ----------------------------------------------------------------------------------

_ONSETS = [
    "b",
    "d",
    "f",
    "g",
    "k",
    "l",
    "m",
    "n",
    "p",
    "r",
    "s",
    "t",
    "v",
    "z",
    "br",
    "dr",
    "kr",
    "tr",
    "st",
    "sh",
    "th",
]
_VOWELS = ["a", "e", "i", "o", "u", "a", "e", "o", "ai", "ea", "io"]
_CODAS = ["", "", "", "", "n", "r", "l", "s", "m", "x"]
ORG_SUFFIXES = [
    "Labs",
    "Systems",
    "Group",
    "Industries",
    "Holdings",
    "Dynamics",
    "Works",
    "Partners",
    "Technologies",
    "Foundry",
    "Networks",
    "Analytics",
]
SECTORS = [
    "biotechnology",
    "freight logistics",
    "semiconductor design",
    "renewable energy",
    "agricultural machinery",
    "financial software",
    "medical devices",
    "textile manufacturing",
    "aerospace components",
    "water treatment",
    "consumer electronics",
    "specialty chemicals",
    "maritime shipping",
    "precision optics",
    "food processing",
]
LATEST_YEAR = 2024


class _NameMaker:
    """Unique pronounceable words; every generated word is distinct across the whole world."""

    def __init__(self, rng: random.Random):
        self.rng = rng
        self.used: set[str] = set(_RESERVED_WORDS) | set(ORG_SUFFIXES)

    def word(self, min_syllables: int = 2, max_syllables: int = 3) -> str:
        rng = self.rng
        while True:
            n = rng.randint(min_syllables, max_syllables)
            syllables = [rng.choice(_ONSETS) + rng.choice(_VOWELS) for _ in range(n)]
            syllables[-1] += rng.choice(_CODAS)
            word = "".join(syllables).capitalize()
            if 4 <= len(word) <= 12 and word not in self.used:
                self.used.add(word)
                return word


@dataclass
class Organization:
    name: str
    founded: int
    founder: str
    headquarters: str
    employees: int
    sector: str
    acquired_by: str | None = None
    acquired_in: int | None = None
    confusable_with: str | None = None  # for a distractor: the real organization it imitates
    is_distractor: bool = False

    def facts(self) -> dict[str, str]:
        out = {
            "founded": str(self.founded),
            "founder": self.founder,
            "headquarters": self.headquarters,
            "employees": str(self.employees),
            "sector": self.sector,
        }
        if self.acquired_by is not None:
            out["acquired_by"] = self.acquired_by
            out["acquired_in"] = str(self.acquired_in)
        return out


@dataclass
class Person:
    name: str
    born: int
    birthplace: str
    founder_of: str
    confusable_with: str | None = None
    is_distractor: bool = False

    def facts(self) -> dict[str, str]:
        return {"born": str(self.born), "birthplace": self.birthplace, "founder_of": self.founder_of}


@dataclass
class City:
    name: str
    population: int

    def facts(self) -> dict[str, str]:
        return {"population": str(self.population)}


@dataclass
class World:
    """A generated world. `documents` and `queries` are what agents see; the rest is ground truth."""

    config: WorldConfig
    documents: list[Document]
    queries: list[Query]
    organizations: list[Organization]
    persons: list[Person]
    cities: list[City]
    facts: list[Fact]
    fact_doc_ids: dict[Fact, list[str]] = field(repr=False)
    doc_facts: dict[str, list[Fact]] = field(repr=False)

    def corpus_table(self) -> pa.Table:
        return pa.table(
            {
                "doc_id": [d.doc_id for d in self.documents],
                "title": [d.title for d in self.documents],
                "text": [d.text for d in self.documents],
                "source": ["synthetic"] * len(self.documents),
            },
            schema=CORPUS_SCHEMA,
        )

    def queries_table(self) -> pa.Table:
        return queries_to_table(self.queries)


def _log_uniform_int(rng: random.Random, low: float, high: float) -> int:
    return int(math.exp(rng.uniform(math.log(low), math.log(high))))


def _plan_sizes(cfg: WorldConfig) -> tuple[int, int, int, int]:
    """(organizations, distractor organizations, cities, near-duplicates) summing to n_documents.

    Each organization comes with one founder, so organizations and persons give two passages each;
    cities absorb the rounding so the corpus has exactly n_documents passages.
    """
    per_org = 2 * (1 + cfg.near_duplicate_rate) + 0.2
    n_orgs = max(8, int(cfg.n_documents / per_org))
    n_distractors = min(round(cfg.distractor_rate * n_orgs), n_orgs // 2)
    n_near_dups = round(cfg.near_duplicate_rate * 2 * n_orgs)
    n_cities = max(3, n_orgs // 5)
    overflow = 2 * n_orgs + n_near_dups + n_cities - cfg.n_documents
    if overflow > 0:
        n_near_dups = max(0, n_near_dups - overflow)
    n_cities = cfg.n_documents - 2 * n_orgs - n_near_dups
    return n_orgs, n_distractors, n_cities, n_near_dups


def _make_entities(cfg: WorldConfig, rng: random.Random) -> tuple[list[Organization], list[Person], list[City]]:
    n_orgs, n_distractors, n_cities, _ = _plan_sizes(cfg)
    names = _NameMaker(rng)
    cities = [City(names.word(2, 3), _log_uniform_int(rng, 8_000, 6_000_000)) for _ in range(n_cities)]
    city_names = [c.name for c in cities]
    n_real = n_orgs - n_distractors
    orgs: list[Organization] = []
    persons: list[Person] = []

    def new_org(name: str, founder: str) -> Organization:
        return Organization(
            name=name,
            founded=rng.randint(1850, 2015),
            founder=founder,
            headquarters=rng.choice(city_names),
            employees=_log_uniform_int(rng, 20, 250_000),
            sector=rng.choice(SECTORS),
        )

    def new_person(name: str, org: Organization) -> Person:
        return Person(
            name=name, born=org.founded - rng.randint(22, 60), birthplace=rng.choice(city_names), founder_of=org.name
        )

    for _ in range(n_real):
        founder = f"{names.word(2, 2)} {names.word(2, 3)}"
        org = new_org(f"{names.word(2, 3)} {rng.choice(ORG_SUFFIXES)}", founder)
        orgs.append(org)
        persons.append(new_person(founder, org))
    # Distractors imitate distinct real organizations: same root word with another suffix, and a
    # founder with the same surname as the real founder.
    for index in rng.sample(range(n_real), n_distractors):
        real_org, real_person = orgs[index], persons[index]
        root, suffix = real_org.name.rsplit(" ", 1)
        founder = f"{names.word(2, 2)} {real_person.name.split(' ', 1)[1]}"
        org = new_org(f"{root} {rng.choice([s for s in ORG_SUFFIXES if s != suffix])}", founder)
        while org.founded == real_org.founded:
            org.founded = rng.randint(1850, 2015)
        while org.employees == real_org.employees:
            org.employees = _log_uniform_int(rng, 20, 250_000)
        if len(city_names) > 1:
            while org.headquarters == real_org.headquarters:
                org.headquarters = rng.choice(city_names)
        org.is_distractor, org.confusable_with = True, real_org.name
        person = new_person(founder, org)
        person.is_distractor, person.confusable_with = True, real_person.name
        orgs.append(org)
        persons.append(person)
    # Acquisitions among real organizations, dated after both were founded.
    real = orgs[:n_real]
    for target in rng.sample(real, max(1, n_real // 7)):
        buyer = rng.choice(real)
        if buyer is target or buyer.acquired_by == target.name:
            continue
        target.acquired_by = buyer.name
        target.acquired_in = rng.randint(max(target.founded, buyer.founded) + 1, LATEST_YEAR)
    return orgs, persons, cities


def _render(
    subject: str,
    values: dict[str, str],
    groups: dict[str, list[list[str]]],
    filler: list[str],
    rng: random.Random,
    avoid: dict[str, int] | None = None,
) -> tuple[str, dict[str, int]]:
    """Render one passage; `avoid` (group -> option used before) forces a re-phrasing for near-duplicates."""
    display = {k: (f"{int(v):,}" if k in _NUMERIC else v) for k, v in values.items()}
    display["subj"] = subject
    chosen: dict[str, int] = {}
    blocks: list[list[str]] = []
    for group, options in groups.items():
        needed = _PLACEHOLDER.findall(" ".join(options[0]))
        if any(name != "subj" and name not in values for name in needed):
            continue  # e.g. an organization that was never acquired
        choices = [i for i in range(len(options)) if avoid is None or i != avoid.get(group)]
        option = rng.choice(choices)
        chosen[group] = option
        blocks.append([s.format(**display) for s in options[option]])
    if avoid is not None:
        rng.shuffle(blocks)
    sentences = [s for block in blocks for s in block]
    if rng.random() < 0.5:
        sentences.insert(rng.randint(1, len(sentences)), rng.choice(filler).format(subj=subject))
    return " ".join(sentences), chosen


# ---- queries -----------------------------------------------------------------------------------

_ATTRIBUTE_PHRASES = {
    "founded": ("States that {e} was founded in {v}", "a founding year"),
    "employees": ("States that {e} has {v} employees", "an employee count"),
    "headquarters": ("States that {e} is headquartered in {v}", "a headquarters city"),
    "sector": ("States that {e} operates in the {v} sector", "a sector"),
    "founder_of": ("States that {e} founded {v}", "an organization founded"),
    "acquired_by": ("States that {e} was acquired by {v}", "an acquirer"),
}


def _display(attribute: str, value: str) -> str:
    return f"{int(value):,}" if attribute in _NUMERIC else value


class _QueryBuilder:
    def __init__(
        self,
        world_orgs: list[Organization],
        persons: list[Person],
        fact_doc_ids: dict[Fact, list[str]],
        rng: random.Random,
    ):
        self.rng = rng
        self.fact_doc_ids = fact_doc_ids
        self.real_orgs = [o for o in world_orgs if not o.is_distractor]
        self.org_by_name = {o.name: o for o in world_orgs}
        self.person_by_name = {p.name: p for p in persons}
        self.distractor_of = {o.confusable_with: o for o in world_orgs if o.is_distractor}
        self.distractor_of.update({p.confusable_with: p for p in persons if p.is_distractor})  # type: ignore[misc]
        self.acquired = [o for o in self.real_orgs if o.acquired_by is not None]

    def _required(self, entity: str, attribute: str, value: str) -> dict[str, Any]:
        return {
            "entity": entity,
            "attribute": attribute,
            "value": value,
            "doc_ids": self.fact_doc_ids[Fact(entity, attribute, value)],
        }

    def _rubrics(
        self, required: list[dict[str, Any]], final_text: str, final_check: dict[str, Any]
    ) -> list[dict[str, Any]]:
        rubrics = []
        for fact in required:
            title = _ATTRIBUTE_PHRASES[fact["attribute"]][0].format(
                e=fact["entity"], v=_display(fact["attribute"], fact["value"])
            )
            rubrics.append(
                {
                    "title": title,
                    "weight": 2.0,
                    "polarity": "positive",
                    "stage": "answer",
                    "description": f"{title}, a fact the answer needs and the corpus supports.",
                    "check": {"type": "fact", **fact},
                }
            )
        rubrics.append(
            {
                "title": final_text,
                "description": f"The final answer is: {final_check['value']}.",
                "weight": 3.0,
                "polarity": "positive",
                "stage": "answer",
                "check": final_check,
            }
        )
        rubrics.append(self._negative(required))
        return rubrics

    def _negative(self, required: list[dict[str, Any]]) -> dict[str, Any]:
        # Prefer a fact whose entity has a look-alike with a different value: confusing the two is
        # the error worth penalising.
        def twin_value(fact: dict[str, Any]) -> str | None:
            twin = self.distractor_of.get(fact["entity"])
            value = None if twin is None else twin.facts().get(fact["attribute"])
            return value if value != fact["value"] else None

        with_twin = [f for f in required if twin_value(f) is not None]
        fact = with_twin[0] if with_twin else required[0]
        entity, attribute, value = fact["entity"], fact["attribute"], fact["value"]
        label = _ATTRIBUTE_PHRASES[attribute][1]
        twin = twin_value(fact)  # not None when with_twin (fact is its first)
        confusable = None if twin is None else {"entity": self.distractor_of[entity].name, "value": twin}
        if confusable is not None:
            title = f"Confuses {entity} with {confusable['entity']}"
            description = (
                f"States {label} for {entity} other than {_display(attribute, value)}, e.g. "
                f"{_display(attribute, confusable['value'])}, which belongs to {confusable['entity']}."
            )
        else:
            title = f"States {label} for {entity} other than {_display(attribute, value)}"
            description = f"{title}; the corpus gives {_display(attribute, value)}."
        return {
            "title": title,
            "description": description,
            "weight": 2.0,
            "polarity": "negative",
            "stage": "answer",
            "check": {
                "type": "wrong_value",
                "entity": entity,
                "attribute": attribute,
                "value": value,
                "confusable": confusable,
            },
        }

    def _distinct(self, k: int, attribute: str) -> list[Organization] | None:
        if len(self.real_orgs) < k:
            return None
        for _ in range(50):
            picks = self.rng.sample(self.real_orgs, k)
            if len({getattr(o, attribute) for o in picks}) == k:
                return picks
        return None

    def build(self, kind: str) -> tuple[str, str, dict[str, Any], list[dict[str, Any]], list[dict[str, Any]]] | None:
        """One query of `kind`: (question, reference answer, spec, required facts, rubrics)."""
        return getattr(self, f"_{kind}")()

    def _comparison(self):
        attribute = self.rng.choice(["founded", "employees"])
        picks = self._distinct(2, attribute)
        if picks is None:
            return None
        a, b = picks
        if attribute == "founded":
            question, op = f"Which was founded earlier, {a.name} or {b.name}?", "earlier"
            winner = a if a.founded < b.founded else b
            final_text = f"Concludes that {winner.name} was founded earlier"
        else:
            question, op = f"Which has more employees, {a.name} or {b.name}?", "more"
            winner = a if a.employees > b.employees else b
            final_text = f"Concludes that {winner.name} has more employees"
        required = [self._required(o.name, attribute, str(getattr(o, attribute))) for o in (a, b)]
        spec = {"kind": "comparison", "attribute": attribute, "subjects": [a.name, b.name], "op": op}
        return (
            question,
            winner.name,
            spec,
            required,
            self._rubrics(required, final_text, {"type": "final", "value": winner.name}),
        )

    def _multi_hop(self):
        attribute = self.rng.choice(["headquarters", "founded", "sector"])
        start: Organization | Person
        if self.acquired and self.rng.random() < 0.3:
            acquired = self.rng.choice(self.acquired)
            assert acquired.acquired_by is not None  # self.acquired holds the acquired organizations only
            start, target = acquired, self.org_by_name[acquired.acquired_by]
            relation, phrase = "acquired_by", f"the organization that acquired {start.name}"
        else:
            target = self.rng.choice(self.real_orgs)
            start = self.person_by_name[target.founder]
            relation, phrase = "founder_of", f"the organization founded by {start.name}"
        value = str(getattr(target, attribute))
        question = {
            "headquarters": f"In which city is the headquarters of {phrase}?",
            "founded": f"What is the founding year of {phrase}?",
            "sector": f"In which sector does {phrase} operate?",
        }[attribute]
        required = [self._required(start.name, relation, target.name), self._required(target.name, attribute, value)]
        spec = {
            "kind": "multi_hop",
            "attribute": attribute,
            "subjects": [start.name],
            "op": "lookup",
            "hops": [{"entity": start.name, "relation": relation}, {"relation": attribute}],
        }
        final_text = f"Answers {value} ({target.name})"
        return question, value, spec, required, self._rubrics(required, final_text, {"type": "final", "value": value})

    def _aggregation(self):
        k = self.rng.choice([2, 3, 3, 4])
        if len(self.real_orgs) < k:
            return None
        picks = self.rng.sample(self.real_orgs, k)
        names = [o.name for o in picks]
        listed = ", ".join(names[:-1]) + f" and {names[-1]}"
        question = f"What is the combined number of employees of {listed}?"
        total = str(sum(o.employees for o in picks))
        required = [self._required(o.name, "employees", str(o.employees)) for o in picks]
        spec = {"kind": "aggregation", "attribute": "employees", "subjects": names, "op": "sum"}
        final_text = f"Gives the combined total of {int(total):,} employees"
        return question, total, spec, required, self._rubrics(required, final_text, {"type": "final", "value": total})

    def _timeline(self):
        k = self.rng.choice([3, 4, 4])
        picks = self._distinct(k, "founded")
        if picks is None:
            return None
        names = [o.name for o in picks]
        question = f"Order these organizations by founding year: {', '.join(names)}."
        order = [o.name for o in sorted(picks, key=lambda o: o.founded)]
        answer = ", ".join(order)
        required = [self._required(o.name, "founded", str(o.founded)) for o in picks]
        spec = {"kind": "timeline", "attribute": "founded", "subjects": names, "op": "sort"}
        final_text = f"Orders them earliest first: {answer}"
        check = {"type": "final", "value": answer, "order": order}
        return question, answer, spec, required, self._rubrics(required, final_text, check)


# ---- assembly ----------------------------------------------------------------------------------


def generate_world(cfg: WorldConfig) -> World:
    """Generate entities, corpus and queries. O(n_documents + n_queries); deterministic per config."""
    entity_rng = random.Random(f"rubricem-world-{cfg.seed}-entities")
    render_rng = random.Random(f"rubricem-world-{cfg.seed}-render")
    query_rng = random.Random(f"rubricem-world-{cfg.seed}-queries")
    orgs, persons, cities = _make_entities(cfg, entity_rng)
    _, _, _, n_near_dups = _plan_sizes(cfg)

    # (title, text, facts) before ids are assigned; ids follow a shuffled order so that passage
    # kinds are interleaved in the corpus rather than grouped.
    drafts: list[tuple[str, str, list[Fact]]] = []
    duplicable: list[tuple[str, dict[str, str], dict[str, list[list[str]]], list[str], dict[str, int]]] = []
    for entities, groups, filler in (
        (orgs, ORG_GROUPS, FILLER["org"]),
        (persons, PERSON_GROUPS, FILLER["person"]),
        (cities, CITY_GROUPS, FILLER["city"]),
    ):
        for entity in entities:
            values = entity.facts()
            text, chosen = _render(entity.name, values, groups, filler, render_rng)
            facts = [Fact(entity.name, k, v) for k, v in values.items()]
            drafts.append((entity.name, text, facts))
            if groups is not CITY_GROUPS:
                duplicable.append((entity.name, values, groups, filler, chosen))
    for name, values, groups, filler, chosen in render_rng.sample(duplicable, min(n_near_dups, len(duplicable))):
        text, _ = _render(name, values, groups, filler, render_rng, avoid=chosen)
        drafts.append((name, text, [Fact(name, k, v) for k, v in values.items()]))
    render_rng.shuffle(drafts)

    width = max(6, len(str(len(drafts) - 1)))
    documents: list[Document] = []
    doc_facts: dict[str, list[Fact]] = {}
    fact_doc_ids: dict[Fact, list[str]] = {}
    for index, (title, text, facts) in enumerate(drafts):
        doc_id = f"D{index:0{width}d}"
        documents.append(Document(doc_id, title, text))
        doc_facts[doc_id] = facts
        for fact in facts:
            fact_doc_ids.setdefault(fact, []).append(doc_id)
    all_facts = [Fact(e.name, k, v) for group in (orgs, persons, cities) for e in group for k, v in e.facts().items()]

    queries = _make_queries(cfg, orgs, persons, fact_doc_ids, query_rng)
    return World(cfg, documents, queries, orgs, persons, cities, all_facts, fact_doc_ids, doc_facts)


def _make_queries(
    cfg: WorldConfig,
    orgs: list[Organization],
    persons: list[Person],
    fact_doc_ids: dict[Fact, list[str]],
    rng: random.Random,
) -> list[Query]:
    builder = _QueryBuilder(orgs, persons, fact_doc_ids, rng)
    built: list[tuple[str, str, str, dict[str, Any], list[dict[str, Any]], list[dict[str, Any]]]] = []
    seen_questions: set[str] = set()
    attempts = 0
    # Small worlds run out of distinct questions; stop after a bounded number of misses.
    while len(built) < cfg.n_queries and attempts < 20 * cfg.n_queries + 100:
        kind = cfg.query_kinds[attempts % len(cfg.query_kinds)]
        attempts += 1
        result = builder.build(kind)
        if result is None or result[0] in seen_questions:
            continue
        seen_questions.add(result[0])
        built.append((kind, *result))

    n_eval = round(cfg.eval_fraction * len(built))
    if cfg.eval_fraction > 0 and n_eval == 0 and len(built) > 1:
        n_eval = 1
    eval_indices = set(rng.sample(range(len(built)), n_eval))
    rest = [i for i in range(len(built)) if i not in eval_indices]
    n_sft = min(round(cfg.sft_fraction * len(rest)), len(rest) - 1) if rest else 0
    sft_indices = set(rng.sample(rest, n_sft)) if n_sft > 0 else set()  # no draw at 0: worlds stay as they were
    queries = []
    for index, (kind, question, answer, spec, required, rubrics) in enumerate(built):  # type: ignore[assignment]
        gold = sorted({doc_id for fact in required for doc_id in fact["doc_ids"]})
        queries.append(
            Query(
                query_id=f"syn-{index:05d}",
                source="synthetic",
                split="eval" if index in eval_indices else "sft" if index in sft_indices else "train",
                kind=kind,
                question=question,
                messages=[{"role": "user", "content": question}],
                rubrics=rubrics,
                reference_answer=answer,
                spec=spec,
                metadata={"required_facts": required, "gold_doc_ids": gold, "world_seed": cfg.seed},
            )
        )
    return queries


def world_summary(world: World) -> dict[str, Any]:
    """Counts for logging and MLflow params."""
    kinds: dict[str, int] = {}
    for q in world.queries:
        kinds[q.kind] = kinds.get(q.kind, 0) + 1
    return {
        "documents": len(world.documents),
        "organizations": len(world.organizations),
        "distractor_organizations": sum(o.is_distractor for o in world.organizations),
        "persons": len(world.persons),
        "cities": len(world.cities),
        "facts": len(world.facts),
        "queries": len(world.queries),
        "eval_queries": sum(q.split == "eval" for q in world.queries),
        "query_kinds": json.dumps(kinds, sort_keys=True),
    }
