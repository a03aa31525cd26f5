"""On-disk cache of successful tool results, shared by threads and processes, surviving restarts.

Web search costs money and changes over time; a fixed cache directory makes reruns (and replays of
a failed RL step) see the same tool outputs at no cost. One SQLite file in WAL mode: every ``put`` is
one transaction (atomic), readers never block the writer, and several processes may share the file.
The key is (tool name, normalized query, fingerprint); the fingerprint names the tool's version and
configuration (endpoint, top_k, corpus digest, …) so a config change never serves stale results.
Only successful results are stored: an error or a timeout is never replayed.
"""

from __future__ import annotations

import hashlib
import json
import os
import sqlite3
import threading
import time
import unicodedata
from pathlib import Path

from rubricem_core.tools.base import ToolError, ToolResult

__all__ = ["ToolCache", "normalize_query", "cache_key"]

DB_NAME = "tool_cache.sqlite"
_SCHEMA = """
CREATE TABLE IF NOT EXISTS results (
    key TEXT PRIMARY KEY,
    tool TEXT NOT NULL,
    query TEXT NOT NULL,
    fingerprint TEXT NOT NULL,
    text TEXT NOT NULL,
    snippet_ids TEXT NOT NULL,
    created_at REAL NOT NULL
)
"""


def normalize_query(query: str) -> str:
    """Unicode NFC and collapsed whitespace. Case is kept: URLs and some ids are case-sensitive."""
    return " ".join(unicodedata.normalize("NFC", query).split())


def cache_key(tool: str, query: str, fingerprint: str) -> str:
    payload = json.dumps([tool, normalize_query(query), fingerprint], ensure_ascii=False)
    return hashlib.sha256(payload.encode("utf-8")).hexdigest()


class ToolCache:
    """``get``/``put`` of ``ToolResult`` by (tool, query, fingerprint) in ``directory/tool_cache.sqlite``.

    ``max_age_s`` (optional) makes older entries misses, e.g. to refresh web results weekly.
    """

    def __init__(self, directory: str | os.PathLike[str], max_age_s: float | None = None, busy_timeout_s: float = 30.0):
        if max_age_s is not None and max_age_s <= 0:
            raise ToolError(f"ToolCache: max_age_s must be positive, got {max_age_s}")
        self.directory = Path(directory)
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise ToolError(f"ToolCache: cannot create cache directory {self.directory}: {exc}") from exc
        self.path = self.directory / DB_NAME
        self.max_age_s = max_age_s
        self.busy_timeout_s = busy_timeout_s
        self._local = threading.local()
        with self._connect() as conn:
            conn.execute(_SCHEMA)

    def _connect(self) -> sqlite3.Connection:
        # One connection per thread and process: sqlite3 connections must not cross threads, and a
        # connection inherited through fork must not be reused by the child.
        conn = getattr(self._local, "conn", None)
        if conn is None or self._local.pid != os.getpid():
            try:
                conn = sqlite3.connect(self.path, timeout=self.busy_timeout_s, isolation_level=None)
                conn.execute("PRAGMA journal_mode=WAL")
                conn.execute("PRAGMA synchronous=NORMAL")
            except sqlite3.Error as exc:
                raise ToolError(f"ToolCache: cannot open {self.path}: {exc}") from exc
            self._local.conn, self._local.pid = conn, os.getpid()
        return conn

    def get(self, tool: str, query: str, fingerprint: str) -> ToolResult | None:
        row = (
            self._connect()
            .execute(
                "SELECT text, snippet_ids, created_at FROM results WHERE key = ?",
                (cache_key(tool, query, fingerprint),),
            )
            .fetchone()
        )
        if row is None:
            return None
        text, snippet_ids, created_at = row
        if self.max_age_s is not None and time.time() - created_at > self.max_age_s:
            return None
        return ToolResult(text=text, snippet_ids=list(json.loads(snippet_ids)), error=None)

    def put(self, tool: str, query: str, fingerprint: str, result: ToolResult) -> bool:
        """Store a successful result; returns False (and stores nothing) for an error result."""
        if not isinstance(result, ToolResult) or not result.ok or not isinstance(result.text, str):
            return False
        self._connect().execute(
            "INSERT OR REPLACE INTO results VALUES (?, ?, ?, ?, ?, ?, ?)",
            (
                cache_key(tool, query, fingerprint),
                tool,
                normalize_query(query),
                fingerprint,
                result.text,
                json.dumps([str(s) for s in result.snippet_ids]),
                time.time(),
            ),
        )
        return True

    def __len__(self) -> int:
        return int(self._connect().execute("SELECT count(*) FROM results").fetchone()[0])

    def close(self) -> None:
        """Close this thread's connection (others close when their threads end)."""
        conn = getattr(self._local, "conn", None)
        if conn is not None:
            conn.close()
            self._local.conn = None
