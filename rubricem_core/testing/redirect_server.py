"""A tiny HTTP server for tests of what web tools follow: on a chosen loopback address (127.0.0.2 stands
for an internal service), every request answered with one redirect or one page, and recorded.

    with RecordingServer("127.0.0.2", body="internal-only metadata") as internal:
        with RecordingServer("127.0.0.1", redirect_to=internal.url("/secret")) as hop:
            ...   # hop.url("/") redirects to the internal page; internal.requests says who came
"""

from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


class RecordingServer:
    def __init__(self, host: str, body: str = "ok", redirect_to: str | None = None, status: int = 307):
        self.body, self.redirect_to, self.status = body, redirect_to, status
        self.requests: list[tuple[str, str, dict[str, str]]] = []  # (method, path, headers)
        self._server = ThreadingHTTPServer((host, 0), _Handler)
        self._server.owner = self  # type: ignore[attr-defined]
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    def url(self, path: str = "/") -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host!s}:{port}{path}"

    def __enter__(self) -> RecordingServer:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.shutdown()
        self._server.server_close()


class _Handler(BaseHTTPRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        pass

    def _answer(self) -> None:
        owner: RecordingServer = self.server.owner  # type: ignore[attr-defined]
        owner.requests.append((self.command, self.path, {k.lower(): v for k, v in self.headers.items()}))
        length = int(self.headers.get("content-length") or 0)
        if length:
            self.rfile.read(length)
        if owner.redirect_to is not None:
            self.send_response(owner.status)
            self.send_header("Location", owner.redirect_to)
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        data = owner.body.encode()
        self.send_response(200)
        self.send_header("Content-Type", "text/plain")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    do_GET = do_POST = _answer
