"""In-process chat providers registered with litellm.

The built-in teacher and judge are plain Python functions; registering them as litellm custom
providers lets the offline default travel exactly the code path a real provider does
(``litellm.completion`` / ``acompletion``, the concurrent runner, the result parsing).

Tokens are counted as whitespace-separated words: there is no real tokenizer behind these
providers, and a word count is deterministic and good enough for budgets and usage columns.
"""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Callable
from typing import Any

from litellm import CustomLLM
from litellm.llms.custom_llm import CustomLLMError
from litellm.types.utils import Usage

from rubricem_core.llm._litellm import litellm
from rubricem_core.llm.types import message_text

RespondFn = Callable[[list[dict[str, Any]], dict[str, Any]], str]

_WORD = re.compile(r"\S+")
_REGISTRY_LOCK = threading.Lock()


class ProviderRegistrationError(ValueError):
    """A provider name or respond function is unusable."""


def count_words(text: str) -> int:
    return len(_WORD.findall(text))


def count_prompt_words(messages: list[dict[str, Any]]) -> int:
    return sum(count_words(message_text(message.get("content"))) for message in messages)


def _normalize_stop(stop: Any) -> list[str]:
    if stop is None:
        return []
    if isinstance(stop, str):
        return [stop] if stop else []
    return [item for item in stop if isinstance(item, str) and item]


def truncate_like_openai(text: str, stop: Any = None, max_tokens: int | None = None) -> tuple[str, str]:
    """Apply ``stop`` and ``max_tokens`` to a full generation the way the OpenAI API does.

    The text is cut before the earliest stop string (which is not included) with finish_reason
    "stop" — unless more than ``max_tokens`` words come before that point, in which case the
    generation would have hit the length limit first: it is cut after ``max_tokens`` words with
    finish_reason "length".
    """
    finish_reason = "stop"
    cut = len(text)
    for stop_string in _normalize_stop(stop):
        position = text.find(stop_string)
        if 0 <= position < cut:
            cut = position
    text = text[:cut]
    if max_tokens is not None and max_tokens >= 0:
        words = list(_WORD.finditer(text))
        if len(words) > max_tokens:
            text = text[: words[max_tokens - 1].end()] if max_tokens > 0 else ""
            finish_reason = "length"
    return text, finish_reason


class _RespondingLLM(CustomLLM):
    """A litellm ``CustomLLM`` whose generation is ``respond(messages, params)``."""

    def __init__(self, provider_name: str, respond: RespondFn) -> None:
        super().__init__()
        self.provider_name = provider_name
        self.respond = respond

    def _fill(self, model: str, messages: list, optional_params: dict, model_response: Any) -> Any:
        params: dict[str, Any] = {
            "model": model,
            "stop": _normalize_stop(optional_params.get("stop")) or None,
            "max_tokens": optional_params.get("max_tokens", optional_params.get("max_completion_tokens")),
            "temperature": optional_params.get("temperature"),
            "seed": optional_params.get("seed"),
            "response_format": optional_params.get("response_format"),
        }
        try:
            raw = self.respond(messages, params)
        except CustomLLMError:
            raise  # respond chose its own status (e.g. 503 to simulate a transient outage)
        except Exception as exc:
            # An in-process function that raised will raise again: report it as a 400 so callers
            # fail the request at once instead of retrying a deterministic error.
            raise CustomLLMError(
                status_code=400,
                message=f"provider {self.provider_name!r}: respond() raised {type(exc).__name__}: {exc}",
            ) from exc
        if not isinstance(raw, str):
            raise CustomLLMError(
                status_code=400,
                message=f"provider {self.provider_name!r}: respond() returned {type(raw).__name__}, expected str",
            )
        text, finish_reason = truncate_like_openai(raw, params["stop"], params["max_tokens"])
        prompt_tokens = count_prompt_words(messages)
        completion_tokens = count_words(text)
        model_response.choices[0].message.content = text
        model_response.choices[0].finish_reason = finish_reason
        model_response.model = f"{self.provider_name}/{model}"
        model_response.created = int(time.time())
        model_response.usage = Usage(
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            total_tokens=prompt_tokens + completion_tokens,
        )
        return model_response

    # The full signature of litellm's CustomLLM (mypy checks the override), though litellm passes it all by name
    def completion(
        self,
        model: str,
        messages: list,
        api_base: str,
        custom_prompt_dict: dict,
        model_response: Any,
        print_verbose: Callable,
        encoding: Any,
        api_key: Any,
        logging_obj: Any,
        optional_params: dict,
        *args: Any,
        **kwargs: Any,
    ) -> Any:
        return self._fill(model, messages, optional_params, model_response)

    async def acompletion(self, *args: Any, **kwargs: Any) -> Any:
        # completion's arguments (an override with *args, **kwargs accepts the base signature); respond() is
        # CPU-bound Python, so it runs right here: a thread would not run it faster under the GIL.
        return self.completion(*args, **kwargs)


_PROVIDER_NAME = re.compile(r"^[a-z][a-z0-9_\-]*$")


def register_completion_provider(name: str, respond: RespondFn) -> None:
    """Make ``litellm.completion(model=f"{name}/anything", ...)`` answer with ``respond``.

    ``respond(messages, params)`` gets the chat messages and {model, stop, max_tokens, temperature,
    seed, response_format} and returns the full generation; stop and max_tokens are applied here.
    Registering a name again replaces its respond function.
    """
    if not isinstance(name, str) or not _PROVIDER_NAME.match(name):
        raise ProviderRegistrationError(f"provider name {name!r} must match {_PROVIDER_NAME.pattern}")
    if name in litellm.provider_list and name not in litellm._custom_providers:
        raise ProviderRegistrationError(f"provider name {name!r} is a built-in litellm provider; pick another")
    if not callable(respond):
        raise ProviderRegistrationError(f"provider {name!r}: respond must be callable")
    handler = _RespondingLLM(name, respond)
    with _REGISTRY_LOCK:
        # Rebind a fresh list rather than mutate: a call in flight keeps iterating a consistent list.
        others = [item for item in litellm.custom_provider_map if item.get("provider") != name]
        litellm.custom_provider_map = [*others, {"provider": name, "custom_handler": handler}]


def registered_provider_names() -> list[str]:
    return [
        item["provider"]
        for item in litellm.custom_provider_map
        if isinstance(item.get("custom_handler"), _RespondingLLM)
    ]
