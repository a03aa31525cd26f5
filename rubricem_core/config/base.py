"""What every config section shares: the strict model base, the error type, the profiles folder."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from pathlib import Path

from pydantic import BaseModel, ConfigDict

PROFILES_DIR = Path(__file__).resolve().parents[2] / "data" / "profiles"


class ConfigError(ValueError):
    """A profile or override is invalid; the message names the file and field."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


def check_known(values: Iterable[str], known: Sequence[str], message: str) -> None:
    """A validator's check that every value is one of ``known``; else ValueError(message), its ``{unknown}``
    filled with the values not known (in order) and ``{known}`` with the known ones (as a list)."""
    unknown = [v for v in values if v not in known]
    if unknown:
        raise ValueError(message.format(unknown=unknown, known=list(known)))
