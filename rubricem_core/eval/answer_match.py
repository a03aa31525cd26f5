"""Answer match: a held-out grader of the synthetic world that shares no code with the training judge.

The built-in grader (``sim/world_grader.py``) scores with the training judge's own rubric checks, so a
policy that learned to game the judge would carry the trick into its evaluation. This grader reads only
the query's gold (``reference_answer``, ``spec`` and ``metadata.required_facts``, written by the world
generator) and the ``<answer>`` text, and matches them with plain string code of its own:

- the text is lower-cased, tags and ``[D…]`` ids dropped, thousands separators removed, punctuation turned
  into spaces, and split into words; a name or value *matches* when its words occur in that order;
- a **fact** is stated when one sentence of the answer matches both its entity and its value;
- the **final answer** is read from the answer's last sentence (where the scaffold puts the conclusion):
  a comparison names the winner and not the other side, a lookup or a sum states the value, an ordering
  names every organization in the gold order.

score = ½ · final correct + ½ · share of the gold facts stated; an empty answer scores 0.
"""

from __future__ import annotations

import re
import string
from typing import Any

_TAG = re.compile(r"<[^>]*>")
_ID = re.compile(r"\[\s*D\d+\s*\]")
_THOUSANDS = re.compile(r"(?<=\d),(?=\d{3}\b)")
_PUNCT = str.maketrans({c: " " for c in string.punctuation})
_SENTENCE = re.compile(r"(?<=[.!?])\s+|\n+")


def words(text: str) -> list[str]:
    """Lower-case words without tags, ids, thousands separators or punctuation."""
    text = _THOUSANDS.sub("", _ID.sub(" ", _TAG.sub(" ", text)))
    return text.lower().translate(_PUNCT).split()


def find(haystack: list[str], phrase: str) -> int | None:
    """Index of the first occurrence of ``phrase``'s words in ``haystack`` (None: absent)."""
    needle = words(phrase)
    if not needle:
        return None
    for i in range(len(haystack) - len(needle) + 1):
        if haystack[i : i + len(needle)] == needle:
            return i
    return None


def sentences(answer: str) -> list[list[str]]:
    """The answer's sentences as word lists (a cited claim keeps its words; empty sentences dropped)."""
    plain = _TAG.sub(" ", answer)
    return [ws for ws in (words(s) for s in _SENTENCE.split(plain)) if ws]


def fact_stated(answer_sentences: list[list[str]], fact: dict[str, Any]) -> bool:
    return any(
        find(ws, str(fact["entity"])) is not None and find(ws, str(fact["value"])) is not None
        for ws in answer_sentences
    )


def final_correct(last: list[str], spec: dict[str, Any], reference: str) -> bool:
    """Whether the concluding sentence gives the gold final answer of the query's kind."""
    kind = spec.get("kind")
    if kind == "comparison":
        losers = [s for s in spec.get("subjects", []) if s != reference]
        return find(last, reference) is not None and all(find(last, s) is None for s in losers)
    if kind == "timeline":
        order = [name.strip() for name in reference.split(",")]
        positions = [find(last, name) for name in order]
        return all(p is not None for p in positions) and positions == sorted(positions)  # type: ignore[type-var]
    return find(last, reference) is not None  # multi_hop (a city, year or sector), aggregation (a total)


def match_answer(answer: str, reference: str, spec: dict[str, Any], facts: list[dict[str, Any]]) -> dict[str, Any]:
    """The answer-match grade of one answer: score, final correct, facts stated of facts required."""
    parts = sentences(answer or "")
    if not parts:
        return {"score": 0.0, "final_correct": False, "facts_stated": 0, "facts_required": len(facts)}
    stated = sum(fact_stated(parts, fact) for fact in facts)
    final = final_correct(parts[-1], spec, reference)
    share = stated / len(facts) if facts else float(final)
    return {
        "score": 0.5 * float(final) + 0.5 * share,
        "final_correct": final,
        "facts_stated": stated,
        "facts_required": len(facts),
    }


def match_query(query: Any, answer: str) -> dict[str, Any]:
    """``match_answer`` with a synthetic query's gold (a ``schemas.Query``)."""
    facts = list((query.metadata or {}).get("required_facts") or [])
    return match_answer(answer, str(query.reference_answer or ""), dict(query.spec or {}), facts)
