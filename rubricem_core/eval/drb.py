"""DeepResearchBench's pipeline before RACE (Ayanami0730/deep_research_bench): each target article is
cleaned by the grader model (citations, reference lists and footnotes removed, nothing else changed), and
both the cleaning and the RACE prompts are in the task's language (its ``language`` field: zh or en).

The release cleans an article in one call and, when the model's context refuses it, in two halves cut at
a sentence end; here an article longer than ``max_chars`` is halved the same way up front (again while a
half is still too long). A cleaned text shorter than 100 characters is refused (the release retries it),
or shorter than half the submitted text when that is under 200 characters (a policy's short answer).
Reference articles come cleaned with the benchmark and are not cleaned again.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any

from rubricem_core.eval.prompts import TASK_LINE, grader_prompt, object_schema, section
from rubricem_core.eval.types import EvalError
from rubricem_core.judge.prompts import escape_section_markers
from rubricem_core.llm.replies import ReplyError, checked_reply
from rubricem_core.schemas import Query

CLEAN_KIND = "article_clean"  # task-line marker (the built-in grader dispatches on it)
LANGUAGES: tuple[str, ...] = ("en", "zh")
MIN_CLEANED_CHARS = 100  # the release's check of a cleaned article
_SENTENCE_END = re.compile(r"[.?!。？！\n]")
_BOUNDARY_WINDOW = 200  # how far back from the middle a cut looks for a sentence end (the release's)


def task_language(query: Query) -> str:
    """The task's language (DeepResearchBench's ``language`` field), English when it has none."""
    language = str(query.metadata.get("language") or "en").lower()
    return language if language in LANGUAGES else "en"


def clean_schema() -> dict[str, Any]:
    return object_schema({"article": {"type": "string", "minLength": 1}})


def clean_messages(article: str, language: str) -> list[dict[str, str]]:
    """The cleaning prompt of one article (or one half of one), in the task's language."""
    if language not in LANGUAGES:
        raise EvalError(f"DeepResearchBench language must be one of {LANGUAGES}, got {language!r}")
    system = grader_prompt(f"drb_clean_{language}").format(schema=json.dumps(clean_schema()))
    parts = [
        f"{TASK_LINE}: remove its citations before scoring ({CLEAN_KIND}).",
        section("BENCHMARK", "deep_research_bench"),
        section("ARTICLE", escape_section_markers(article)),
        section("END", "Return the cleaned article."),
    ]
    return [{"role": "system", "content": system}, {"role": "user", "content": "\n\n".join(parts)}]


def clean_parser(submitted: str) -> Callable[[str | None], str]:
    """The cleaned article from a reply; one shorter than 100 characters (or than half of a shorter
    submitted text) is a failed cleaning, answered by a repair turn."""
    least = min(MIN_CLEANED_CHARS, len(submitted.strip()) // 2)

    def parse(text: str | None) -> str:
        article = checked_reply(text, clean_schema())["article"].strip()
        if len(article) < least:
            raise ReplyError(f"the cleaned article has {len(article)} characters; at least {least} expected")
        return article

    return parse


def split_for_cleaning(article: str, max_chars: int) -> list[str]:
    """The article as pieces of at most ``max_chars`` (where a sentence end allows): halves cut at the last
    sentence end within 200 characters before the middle, halved again while too long."""
    if max_chars < 2 * _BOUNDARY_WINDOW:
        raise EvalError(f"the cleaner's piece size must be at least {2 * _BOUNDARY_WINDOW} characters, got {max_chars}")
    if len(article) <= max_chars:
        return [article]
    middle = len(article) // 2
    ends = [m.end() for m in _SENTENCE_END.finditer(article, middle - _BOUNDARY_WINDOW, middle)]
    cut = ends[-1] if ends else middle
    return split_for_cleaning(article[:cut], max_chars) + split_for_cleaning(article[cut:], max_chars)
