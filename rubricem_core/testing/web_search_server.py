"""A fake web-search HTTP server for tests: Serper, Semantic Scholar and plain web pages.

A stdlib ``ThreadingHTTPServer`` on 127.0.0.1 (free port, background thread), so the web tools talk
to it over real HTTP::

    with FakeWebSearchServer(api_key="k") as server:
        tool = SerperSearchTool(base_url=server.base_url, ...)

Endpoints:
- ``POST /search`` (Serper): JSON ``{"q", "num"}``, header ``X-API-KEY``; answers ``{"organic": [...]}``
  with ``num`` results from ``results_for(query)`` (default: deterministic fake pages about the query).
- ``GET /graph/v1/paper/search`` (Semantic Scholar): ``query``, ``limit``, ``fields``; header
  ``x-api-key`` when ``s2_api_key`` is set; answers ``{"total", "offset", "data": [...]}``.
- ``POST /v1beta/models/<model>:generateContent`` (Gemini with the ``google_search`` tool): header
  ``x-goog-api-key`` when ``gemini_api_key`` is set; answers a candidate whose text states each result's
  snippet and whose ``groundingMetadata`` holds ``webSearchQueries``, ``groundingChunks`` (``web.uri``,
  ``web.title``: the page's host, as Google gives it) and ``groundingSupports`` (each sentence's segment and
  the chunks it cites); a 429 fault answers Google's ``RESOURCE_EXHAUSTED`` body with a ``RetryInfo``
  delay, ``"blocked"`` a ``promptFeedback.blockReason`` without candidates.
- ``GET /page/<slug>``: an HTML page (``pages[slug]`` or a generated one) for the browse tool.

Fault knobs (mutable attributes; change them between calls):
- ``faults``: a queue of faults, each consumed by one API request (search or paper search):
  an int status (e.g. 429 → answered with that status and ``Retry-After: 0``), ``"malformed"``
  (a 200 with broken JSON), ``"slow"`` (sleeps ``slow_s`` before answering normally),
  ``"echo_key"`` (a 403 whose body echoes the API key, as careless servers do).
- ``page_faults``: the same for ``/page/...`` requests.
- ``api_key`` / ``s2_api_key``: when set, a request without the matching header gets a 401.

Records: ``requests`` — (method, path, headers dict, body dict or query dict) of every request.
"""

from __future__ import annotations

import collections
import hashlib
import json
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler
from typing import Any
from urllib.parse import parse_qs, urlparse

from rubricem_core.testing.served import ServedInThread


def default_results(query: str, n: int) -> list[dict[str, str]]:
    words = query.split() or ["nothing"]
    return [
        {
            "title": f"Result {i} about {query}",
            "slug": f"{words[0].lower()}-{i}",
            "snippet": f"Snippet {i}: facts on {query} with number {100 + i}.",
        }
        for i in range(n)
    ]


class FakeWebSearchServer(ServedInThread):
    def __init__(
        self,
        api_key: str | None = None,
        s2_api_key: str | None = None,
        gemini_api_key: str | None = None,
        results_for: Callable[[str, int], list[dict[str, str]]] = default_results,
        pages: dict[str, tuple[str, str]] | None = None,
        slow_s: float = 1.0,
    ):
        self.api_key = api_key
        self.s2_api_key = s2_api_key
        self.gemini_api_key = gemini_api_key
        self.results_for = results_for
        self.pages = dict(pages or {})  # slug -> (content type, body)
        self.slow_s = slow_s
        self.faults: collections.deque[Any] = collections.deque()
        self.page_faults: collections.deque[Any] = collections.deque()
        self.requests: list[tuple[str, str, dict[str, str], dict[str, Any]]] = []
        self._lock = threading.Lock()

    # ---- lifecycle ----------------------------------------------------------------------------
    @property
    def port(self) -> int:
        assert self._httpd is not None, "server not started"
        return self._httpd.server_address[1]

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def page_url(self, slug: str) -> str:
        return f"{self.base_url}/page/{slug}"

    def start(self) -> FakeWebSearchServer:
        return self._serve(type("Handler", (_Handler,), {"fake": self}))

    def next_fault(self, queue: collections.deque[Any]) -> Any:
        with self._lock:
            return queue.popleft() if queue else None

    def record(self, method: str, path: str, headers: dict[str, str], payload: dict[str, Any]) -> None:
        with self._lock:
            self.requests.append((method, path, headers, payload))


class _Handler(BaseHTTPRequestHandler):
    fake: FakeWebSearchServer
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: Any) -> None:  # keep test output quiet
        pass

    def _send(
        self, status: int, body: bytes, content_type: str = "application/json", headers: dict[str, str] | None = None
    ) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        for key, value in (headers or {}).items():
            self.send_header(key, value)
        self.end_headers()
        self.wfile.write(body)

    def _json(self, status: int, payload: Any) -> None:
        self._send(status, json.dumps(payload).encode("utf-8"))

    def _fault(self, fault: Any, key: str | None) -> bool:
        """Apply an injected fault; True when the request was answered by it."""
        if fault is None:
            return False
        if fault == "slow":
            time.sleep(self.fake.slow_s)
            return False
        if fault == "malformed":
            self._send(200, b'{"organic": [{"title": "cut off')
        elif fault == "echo_key":
            self._send(403, f"forbidden: key {key} is not allowed".encode(), "text/plain")
        else:
            status = int(fault)
            retry = {"Retry-After": "0"} if status == 429 else {}
            self._send(status, json.dumps({"message": f"injected {status}"}).encode("utf-8"), headers=retry)
        return True

    def do_POST(self) -> None:
        length = int(self.headers.get("Content-Length", "0") or 0)
        raw = self.rfile.read(length)
        try:
            body = json.loads(raw or b"{}")
        except json.JSONDecodeError:
            body = {}
        headers = {k.lower(): v for k, v in self.headers.items()}
        self.fake.record("POST", self.path, headers, body)
        path = urlparse(self.path).path
        if path.startswith("/v1beta/models/") and path.endswith(":generateContent"):
            return self._gemini(body, headers.get("x-goog-api-key"))
        if path != "/search":
            return self._json(404, {"message": "not found"})
        key = headers.get("x-api-key")
        if self._fault(self.fake.next_fault(self.fake.faults), key):
            return
        if self.fake.api_key is not None and key != self.fake.api_key:
            return self._json(401, {"message": "Unauthorized."})
        query, num = str(body.get("q", "")), int(body.get("num", 10))
        organic = [
            {"title": r["title"], "link": self.fake.page_url(r["slug"]), "snippet": r["snippet"], "position": i + 1}
            for i, r in enumerate(self.fake.results_for(query, num)[:num])
        ]
        self._json(200, {"searchParameters": {"q": query}, "organic": organic})

    def _gemini(self, body: dict[str, Any], key: str | None) -> None:
        fault = self.fake.next_fault(self.fake.faults)
        if fault == 429:  # Google's quota answer: the delay is in the body, not a header
            details = [{"@type": "type.googleapis.com/google.rpc.RetryInfo", "retryDelay": "0s"}]
            error = {"code": 429, "message": "Resource has been exhausted", "status": "RESOURCE_EXHAUSTED"}
            return self._json(429, {"error": {**error, "details": details}})
        if fault == "blocked":
            return self._json(200, {"promptFeedback": {"blockReason": "SAFETY"}})
        if self._fault(fault, key):
            return
        if self.fake.gemini_api_key is not None and key != self.fake.gemini_api_key:
            error = {
                "code": 400,
                "message": "API key not valid. Please pass a valid API key.",
                "status": "INVALID_ARGUMENT",
            }
            return self._json(400, {"error": error})
        if body.get("tools") != [{"google_search": {}}]:
            return self._json(400, {"error": {"code": 400, "message": "expected the google_search tool"}})
        query = str(body["contents"][0]["parts"][0]["text"])
        results = self.fake.results_for(query, 5)
        text, chunks, supports = "", [], []
        for i, r in enumerate(results):
            sentence = r["snippet"] + " "
            chunks.append({"web": {"uri": self.fake.page_url(r["slug"]), "title": "127.0.0.1"}})
            segment = {
                "startIndex": len(text.encode()),
                "endIndex": len((text + sentence).encode()),
                "text": sentence.strip(),
            }
            supports.append({"segment": segment, "groundingChunkIndices": [i], "confidenceScores": [0.9]})
            text += sentence
        candidate = {
            "content": {"role": "model", "parts": [{"text": text.strip()}]},
            "finishReason": "STOP",
            "groundingMetadata": {
                "webSearchQueries": [query],
                "groundingChunks": chunks,
                "groundingSupports": supports,
            },
        }
        self._json(200, {"candidates": [candidate], "usageMetadata": {"promptTokenCount": 9}})

    def do_GET(self) -> None:
        parsed = urlparse(self.path)
        params = {k: v[0] for k, v in parse_qs(parsed.query).items()}
        headers = {k.lower(): v for k, v in self.headers.items()}
        self.fake.record("GET", parsed.path, headers, params)
        if parsed.path == "/graph/v1/paper/search":
            key = headers.get("x-api-key")
            if self._fault(self.fake.next_fault(self.fake.faults), key):
                return
            if self.fake.s2_api_key is not None and key != self.fake.s2_api_key:
                return self._json(401, {"message": "Forbidden"})
            query, limit = params.get("query", ""), int(params.get("limit", 10))
            data = [
                {
                    "paperId": hashlib.sha1(r["slug"].encode("utf-8")).hexdigest(),
                    "title": r["title"],
                    "abstract": r["snippet"],
                    "year": 2020 + i,
                    "url": self.fake.page_url(r["slug"]),
                }
                for i, r in enumerate(self.fake.results_for(query, limit)[:limit])
            ]
            return self._json(200, {"total": len(data), "offset": 0, "data": data})
        if parsed.path.startswith("/page/"):
            fault = self.fake.next_fault(self.fake.page_faults)
            if self._fault(fault, None):
                return
            slug = parsed.path[len("/page/") :]
            content_type, body = self.fake.pages.get(
                slug,
                (
                    "text/html; charset=utf-8",
                    f"<html><head><title>Page {slug}</title><script>var x=1;</script></head>"
                    f"<body><h1>Heading {slug}</h1><p>Body text of {slug}.</p></body></html>",
                ),
            )
            return self._send(200, body.encode("utf-8"), content_type)
        self._json(404, {"message": "not found"})
