"""One factory for every endpoint a run calls — the teacher, the judge, the reflection judge and the
benchmark grader: a config section and its API key in, ``EndpointSettings`` out, with the built-in
provider registered when the section's model string names one (``rubricem-judge/...`` and the like).

The built-in providers are offline stand-ins (the ``sim`` package), found by their provider name
through ``rubricem_core.stand_ins``; they are imported only when a model names them, so a run against
real endpoints never loads them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from rubricem_core.config import EndpointConfig, require_env
from rubricem_core.llm.types import EndpointSettings
from rubricem_core.redact import reveal_url
from rubricem_core.stand_ins import is_stand_in, stand_in, stand_in_names

_NOT_FROM_CONFIG = ("model", "api_key")  # the model may be rewritten; the key is resolved by the caller


def builtin_provider(model: str) -> str | None:
    """The built-in provider a litellm model string names, or None for any other model."""
    provider, slash, _ = model.partition("/")
    return provider if slash and is_stand_in("provider", provider) else None


def register_builtin(cfg: EndpointConfig, max_tool_calls: int = 10) -> str:
    """Register the built-in provider ``cfg.model`` names (idempotent); returns the model string to call."""
    provider = builtin_provider(cfg.model)
    if provider is None:
        raise ValueError(f"model {cfg.model!r} names no built-in provider ({', '.join(stand_in_names('provider'))})")
    register: Callable[..., str | None] = stand_in("provider", provider)
    # The judge, reflection judge and grader register their provider and return the model to call
    # ("<provider>/builtin", whatever the config's suffix); the teacher is configured from its section
    # (error rates) and answers the model as written.
    if provider == "rubricem-teacher":
        register(cfg, max_tool_calls=max_tool_calls)
        return cfg.model
    model = register()  # the others return the model to call
    if model is None:
        raise ValueError(f"the built-in provider {provider!r} returned no model to call")
    return model


def endpoint_settings(cfg: EndpointConfig, api_key: str | None = None, model: str | None = None) -> EndpointSettings:
    """litellm settings from an endpoint section: every ``EndpointSettings`` field the section has (the batch
    fields exist on the teacher only). ``api_key`` overrides the environment (the Prefect layer passes a
    Secret block's value); ``model`` overrides the section's (a built-in provider's model)."""
    model = model or cfg.model
    if api_key is None and cfg.api_key_env:
        api_key = require_env(cfg.api_key_env, purpose=f"model {model}")
    names = [f.name for f in dataclasses.fields(EndpointSettings) if f.name not in _NOT_FROM_CONFIG]
    fields = {name: getattr(cfg, name) for name in names if hasattr(cfg, name)}
    if fields.get("api_base"):  # the config holds it with its credentials masked (rubricem_core.redact)
        fields["api_base"] = reveal_url(fields["api_base"], field=f"the api_base of model {model}")
    return EndpointSettings(model=model, api_key=api_key, **fields)


def endpoint_for(cfg: EndpointConfig, api_key: str | None = None, *, max_tool_calls: int = 10) -> EndpointSettings:
    """The settings of one endpoint section, its built-in provider registered first when it names one.

    ``max_tool_calls`` configures the built-in teacher (the run's ``tools.max_tool_calls``); other
    endpoints ignore it.
    """
    model = register_builtin(cfg, max_tool_calls) if builtin_provider(cfg.model) else cfg.model
    return endpoint_settings(cfg, api_key=api_key, model=model)
