"""Loading a profile with overrides, naming what is wrong in it, and the config's flat and YAML forms."""

from __future__ import annotations

import difflib
import os
import typing
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from rubricem_core.config.base import PROFILES_DIR, ConfigError
from rubricem_core.config.run import RunConfig
from rubricem_core.redact import (
    MissingSecretError,
    hold_url_credentials,
    is_secret_name,
    shown_value,
)


# ---- loading ---------------------------------------------------------------------------------
def profile_path(profile: str | os.PathLike[str]) -> Path:
    """A profile name (``tiny``) or a path to a YAML file. Only a ``*.yaml``/``*.yml`` name or one with a path
    separator is a file: a bare name is looked up in ``data/profiles`` even when a folder of that name is in
    the working directory (``runs/tiny`` after ``make run``, seen from ``runs/``)."""
    path, text = Path(profile), os.fspath(profile)
    if path.suffix in (".yaml", ".yml") or "/" in text or os.sep in text:
        if not path.is_file():
            raise ConfigError(f"profile file not found: {path}")
        return path
    candidate = PROFILES_DIR / f"{profile}.yaml"
    if not candidate.is_file():
        known = sorted(p.stem for p in PROFILES_DIR.glob("*.yaml"))
        raise ConfigError(f"unknown profile {str(profile)!r}; known profiles: {', '.join(known)}")
    return candidate


def _model_of(annotation: Any) -> type[BaseModel] | None:
    """The config section class a field holds (``X``, ``X | None``), None for a plain value."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in typing.get_args(annotation):
        found = _model_of(arg)
        if found is not None:
            return found
    return None


def config_keys(model: type[BaseModel] | None = None, prefix: str = "") -> list[str]:
    """Every dotted key of the run config, sections and values (``teacher``, ``teacher.max_rounds``)."""
    model = RunConfig if model is None else model
    out: list[str] = []
    for name, field in model.model_fields.items():
        out.append(prefix + name)
        section = _model_of(field.annotation)
        if section is not None:
            out += config_keys(section, f"{prefix}{name}.")
    return out


def nearest_key(loc: tuple[str, ...], value: Any = None) -> str | None:
    """The valid dotted key closest to an unknown one at the same depth (difflib), e.g.
    ``teacher.max_round`` → ``teacher.max_rounds``; a misspelt section holding one key is completed
    (``teachr.max_rounds`` → ``teacher.max_rounds``). None when nothing is close."""
    keys = config_keys()
    wanted = ".".join(loc)
    same_depth = [k for k in keys if k.count(".") == wanted.count(".")]
    found = difflib.get_close_matches(wanted, same_depth, n=1, cutoff=0.6)
    if not found:
        return None
    if isinstance(value, dict) and len(value) == 1 and f"{found[0]}.{next(iter(value))}" in keys:
        return f"{found[0]}.{next(iter(value))}"
    return found[0]


def format_validation_error(err: ValidationError, origin: str) -> str:
    """One line per invalid field, naming it; values of secret-like fields or that look like keys are not shown
    (pydantic's own text repeats every input)."""
    lines = [f"invalid config in {origin}:"]
    for item in err.errors():
        field = ".".join(str(p) for p in item["loc"]) or "<root>"
        if item["type"] == "extra_forbidden" and is_secret_name(field):
            lines.append(
                f"  {field}: unknown key (keys are never config fields: name the environment variable that holds "
                f"it in {field.rsplit('.', 1)[0]}.api_key_env)"
            )
        elif item["type"] == "extra_forbidden":
            near = nearest_key(tuple(str(p) for p in item["loc"]), item.get("input"))
            lines.append(f"  {field}: unknown key" + (f"; did you mean {near}?" if near else ""))
        elif not item["loc"] and item["type"] == "value_error":  # a whole-config check: its text names the fields
            lines.append("  " + str(item["msg"]).removeprefix("Value error, "))
        else:  # the root's input is the whole config; a key-like value is never repeated
            got = f" (got {shown_value(field, item.get('input'))})" if item["loc"] else ""
            lines.append(f"  {field}: {item['msg']}{got}")
    return "\n".join(lines)


def parse_override(item: str) -> tuple[str, Any]:
    """``teacher.max_rounds=4`` → ("teacher.max_rounds", 4); the value is parsed as YAML. An ``api_base`` comes
    back with its credentials masked (held in this process: rubricem_core.redact)."""
    if "=" not in item:
        raise ConfigError(f"override {shown_value(item, item)} must look like key.path=value")
    key, raw = item.split("=", 1)
    key = key.strip()
    if not key:
        raise ConfigError(f"override {shown_value(item, item)} has an empty key")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError as exc:  # its text quotes the value: only the problem is shown
        problem = getattr(exc, "problem", None) or type(exc).__name__
        raise ConfigError(f"override {key}={shown_value(key, raw)}: the value is not valid YAML ({problem})") from None
    if key.rsplit(".", 1)[-1] == "api_base" and isinstance(value, str):
        value = hold_url_credentials(value)  # so the flow-run parameters made from overrides carry no credentials
    return key, value


def apply_overrides(data: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    """Set dotted keys in a nested dict (copying the path it touches)."""
    out = dict(data)
    for dotted, value in overrides.items():
        node = out
        parts = dotted.split(".")
        for part in parts[:-1]:
            child = node.get(part)
            child = dict(child) if isinstance(child, dict) else {}
            node[part] = child
            node = child
        node[parts[-1]] = value
    return out


def load_config(
    profile: str | os.PathLike[str] = "tiny",
    overrides: dict[str, Any] | list[str] | None = None,
) -> RunConfig:
    """Load a profile and apply overrides (a dict of dotted keys, or ``key=value`` strings)."""
    path = profile_path(profile)
    raw = read_profile(path)
    if isinstance(overrides, list):
        overrides = dict(parse_override(item) for item in overrides)
    origin = str(path)
    if overrides:
        raw = apply_overrides(raw, overrides)
        origin += " with overrides " + ", ".join(f"{k}={shown_value(k, v)}" for k, v in overrides.items())
    try:
        return RunConfig.model_validate(raw)
    except ValidationError as exc:
        raise ConfigError(format_validation_error(exc, origin)) from None


def read_profile(path: Path, _seen: tuple[Path, ...] = ()) -> dict[str, Any]:
    """A profile file as a nested dict, with ``base:`` resolved: the named profile (a name in data/profiles,
    or a YAML path relative to this file's folder) read first, and this file's keys merged over it section
    by section (a list or value replaces the base's). ``profile`` is this file's name unless it sets one."""
    try:
        raw = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    except (yaml.YAMLError, UnicodeDecodeError) as exc:
        raise ConfigError(f"cannot parse profile {path}: {exc}") from exc
    if not isinstance(raw, dict):
        raise ConfigError(f"profile {path} must be a mapping at the top level")
    base = raw.pop("base", None)
    if base is not None:
        if not isinstance(base, str) or not base.strip():
            raise ConfigError(f"profile {path}: base must name a profile or a YAML file, got {base!r}")
        as_file = Path(base).suffix in (".yaml", ".yml") or "/" in base
        base_path = profile_path(path.parent / base if as_file and not Path(base).is_absolute() else base)
        if base_path.resolve() in (*_seen, path.resolve()):
            chain = " → ".join(str(p) for p in (*_seen, path.resolve(), base_path.resolve()))
            raise ConfigError(f"profile {path}: its bases form a cycle ({chain})")
        inherited = read_profile(base_path, (*_seen, path.resolve()))
        inherited.pop("profile", None)
        raw = _merged(inherited, raw)
    raw.setdefault("profile", path.stem)
    return raw


def _merged(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in over.items():
        both_sections = isinstance(value, dict) and isinstance(out.get(key), dict)
        out[key] = _merged(out[key], value) if both_sections else value
    return out


def config_to_yaml(cfg: RunConfig) -> str:
    return yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False)


def flatten(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested dict → dotted keys (for MLflow params)."""
    out: dict[str, Any] = {}
    for key, value in d.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(flatten(value, name + "."))
        else:
            out[name] = value
    return out


# ---- secrets ---------------------------------------------------------------------------------
def require_env(name: str, purpose: str = "") -> str:
    """Read a secret from the environment or fail fast with the variable's name."""
    value = os.environ.get(name)
    if not value:
        why = f" (needed for {purpose})" if purpose else ""
        raise MissingSecretError(f"environment variable {name} is not set{why}")
    return value
