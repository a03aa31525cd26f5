"""Secrets never shown: the one place that decides which names and values are secret, and masks them.

Every sink uses it: config errors (a refused ``--set`` names the field, never a key-like value),
``config.yaml`` and everything dumped from the config (MLflow params, Prefect flow-run parameters,
launch files), error texts of LLM calls and the MLflow tracker's refusal of secret-named params.

Credentials inside a URL (``https://user:pass@host``, ``?api_key=…``) are *held*: the config keeps the
masked URL (``https://user:***@host``), so nothing recorded from it carries them, and this process keeps
the real one in memory (``hold_url_credentials``) for the endpoint that calls it (``reveal_url``). A later
process that reads the masked URL back from ``config.yaml`` must be given the URL again.
"""

from __future__ import annotations

import re
import threading
from typing import Any

MASK = "***"

# A name is secret-like when its last word is one of these ("api_key", "hf_token", "db_password",
# "openaiApiKey"). Judging by the last word lets names that only point at a secret or merely mention
# the word pass: "api_key_env" (an env var name), "api_key_secret_block", "max_tokens", "token_level".
SECRET_LAST_WORDS = frozenset(
    {"key", "apikey", "token", "secret", "password", "passwd", "pwd", "credential", "credentials"}
)
_WORDS = re.compile(r"[A-Z]?[a-z]+|[A-Z]+(?![a-z])|\d+")
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
# Prefixes of provider keys and tokens (OpenAI/Anthropic sk-, Hugging Face hf_, Groq gsk_, GitHub ghp_/
# github_pat_, GitLab glpat-, Slack xox?-, Google AIza, xAI xai-, Replicate r8_).
_KEY_PREFIXES = (
    "sk-",
    "sk_",
    "hf_",
    "gsk_",
    "ghp_",
    "gho_",
    "ghs_",
    "github_pat_",
    "glpat-",
    "xox",
    "AIza",
    "xai-",
    "r8_",
)
# scheme://user:password@ or scheme://token@ in free text
_URL_USERINFO = re.compile(r"(?P<head>\b[A-Za-z][A-Za-z0-9+.\-]*://)(?P<userinfo>[^\s/@?#]+)@")
# ?api_key=… / &token=… in free text
_QUERY_PARAM = re.compile(r"(?P<head>[?&](?P<name>[A-Za-z0-9_.\-]+)=)(?P<value>[^&\s#'\"]+)")
_HELD: dict[str, str] = {}
_HELD_LOCK = threading.Lock()


class MissingSecretError(RuntimeError):
    """A required API key or credential is not available; the message names the variable or field."""


def _words(name: str) -> list[str]:
    leaf = str(name).rsplit(".", 1)[-1]
    return [w.lower() for part in re.split(r"[^A-Za-z0-9]+", leaf) for w in _WORDS.findall(part)]


def is_secret_name(name: str) -> bool:
    """The field holds a secret itself (its last word says so): ``api_key``, ``hf_token``, ``password``."""
    words = _words(name)
    if not words or words[-1] not in SECRET_LAST_WORDS:
        return False
    return not (len(words) > 1 and words[-2] == "per")  # a unit such as cost_per_token


def mentions_secret(name: str) -> bool:
    """Any word of the field's leaf is secret-like (``api_key_env``, ``api_key_secret_block`` too): a value
    refused for such a field may be a key pasted in the wrong place, so errors never show it."""
    words = _words(name)
    return any(w in SECRET_LAST_WORDS for w in words) and not (len(words) > 1 and "per" in words)


def looks_like_secret(value: str) -> bool:
    """A value shaped like a provider key or token rather than a name: a known key prefix, or a long run
    of mixed letters and digits."""
    text = value.strip()
    if len(text) >= 16 and text.startswith(_KEY_PREFIXES):
        return True
    for run in re.split(r"[^A-Za-z0-9]+", text):
        # random keys mix cases and digits; names (OPENAI_API_KEY, RUBRICEM_JUDGE_KEY_2) are words
        if len(run) >= 20 and re.search(r"\d", run) and re.search(r"[A-Za-z]", run):
            return True
    return False


def is_env_var_name(value: str) -> bool:
    """An environment-variable name (letters, digits, underscores; not starting with a digit) that does
    not look like a key."""
    return bool(_ENV_NAME.match(value)) and not looks_like_secret(value)


_BLOCK_NAME = re.compile(r"^[a-z0-9][a-z0-9-]{0,99}$")  # Prefect: lowercase letters, digits and dashes


def is_block_name(value: str) -> bool:
    """A Prefect block name that is not shaped like a key: a known key prefix is refused at any length (a
    short ``sk-…`` is a key, not a name)."""
    text = value.strip()
    return bool(_BLOCK_NAME.match(text)) and not text.startswith(_KEY_PREFIXES) and not looks_like_secret(text)


def redact_text(text: str) -> str:
    """Free text (a URL, an error message, a log line) with the credentials of every URL in it masked:
    ``https://user:pass@host/v1?api_key=k`` → ``https://user:***@host/v1?api_key=***``; a user part that looks
    like a token is masked whole."""

    def mask(match: re.Match[str]) -> str:
        user, colon, _password = match["userinfo"].partition(":")
        if colon:
            return f"{match['head']}{user}:{MASK}@"
        return f"{match['head']}{MASK}@" if looks_like_secret(user) else match[0]

    def mask_param(match: re.Match[str]) -> str:
        return f"{match['head']}{MASK}" if mentions_secret(match["name"]) else match[0]

    return _QUERY_PARAM.sub(mask_param, _URL_USERINFO.sub(mask, text))


def _holds_secret(value: Any) -> bool:
    if isinstance(value, str):
        return looks_like_secret(value)
    if isinstance(value, dict):
        return any(mentions_secret(str(k)) or _holds_secret(v) for k, v in value.items())
    if isinstance(value, (list, tuple)):
        return any(_holds_secret(v) for v in value)
    return False


def shown_value(name: str, value: Any) -> str:
    """How an error message may show ``value`` of field ``name``: not at all for a secret-like field or a
    value that is or holds something key-like, URLs with their credentials masked, else its repr."""
    if mentions_secret(name) or _holds_secret(value):
        return "<value not shown>"
    return redact_text(repr(value))


def hold_url_credentials(url: str) -> str:
    """The URL with its credentials masked; the real one is kept in this process for ``reveal_url``."""
    masked = redact_text(url)
    if masked != url:
        with _HELD_LOCK:
            _HELD[masked] = url
    return masked


def reveal_url(url: str, field: str) -> str:
    """The real URL behind a masked one this process holds; an unmasked URL as it is."""
    if MASK not in url:
        return url
    with _HELD_LOCK:
        real = _HELD.get(url)
    if real is None:
        raise MissingSecretError(
            f"{field} {url} has its credentials masked (they are never recorded, e.g. in the run's config.yaml); "
            "give the full URL again in this command (--set <section>.api_base=...)"
        )
    return real
