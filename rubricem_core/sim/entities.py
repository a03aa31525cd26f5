"""The world's entities (organizations, people, cities with their attributes), the `World` that holds them and
its documents, and rendering an entity's facts as a document by the sentence templates (sim/facts.py)."""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field

import pyarrow as pa

from rubricem_core.config import WorldConfig  # the profile's section; config/ owns every section
from rubricem_core.schemas import CORPUS_SCHEMA, Query, queries_to_table
from rubricem_core.sim.facts import (
    _NUMERIC,
    _PLACEHOLDER,
    _RESERVED_WORDS,
    Fact,
)


@dataclass(frozen=True)
class Document:
    doc_id: str
    title: str
    text: str


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
