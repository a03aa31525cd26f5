"""An API-key check on every route of a `vllm serve` process (``--middleware`` of VLLMServer).

vLLM's own ``--api-key``/``VLLM_API_KEY`` check guards only paths under ``/v1``; with
``VLLM_SERVER_DEV_MODE=1`` (which this project needs for ``/collective_rpc``, ``/reset_prefix_cache``,
``/sleep``, ``/wake_up`` and the weight-transfer routes) anyone who reaches the port could reload the
policy's weights. This ASGI middleware answers 401 to any HTTP or websocket request, on any path, that
does not carry ``Authorization: Bearer <VLLM_API_KEY>``. It runs inside the server (vLLM adds a class
named by ``--middleware`` with ``app.add_middleware``), reads the key from the server's environment
(never its command line, which ``ps`` shows), and imports nothing but the standard library.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
from typing import Any

KEY_ENV = "VLLM_API_KEY"


class RequireApiKey:
    """Pure ASGI middleware: every request needs the bearer key; lifespan events pass."""

    def __init__(self, app: Any) -> None:
        self.app = app
        key = os.environ.get(KEY_ENV, "")
        if not key:
            raise RuntimeError(f"{__name__}.RequireApiKey needs {KEY_ENV} in the server's environment")
        self._digest = hashlib.sha256(key.encode()).digest()

    def _allowed(self, scope: dict[str, Any]) -> bool:
        for name, value in scope.get("headers", []):
            if name.lower() == b"authorization":
                scheme, _, token = value.decode("latin-1").partition(" ")
                return scheme.lower() == "bearer" and hmac.compare_digest(
                    hashlib.sha256(token.encode()).digest(), self._digest
                )
        return False

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] not in ("http", "websocket") or self._allowed(scope):
            await self.app(scope, receive, send)
            return
        if scope["type"] == "websocket":
            await send({"type": "websocket.close", "code": 1008})
            return
        body = json.dumps({"error": "Unauthorized"}).encode()
        await send(
            {
                "type": "http.response.start",
                "status": 401,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())],
            }
        )
        await send({"type": "http.response.body", "body": body})
