"""In-process litellm providers: registration, OpenAI-style stop/length handling, usage."""

from __future__ import annotations

import asyncio

import litellm
import pytest

from rubricem_core.sim.provider import (
    ProviderRegistrationError,
    register_completion_provider,
    registered_provider_names,
    truncate_like_openai,
)


def test_truncate_cuts_before_first_stop_string() -> None:
    text, reason = truncate_like_openai("plan </plan> then <call_tool> x", stop=["<call_tool>", "</plan>"])
    assert (text, reason) == ("plan ", "stop")


def test_truncate_length_wins_when_limit_comes_before_stop() -> None:
    text, reason = truncate_like_openai("a b c d STOP e", stop=["STOP"], max_tokens=2)
    assert (text, reason) == ("a b", "length")
    text, reason = truncate_like_openai("a b STOP c d e", stop=["STOP"], max_tokens=2)
    assert (text, reason) == ("a b ", "stop")


def test_truncate_without_limits_keeps_text_and_reports_stop() -> None:
    assert truncate_like_openai("  keep   spacing ", stop=None, max_tokens=10) == ("  keep   spacing ", "stop")
    assert truncate_like_openai("one two", stop="", max_tokens=0) == ("", "length")


def test_completion_through_litellm_applies_stop_and_counts_words() -> None:
    seen: list[tuple[list, dict]] = []

    def respond(messages: list[dict], params: dict) -> str:
        seen.append((messages, params))
        return "<answer>short</answer> trailing words"

    register_completion_provider("rubricem_test_stop", respond)
    response = litellm.completion(
        model="rubricem_test_stop/teacher-v1",
        messages=[{"role": "system", "content": "be brief"}, {"role": "user", "content": "what is x"}],
        stop=["</answer>"],
        max_tokens=50,
        temperature=0.3,
        seed=7,
    )
    assert response.choices[0].message.content == "<answer>short"
    assert response.choices[0].finish_reason == "stop"
    assert response.usage.prompt_tokens == 5
    assert response.usage.completion_tokens == 1
    messages, params = seen[0]
    assert messages[1]["content"] == "what is x"
    assert params["model"] == "teacher-v1"
    assert params["stop"] == ["</answer>"]
    assert params["max_tokens"] == 50 and params["temperature"] == 0.3 and params["seed"] == 7


def test_acompletion_reports_length_finish_reason() -> None:
    register_completion_provider("rubricem_test_len", lambda messages, params: "w1 w2 w3 w4 w5")
    response = asyncio.run(
        litellm.acompletion(
            model="rubricem_test_len/x",
            messages=[{"role": "user", "content": [{"type": "text", "text": "a b"}]}],
            max_tokens=3,
        )
    )
    assert response.choices[0].message.content == "w1 w2 w3"
    assert response.choices[0].finish_reason == "length"
    assert response.usage.prompt_tokens == 2
    assert response.usage.completion_tokens == 3


def test_reregistration_replaces_the_respond_function() -> None:
    register_completion_provider("rubricem_test_rereg", lambda messages, params: "first")
    register_completion_provider("rubricem_test_rereg", lambda messages, params: "second")
    assert registered_provider_names().count("rubricem_test_rereg") == 1
    assert sum(item["provider"] == "rubricem_test_rereg" for item in litellm.custom_provider_map) == 1
    response = litellm.completion(model="rubricem_test_rereg/m", messages=[{"role": "user", "content": "hi"}])
    assert response.choices[0].message.content == "second"


def test_respond_error_surfaces_as_bad_request() -> None:
    def broken(messages: list[dict], params: dict) -> str:
        raise KeyError("missing world spec")

    register_completion_provider("rubricem_test_broken", broken)
    with pytest.raises(litellm.BadRequestError, match="missing world spec"):
        litellm.completion(model="rubricem_test_broken/m", messages=[{"role": "user", "content": "hi"}])


def test_invalid_registrations_are_rejected() -> None:
    with pytest.raises(ProviderRegistrationError, match="built-in litellm provider"):
        register_completion_provider("openai", lambda messages, params: "x")
    with pytest.raises(ProviderRegistrationError, match="must match"):
        register_completion_provider("Bad Name", lambda messages, params: "x")
    with pytest.raises(ProviderRegistrationError, match="callable"):
        register_completion_provider("rubricem_test_nc", "not a function")  # type: ignore[arg-type]
