"""A research tool served by an MCP server (streamable HTTP URL or a stdio command), via fastmcp.

The policy's query becomes one argument of the MCP tool (``argument_name``); the result becomes
snippets: a structured list of ``{id, title, text}`` (also under ``results``/``items``/…), or text
content blocks (one snippet each, or parsed when a block is such a JSON list). Ids the scaffold cannot
write, or missing ids, are replaced by ``M`` + a short hash of the text, stable across calls.

Rollout threads call ``__call__`` synchronously; all of them share one connected client that lives
on this tool's own event-loop thread. A broken connection is dropped and re-opened on the next call;
everything that goes wrong comes back as an error ToolResult.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import hashlib
import json
import re
import shlex
import threading
from typing import Any

from rubricem_core.tools.base import (
    Tool,
    ToolError,
    ToolResult,
    ToolSpec,
    error_result,
    search_result,
)

__all__ = ["MCPTool", "result_to_snippets"]

_SAFE_ID = re.compile(r"^[A-Za-z0-9_.:\-/#]+$")
_ID_KEYS = ("id", "doc_id", "docid", "snippet_id")
_TEXT_KEYS = ("text", "snippet", "content", "abstract", "body")
_LIST_KEYS = ("results", "result", "items", "documents", "snippets", "data")


def _import_fastmcp() -> Any:
    try:
        import fastmcp
    except ImportError as exc:  # an optional extra: most runs never use MCP
        raise ToolError("MCPTool needs the fastmcp package; install the extra: pip install 'rubricem[mcp]'") from exc
    return fastmcp


def _hash_id(prefix: str, text: str) -> str:
    return prefix + hashlib.sha1(text.encode("utf-8")).hexdigest()[:10]


def _item_snippet(item: dict[str, Any], prefix: str, max_chars: int) -> tuple[str, str, str] | None:
    text = next((item[k] for k in _TEXT_KEYS if isinstance(item.get(k), str) and item[k].strip()), None)
    if text is None:
        return None
    title = str(item.get("title") or "")
    raw_id = next((item[k] for k in _ID_KEYS if item.get(k) is not None), None)
    snippet_id = str(raw_id) if raw_id is not None else ""
    if not _SAFE_ID.match(snippet_id):
        snippet_id = _hash_id(prefix, snippet_id or f"{title}\n{text}")
    if isinstance(item.get("url"), str) and item["url"]:
        text = f"{text}\nURL: {item['url']}"
    return snippet_id, title, _cut(text, max_chars)


def _cut(text: str, limit: int) -> str:
    text = text.strip()
    if len(text) <= limit:
        return text
    cut = text.rfind(" ", 0, limit)
    return text[: cut if cut > limit // 2 else limit] + "…"


def _as_items(value: Any) -> list[dict[str, Any]] | None:
    """A list of result dicts, directly or under a usual key; None when ``value`` is not one."""
    if isinstance(value, dict):
        for key in _LIST_KEYS:
            if isinstance(value.get(key), list):
                return _as_items(value[key])
        if any(isinstance(value.get(k), str) for k in _TEXT_KEYS):
            return [value]
        return None
    if isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
        return value
    return None


def result_to_snippets(
    data: Any, texts: list[str], prefix: str = "M", max_chars: int = 4000
) -> list[tuple[str, str, str]]:
    """MCP tool output → ``(id, title, text)`` snippets, deduplicated by id, in order.

    ``data`` is the structured result (fastmcp's ``.data``/``.structured_content``), ``texts`` the
    text content blocks; structured data wins when it holds result items.
    """
    items = _as_items(data)
    if items is None and isinstance(data, str) and data.strip():
        texts = [data]
    snippets: list[tuple[str, str, str]] = []
    if items is not None:
        snippets = [s for s in (_item_snippet(i, prefix, max_chars) for i in items) if s is not None]
    else:
        for block in texts:
            try:
                parsed = _as_items(json.loads(block))
            except (json.JSONDecodeError, TypeError):
                parsed = None
            if parsed is not None:
                snippets += [s for s in (_item_snippet(i, prefix, max_chars) for i in parsed) if s is not None]
            elif block.strip():
                snippets.append((_hash_id(prefix, block.strip()), "", _cut(block, max_chars)))
    seen: set[str] = set()
    unique = []
    for snippet in snippets:
        if snippet[0] not in seen:
            seen.add(snippet[0])
            unique.append(snippet)
    return unique


class MCPTool(Tool):
    """Calls ``tool_name`` on an MCP ``server`` with ``{argument_name: query, **extra_arguments}``.

    ``server``: an ``http(s)://…`` URL of a streamable-HTTP server, or a command line that starts a
    stdio server (e.g. ``"python my_server.py"``). ``name`` is the tool name the policy writes
    (default: ``tool_name``).
    """

    def __init__(
        self,
        server: str,
        tool_name: str,
        argument_name: str = "query",
        name: str | None = None,
        description: str | None = None,
        timeout_s: float = 30.0,
        extra_arguments: dict[str, Any] | None = None,
        id_prefix: str = "M",
        max_snippet_chars: int = 4000,
    ):
        _import_fastmcp()
        if not isinstance(server, str) or not server.strip():
            raise ToolError("MCPTool: server must be a URL or a command line, got an empty value")
        if not tool_name or not argument_name:
            raise ToolError("MCPTool: tool_name and argument_name must be non-empty")
        if timeout_s <= 0:
            raise ToolError(f"MCPTool: timeout_s must be positive, got {timeout_s}")
        if not _SAFE_ID.match(id_prefix):
            raise ToolError(f"MCPTool: id_prefix {id_prefix!r} must be letters, digits or _.:-/#")
        self.server = server.strip()
        self.tool_name = tool_name
        self.argument_name = argument_name
        self.timeout_s = float(timeout_s)
        self.extra_arguments = dict(extra_arguments or {})
        self.id_prefix = id_prefix
        self.max_snippet_chars = int(max_snippet_chars)
        self.spec = ToolSpec(
            name or tool_name,
            description or f"the argument is a {argument_name}; returns snippets with ids from the '{tool_name}' tool.",
        )
        args = json.dumps(self.extra_arguments, sort_keys=True, default=str)
        self.fingerprint = f"mcp/v1 {self.server} {tool_name} {argument_name} {args}"
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._start_lock = threading.Lock()
        self._client: Any = None
        self._connect_lock: asyncio.Lock | None = None
        self._tool_names: set[str] | None = None

    # ---- the event-loop thread ----------------------------------------------------------------
    def _ensure_loop(self) -> asyncio.AbstractEventLoop:
        with self._start_lock:
            if self._loop is None or self._loop.is_closed():
                loop = asyncio.new_event_loop()
                thread = threading.Thread(target=loop.run_forever, name=f"mcp-{self.spec.name}", daemon=True)
                thread.start()
                self._loop, self._thread = loop, thread
            return self._loop

    def _transport(self) -> Any:
        if self.server.startswith(("http://", "https://")):
            return self.server
        from fastmcp.client.transports import StdioTransport

        argv = shlex.split(self.server)
        return StdioTransport(command=argv[0], args=argv[1:])

    async def _connected(self) -> tuple[Any, bool]:
        """(connected client, whether this call opened it)."""
        if self._connect_lock is None:
            self._connect_lock = asyncio.Lock()
        async with self._connect_lock:
            if self._client is not None:
                return self._client, False
            from fastmcp import Client

            client = Client(self._transport(), timeout=self.timeout_s, init_timeout=self.timeout_s)
            await client.__aenter__()
            try:
                self._tool_names = {t.name for t in await client.list_tools()}
            except BaseException:
                await _quietly_close(client)
                raise
            self._client = client
            return client, True

    async def _disconnect(self, client: Any = None) -> None:
        """Close ``client`` (default: the current one); forget it only if it is still the current
        one, so a concurrent call's fresh connection survives."""
        client = client if client is not None else self._client
        if client is not None and self._client is client:
            self._client = None
        if client is not None:
            await _quietly_close(client)

    async def _call(self, query: str) -> ToolResult:
        arguments = {**self.extra_arguments, self.argument_name: query}
        for attempt in range(2):
            try:
                client, fresh = await self._connected()
            except Exception as exc:
                return error_result(f"MCP server {self.server} unreachable: {_reason(exc)}")
            if self._tool_names is not None and self.tool_name not in self._tool_names:
                known = ", ".join(sorted(self._tool_names)) or "none"
                return error_result(f"MCP server {self.server} has no tool {self.tool_name!r} (available: {known})")
            try:
                result = await client.call_tool(self.tool_name, arguments, raise_on_error=False, timeout=self.timeout_s)
                break
            except Exception as exc:
                # The session may be dead (server restarted): drop it; a reused one gets one retry
                # on a fresh connection, a fresh one that fails is reported.
                await self._disconnect(client)
                if fresh or attempt == 1:
                    return error_result(f"MCP tool {self.tool_name!r} call failed: {_reason(exc)}")
        texts = [block.text for block in result.content if getattr(block, "type", None) == "text"]
        if result.is_error:
            return error_result(f"MCP tool {self.tool_name!r} failed: {' '.join(texts)[:500] or 'no message'}")
        data = result.data if result.data is not None else result.structured_content
        snippets = result_to_snippets(data, texts, self.id_prefix, self.max_snippet_chars)
        return search_result(query, snippets)

    # ---- the synchronous Tool interface --------------------------------------------------------
    def __call__(self, query: str) -> ToolResult:
        query = query.strip()
        if not query:
            return error_result(f"empty {self.argument_name}")
        future = asyncio.run_coroutine_threadsafe(self._call(query), self._ensure_loop())
        try:
            # connect + call (twice at most) each have timeout_s; slack lets their own errors arrive first
            return future.result(timeout=4 * self.timeout_s + 1)
        except concurrent.futures.TimeoutError:
            future.cancel()
            return error_result(f"MCP tool {self.tool_name!r} timed out after {self.timeout_s:g}s")
        except Exception as exc:
            return error_result(f"MCP tool {self.tool_name!r} failed: {_reason(exc)}")

    def close(self) -> None:
        """Disconnect and stop the event-loop thread (a later call starts them again)."""
        with self._start_lock:
            loop, thread = self._loop, self._thread
            self._loop = self._thread = None
        if loop is None or loop.is_closed():
            return
        try:
            asyncio.run_coroutine_threadsafe(self._disconnect(), loop).result(timeout=self.timeout_s)
        except Exception:
            pass  # closing a dead connection may fail; the loop still stops below
        self._connect_lock = None
        loop.call_soon_threadsafe(loop.stop)
        if thread is not None:
            thread.join(timeout=self.timeout_s)
        if not loop.is_running():
            loop.close()

    def __enter__(self) -> MCPTool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


async def _quietly_close(client: Any) -> None:
    try:
        await client.__aexit__(None, None, None)
    except Exception:
        pass


def _reason(exc: BaseException) -> str:
    message = str(exc).strip()
    return f"{type(exc).__name__}: {message}" if message else type(exc).__name__
