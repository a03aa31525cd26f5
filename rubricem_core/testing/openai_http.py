"""The fake server's HTTP side: routes to its handlers, the API key check, OpenAI-shaped error bodies and
multipart uploads (openai_server holds the behaviour)."""

from __future__ import annotations

import email.parser
import email.policy
import email.utils
import json
import re
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler
from typing import Any


def _error_payload(status: int, message: str) -> dict[str, Any]:
    kind = {
        400: "invalid_request_error",
        401: "authentication_error",
        404: "not_found_error",
        429: "rate_limit_exceeded",
    }.get(status, "server_error")
    return {"error": {"message": message, "type": kind, "param": None, "code": kind}}


def _parse_multipart(content_type: str, raw: bytes) -> dict[str, tuple[str | None, bytes]]:
    """{field name: (filename, bytes)} of a multipart/form-data body."""
    parser = email.parser.BytesParser(policy=email.policy.HTTP)
    message = parser.parsebytes(b"Content-Type: " + content_type.encode("latin-1") + b"\r\n\r\n" + raw)
    fields: dict[str, tuple[str | None, bytes]] = {}
    if not message.is_multipart():
        return fields
    for part in message.iter_parts():
        name = part.get_param("name", header="content-disposition")
        if name:
            payload = part.get_payload(decode=True)
            fields[str(name)] = (part.get_filename(), payload if isinstance(payload, bytes) else b"")
    return fields


_FILE_PATH = re.compile(r"^/v1/files/([^/]+)$")
_FILE_CONTENT_PATH = re.compile(r"^/v1/files/([^/]+)/content$")
_BATCH_PATH = re.compile(r"^/v1/batches/([^/]+)$")
_BATCH_CANCEL_PATH = re.compile(r"^/v1/batches/([^/]+)/cancel$")


def _make_handler(server: Any) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, format: str, *args: Any) -> None:  # keep test output clean
            return

        def _send_json(self, status: int, payload: dict[str, Any], headers: dict[str, str] | None = None) -> None:
            data = json.dumps(payload).encode("utf-8")
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            for name, value in (headers or {}).items():
                self.send_header(name, value)
            self.end_headers()
            self.wfile.write(data)

        def _send_bytes(self, data: bytes) -> None:
            self.send_response(200)
            self.send_header("Content-Type", "application/octet-stream")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _read_body(self) -> bytes:
            length = int(self.headers.get("Content-Length") or 0)
            return self.rfile.read(length) if length else b""

        def _authorized(self) -> bool:
            if server.api_key is None:
                return True
            if self.headers.get("Authorization") == f"Bearer {server.api_key}":
                return True
            self._send_json(401, _error_payload(401, "Incorrect API key provided"))
            return False

        def _path(self) -> str:
            return self.path.split("?", 1)[0].rstrip("/")

        def do_POST(self) -> None:
            try:
                self._post()
            except Exception as exc:  # a bug in respond() must reach the test as a 500, not a hang
                self._send_json(500, _error_payload(500, f"fake server error: {type(exc).__name__}: {exc}"))

        def do_GET(self) -> None:
            try:
                self._get()
            except Exception as exc:
                self._send_json(500, _error_payload(500, f"fake server error: {type(exc).__name__}: {exc}"))

        def _post(self) -> None:
            path = self._path()
            raw = self._read_body()
            with server._lock:
                server.request_log.append(("POST", path))
            if not self._authorized():
                return
            if path == "/v1/chat/completions":
                self._send_json(*server.handle_chat(json.loads(raw or b"{}")))
            elif path == "/v1/files":
                self._send_json(*server.handle_upload(self.headers.get("Content-Type", ""), raw))
            elif path == "/v1/batches":
                self._send_json(*server.handle_create_batch(json.loads(raw or b"{}")))
            elif match := _BATCH_CANCEL_PATH.match(path):
                self._send_json(*server.handle_cancel_batch(match.group(1)))
            else:
                self._send_json(404, _error_payload(404, f"no route POST {path}"))

        def _send_file(self, stored: dict[str, Any], file_id: str, send: Callable[[Any], None]) -> None:
            """A stored file's content or metadata through ``send``; OpenAI's 404 for an unknown id."""
            with server._lock:
                found = stored.get(file_id)
            if found is None:
                self._send_json(404, _error_payload(404, f"No such File object: {file_id}"))
            else:
                send(found)

        def _get(self) -> None:
            path = self._path()
            with server._lock:
                server.request_log.append(("GET", path))
            if not self._authorized():
                return
            if match := _FILE_CONTENT_PATH.match(path):
                self._send_file(server._file_bytes, match.group(1), self._send_bytes)
            elif match := _FILE_PATH.match(path):
                self._send_file(server._files, match.group(1), lambda meta: self._send_json(200, meta))
            elif match := _BATCH_PATH.match(path):
                self._send_json(*server.handle_get_batch(match.group(1)))
            else:
                self._send_json(404, _error_payload(404, f"no route GET {path}"))

    return Handler
