"""Google Search through Gemini's grounding, the paper's search tool (RubricEM searches with
Gemini-flash-grounded Google Search beside Semantic Scholar).

One tool call is one ``generateContent`` request to the Gemini API with the ``google_search`` tool; the
sources are the response's grounding metadata, not the model's prose: each ``groundingChunks[i].web``
(a Google redirect URI and the page's title or host) becomes a snippet whose text is the answer's
sentences that cite chunk i (``groundingSupports``), so every snippet states what Google's pages were used
for and the browse tool can open its URI. The model's own text is never returned as a source.
"""

from __future__ import annotations

import re
from typing import Any

import httpx

from rubricem_core.tools.base import ToolError, ToolResult
from rubricem_core.tools.web import _shorten, _WebSearchTool, url_id

_MAX_RETRY_DELAY_S = 60.0


class GeminiGroundedSearchTool(_WebSearchTool):
    """Web search as Gemini's grounding with Google Search: POST ``/models/<model>:generateContent`` with the
    ``x-goog-api-key`` header and ``tools: [{google_search: {}}]``."""

    KEY_ENV = "GEMINI_API_KEY"
    BASE_URL = "https://generativelanguage.googleapis.com/v1beta"
    NAME = "google_search"
    DESCRIPTION = (
        "Search the web (Google Search through Gemini's grounding); returns the pages' passages with ids such as "
        "W3f2a9c01b7 and their URLs."
    )
    FINGERPRINT = "gemini-grounding/v1"

    def __init__(self, *args: Any, model: str = "gemini-3-flash-preview", **kwargs: Any):
        if not re.fullmatch(r"[A-Za-z0-9._-]+", model):
            raise ToolError(
                f"GeminiGroundedSearchTool: model {model!r} is not a model id such as gemini-3-flash-preview"
            )
        kwargs.setdefault("top_k", 8)
        kwargs.setdefault("timeout_s", 60.0)
        super().__init__(*args, **kwargs)
        self.model = model
        self.fingerprint += f" model={model}"

    def _request_for(self, query: str) -> tuple[str, str, str, dict[str, Any]]:
        body = {"contents": [{"role": "user", "parts": [{"text": query}]}], "tools": [{"google_search": {}}]}
        headers = {"x-goog-api-key": self._key, "Content-Type": "application/json"}
        return "POST", f"/models/{self.model}:generateContent", "google search", {"json": body, "headers": headers}

    def _hits(self, data: dict[str, Any]) -> list[tuple[str, str, str, str]] | ToolResult:
        """One hit per grounding chunk, in order, its text the answer's segments that cite it."""
        candidates = data.get("candidates") or []
        if not isinstance(candidates, list) or not candidates:
            reason = (data.get("promptFeedback") or {}).get("blockReason")
            return self._error(f"google search: no answer ({'blocked: ' + str(reason) if reason else 'no candidates'})")
        found = candidates[0].get("groundingMetadata") if isinstance(candidates[0], dict) else None
        metadata: dict[str, Any] = found if isinstance(found, dict) else {}
        chunks = metadata.get("groundingChunks") or []
        cited: dict[int, list[str]] = {}
        for support in metadata.get("groundingSupports") or []:
            if not isinstance(support, dict):
                continue
            text = str((support.get("segment") or {}).get("text") or "").strip()
            for index in support.get("groundingChunkIndices") or []:
                if isinstance(index, int) and text and text not in cited.setdefault(index, []):
                    cited[index].append(text)
        hits = []
        for i, chunk in enumerate(chunks if isinstance(chunks, list) else []):
            web = chunk.get("web") if isinstance(chunk, dict) else None
            uri = web.get("uri") if isinstance(web, dict) else None
            if not isinstance(web, dict) or not isinstance(uri, str) or not uri.startswith(("http://", "https://")):
                continue  # a chunk without a web page (e.g. a retrieved context) cannot be browsed
            title = _shorten(str(web.get("title") or ""), 200)
            text = _shorten(" ".join(cited.get(i, [])), self.snippet_chars) or "(cited by no sentence)"
            hits.append((url_id(uri), title, text, uri))
        return hits

    def _retry_delay(self, response: httpx.Response, attempt: int) -> float:
        """Google puts the wait in the error body (``google.rpc.RetryInfo``'s ``retryDelay``, e.g. "7s")."""
        delay = super()._retry_delay(response, attempt)
        try:
            details = response.json().get("error", {}).get("details", [])
        except (ValueError, AttributeError):
            return delay
        for detail in details if isinstance(details, list) else []:
            match = re.fullmatch(r"(\d+(?:\.\d+)?)s", str((detail or {}).get("retryDelay", "")))
            if match:
                return max(delay, min(float(match.group(1)), _MAX_RETRY_DELAY_S))
        return delay
