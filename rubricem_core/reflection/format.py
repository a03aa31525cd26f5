"""The reflection the policy writes about one of its own rollouts: prompt, output format, checks.

The shared backbone sees only the question and the raw trajectory (its own text plus the tool
outputs it got) — never rubrics, scores or justifications: those are privileged inputs of the
reflection judge. It answers in one fixed format::

    <reflection>
    <reflection_rubrics>
    - criteria a strong report on this question meets, one per line
    </reflection_rubrics>
    <takeaways>
    - concrete lessons for the next attempt, one per line
    </takeaways>
    </reflection>

Generation stops at ``</reflection>`` (``REFLECTION_STOP``); engines that strip the stop string
give text without it, so the parser accepts a missing final ``</reflection>``.
The accepted reflection is injected into later prompts through ``guidance_text`` →
``scaffold.system_prompt(guidance=...)``.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from rubricem_core.scaffold import TAG_NAMES, CodeTable, neutralize_tags

REFLECTION_STOP = "</reflection>"
# The tags of the fixed format, in the order a valid reflection writes them.
FORMAT_TAGS = (
    "<reflection>",
    "<reflection_rubrics>",
    "</reflection_rubrics>",
    "<takeaways>",
    "</takeaways>",
    REFLECTION_STOP,
)
_FORMAT_TAG = re.compile("|".join(re.escape(tag) for tag in sorted(FORMAT_TAGS, key=len, reverse=True)))
DEFAULT_MAX_TRAJECTORY_CHARS = 24_000
MAX_REFLECTION_CHARS = 3_000  # longer guidance crowds the prompt and is rarely read
MAX_ITEMS = 8  # per list
MAX_ITEM_CHARS = 400
COPY_MIN_WORDS = 12  # a run of this many words shared with the trajectory is a verbatim copy

# Validation codes (reflections.valid is False when any is present), declared like the scaffold's.
REFLECTION_CODES = CodeTable()
_code = REFLECTION_CODES.code

MISSING_REFLECTION = _code("missing_reflection", "no <reflection> element")
MISSING_RUBRICS = _code("missing_rubrics", "no <reflection_rubrics> element inside the reflection")
MISSING_TAKEAWAYS = _code("missing_takeaways", "no <takeaways> element inside the reflection")
REPEATED_TAG = _code("repeated_tag", "a reflection tag opens more than once")
TEXT_OUTSIDE_TAGS = _code(
    "text_outside_tags", "text before <reflection>, after </reflection>, or between the two lists"
)
EMPTY_RUBRICS = _code("empty_rubrics", "the rubric list has no items")
EMPTY_TAKEAWAYS = _code("empty_takeaways", "the takeaway list has no items")
TOO_LONG = _code("too_long", f"over {MAX_REFLECTION_CHARS} characters, or an item over {MAX_ITEM_CHARS}")
TOO_MANY_ITEMS = _code("too_many_items", f"a list has more than {MAX_ITEMS} items")
COPIES_TRAJECTORY = _code(
    "copies_trajectory", f"repeats {COPY_MIN_WORDS}+ consecutive words of the trajectory verbatim"
)
SCAFFOLD_TAGS = _code("scaffold_tags", "contains scaffold tags (<answer>, <cite>, <call_tool>, ...)")
MENTIONS_SCORES = _code("mentions_scores", "talks about scores, rewards or grading, which the policy never saw")

# The paper's format check: a reflection element holding two non-empty lists and nothing else. The other
# codes are this project's stricter checks (``validity="strict"``).
STRUCTURAL_CODES = frozenset(
    {
        MISSING_REFLECTION,
        MISSING_RUBRICS,
        MISSING_TAKEAWAYS,
        REPEATED_TAG,
        TEXT_OUTSIDE_TAGS,
        EMPTY_RUBRICS,
        EMPTY_TAKEAWAYS,
    }
)
VALIDITY_MODES = ("strict", "structural")

REFLECTION_SYSTEM = f"""You review one of your own earlier research attempts so that the next attempt at this question, or at a similar one, goes better. You see the question and the attempt exactly as it happened: your plan, your tool calls, the tool outputs you got, your review and your final answer. Nobody tells you how good it was; judge that yourself from the evidence.

Write two lists:
1. reflection_rubrics: the criteria a strong report on this question must meet — the specific facts, entities, comparisons and sources it needs, and the specific mistakes it must avoid (look-alike names, wrong values, unsupported claims).
2. takeaways: concrete, actionable lessons for the next attempt — what to search for and how, which documents to browse, what to verify before answering, what went wrong here and how to avoid it.

Rules: be specific to this question (name entities, attributes, search queries); no generic advice such as "be thorough"; at most {MAX_ITEMS} items per list, one per line starting with "- "; do not copy passages of the attempt; do not write any research tags (no <answer>, <cite>, <call_tool>); under {MAX_REFLECTION_CHARS} characters in all.

Reply in exactly this format and nothing else:
<reflection>
<reflection_rubrics>
- ...
</reflection_rubrics>
<takeaways>
- ...
</takeaways>
</reflection>"""


@dataclass(frozen=True)
class Reflection:
    rubrics: tuple[str, ...]
    takeaways: tuple[str, ...]

    def render(self) -> str:
        """The canonical text of the reflection (what the bank stores)."""
        rubrics = "\n".join(f"- {item}" for item in self.rubrics)
        takeaways = "\n".join(f"- {item}" for item in self.takeaways)
        return (
            f"<reflection>\n<reflection_rubrics>\n{rubrics}\n</reflection_rubrics>\n"
            f"<takeaways>\n{takeaways}\n</takeaways>\n</reflection>"
        )

    @property
    def items(self) -> tuple[str, ...]:
        return self.rubrics + self.takeaways


def _omission_marker(omitted: int, unit: str) -> str:
    """The line that stands where the middle of the attempt was cut (``unit``: characters or tokens)."""
    return f"\n[... {omitted} {unit} of the attempt omitted here ...]\n"


def clip_middle(text: str, max_chars: int | None) -> tuple[str, int]:
    """``text`` cut to about ``max_chars`` by dropping its middle (plan and answer are kept), and how
    many characters were dropped."""
    if max_chars is None or len(text) <= max_chars:
        return text, 0
    if max_chars < 2:
        raise ValueError(f"max_chars must be >= 2 to keep a head and a tail, got {max_chars}")
    omitted = len(text) - max_chars
    head = max_chars // 2
    tail = max_chars - head
    return f"{text[:head]}{_omission_marker(omitted, 'characters')}{text[-tail:]}", omitted


def token_ids(tokenizer: Any, text: str) -> list[int]:
    """The ids of ``text`` alone under ``tokenizer`` (no special tokens added): what a token bound counts."""
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def _decode(tokenizer: Any, ids: list[int]) -> str:
    return str(tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False))


def clip_middle_tokens(text: str, max_tokens: int | None, tokenizer: Any) -> tuple[str, int]:
    """``text`` cut to at most ``max_tokens`` tokens of ``tokenizer`` by dropping its middle, and how many
    of its tokens were dropped.

    The head and tail token halves are decoded back to text; the omission line counts against the bound,
    so the whole result (head, the line, tail) re-encodes to at most ``max_tokens`` tokens.
    """
    if max_tokens is None:
        return text, 0
    ids = token_ids(tokenizer, text)
    if len(ids) <= max_tokens:
        return text, 0
    # the line with the largest count it can state, so a smaller one never takes more tokens
    keep = max_tokens - len(token_ids(tokenizer, _omission_marker(len(ids), "tokens")))
    while keep >= 2:
        head_n = keep // 2
        tail_n = keep - head_n
        omitted = len(ids) - keep
        # a head or tail cut inside a multi-byte character decodes to U+FFFD there: drop it
        head = _decode(tokenizer, ids[:head_n]).rstrip("\ufffd")
        tail = _decode(tokenizer, ids[len(ids) - tail_n :]).lstrip("\ufffd")
        shown = f"{head}{_omission_marker(omitted, 'tokens')}{tail}"
        excess = len(token_ids(tokenizer, shown)) - max_tokens
        if excess <= 0:
            return shown, omitted
        keep -= excess  # re-encoding merged differently at a cut: shrink by what it overran
    raise ValueError(f"max_tokens={max_tokens} leaves no room for a head and a tail beside the omission line")


def _escape_delimiters(text: str) -> str:
    return text.replace("<<<", "<< <")  # the attempt cannot close its own delimiters


def strip_special_tokens(text: str, tokenizer: Any) -> str:
    """``text`` without the texts of ``tokenizer``'s special tokens.

    The attempt is data, but a chat prompt is encoded with special-token parsing on: the end-of-turn
    text that ends every rollout which stopped on eos (``rollouts.text`` keeps it) would become the real
    end-of-turn token, closing the user's turn in the middle of the reflection prompt — a prompt the
    policy never saw in SFT (teacher attempts contain no special tokens).
    """
    specials = {t for t in getattr(tokenizer, "all_special_tokens", ()) or () if t}
    for special in sorted(specials, key=len, reverse=True):
        text = text.replace(special, "")
    return text


def reflection_messages(
    question: str,
    trajectory_text: str,
    max_chars: int | None = DEFAULT_MAX_TRAJECTORY_CHARS,
    *,
    max_tokens: int | None = None,
    tokenizer: Any = None,
) -> list[dict[str, str]]:
    """Chat messages asking the policy for a reflection on ``trajectory_text``.

    The attempt is shown whole or middle-cut: to ``max_tokens`` tokens of ``tokenizer`` (the policy's)
    when ``max_tokens`` is set (``max_chars`` is then ignored), else to ``max_chars`` characters.
    With ``tokenizer`` the texts of its special tokens are removed from the attempt (``strip_special_tokens``).
    Deliberately takes no rubrics or scores: the policy must not see privileged judge inputs.
    """
    if not isinstance(question, str) or not question.strip():
        raise ValueError("reflection_messages: question must be a non-empty string")
    if not isinstance(trajectory_text, str) or not trajectory_text.strip():
        raise ValueError("reflection_messages: trajectory_text must be a non-empty string")
    text = trajectory_text.strip()
    if tokenizer is not None:
        text = strip_special_tokens(text, tokenizer).strip()
    if max_tokens is not None:
        if tokenizer is None:
            raise ValueError("reflection_messages: max_tokens needs the policy's tokenizer")
        text = _escape_delimiters(text)  # before the cut, so the bound holds for what is shown
        total, unit = len(token_ids(tokenizer, text)), "tokens"
        shown, omitted = clip_middle_tokens(text, max_tokens, tokenizer)
    else:
        total, unit = len(text), "characters"
        shown, omitted = clip_middle(text, max_chars)
        shown = _escape_delimiters(shown)
    note = (
        f"\n(The attempt is {total} {unit} long; {omitted} {unit} from its middle are omitted below.)"
        if omitted
        else ""
    )
    user = (
        f"Question:\n{question.strip()}\n\nYour earlier attempt:{note}\n"
        f"<<<ATTEMPT>>>\n{shown}\n<<<END OF ATTEMPT>>>\n\n"
        "Write your reflection now, in the required format."
    )
    return [{"role": "system", "content": REFLECTION_SYSTEM}, {"role": "user", "content": user}]


# ---- parsing and validation ----------------------------------------------------------------------

_OPEN = {name: re.compile(rf"<\s*{name}\s*>", re.I) for name in ("reflection", "reflection_rubrics", "takeaways")}
_CLOSE = {name: re.compile(rf"<\s*/\s*{name}\s*>", re.I) for name in ("reflection", "reflection_rubrics", "takeaways")}
_BULLET = re.compile(r"^\s*(?:[-*\u2022]|\d+[.)])\s*")
_SCAFFOLD_TAG = re.compile(rf"<\s*/?\s*(?:{'|'.join(sorted(TAG_NAMES, key=len, reverse=True))})\b", re.I)
_SCORE_TALK = re.compile(
    r"\b(?:scor(?:e|es|ed|ing)|rewards?|rewarded|grad(?:er|ers|ed|ing)|judged|judge's|the judge)\b"
    r"|\b[0-2]\s*/\s*2\b",
    re.I,
)
_WORD = re.compile(r"\w+")


@dataclass(frozen=True)
class _Span:
    inner_start: int
    inner_end: int
    outer_start: int
    outer_end: int


def _element(
    text: str, name: str, start: int = 0, end: int | None = None, open_ended: bool = False
) -> tuple[_Span | None, int]:
    """The first ``<name>…</name>`` in text[start:end], and how many times ``<name>`` opens there."""
    end = len(text) if end is None else end
    opens = list(_OPEN[name].finditer(text, start, end))
    if not opens:
        return None, 0
    first = opens[0]
    close = _CLOSE[name].search(text, first.end(), end)
    if close is None:
        if not open_ended:
            return None, len(opens)
        return _Span(first.end(), end, first.start(), end), len(opens)
    return _Span(first.end(), close.start(), first.start(), close.end()), len(opens)


def _items(body: str) -> tuple[str, ...]:
    items = []
    for line in body.splitlines():
        item = _BULLET.sub("", line, count=1).strip()
        if item:
            items.append(item)
    return tuple(items)


def _structure(text: str) -> tuple[Reflection | None, list[str]]:
    codes: list[str] = []
    # The closing tag may be missing when the engine strips the stop string.
    outer, n_outer = _element(text, "reflection", open_ended=True)
    if outer is None:
        return None, [MISSING_REFLECTION]
    if n_outer > 1:
        codes.append(REPEATED_TAG)
    if text[: outer.outer_start].strip() or text[outer.outer_end :].strip():
        codes.append(TEXT_OUTSIDE_TAGS)
    rubrics, n_rubrics = _element(text, "reflection_rubrics", outer.inner_start, outer.inner_end)
    takeaways, n_takeaways = _element(text, "takeaways", outer.inner_start, outer.inner_end)
    if rubrics is None:
        codes.append(MISSING_RUBRICS)
    if takeaways is None:
        codes.append(MISSING_TAKEAWAYS)
    if (n_rubrics > 1 or n_takeaways > 1) and REPEATED_TAG not in codes:
        codes.append(REPEATED_TAG)
    if rubrics is None or takeaways is None:
        return None, codes
    # Everything inside <reflection> must belong to one of the two lists.
    leftover = text[outer.inner_start : outer.inner_end]
    for span in sorted((rubrics, takeaways), key=lambda s: s.outer_start, reverse=True):
        a, b = span.outer_start - outer.inner_start, span.outer_end - outer.inner_start
        leftover = leftover[:a] + leftover[b:]
    if leftover.strip() and TEXT_OUTSIDE_TAGS not in codes:
        codes.append(TEXT_OUTSIDE_TAGS)
    reflection = Reflection(
        _items(text[rubrics.inner_start : rubrics.inner_end]), _items(text[takeaways.inner_start : takeaways.inner_end])
    )
    return reflection, codes


def parse_reflection(text: str | None) -> Reflection | None:
    """The two lists of a reflection, or None when its tags are missing (lists may be empty)."""
    if not isinstance(text, str):
        return None
    reflection, _ = _structure(text)
    return reflection


def _word_ngrams(words: list[str], n: int) -> set[tuple[str, ...]]:
    return {tuple(words[i : i + n]) for i in range(len(words) - n + 1)}


def copies_text(candidate: str, source: str, min_words: int = COPY_MIN_WORDS, allowed: str | None = None) -> bool:
    """True when ``candidate`` repeats ``min_words`` consecutive words of ``source`` (case-insensitive)
    that are not also words of ``allowed`` (the question: restating it, as a first search often does
    verbatim, is not copying the attempt)."""
    words = [w.lower() for w in _WORD.findall(candidate)]
    if len(words) < min_words:
        return False
    source_grams = _word_ngrams([w.lower() for w in _WORD.findall(source)], min_words)
    if allowed:
        source_grams -= _word_ngrams([w.lower() for w in _WORD.findall(allowed)], min_words)
    return any(gram in source_grams for gram in _word_ngrams(words, min_words))


def _mentions_scores(text: str, question: str | None) -> bool:
    allowed = question.lower() if question else ""
    # a question about a match score may name the word; only talk the question itself does not use counts
    return any(match.group(0).lower() not in allowed for match in _SCORE_TALK.finditer(text))


def validate_reflection(
    text: str,
    trajectory_text: str | None = None,
    question: str | None = None,
    max_chars: int = MAX_REFLECTION_CHARS,
    validity: str = "strict",
) -> list[str]:
    """Codes (``REFLECTION_CODES``) of everything wrong with a generated reflection; [] = valid.

    ``validity="structural"`` keeps only the paper's format check (``STRUCTURAL_CODES``); ``"strict"``
    adds length, item count, scaffold tags, talk of scores and, given ``trajectory_text``, verbatim copying
    (words of ``question`` never count as talk about scores or as copying).
    """
    if validity not in VALIDITY_MODES:
        raise ValueError(f"reflection validity must be one of {VALIDITY_MODES}, got {validity!r}")
    if not isinstance(text, str):
        return [MISSING_REFLECTION]
    codes = _strict_codes(text, trajectory_text, question, max_chars)
    return codes if validity == "strict" else [code for code in codes if code in STRUCTURAL_CODES]


def _strict_codes(text: str, trajectory_text: str | None, question: str | None, max_chars: int) -> list[str]:
    reflection, codes = _structure(text)
    if reflection is not None:
        if not reflection.rubrics:
            codes.append(EMPTY_RUBRICS)
        if not reflection.takeaways:
            codes.append(EMPTY_TAKEAWAYS)
        if len(reflection.rubrics) > MAX_ITEMS or len(reflection.takeaways) > MAX_ITEMS:
            codes.append(TOO_MANY_ITEMS)
    too_long_item = reflection is not None and any(len(item) > MAX_ITEM_CHARS for item in reflection.items)
    if len(text.strip()) > max_chars or too_long_item:
        codes.append(TOO_LONG)
    if _SCAFFOLD_TAG.search(text):
        codes.append(SCAFFOLD_TAGS)
    if _mentions_scores(text, question):
        codes.append(MENTIONS_SCORES)
    if trajectory_text and copies_text(text, trajectory_text, allowed=question):
        codes.append(COPIES_TRAJECTORY)
    return codes


def guidance_text(reflection: Reflection, source_question: str | None = None) -> str:
    """The text injected into the prompt's guidance block (``scaffold.system_prompt(guidance=...)``).

    ``source_question`` names the question the reflection was written for, when it is another
    one (cross-episode retrieval). Scaffold tags are escaped: guidance must never open an element.
    """
    if not reflection.rubrics and not reflection.takeaways:
        raise ValueError("guidance_text: the reflection has no items")
    lines = []
    if source_question:
        lines.append(
            f'These notes come from an earlier attempt at a similar question: "{" ".join(source_question.split())}"'
        )
    if reflection.rubrics:
        lines.append("A strong report meets these criteria:")
        lines += [f"- {item}" for item in reflection.rubrics]
    if reflection.takeaways:
        lines.append("Lessons from the earlier attempt:")
        lines += [f"- {item}" for item in reflection.takeaways]
    return neutralize_tags("\n".join(lines))


def format_tag_tokens(token_ids: Sequence[int], decode: Callable[[list[int]], str]) -> list[bool]:
    """For each of ``token_ids`` (what the policy wrote), whether it spells part of a format tag.

    A token covers the characters it adds to the decoded prefix; decoding prefixes, not single
    tokens, keeps multi-byte characters and merged spaces where the tokenizer puts them."""
    ids = list(token_ids)
    spans = [m.span() for m in _FORMAT_TAG.finditer(decode(ids))]
    out: list[bool] = []
    start = 0
    for k in range(len(ids)):
        end = len(decode(ids[: k + 1]))
        lo, hi = min(start, end), max(start, end)
        out.append(hi > lo and any(s < hi and lo < e for s, e in spans))
        start = end
    return out
