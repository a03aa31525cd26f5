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
import random
from typing import Any

from rubricem_core.config import WorldConfig  # the profile's section; config/ owns every section
from rubricem_core.schemas import Query
from rubricem_core.sim.entities import Document, Organization, Person, World, _make_entities, _plan_sizes, _render
from rubricem_core.sim.facts import (
    _NUMERIC,
    CITY_GROUPS,
    FILLER,
    ORG_GROUPS,
    PERSON_GROUPS,
    Fact,
)

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
