"""Rejection filtering of teacher traces: keep only valid, grounded ones for SFT.

A trace is rejected with coded reasons (a list, so SQL can ``unnest`` them): every scaffold
violation code from ``rubricem_core.scaffold.validate``, plus the codes below.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from rubricem_core.scaffold import extract_citations, validate

UNGROUNDED_CITATION = "ungrounded_citation"
TOO_FEW_TOOL_CALLS = "too_few_tool_calls"
NOT_FINISHED = "not_finished"
TEACHER_FAILED = "teacher_failed"

FILTER_CODES = {
    UNGROUNDED_CITATION: "a cited claim states a value (number or name) its cited snippet does not contain",
    TOO_FEW_TOOL_CALLS: "fewer tool calls than filter.min_tool_calls",
    NOT_FINISHED: "the trace hit the round or tool budget, or was truncated, before </answer>",
    TEACHER_FAILED: "a teacher request failed after all retries",
}

_SNIPPET = re.compile(r'<snippet id="([^"]+)">(.*?)</snippet>', re.S)
_TOOL_OUTPUT = re.compile(r"<tool_output>(.*?)</tool_output>", re.S)
_NUMBER = re.compile(r"\b\d[\d,]*(?:\.\d+)?\b")
_NAME = re.compile(r"\b[A-Z][a-z]+(?:\s+[A-Z][a-z]+)+\b")  # multi-word proper names
_WORD = re.compile(r"[a-z0-9]+")
_STOP = frozenset("the a an of and or in on at to for by with was is are were from that this as it its".split())


@dataclass
class FilterDecision:
    accepted: bool
    reject_reasons: list[str] = field(default_factory=list)
    details: list[str] = field(default_factory=list)


def snippet_texts(text: str) -> dict[str, str]:
    """doc id → all text the environment showed for it (search snippets and browsed pages)."""
    seen: dict[str, list[str]] = {}
    for block in _TOOL_OUTPUT.findall(text):
        for doc_id, body in _SNIPPET.findall(block):
            seen.setdefault(doc_id, []).append(body)
    return {k: "\n".join(v) for k, v in seen.items()}


def claim_supported(claim: str, evidence: str) -> bool:
    """Checkable values in the claim (numbers, multi-word names) must appear in the evidence.

    A claim with no such values needs half of its content words in the evidence. This is a
    conservative lexical test: it cannot prove support, but it catches invented numbers and names.
    """
    norm_evidence = evidence.replace(",", "")
    numbers = [n.replace(",", "") for n in _NUMBER.findall(claim)]
    names = _NAME.findall(claim)
    if numbers or names:
        return all(n in norm_evidence for n in numbers) and all(n in evidence for n in names)
    words = [w for w in _WORD.findall(claim.lower()) if w not in _STOP]
    if not words:
        return True
    ev = set(_WORD.findall(evidence.lower()))
    return sum(w in ev for w in words) / len(words) >= 0.5


def grounding_failures(text: str) -> list[str]:
    evidence = snippet_texts(text)
    failures = []
    for cite in extract_citations(text):
        if cite.doc_id in evidence and not claim_supported(cite.claim, evidence[cite.doc_id]):
            failures.append(f"{cite.doc_id}: {cite.claim[:120]}")
    return failures


def filter_trace(
    text: str,
    n_tool_calls: int,
    finish_reason: str | None,
    min_tool_calls: int = 1,
    require_grounding: bool = True,
    allowed_violations: list[str] | tuple[str, ...] = (),
    max_tool_calls: int | None = None,
    trace_format: str = "scaffold",
) -> FilterDecision:
    reasons: list[str] = []
    details: list[str] = []
    if finish_reason == "error":
        reasons.append(TEACHER_FAILED)
    elif finish_reason != "answered":
        reasons.append(NOT_FINISHED)
        details.append(f"finish_reason={finish_reason}")
    for v in validate(text, max_tool_calls=max_tool_calls, trace_format=trace_format):
        if v.code not in allowed_violations and v.code not in reasons:
            reasons.append(v.code)
            details.append(f"{v.code}: {v.message}")
    if n_tool_calls < min_tool_calls:
        reasons.append(TOO_FEW_TOOL_CALLS)
    if require_grounding:
        bad = grounding_failures(text)
        if bad:
            reasons.append(UNGROUNDED_CITATION)
            details.extend(f"{UNGROUNDED_CITATION}: {b}" for b in bad)
    return FilterDecision(accepted=not reasons, reject_reasons=reasons, details=details)
