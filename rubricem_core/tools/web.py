"""Web research tools: Serper (Google) search, Semantic Scholar paper search, and browsing a result.

Keys come from the environment only (a config names the variable, never the key); a missing
required key fails at construction with the variable's name. A key is sent as a header and scrubbed
from every message the tools produce, so it cannot reach a trajectory, Parquet or a log.

Snippet ids: Serper results get ``W`` + a short hash of the URL (stable across calls and runs, so
the same page keeps its id), Semantic Scholar papers ``S2:<paperId>``. Search tools record
id → URL in a shared ``UrlBook``; ``WebBrowseTool`` opens only pages a search returned. Each snippet
ends with ``URL: …`` so the policy sees the source and a cached result can refill the book
(``observe``).

Redirects are followed by hand, each hop checked before it is sent: an API tool follows only redirects
to its own host (its key header never travels to another), and ``WebBrowseTool`` resolves every hop's
host and refuses loopback, private, link-local (the cloud metadata address among them), multicast and
reserved addresses unless the spec allows a named network (``allow_networks``): a page cannot make the
agent read the host's or the cluster's internal services.
"""

from __future__ import annotations

import collections
import hashlib
import ipaddress
import json
import os
import re
import socket
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, Literal, overload
from urllib.parse import urljoin, urlsplit

import httpx

from rubricem_core.redact import MASK, redact_text
from rubricem_core.tools.base import (
    Tool,
    ToolError,
    ToolResult,
    ToolSpec,
    error_result,
    no_results,
    search_result,
    snippets_result,
)
from rubricem_core.tools.html_text import html_to_text

__all__ = [
    "SemanticScholarSearchTool",
    "SerperSearchTool",
    "UrlBook",
    "WebBrowseTool",
    "html_to_text",
    "url_id",
]

_RETRY_STATUS = {429, 500, 502, 503, 504}
_SNIPPET = re.compile(r'<snippet id="([^"]+)">(.*?)</snippet>', re.DOTALL)
_URL_LINE = re.compile(r"\nURL: (\S+)$")
_MAX_RETRY_AFTER_S = 30.0
_MAX_REDIRECTS = 5
_REDIRECT_STATUS = {301, 302, 303, 307, 308}


class RefusedURL(httpx.HTTPError):
    """A URL (a redirect's target too) that this tool must not fetch."""


def same_host_only(origin: str) -> Callable[[str], None]:
    """A redirect check: the target keeps the origin's scheme, host and port (an API key stays at its host)."""
    first = urlsplit(origin)

    def check(url: str) -> None:
        target = urlsplit(url)
        if (target.scheme, target.hostname, target.port) != (first.scheme, first.hostname, first.port):
            raise RefusedURL(f"redirect to another host refused ({target.hostname or url!r})")

    return check


Network = ipaddress.IPv4Network | ipaddress.IPv6Network


def public_only(allow: Sequence[Network] = ()) -> Callable[[str], None]:
    """A URL check: http(s), and every address its host resolves to is public (or inside ``allow``)."""

    def check(url: str) -> None:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise RefusedURL(f"only http(s) URLs are fetched, not {url[:80]!r}")
        try:
            infos = socket.getaddrinfo(parts.hostname, parts.port or 443, proto=socket.IPPROTO_TCP)
        except socket.gaierror as exc:
            raise RefusedURL(f"cannot resolve {parts.hostname}: {exc}") from exc
        for info in infos:
            address = ipaddress.ip_address(str(info[4][0]).split("%", 1)[0])
            mapped = getattr(address, "ipv4_mapped", None)
            address = mapped or address
            if any(address in net for net in allow):
                continue
            if not address.is_global or address.is_multicast:
                raise RefusedURL(f"{parts.hostname} resolves to {address}, a non-public address (refused)")

    return check


def url_id(url: str, prefix: str = "W") -> str:
    """A short id that is the same for the same URL in every run (10 hex chars of SHA-1)."""
    return prefix + hashlib.sha1(url.encode("utf-8")).hexdigest()[:10]


class UrlBook:
    """Thread-safe snippet id ↔ URL map shared by search tools and the browse tool (LRU-bounded)."""

    def __init__(self, max_entries: int = 200_000):
        if max_entries < 1:
            raise ToolError(f"UrlBook: max_entries must be >= 1, got {max_entries}")
        self.max_entries = max_entries
        self._urls: collections.OrderedDict[str, str] = collections.OrderedDict()
        self._ids: dict[str, str] = {}
        self._lock = threading.Lock()

    def add(self, snippet_id: str, url: str) -> None:
        with self._lock:
            self._urls[snippet_id] = url
            self._urls.move_to_end(snippet_id)
            self._ids[url] = snippet_id
            while len(self._urls) > self.max_entries:
                old_id, old_url = self._urls.popitem(last=False)
                if self._ids.get(old_url) == old_id:
                    del self._ids[old_url]

    def url(self, snippet_id: str) -> str | None:
        with self._lock:
            return self._urls.get(snippet_id)

    def id_for_url(self, url: str) -> str | None:
        with self._lock:
            return self._ids.get(url)

    def __len__(self) -> int:
        with self._lock:
            return len(self._urls)


@overload
def _api_key(env_var: str, required: Literal[True], who: str) -> str: ...


@overload
def _api_key(env_var: str, required: bool, who: str) -> str | None: ...


def _api_key(env_var: str, required: bool, who: str) -> str | None:
    key = os.environ.get(env_var, "").strip()
    if not key:
        if required:
            raise ToolError(f"{who}: environment variable {env_var} is not set (it must hold the API key)")
        return None
    return key


def _shorten(text: str, limit: int) -> str:
    return _cut_text(" ".join(text.split()), limit)


class _HttpTool(Tool):
    """Shared HTTP plumbing: one pooled client, bounded retries on 429/5xx/transport errors, and
    key scrubbing of every message."""

    def __init__(self, name: str, timeout_s: float, max_retries: int, backoff_s: float, secrets: list[str]):
        if timeout_s <= 0:
            raise ToolError(f"{type(self).__name__}: timeout_s must be positive, got {timeout_s}")
        if max_retries < 0 or backoff_s < 0:
            raise ToolError(f"{type(self).__name__}: max_retries and backoff_s must be >= 0")
        self.name = name
        self.max_retries = int(max_retries)
        self.backoff_s = float(backoff_s)
        self._secrets = [s for s in secrets if s]
        # redirects by hand (_send): every hop is checked before it is sent
        self._client = httpx.Client(timeout=httpx.Timeout(timeout_s), follow_redirects=False)

    def _scrub(self, text: str) -> str:
        for secret in self._secrets:
            text = text.replace(secret, MASK)
        return redact_text(text)  # the credentials of a base URL too

    def _error(self, message: str) -> ToolResult:
        return error_result(self._scrub(message))

    def _send(self, method: str, url: str, check: Callable[[str], None], **kwargs: Any) -> httpx.Response:
        """One request, following up to _MAX_REDIRECTS redirects, each target passed by ``check`` first
        (it raises RefusedURL); the response is read."""
        check(url)
        for _ in range(_MAX_REDIRECTS + 1):
            response = self._client.request(method, url, **kwargs)
            location = response.headers.get("location")
            if response.status_code not in _REDIRECT_STATUS or not location:
                return response
            url = urljoin(url, location)
            check(url)
            if response.status_code in (301, 302, 303) and method != "HEAD":
                method = "GET"
                kwargs = {k: v for k, v in kwargs.items() if k not in ("json", "data", "content")}
        raise RefusedURL(f"more than {_MAX_REDIRECTS} redirects")

    def _request(self, method: str, url: str, **kwargs: Any) -> httpx.Response:
        """Send with bounded retries; returns the last response or raises the last transport error. Redirects
        only to the same host (the key header stays there)."""
        for attempt in range(self.max_retries + 1):
            last = attempt == self.max_retries
            try:
                response = self._send(method, url, same_host_only(url), **kwargs)
            except httpx.TransportError:
                if last:
                    raise
                time.sleep(self.backoff_s * 2**attempt)
                continue
            if response.status_code not in _RETRY_STATUS or last:
                return response
            time.sleep(self._retry_delay(response, attempt))
        raise AssertionError("unreachable")

    def _retry_delay(self, response: httpx.Response, attempt: int) -> float:
        delay = self.backoff_s * 2**attempt
        retry_after = response.headers.get("retry-after", "")
        try:  # only the seconds form; an HTTP date is rare from search APIs
            delay = max(delay, min(float(retry_after), _MAX_RETRY_AFTER_S))
        except ValueError:
            pass
        return delay

    def _get_json(self, method: str, url: str, what: str, **kwargs: Any) -> tuple[Any, ToolResult | None]:
        """(parsed JSON, None) or (None, error result) — never raises for network or API trouble."""
        try:
            response = self._request(method, url, **kwargs)
        except httpx.TimeoutException:
            return None, self._error(f"{what}: request timed out")
        except httpx.HTTPError as exc:
            return None, self._error(f"{what}: request failed: {type(exc).__name__}: {exc}")
        if response.status_code != 200:
            body = _shorten(response.text, 200)
            return None, self._error(f"{what}: HTTP {response.status_code}: {body}")
        try:
            return response.json(), None
        except (json.JSONDecodeError, UnicodeDecodeError):
            return None, self._error(f"{what}: malformed JSON in the response")

    def close(self) -> None:
        self._client.close()

    def __enter__(self) -> _HttpTool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:  # never show the key
        return f"{type(self).__name__}(name={self.name!r})"


class _WebSearchTool(_HttpTool):
    """Search tools that record id → URL for browsing and can replay that from a cached result. A subclass
    names its defaults (key variable, whether the key is required, API root, tool name, snippet length) and
    its ``spec`` text and fingerprint tag; the constructor is this one."""

    KEY_ENV: str
    KEY_REQUIRED = True
    BASE_URL: str
    NAME: str
    SNIPPET_CHARS = 400
    DESCRIPTION: str  # the tool's spec text for the policy
    FINGERPRINT: str  # what cached results are keyed by, with the settings that shape them

    urls: UrlBook

    def __init__(
        self,
        api_key_env: str | None = None,
        base_url: str | None = None,
        top_k: int = 5,
        snippet_chars: int | None = None,
        timeout_s: float = 20.0,
        max_retries: int = 3,
        backoff_s: float = 1.0,
        urls: UrlBook | None = None,
        name: str | None = None,
    ):
        who = type(self).__name__
        snippet_chars = self.SNIPPET_CHARS if snippet_chars is None else snippet_chars
        if top_k < 1 or snippet_chars < 1:
            raise ToolError(f"{who}: top_k and snippet_chars must be positive")
        key = _api_key(api_key_env or self.KEY_ENV, required=self.KEY_REQUIRED, who=who)
        name = name or self.NAME
        super().__init__(name, timeout_s, max_retries, backoff_s, [key] if key else [])
        self._key = key
        self.base_url = (base_url or self.BASE_URL).rstrip("/")
        self.top_k = int(top_k)
        self.snippet_chars = int(snippet_chars)
        self.urls = urls if urls is not None else UrlBook()
        self.spec = ToolSpec(name, self.DESCRIPTION)
        self.fingerprint = (
            f"{self.FINGERPRINT} {redact_text(self.base_url)} top_k={self.top_k} chars={self.snippet_chars}"
        )

    def __call__(self, query: str) -> ToolResult:
        query = query.strip()
        if not query:
            return error_result("empty search query")
        method, path, what, kwargs = self._request_for(query)
        data, error = self._get_json(method, f"{self.base_url}{path}", what, **kwargs)
        if error is not None:
            return error
        if not isinstance(data, dict):
            return self._error(f"{what}: expected a JSON object, got {type(data).__name__}")
        hits = self._hits(data)
        if isinstance(hits, ToolResult):
            return hits
        return self._result(hits[: self.top_k], query)

    def _request_for(self, query: str) -> tuple[str, str, str, dict[str, Any]]:
        """(method, path under base_url, what the errors call it, request keywords) of one search."""
        raise NotImplementedError

    def _hits(self, data: dict[str, Any]) -> list[tuple[str, str, str, str]] | ToolResult:
        """The answer's ``(id, title, text, url)`` hits in order, or an error result."""
        raise NotImplementedError

    def _result(self, hits: list[tuple[str, str, str, str]], query: str) -> ToolResult:
        """``(id, title, text, url)`` hits → the tool output; records each id's URL."""
        seen: set[str] = set()
        snippets = []
        for snippet_id, title, text, url in hits:
            if snippet_id in seen:  # the same page twice in one answer
                continue
            seen.add(snippet_id)
            if url:
                self.urls.add(snippet_id, url)
                text = f"{text}\nURL: {url}"
            snippets.append((snippet_id, title, text))
        return search_result(query, snippets)

    def observe(self, result: ToolResult) -> None:
        """Refill the URL book from a result served by a cache (the URL closes each snippet)."""
        for match in _SNIPPET.finditer(result.text):
            url = _URL_LINE.search(match.group(2))
            if url:
                self.urls.add(match.group(1), url.group(1))


class SerperSearchTool(_WebSearchTool):
    """Google results through serper.dev: POST ``/search`` with the ``X-API-KEY`` header."""

    KEY_ENV = "SERPER_API_KEY"
    BASE_URL = "https://google.serper.dev"
    NAME = "search"
    DESCRIPTION = "Search the web (Google); returns snippets with ids such as W3f2a9c01b7 and their URLs."
    FINGERPRINT = "serper/v1"

    def _request_for(self, query: str) -> tuple[str, str, str, dict[str, Any]]:
        headers = {"X-API-KEY": self._key, "Content-Type": "application/json"}
        return "POST", "/search", "web search", {"json": {"q": query, "num": self.top_k}, "headers": headers}

    def _hits(self, data: dict[str, Any]) -> list[tuple[str, str, str, str]] | ToolResult:
        organic = data.get("organic") or []
        if not isinstance(organic, list):
            return self._error("web search: 'organic' is not a list")
        hits = []
        for item in organic:
            if not isinstance(item, dict) or not isinstance(item.get("link"), str) or not item["link"]:
                continue  # a result without a URL cannot be browsed or given a stable id
            link = item["link"]
            title = _shorten(str(item.get("title") or ""), 200)
            text = _shorten(str(item.get("snippet") or ""), self.snippet_chars) or "(no snippet)"
            hits.append((url_id(link), title, text, link))
        return hits


class SemanticScholarSearchTool(_WebSearchTool):
    """Papers from the Semantic Scholar Graph API: GET ``/paper/search``; the key is optional
    (shared rate limit without one)."""

    FIELDS = "title,abstract,year,url,paperId"
    KEY_ENV = "S2_API_KEY"
    KEY_REQUIRED = False
    BASE_URL = "https://api.semanticscholar.org/graph/v1"
    NAME = "paper_search"
    SNIPPET_CHARS = 600
    DESCRIPTION = "Search scientific papers (Semantic Scholar); returns abstracts with ids such as S2:<paperId>."
    FINGERPRINT = "s2/v1"

    def _request_for(self, query: str) -> tuple[str, str, str, dict[str, Any]]:
        params = {"query": query, "limit": self.top_k, "fields": self.FIELDS}
        headers = {"x-api-key": self._key} if self._key else {}
        return "GET", "/paper/search", "paper search", {"params": params, "headers": headers}

    def _hits(self, data: dict[str, Any]) -> list[tuple[str, str, str, str]] | ToolResult:
        papers = data.get("data") or []
        if not isinstance(papers, list):
            return self._error("paper search: 'data' is not a list")
        hits = []
        for paper in papers:
            paper_id = paper.get("paperId") if isinstance(paper, dict) else None
            if not isinstance(paper_id, str) or not re.fullmatch(r"[A-Za-z0-9]+", paper_id):
                continue
            title = _shorten(str(paper.get("title") or ""), 300)
            if paper.get("year"):
                title = f"{title} ({paper['year']})"
            abstract = _shorten(str(paper.get("abstract") or ""), self.snippet_chars) or "(no abstract)"
            url = paper.get("url") if isinstance(paper.get("url"), str) else ""
            hits.append((f"S2:{paper_id}", title, abstract, url))
        return hits


class WebBrowseTool(_HttpTool):
    """Fetches a page that a web search returned, by its snippet id (or its exact URL), as text."""

    def __init__(
        self,
        urls: UrlBook | None = None,
        max_chars: int = 6000,
        max_bytes: int = 3_000_000,
        timeout_s: float = 20.0,
        max_retries: int = 2,
        backoff_s: float = 1.0,
        user_agent: str = "Mozilla/5.0 (compatible; rubricem-research-agent)",
        name: str = "browse",
        allow_networks: Sequence[str] = (),
    ):
        if max_chars < 1 or max_bytes < 1:
            raise ToolError("WebBrowseTool: max_chars and max_bytes must be positive")
        try:
            allowed = [ipaddress.ip_network(n, strict=False) for n in allow_networks]
        except ValueError as exc:
            raise ToolError(f"WebBrowseTool: allow_networks: {exc}") from exc
        self._check = public_only(allowed)
        super().__init__(name, timeout_s, max_retries, backoff_s, [])
        self.urls = urls if urls is not None else UrlBook()
        self.max_chars = int(max_chars)
        self.max_bytes = int(max_bytes)
        self.user_agent = user_agent
        self.spec = ToolSpec(
            name, "Open a web page from a search result by its id (e.g. W3f2a9c01b7) and read its text."
        )
        self.fingerprint = f"web_browse/v1 chars={self.max_chars}"

    def _resolve(self, query: str) -> tuple[str | None, str | None]:
        target = query.strip().strip("\"'`[]()<> ")
        url = self.urls.url(target)
        if url is not None:
            return target, url
        snippet_id = self.urls.id_for_url(target)  # the policy pasted the URL of a result
        if snippet_id is not None:
            return snippet_id, target
        return target, None

    def __call__(self, query: str) -> ToolResult:
        snippet_id, url = self._resolve(query)
        if not snippet_id:
            return error_result("empty page id")
        if url is None:
            return error_result(f"unknown page id {snippet_id!r}; browse takes an id from a web search result")
        try:
            body, content_type = self._fetch(url)
        except httpx.TimeoutException:
            return self._error(f"browse {snippet_id}: request timed out")
        except RefusedURL as exc:
            return self._error(f"browse {snippet_id}: {exc}")
        except httpx.HTTPError as exc:
            return self._error(f"browse {snippet_id}: request failed: {type(exc).__name__}: {exc}")
        except _FetchError as exc:
            return self._error(f"browse {snippet_id}: {exc}")
        if "html" in content_type or body.lstrip()[:15].lower().startswith(("<!doctype html", "<html")):
            title, text = html_to_text(body)
        elif content_type.startswith("text/") or "json" in content_type or not content_type:
            title, text = "", "\n".join(" ".join(line.split()) for line in body.splitlines() if line.strip())
        else:
            return error_result(f"browse {snippet_id}: unsupported content type {content_type!r}")
        if not text:
            return no_results(f"page {snippet_id} has no readable text")
        text = _cut_text(text, self.max_chars)
        return snippets_result([(snippet_id, title, text)])

    def _fetch(self, url: str) -> tuple[str, str]:
        """(decoded body, content type); streams so a huge page stops at ``max_bytes``. Redirects are followed
        here, each hop resolved and checked (``public_only``) before anything is sent to it."""
        headers = {"User-Agent": self.user_agent, "Accept": "text/html,text/plain;q=0.9,*/*;q=0.5"}
        self._check(url)
        hops = 0
        for attempt in range(self.max_retries + 1):
            last = attempt == self.max_retries
            try:
                while True:
                    with self._client.stream("GET", url, headers=headers) as response:
                        location = response.headers.get("location")
                        if response.status_code in _REDIRECT_STATUS and location:
                            hops += 1
                            if hops > _MAX_REDIRECTS:
                                raise RefusedURL(f"more than {_MAX_REDIRECTS} redirects")
                            url = urljoin(url, location)
                            self._check(url)
                            continue
                        if response.status_code in _RETRY_STATUS and not last:
                            delay = self._retry_delay(response, attempt)
                            break
                        if response.status_code != 200:
                            raise _FetchError(f"HTTP {response.status_code}")
                        return self._read(response)
            except httpx.TransportError:
                if last:
                    raise
                delay = self.backoff_s * 2**attempt
            time.sleep(delay)
        raise AssertionError("unreachable")

    def _read(self, response: httpx.Response) -> tuple[str, str]:
        content_type = response.headers.get("content-type", "").split(";")[0].strip().lower()
        chunks, size = [], 0
        for chunk in response.iter_bytes():
            chunks.append(chunk)
            size += len(chunk)
            if size >= self.max_bytes:
                break
        raw = b"".join(chunks)[: self.max_bytes]
        try:
            return raw.decode(response.encoding or "utf-8", errors="replace"), content_type
        except LookupError:  # a charset Python does not know
            return raw.decode("utf-8", errors="replace"), content_type


class _FetchError(Exception):
    pass


def _cut_text(text: str, limit: int) -> str:
    if len(text) <= limit:
        return text
    cut = text.rfind(" ", 0, limit)
    return text[: cut if cut > limit // 2 else limit] + "…"
