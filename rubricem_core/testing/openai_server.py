"""A fake OpenAI-compatible HTTP server for tests (chat completions, files, batches).

Runs a stdlib ``ThreadingHTTPServer`` on 127.0.0.1 with a free port in a background thread, so
litellm and the openai SDK talk to it over real HTTP — the same code path as a real provider::

    with FakeOpenAIServer(respond=lambda body: "hello") as server:
        litellm.completion(model="openai/any", api_base=server.base_url, api_key="k", messages=[...])

``respond(body) -> str`` receives the chat-completions request body (a dict; for batches, the
``body`` of each JSONL line) and returns the full generation; ``body["stop"]`` and
``body["max_tokens"]`` are applied like OpenAI does. Usage counts whitespace words.

Endpoints: POST /v1/chat/completions, POST /v1/files (multipart upload), GET /v1/files/{id},
GET /v1/files/{id}/content, POST /v1/batches, GET /v1/batches/{id}, POST /v1/batches/{id}/cancel.
A batch moves validating → in_progress → completed over successive GET polls
(``polls_in_progress`` polls stay in_progress); it is processed when it leaves in_progress.

Fault injection (all mutable attributes, change them between calls):

- ``fail_custom_ids``: batch lines with these custom ids always fail; how depends on
  ``failure_style``: ``"error_file"`` (a line in the batch's error file with an ``error`` object) or
  ``"status_500"`` (a line in the output file whose response has status_code ``fail_status``).
- ``fail_times``: {custom_id: k} fails that id (as above) only the first k times it is seen in a
  batch, to test resubmission.
- ``bad_request_ids``: batch lines answered with status_code 400 (a permanent error).
- ``malformed_ids``: batch lines that come back broken; ``malformed_style`` ``"truncated_line"``
  writes a cut-off JSON line, ``"bad_content"`` returns content that is truncated JSON text.
- ``http_errors``: a queue of status codes (or ``(status, headers)`` pairs, a header value may be a
  function called when the error is sent, e.g. an HTTP-date); each of the next chat calls pops one and
  returns it as an error response instead of answering.
- ``rate_limit``: a ``RateLimit`` token bucket (``per_second`` calls, ``burst`` at once): a chat call
  that finds it empty gets 429 with the time to the next token as ``Retry-After`` (whole seconds,
  rounded up), ``retry-after-ms`` beside it, or an HTTP-date (``RateLimit.retry_after``).
- ``concurrency_limit``: a chat call that arrives while this many are being answered gets 429 with
  ``retry-after-ms: 20`` (an endpoint that serves a few calls at a time); ``concurrency_retry_after`` sets
  other headers (``{"Retry-After": "1"}``: a whole second, as many such endpoints say).
- ``upload_errors``: like ``http_errors``, for the next file uploads (POST /v1/files).
- ``server_error_rate``: the share of admitted chat calls answered 500 instead (seeded by ``seed``).
- ``expire_next_batch``: the next created batch ends "expired" with output for only the first
  half of its lines (the flag resets itself). ``fail_next_batch``: the next batch ends "failed"
  with a validation error and no output.
- ``delay_s``: seconds each chat call waits before answering (to provoke client timeouts).
- ``api_key``: when set, requests without ``Authorization: Bearer <api_key>`` get a 401.

Records for assertions: ``chat_calls`` (bodies of chat calls that were answered or failed),
``chat_events`` (one ``ChatEvent`` per chat call: arrival and end times, status, calls in flight, the
Retry-After it was told, a digest of its messages), ``max_in_flight`` (most calls being answered at once),
``uploaded_lines`` (every parsed JSONL line of every batch upload, in order), ``uploads`` (file
metadata), ``batches`` (the live batch objects, each with an extra ``custom_ids`` list),
``request_log`` ((method, path) of every HTTP request).
"""

from __future__ import annotations

import collections
import email.parser
import email.policy
import email.utils
import hashlib
import json
import math
import random
import threading
import time
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from rubricem_core.sim.provider import count_prompt_words, count_words, truncate_like_openai
from rubricem_core.testing.openai_http import _error_payload, _make_handler, _parse_multipart
from rubricem_core.testing.served import ServedInThread

RespondToBody = Callable[[dict[str, Any]], str]

_TERMINAL = {"completed", "expired", "failed", "cancelled"}


def _new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:16]}"


RETRY_AFTER_STYLES = ("seconds", "ms", "http-date")


@dataclass
class RateLimit:
    """A provider's request limit: ``per_second`` calls on average, ``burst`` at once (default: one
    second's worth); ``retry_after`` is how a 429 says when to come back (``RETRY_AFTER_STYLES``)."""

    per_second: float
    burst: float | None = None
    retry_after: str = "ms"

    def __post_init__(self) -> None:
        if self.retry_after not in RETRY_AFTER_STYLES:
            raise ValueError(f"retry_after must be one of {RETRY_AFTER_STYLES}, got {self.retry_after!r}")
        if self.burst is None:
            self.burst = max(1.0, self.per_second)


@dataclass
class ChatEvent:
    """One chat call as the server saw it."""

    arrived: float  # time.time() at arrival
    status: int
    in_flight: int  # calls being answered when it arrived (itself included when admitted)
    digest: str  # of its messages: the same request sent twice has the same digest
    retry_after_s: float | None = None  # what a 429 asked for (an HTTP-date: seconds from arrival to it)
    retry_at: float | None = None  # time.time() before which a 429 asked not to come back
    ended: float = 0.0


def messages_digest(body: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(body.get("messages"), sort_keys=True).encode()).hexdigest()[:16]


class FakeOpenAIServer(ServedInThread):
    """See the module docstring. Use as a context manager, or call ``start()`` / ``stop()``."""

    def __init__(
        self,
        respond: RespondToBody,
        *,
        fail_custom_ids: Iterable[str] = (),
        fail_times: dict[str, int] | None = None,
        failure_style: str = "error_file",
        fail_status: int = 500,
        bad_request_ids: Iterable[str] = (),
        malformed_ids: Iterable[str] = (),
        malformed_style: str = "truncated_line",
        http_errors: Iterable[int | tuple[int, dict[str, Any]]] = (),
        rate_limit: RateLimit | None = None,
        concurrency_limit: int | None = None,
        concurrency_retry_after: dict[str, str] | None = None,
        upload_errors: Iterable[int | tuple[int, dict[str, Any]]] = (),
        server_error_rate: float = 0.0,
        seed: int = 0,
        expire_next_batch: bool = False,
        fail_next_batch: bool = False,
        delay_s: float = 0.0,
        polls_in_progress: int = 1,
        api_key: str | None = None,
    ) -> None:
        if failure_style not in ("error_file", "status_500"):
            raise ValueError(f"failure_style must be 'error_file' or 'status_500', got {failure_style!r}")
        if malformed_style not in ("truncated_line", "bad_content"):
            raise ValueError(f"malformed_style must be 'truncated_line' or 'bad_content', got {malformed_style!r}")
        self.respond = respond
        self.fail_custom_ids: set[str] = set(fail_custom_ids)
        self.fail_times: dict[str, int] = dict(fail_times or {})
        self.failure_style = failure_style
        self.fail_status = fail_status
        self.bad_request_ids: set[str] = set(bad_request_ids)
        self.malformed_ids: set[str] = set(malformed_ids)
        self.malformed_style = malformed_style
        self.http_errors: collections.deque[int | tuple[int, dict[str, Any]]] = collections.deque(http_errors)
        self.rate_limit = rate_limit
        self.concurrency_limit = concurrency_limit
        self.concurrency_retry_after = concurrency_retry_after or {"Retry-After": "1", "retry-after-ms": "20"}
        self.upload_errors: collections.deque[int | tuple[int, dict[str, Any]]] = collections.deque(upload_errors)
        self.server_error_rate = server_error_rate
        self._rng = random.Random(seed)
        self._tokens = rate_limit.burst if rate_limit is not None else 0.0
        self._tokens_at = time.monotonic()
        self.chat_events: list[ChatEvent] = []
        self.in_flight = 0
        self.max_in_flight = 0
        self.expire_next_batch = expire_next_batch
        self.fail_next_batch = fail_next_batch
        self.delay_s = delay_s
        self.polls_in_progress = polls_in_progress
        self.api_key = api_key

        self.chat_calls: list[dict[str, Any]] = []
        self.uploaded_lines: list[dict[str, Any]] = []
        self.uploads: list[dict[str, Any]] = []
        self.batches: list[dict[str, Any]] = []
        self.request_log: list[tuple[str, str]] = []
        self.seen_counts: collections.Counter[str] = collections.Counter()

        self._files: dict[str, dict[str, Any]] = {}
        self._file_bytes: dict[str, bytes] = {}
        self._batches_by_id: dict[str, dict[str, Any]] = {}
        self._batch_plan: dict[str, dict[str, Any]] = {}  # batch id -> {expire, fail, polls}
        self._lock = threading.RLock()

    # ---- lifecycle -------------------------------------------------------------------------
    @property
    def base_url(self) -> str:
        if self._httpd is None:
            raise RuntimeError("FakeOpenAIServer is not running; use it as a context manager or call start()")
        host, port = self._httpd.server_address[:2]
        return f"http://{host!s}:{port}/v1"

    def start(self) -> FakeOpenAIServer:
        # a handler sleeping in delay_s must not hold up stop()
        return self._serve(_make_handler(self), block_on_close=False)

    # ---- helpers for assertions ------------------------------------------------------------
    def batch_custom_ids(self) -> list[list[str]]:
        """The custom ids of each created batch, in creation order."""
        with self._lock:
            return [list(batch["custom_ids"]) for batch in self.batches]

    def file_text(self, file_id: str) -> str:
        with self._lock:
            return self._file_bytes[file_id].decode("utf-8")

    # ---- chat completions ------------------------------------------------------------------
    def completion_body(self, body: dict[str, Any]) -> dict[str, Any]:
        """The OpenAI chat.completion object answering ``body``."""
        raw = self.respond(body)
        text, finish_reason = truncate_like_openai(
            raw, body.get("stop"), body.get("max_tokens") or body.get("max_completion_tokens")
        )
        prompt_tokens = count_prompt_words(body.get("messages") or [])
        completion_tokens = count_words(text)
        return {
            "id": _new_id("chatcmpl"),
            "object": "chat.completion",
            "created": int(time.time()),
            "model": body.get("model", "fake-model"),
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": text},
                    "finish_reason": finish_reason,
                    "logprobs": None,
                }
            ],
            "usage": {
                "prompt_tokens": prompt_tokens,
                "completion_tokens": completion_tokens,
                "total_tokens": prompt_tokens + completion_tokens,
            },
        }

    def _take_token(self) -> float | None:
        """None when the rate limit admits a call now, else the seconds to the next token."""
        limit = self.rate_limit
        if limit is None:
            return None
        now = time.monotonic()
        assert limit.burst is not None and self._tokens is not None
        self._tokens = min(limit.burst, self._tokens + (now - self._tokens_at) * limit.per_second)
        self._tokens_at = now
        if self._tokens >= 1.0:
            self._tokens -= 1.0
            return None
        return (1.0 - self._tokens) / limit.per_second

    def _rate_limited(self, wait: float, event: ChatEvent) -> tuple[int, dict[str, Any], dict[str, str]]:
        assert self.rate_limit is not None
        style = self.rate_limit.retry_after
        if style == "http-date":  # whole seconds: the date is rounded up so it never comes too early
            event.retry_at = math.ceil(event.arrived + wait)
            headers = {"Retry-After": email.utils.formatdate(event.retry_at, usegmt=True)}
        else:
            event.retry_at = event.arrived + (wait if style == "ms" else math.ceil(wait))
            headers = {"Retry-After": str(math.ceil(wait))}
            if style == "ms":
                headers["retry-after-ms"] = str(max(1, math.ceil(wait * 1000)))
        event.retry_after_s = event.retry_at - event.arrived
        return 429, _error_payload(429, "Rate limit reached; try again later"), headers

    def handle_chat(self, body: dict[str, Any]) -> tuple[int, dict[str, Any], dict[str, str]]:
        event = ChatEvent(arrived=time.time(), status=200, in_flight=0, digest=messages_digest(body))
        with self._lock:
            self.chat_calls.append(body)
            self.chat_events.append(event)
            injected = self.http_errors.popleft() if self.http_errors else None
            if injected is None and self.concurrency_limit is not None and self.in_flight >= self.concurrency_limit:
                injected = (429, dict(self.concurrency_retry_after))
            wait = self._take_token() if injected is None else None
            admitted = injected is None and wait is None
            if admitted:
                self.in_flight += 1
                self.max_in_flight = max(self.max_in_flight, self.in_flight)
            event.in_flight = self.in_flight
            server_error = admitted and self.server_error_rate > 0 and self._rng.random() < self.server_error_rate
        try:
            if injected is not None:
                status, values = _injected(injected)
                event.status = status
                if status == 429 and "Retry-After" in values:
                    event.retry_at = _retry_at(values, event.arrived)
                    event.retry_after_s = event.retry_at - event.arrived
                return status, _error_payload(status, "injected error"), values
            if wait is not None:
                event.status = 429
                return self._rate_limited(wait, event)
            if server_error:
                event.status = 500
                return 500, _error_payload(500, "injected server error"), {}
            if self.delay_s:
                time.sleep(self.delay_s)
            return 200, self.completion_body(body), {}
        finally:
            event.ended = time.time()
            if admitted:
                with self._lock:
                    self.in_flight -= 1

    def answered_twice(self) -> list[str]:
        """Digests of messages that got more than one 200 answer."""
        with self._lock:
            counts = collections.Counter(e.digest for e in self.chat_events if e.status == 200)
        return [digest for digest, n in counts.items() if n > 1]

    # ---- files -----------------------------------------------------------------------------
    def add_file(self, data: bytes, filename: str, purpose: str) -> dict[str, Any]:
        file_id = _new_id("file")
        meta = {
            "id": file_id,
            "object": "file",
            "bytes": len(data),
            "created_at": int(time.time()),
            "filename": filename,
            "purpose": purpose,
            "status": "processed",
            "expires_at": None,
            "status_details": None,
        }
        with self._lock:
            self._files[file_id] = meta
            self._file_bytes[file_id] = data
        return meta

    def handle_upload(self, content_type: str, raw: bytes) -> tuple[int, dict[str, Any], dict[str, str]]:
        with self._lock:
            injected = self.upload_errors.popleft() if self.upload_errors else None
        if injected is not None:
            status, headers = _injected(injected)
            return status, _error_payload(status, "injected error"), headers
        fields = _parse_multipart(content_type, raw)
        if "file" not in fields:
            return 400, _error_payload(400, "multipart upload has no 'file' part"), {}
        purpose = fields.get("purpose", (None, b"batch"))[1].decode("utf-8")
        filename, data = fields["file"]
        meta = self.add_file(data, filename or "upload.jsonl", purpose)
        with self._lock:
            self.uploads.append(dict(meta))
            if purpose == "batch":
                for line in data.decode("utf-8").splitlines():
                    if line.strip():
                        self.uploaded_lines.append(json.loads(line))
        return 200, meta, {}

    # ---- batches ---------------------------------------------------------------------------
    def handle_create_batch(self, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        input_file_id = body.get("input_file_id")
        with self._lock:
            if input_file_id not in self._file_bytes:
                return 400, _error_payload(400, f"input_file_id {input_file_id!r} not found")
            lines = [
                json.loads(line)
                for line in self._file_bytes[input_file_id].decode("utf-8").splitlines()
                if line.strip()
            ]
            now = int(time.time())
            batch = {
                "id": _new_id("batch"),
                "object": "batch",
                "endpoint": body.get("endpoint", "/v1/chat/completions"),
                "errors": None,
                "input_file_id": input_file_id,
                "completion_window": body.get("completion_window", "24h"),
                "status": "validating",
                "output_file_id": None,
                "error_file_id": None,
                "created_at": now,
                "in_progress_at": None,
                "expires_at": now + 86400,
                "finalizing_at": None,
                "completed_at": None,
                "failed_at": None,
                "expired_at": None,
                "cancelling_at": None,
                "cancelled_at": None,
                "request_counts": {"total": len(lines), "completed": 0, "failed": 0},
                "metadata": body.get("metadata"),
            }
            self._batches_by_id[batch["id"]] = batch
            self._batch_plan[batch["id"]] = {
                "expire": self.expire_next_batch,
                "fail": self.fail_next_batch,
                "polls_left": self.polls_in_progress,
                "lines": lines,
            }
            self.expire_next_batch = False
            self.fail_next_batch = False
            recorded = dict(batch)
            recorded["custom_ids"] = [line.get("custom_id") for line in lines]
            self.batches.append(recorded)
            self._sync_record(batch)
            return 200, self._public(batch)

    def handle_get_batch(self, batch_id: str) -> tuple[int, dict[str, Any]]:
        return self._on_batch(batch_id, self._advance)

    def handle_cancel_batch(self, batch_id: str) -> tuple[int, dict[str, Any]]:
        return self._on_batch(batch_id, self._cancel)

    def _on_batch(self, batch_id: str, act: Callable[[dict[str, Any]], None]) -> tuple[int, dict[str, Any]]:
        """``act`` on a batch, then its public view; OpenAI's 404 for an unknown id (all under the lock)."""
        with self._lock:
            batch = self._batches_by_id.get(batch_id)
            if batch is None:
                return 404, _error_payload(404, f"No batch found with id '{batch_id}'")
            act(batch)
            return 200, self._public(batch)

    def _cancel(self, batch: dict[str, Any]) -> None:
        if batch["status"] not in _TERMINAL:
            now = int(time.time())
            batch["status"] = "cancelled"
            batch["cancelling_at"] = now
            batch["cancelled_at"] = now
            self._sync_record(batch)

    def _advance(self, batch: dict[str, Any]) -> None:
        plan = self._batch_plan[batch["id"]]
        now = int(time.time())
        if batch["status"] == "validating":
            if plan["fail"]:
                batch["status"] = "failed"
                batch["failed_at"] = now
                batch["errors"] = {
                    "object": "list",
                    "data": [
                        {
                            "code": "invalid_request",
                            "message": "injected validation failure",
                            "line": None,
                            "param": None,
                        }
                    ],
                }
            else:
                batch["status"] = "in_progress"
                batch["in_progress_at"] = now
        elif batch["status"] == "in_progress":
            if plan["polls_left"] > 1:
                plan["polls_left"] -= 1
            else:
                self._finish(batch, plan)
        self._sync_record(batch)

    def _finish(self, batch: dict[str, Any], plan: dict[str, Any]) -> None:
        lines = plan["lines"]
        if plan["expire"]:
            lines = lines[: len(lines) // 2]
        output_lines: list[str] = []
        error_lines: list[str] = []
        completed = failed = 0
        for line in lines:
            custom_id = line.get("custom_id")
            self.seen_counts[custom_id] += 1
            request_id = _new_id("req")
            if custom_id in self.fail_custom_ids or self.seen_counts[custom_id] <= self.fail_times.get(custom_id, 0):
                failed += 1
                if self.failure_style == "error_file":
                    error_lines.append(
                        json.dumps(
                            {
                                "id": _new_id("batch_req"),
                                "custom_id": custom_id,
                                "response": None,
                                "error": {"code": "server_error", "message": "injected failure"},
                            }
                        )
                    )
                else:
                    output_lines.append(
                        json.dumps(
                            {
                                "id": _new_id("batch_req"),
                                "custom_id": custom_id,
                                "response": {
                                    "status_code": self.fail_status,
                                    "request_id": request_id,
                                    "body": _error_payload(self.fail_status, "injected failure"),
                                },
                                "error": None,
                            }
                        )
                    )
                continue
            if custom_id in self.bad_request_ids:
                failed += 1
                output_lines.append(
                    json.dumps(
                        {
                            "id": _new_id("batch_req"),
                            "custom_id": custom_id,
                            "response": {
                                "status_code": 400,
                                "request_id": request_id,
                                "body": _error_payload(400, "injected bad request"),
                            },
                            "error": None,
                        }
                    )
                )
                continue
            body = self.completion_body(line.get("body") or {})
            if custom_id in self.malformed_ids and self.malformed_style == "bad_content":
                body["choices"][0]["message"]["content"] = '{"scores": [1, 2'
            encoded = json.dumps(
                {
                    "id": _new_id("batch_req"),
                    "custom_id": custom_id,
                    "response": {"status_code": 200, "request_id": request_id, "body": body},
                    "error": None,
                }
            )
            if custom_id in self.malformed_ids and self.malformed_style == "truncated_line":
                encoded = encoded[: len(encoded) // 2]
            output_lines.append(encoded)
            completed += 1
        now = int(time.time())
        batch["finalizing_at"] = now
        if output_lines:
            batch["output_file_id"] = self.add_file(
                ("\n".join(output_lines) + "\n").encode("utf-8"), f"{batch['id']}_output.jsonl", "batch_output"
            )["id"]
        if error_lines:
            batch["error_file_id"] = self.add_file(
                ("\n".join(error_lines) + "\n").encode("utf-8"), f"{batch['id']}_error.jsonl", "batch_output"
            )["id"]
        batch["request_counts"] = {"total": len(plan["lines"]), "completed": completed, "failed": failed}
        if plan["expire"]:
            batch["status"] = "expired"
            batch["expired_at"] = now
        else:
            batch["status"] = "completed"
            batch["completed_at"] = now

    def _sync_record(self, batch: dict[str, Any]) -> None:
        for record in self.batches:
            if record["id"] == batch["id"]:
                record.update(batch)

    @staticmethod
    def _public(batch: dict[str, Any]) -> dict[str, Any]:
        return json.loads(json.dumps(batch))


def _injected(entry: int | tuple[int, dict[str, Any]]) -> tuple[int, dict[str, str]]:
    """An injected error's status and headers (a header value may be a function, called now)."""
    status, headers = entry if isinstance(entry, tuple) else (entry, {})
    return status, {name: str(value() if callable(value) else value) for name, value in headers.items()}


def _retry_at(headers: dict[str, str], arrived: float) -> float:
    """The time before which a 429 with these headers asked not to come back."""
    if "retry-after-ms" in headers:
        return arrived + float(headers["retry-after-ms"]) / 1000
    value = headers["Retry-After"]
    try:
        return arrived + float(value)
    except ValueError:
        return email.utils.parsedate_to_datetime(value).timestamp()
