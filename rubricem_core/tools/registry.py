"""Build a run's tools from config-like dicts, each wrapped in RobustTool.

One spec per tool::

    {"name": "search", "kind": "serper", "timeout_s": 20, "max_concurrency": 8, "cache": true, "top_k": 5}

``name`` (what the policy writes in ``<call_tool name=…>``) and ``kind`` are required; ``timeout_s``,
``max_concurrency``, ``max_output_chars`` and ``cache`` configure the wrapper; every other key is an
argument of the kind's constructor (listed in ``KIND_ARGS``). Web search tools and ``web_browse``
built by one call share one id → URL book, so browse opens what search returned.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Mapping, Sequence
from typing import Any

import pyarrow as pa

from rubricem_core.redact import reveal_url
from rubricem_core.tools.base import Tool, ToolError
from rubricem_core.tools.cache import ToolCache
from rubricem_core.tools.robust import RobustTool

__all__ = ["KIND_ARGS", "WRAPPER_ARGS", "build_tools", "corpus_digest"]

WRAPPER_ARGS = {"timeout_s": 30.0, "max_concurrency": 8, "max_output_chars": 20_000, "cache": False}

# Constructor arguments a spec may set, per kind (the rest — corpus, url book, name — come from here).
KIND_ARGS: dict[str, tuple[str, ...]] = {
    "local_search": ("top_k", "snippet_chars", "passage_chars", "dense"),
    "local_browse": ("max_chars",),
    "serper": ("api_key_env", "base_url", "top_k", "snippet_chars", "timeout_s_http", "max_retries", "backoff_s"),
    "semantic_scholar": (
        "api_key_env",
        "base_url",
        "top_k",
        "snippet_chars",
        "timeout_s_http",
        "max_retries",
        "backoff_s",
    ),
    "gemini_google_search": (
        "api_key_env",
        "base_url",
        "model",
        "top_k",
        "snippet_chars",
        "timeout_s_http",
        "max_retries",
        "backoff_s",
    ),
    "web_browse": (
        "max_chars",
        "max_bytes",
        "timeout_s_http",
        "max_retries",
        "backoff_s",
        "user_agent",
        "allow_networks",
    ),
    "mcp": ("server", "tool_name", "argument_name", "description", "extra_arguments", "id_prefix", "max_snippet_chars"),
}
_REQUIRED_ARGS = {"mcp": ("server", "tool_name")}
_WEB_KINDS = {"serper", "semantic_scholar", "gemini_google_search", "web_browse"}


def corpus_digest(corpus: pa.Table) -> str:
    """A content hash of a corpus table, so cached local results never outlive a corpus change."""
    digest = hashlib.sha256()
    for column in ("doc_id", "title", "text"):
        if column in corpus.column_names:
            for value in corpus.column(column).to_pylist():
                digest.update(str(value).encode("utf-8", errors="replace"))
                digest.update(b"\x00")
    return digest.hexdigest()[:16]


def _construct(kind: str, args: dict[str, Any], name: str, corpus: pa.Table | None, embedder: Any, urls: Any) -> Tool:
    # timeout_s belongs to the wrapper; the HTTP tools' own per-request timeout is "timeout_s_http"
    if "timeout_s_http" in args:
        args["timeout_s"] = args.pop("timeout_s_http")
    if kind in ("local_search", "local_browse"):
        from rubricem_core.tools.local import LocalBrowseTool, LocalSearchTool

        if corpus is None:
            raise ToolError(f"kind {kind!r} needs a corpus; pass corpus= to build_tools")
        if kind == "local_browse":
            return LocalBrowseTool(corpus, name=name, **args)
        dense = args.pop("dense", True)
        return LocalSearchTool(corpus, name=name, embedder=embedder if dense else None, **args)
    if kind in _WEB_KINDS:
        from rubricem_core.tools import web
        from rubricem_core.tools.gemini_search import GeminiGroundedSearchTool

        cls = {
            "serper": web.SerperSearchTool,
            "semantic_scholar": web.SemanticScholarSearchTool,
            "gemini_google_search": GeminiGroundedSearchTool,
            "web_browse": web.WebBrowseTool,
        }[kind]
        if isinstance(args.get("base_url"), str):  # the config holds it with its credentials masked
            args["base_url"] = reveal_url(args["base_url"], field=f"tool {name!r} base_url")
        return cls(urls=urls, name=name, **args)
    from rubricem_core.tools.mcp import MCPTool

    return MCPTool(name=name, **args)


def build_tools(
    specs: Sequence[Mapping[str, Any]],
    corpus: pa.Table | None = None,
    cache_dir: str | os.PathLike[str] | None = None,
    embedder: Any = None,
) -> dict[str, Tool]:
    """``specs`` → ``{name: RobustTool}``. ``cache_dir`` is required when any spec sets ``cache: true``;
    ``embedder`` (optional) adds dense retrieval to ``local_search`` unless the spec sets ``dense: false``."""
    tools: dict[str, Tool] = {}
    cache: ToolCache | None = None
    urls = None
    for index, spec in enumerate(specs):
        where = f"tools[{index}]"
        if not isinstance(spec, Mapping):
            raise ToolError(f"{where}: expected a mapping, got {type(spec).__name__}")
        spec = dict(spec)
        name, kind = spec.pop("name", None), spec.pop("kind", None)
        if not isinstance(name, str) or not name.strip():
            raise ToolError(f"{where}.name: required, a non-empty string")
        where = f"tools[{index}] ({name})"
        if name in tools:
            raise ToolError(f"{where}.name: duplicate tool name {name!r}")
        if kind not in KIND_ARGS:
            raise ToolError(f"{where}.kind: unknown kind {kind!r}; expected one of {sorted(KIND_ARGS)}")
        wrapper = {key: spec.pop(key, default) for key, default in WRAPPER_ARGS.items()}
        unknown = sorted(set(spec) - set(KIND_ARGS[kind]))
        if unknown:
            allowed = sorted(set(KIND_ARGS[kind]) | set(WRAPPER_ARGS) | {"name", "kind"})
            raise ToolError(f"{where}.{unknown[0]}: unknown argument for kind {kind!r}; allowed: {allowed}")
        missing = [key for key in _REQUIRED_ARGS.get(kind, ()) if key not in spec]
        if missing:
            raise ToolError(f"{where}.{missing[0]}: required for kind {kind!r}")
        if not isinstance(wrapper["cache"], bool):
            raise ToolError(f"{where}.cache: expected true or false, got {wrapper['cache']!r}")
        if kind in _WEB_KINDS and urls is None:
            from rubricem_core.tools.web import UrlBook

            urls = UrlBook()
        args = dict(spec)
        if kind == "mcp":  # the MCP client's connect/call timeouts follow the wrapper's
            args["timeout_s"] = float(wrapper["timeout_s"]) if isinstance(wrapper["timeout_s"], (int, float)) else 30.0
        try:
            inner = _construct(kind, args, name, corpus, embedder, urls)
        except ToolError as exc:
            raise ToolError(f"{where}: {exc}") from exc
        except (TypeError, ValueError) as exc:
            raise ToolError(f"{where}: bad arguments for kind {kind!r}: {exc}") from exc
        fingerprint = None
        if wrapper["cache"]:
            if cache_dir is None:
                raise ToolError(f"{where}.cache: true needs a cache directory; pass cache_dir= to build_tools")
            if cache is None:
                cache = ToolCache(cache_dir)
            if kind.startswith("local_"):  # the result depends on the corpus and the constructor args
                settings = json.dumps({k: v for k, v in spec.items() if k != "dense"}, sort_keys=True, default=str)
                dense = getattr(inner, "embedder", None)
                fingerprint = f"{kind}/v1 {settings} corpus={corpus_digest(corpus)} dense={type(dense).__name__ if dense else None}"
        try:
            tools[name] = RobustTool(
                inner,
                timeout_s=float(wrapper["timeout_s"]),
                max_concurrency=int(wrapper["max_concurrency"]),
                cache=cache if wrapper["cache"] else None,
                max_output_chars=int(wrapper["max_output_chars"]),
                fingerprint=fingerprint,
            )
        except (ToolError, TypeError, ValueError) as exc:
            raise ToolError(f"{where}: {exc}") from exc
    return tools
