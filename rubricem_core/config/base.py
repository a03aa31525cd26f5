"""What every config section shares: the strict model base, the error type, the profiles folder."""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel, ConfigDict

PROFILES_DIR = Path(__file__).resolve().parents[2] / "data" / "profiles"


class ConfigError(ValueError):
    """A profile or override is invalid; the message names the file and field."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)
