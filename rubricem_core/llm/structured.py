"""One client for every structured (JSON-reply) call: the stagewise judge, the reflection judge and the
benchmark graders.

Each caller keeps its prompts, schemas and the parsing of its own verdicts. What is the same for all of
them lives here: the request (sampling options, the reply format per ``structured_output``), sending
through ``run_concurrent`` (bounded concurrency, retries with backoff on 429/5xx/timeouts, resampling of
replies that are not JSON), validation of every reply by the caller's checker, one repair turn that
sends an unusable reply's validation error back, and a usage record of every call made.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Self

from rubricem_core.llm.concurrent import arun_concurrent, run_sync
from rubricem_core.llm.replies import STRUCTURED_OUTPUT_MODES, ReplyError, repair_message, response_format
from rubricem_core.llm.types import ChatRequest, ChatResult, EndpointSettings

# Called once per answered call: (result, repair) — the caller's usage accounting.
RecordFn = Callable[[ChatResult, bool], None]


@dataclass
class StructuredOptions:
    """Sampling and reply options every structured caller has; callers subclass it with their own."""

    temperature: float | None = field(default=0.0, metadata={"help": "Sampling temperature; None = provider default."})
    max_tokens: int = field(default=4096, metadata={"help": "Completion budget of one call."})
    seed: int | None = field(default=0, metadata={"help": "Sampling seed sent with every call (None: not sent)."})
    structured_output: str = field(
        default="json_schema",
        metadata={"help": "response_format sent: json_schema (exact schema), json_object, or none."},
    )
    repair: bool = field(default=True, metadata={"help": "Send an invalid reply's error back once for a fix."})

    error_type: ClassVar[type[Exception]] = ValueError  # what a bad value raises (the caller's error)

    def __post_init__(self) -> None:
        name = type(self).__name__
        if self.structured_output not in STRUCTURED_OUTPUT_MODES:
            raise self.error_type(
                f"{name}.structured_output must be one of {STRUCTURED_OUTPUT_MODES}, got {self.structured_output!r}"
            )
        if self.max_tokens < 1:
            raise self.error_type(f"{name}.max_tokens must be >= 1")

    @classmethod
    def from_config(cls, section: Any, **overrides: Any) -> Self:
        """The options a config section sets (its fields of the same names), then ``overrides`` for what the
        section does not hold (the run's seed, the recipe's stages...)."""
        names = [f.name for f in dataclasses.fields(cls) if f.init]
        values = {name: getattr(section, name) for name in names if hasattr(section, name)}
        return cls(**{**values, **overrides})


@dataclass
class StructuredCall:
    """One logical call while it goes through first try and repair; ``validate`` turns the reply text into
    a value or raises ``ReplyError`` (which triggers the repair)."""

    request: ChatRequest
    validate: Callable[[str | None], Any]
    value: Any = None
    error: str | None = None
    last_text: str | None = None


class StructuredClient:
    """Structured calls against one endpoint with one set of options."""

    def __init__(
        self, settings: EndpointSettings, options: StructuredOptions | None = None, failure: str = "judge call failed"
    ) -> None:
        self.settings = settings
        self.options = options or StructuredOptions()
        self.failure = failure  # the error of a failed call that came back without one

    def request(self, custom_id: str, messages: list[dict[str, str]], name: str, schema: dict[str, Any]) -> ChatRequest:
        """The chat request of a call whose reply must follow ``schema`` (``name`` names it to the provider)."""
        options = self.options
        return ChatRequest(
            custom_id=custom_id,
            model="",
            messages=messages,
            max_tokens=options.max_tokens,
            temperature=options.temperature,
            seed=options.seed,
            response_format=response_format(options.structured_output, name, schema),
        )

    def call(
        self,
        custom_id: str,
        messages: list[dict[str, str]],
        name: str,
        schema: dict[str, Any],
        validate: Callable[[str | None], Any],
    ) -> StructuredCall:
        return StructuredCall(self.request(custom_id, messages, name, schema), validate)

    def ask(self, calls: Sequence[StructuredCall], record: RecordFn | None = None) -> None:
        """First try for all, then one repair for those whose reply came back but was unusable. Validated
        values land in ``value``, problems in ``error``; ``record`` sees every answered call."""
        run_sync(self.aask(calls, record))

    async def aask(
        self, calls: Sequence[StructuredCall], record: RecordFn | None = None, limit: asyncio.Semaphore | None = None
    ) -> None:
        """``ask`` on the running loop; ``limit`` bounds the calls in flight together with other ``aask``
        calls sharing it (a streaming judge's groups)."""
        await self._send(calls, record, False, limit)
        if not self.options.repair:
            return
        to_repair = []
        for call in calls:
            if call.error is None or call.last_text is None:
                continue
            to_repair.append(call)
            messages = [
                *call.request.messages,
                {"role": "assistant", "content": call.last_text},
                repair_message(call.error),
            ]
            call.request = dataclasses.replace(
                call.request, custom_id=call.request.custom_id + ":repair", messages=messages
            )
        await self._send(to_repair, record, True, limit)

    async def _send(
        self, calls: Sequence[StructuredCall], record: RecordFn | None, repair: bool, limit: asyncio.Semaphore | None
    ) -> None:
        if not calls:
            return
        results = await arun_concurrent([c.request for c in calls], self.settings, limit=limit)
        for call, result in zip(calls, results):
            if record is not None:
                record(result, repair)
            call.last_text = result.text
            if not result.ok and result.text is None:
                call.error = result.error or self.failure
                continue
            try:
                call.value, call.error = call.validate(result.text), None
            except ReplyError as exc:
                call.error = str(exc)
