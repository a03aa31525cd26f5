"""Secrets for tasks: the environment first, then a Prefect Secret block. Never logged."""

from __future__ import annotations

import os

from rubricem_core.config import EndpointConfig, MissingSecretError


def resolve_api_key(cfg: EndpointConfig) -> str | None:
    """The key named by ``api_key_env``, else the ``api_key_secret_block`` Secret; None if neither is set
    in the config (built-in or keyless providers). Fails fast naming the variable when it is required."""
    if cfg.api_key_env and os.environ.get(cfg.api_key_env):
        return os.environ[cfg.api_key_env]
    if cfg.api_key_secret_block:
        from prefect.blocks.system import Secret

        try:
            return Secret.load(cfg.api_key_secret_block).get()
        except ValueError as exc:
            raise MissingSecretError(
                f"Prefect Secret block {cfg.api_key_secret_block!r} not found"
                + (f" and environment variable {cfg.api_key_env} is not set" if cfg.api_key_env else "")
            ) from exc
    if cfg.api_key_env:
        raise MissingSecretError(f"environment variable {cfg.api_key_env} is not set (needed for model {cfg.model})")
    return None


def check_endpoint_keys(*endpoints: EndpointConfig) -> None:
    """Resolve every endpoint's key at flow start, so a missing one fails before any work (not after
    a step's rollouts); the keys themselves are not kept."""
    for endpoint in endpoints:
        resolve_api_key(endpoint)
