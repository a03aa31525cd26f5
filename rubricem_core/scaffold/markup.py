"""Scaffold markup in untrusted or plain text: neutralising injected tags, tool-output blocks, stripping tags.

Inside ``<tool_output>`` only ``</tool_output>`` is a tag: the environment writes that block and
neutralises scaffold tags in document text (:func:`format_tool_output`), so a document cannot
close it early or fake stages.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from rubricem_core.scaffold.records import ScaffoldError
from rubricem_core.scaffold.tags import _NAMES_ALT

# Any scaffold tag in document text, in any letter case and with stray spaces, is neutralised.
_INJECTED_TAG_RE = re.compile(rf"<(\s*/?\s*(?:{_NAMES_ALT})\b[^<>]*)(>?)", re.IGNORECASE)
_SAFE_ID_RE = re.compile(r"^[A-Za-z0-9_.:\-/#]+$")
_ANY_TAG_RE = re.compile(r"</?[a-z_]+(?:\s[^<>]*)?>")  # any tag-like markup, known name or not


def neutralize_tags(text: str) -> str:
    """Escape the angle brackets of scaffold tags so untrusted text cannot open or close elements."""

    def escape(match: re.Match[str]) -> str:
        return "&lt;" + match.group(1) + ("&gt;" if match.group(2) else "")

    return _INJECTED_TAG_RE.sub(escape, text)


def format_tool_output(snippets: Sequence[tuple[str, str]] | None = None, error: str | None = None) -> str:
    """The environment's reply to one tool call: snippets ``(doc_id, text)`` or an error message."""
    if error is not None:
        if snippets:
            raise ScaffoldError("format_tool_output takes snippets or an error, not both")
        return f"<tool_output><error>{neutralize_tags(error)}</error></tool_output>"
    if not snippets:
        return "<tool_output><error>no results</error></tool_output>"
    pieces = []
    for doc_id, text in snippets:
        if not _SAFE_ID_RE.match(doc_id):
            raise ScaffoldError(f"snippet id {doc_id!r} must match {_SAFE_ID_RE.pattern} to be written in a tag")
        pieces.append(f'<snippet id="{doc_id}">{neutralize_tags(text)}</snippet>')
    return "<tool_output>" + "".join(pieces) + "</tool_output>"


def strip_tags(text: str) -> str:
    """``text`` without its tags (any ``<name ...>`` or ``</name>``), their contents kept."""
    return _ANY_TAG_RE.sub("", text)
