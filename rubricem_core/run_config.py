"""A run directory keeps the config its finished work was made with.

The first command writes ``<run_dir>/config.yaml``. A later command with another config is checked
field by field against it:

- fields that never change what is already written (endpoints' and web tools' URLs, keys, retries and timeouts,
  tracking, devices and ranks, evaluation settings, more RL windows, RL checkpoint spacing and retention)
  are accepted and recorded as a revision in ``state/config_revisions.jsonl``;
- any other field is refused, naming the field and both values, once the stage that reads it has
  written something (collection for ``data``, ``seed``, ``tools``, ``teacher``, ``filter``; SFT for
  ``policy``, ``sft``; RL for ``rl``, ``rollout``, ``judge``, ``reflection``). Before that stage
  starts, the new value simply applies.

A refused change is a sign of a mistake (another profile, a forgotten ``--set``) or of a new
experiment, which belongs in a new run directory.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from rubricem_core.config import (
    ConfigError,
    RunConfig,
    apply_overrides,
    config_to_yaml,
    flatten,
    format_validation_error,
    load_config,
    parse_override,
)
from rubricem_core.layout import RunLayout
from rubricem_core.redact import shown_value
from rubricem_core.store import RunStore, atomic_write_text

# Dotted prefixes whose values do not reach any table: where and how things run, not what they compute.
_OPERATIONAL_SUFFIXES = (
    "api_base",
    "api_key_env",
    "api_key_secret_block",
    "max_concurrency",
    "max_tokens_per_minute",
    "timeout_s",
    "max_retries",
    "batch_poll_interval_s",
    "max_batch_resubmits",
    "base_url",
    "timeout_s_http",
    "backoff_s",
)  # the last three: a web tool spec's
_SAFE_PREFIXES = (
    "profile",
    "tracking.",
    "distributed.",
    "eval.",
    "rollout.devices",
    "rollout.server_python",
    "rollout.server_startup_timeout_s",
    "rollout.server_env",  # how the server runs (threads, KV cache space), not what it samples
    "rollout.gpu_memory_utilization",
    "rollout.max_batch_rows",
    "rollout.weight_transfer",  # the same weights by another road
    "rollout.colocate",
    "rollout.replicas",  # the fleet, its schedule and bounds: the same trajectories (docs/rollout_fleet.md)
    "rollout.schedule",
    "rollout.placement",  # who starts the same replicas: local processes or Ray actors
    "rollout.max_calls_per_replica",
    "rollout.max_concurrent_tool_calls",
    # where resumes start from, not what they compute: a resume replays the updates after the newest
    # checkpoint from the tables, so any checkpoint spacing gives the same weights
    "rl.checkpoint_every",
    "rl.keep_checkpoints",
    "rl.eval_every",  # which checkpoints are kept for the curve: the same weights, more of them on disk
)


def _sft_started(run_dir: Path) -> bool:
    root = RunLayout(run_dir).sft_checkpoints_dir
    return root.is_dir() and any(root.iterdir())


def _has(table: str) -> Callable[[Path], bool]:
    return lambda run_dir: bool(RunStore(run_dir).files(table))


# section → (the stage that reads it, "has it written anything?")
_STAGE_OF: dict[str, tuple[str, Callable[[Path], bool]]] = {
    "seed": ("collect-sft-data", _has("queries")),
    "data": ("collect-sft-data", _has("queries")),
    "tools": ("collect-sft-data", _has("queries")),
    "teacher": ("collect-sft-data", _has("teacher_requests")),
    "filter": ("collect-sft-data", _has("sft_trajectories")),
    "policy": ("sft", _sft_started),
    "sft": ("sft", _sft_started),
    "rl": ("rl", _has("rollouts")),
    "rollout": ("rl", _has("rollouts")),
    "judge": ("rl", _has("rollouts")),
    "reflection": ("rl", _has("rollouts")),
    "data.rl_filter": ("rl", _has("rollouts")),  # which queries RL schedules: nothing before RL reads it
}


def _never(run_dir: Path) -> bool:
    return False


@dataclass(frozen=True)
class Change:
    field: str
    old: Any
    new: Any

    def __str__(self) -> str:  # in refusals: a key-like value is never shown
        return f"{self.field}: {shown_value(self.field, self.old)} → {shown_value(self.field, self.new)}"


def is_safe(change: Change) -> bool:
    """A change that leaves every written table valid (recorded as a revision)."""
    name = change.field
    if name.startswith(_SAFE_PREFIXES) or name.rsplit(".", 1)[-1] in _OPERATIONAL_SUFFIXES:
        return True
    if name == "rl.n_windows":  # more windows extend the run; fewer would orphan finished steps
        return isinstance(change.old, int) and isinstance(change.new, int) and change.new >= change.old
    return False


def _fields(cfg: RunConfig) -> dict[str, Any]:
    """The config's dotted fields. ``tools.specs`` (a list) is split per tool: ``tools.specs`` holds the tool
    names in order and ``tools.specs.<name>.<key>`` each argument, so a tool's API URL, key variable,
    timeouts and concurrency change like an endpoint's, and what shapes its results (kind, top_k, cache) is
    refused like any other field."""
    fields = flatten(cfg.model_dump(mode="json"))
    specs = fields.get("tools.specs") or []
    names = [s.get("name") for s in specs if isinstance(s, dict)]
    if len(names) == len(specs) and len(set(names)) == len(names):  # else compared whole (build_tools refuses it)
        fields["tools.specs"] = names
        for spec in specs:
            fields.update({f"tools.specs.{spec['name']}.{key}": value for key, value in spec.items() if key != "name"})
    return fields


# Fields whose default changed how RL trains, with the value a run directory recorded before the field
# existed had (record_config writes every field, so a recorded config without one is older than it): a
# resumed old run keeps training as it began, and a profile's new default is refused there like any change.
LEGACY_VALUES: dict[str, Any] = {
    "reflection.train_format_tags": True,  # session 26: a valid reflection's format tags got no advantage
    "rl.stage_boundary": "entering",  # session 27: a stage's opening tag takes the stage it leaves
    "rl.scaffold_violations": "judged",  # session 29: a stage that broke the scaffold may earn nothing
    "sft.guided_fraction": 0.0,  # session 29: SFT may show traces with their own reflection as guidance
}


def legacy_values(recorded: Any) -> dict[str, Any]:
    """The LEGACY_VALUES of the fields missing from a recorded config (its parsed YAML; {} for anything
    that is not a mapping, which validation then refuses)."""
    if not isinstance(recorded, dict):
        return {}
    present = flatten(recorded)
    return {k: v for k, v in LEGACY_VALUES.items() if k not in present}


def config_changes(old: RunConfig, new: RunConfig) -> list[Change]:
    a, b = _fields(old), _fields(new)
    return [Change(k, a.get(k), b.get(k)) for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)]


def stored_config(run_dir: str | os.PathLike[str]) -> RunConfig | None:
    """The run directory's recorded config (None: no config.yaml yet)."""
    path = RunLayout(run_dir).config_file
    if not path.exists():
        return None
    try:
        raw = yaml.safe_load(path.read_text())
        if legacy := legacy_values(raw):
            raw = apply_overrides(raw, legacy)
        return RunConfig.model_validate(raw)
    except ValidationError as exc:  # pydantic's own text repeats every value; this one hides key-like ones
        raise ConfigError(f"{format_validation_error(exc, str(path))}\nmove it away to start over") from None
    except Exception as exc:  # YAML: the file cannot be trusted
        raise ConfigError(f"{path} is not a valid run config ({exc}); move it away to start over") from None


def base_config(
    run_dir: str | os.PathLike[str], profile: str | None, overrides: dict[str, Any] | list[str]
) -> RunConfig:
    """``profile`` + ``overrides``; with no profile, the run directory's recorded config (so a later
    command needs no --profile and no repeated --set), or ``tiny`` for a new run directory."""
    if profile is None:
        recorded = RunLayout(run_dir).config_file
        if not recorded.is_file():
            return load_config("tiny", overrides)
        if isinstance(overrides, list):
            overrides = dict(parse_override(item) for item in overrides)
        try:
            raw = yaml.safe_load(recorded.read_text())
        except yaml.YAMLError:
            raw = None  # load_config names the file and the parse error
        return load_config(str(recorded), {**legacy_values(raw), **(overrides or {})})
    return load_config(profile, overrides)


def refused_changes(run_dir: Path, changes: list[Change]) -> list[tuple[Change, str]]:
    """The changes that would alter finished work, each with the stage that wrote it."""
    out = []
    for change in changes:
        if is_safe(change):
            continue
        stage, written = _STAGE_OF.get(change.field, _STAGE_OF.get(change.field.split(".", 1)[0], ("", _never)))
        if written(run_dir):
            out.append((change, stage))
    return out


def record_config(run_dir: str | os.PathLike[str], cfg: RunConfig, command: str) -> list[Change]:
    """Check ``cfg`` against the run's recorded config and record it; returns the accepted changes.

    Raises ConfigError naming every field whose change would alter work already written.
    """
    root = Path(run_dir)
    old = stored_config(root)
    changes = config_changes(old, cfg) if old is not None else []
    if old is not None and (refused := refused_changes(root, changes)):  # no recorded config: nothing to refuse
        lines = "\n".join(f"  {c}  (already used by {stage})" for c, stage in refused)
        raise ConfigError(
            f"{command}: the config differs from {RunLayout(root).config_file} in fields that finished work was made with:\n"
            f"{lines}\nrerun with the run's own settings (the profile {old.profile!r} and its --set values), or use a "
            f"new --run-dir for a new experiment"
        )
    if old is None or changes:
        atomic_write_text(RunLayout(root).config_file, config_to_yaml(cfg))
    if changes:
        _append_revision(root, command, changes)
    return changes


def _append_revision(root: Path, command: str, changes: list[Change]) -> None:
    path = RunLayout(root).config_revisions_file
    path.parent.mkdir(parents=True, exist_ok=True)
    entry = {
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "command": command,
        "changes": {c.field: {"old": c.old, "new": c.new} for c in changes},
    }
    with open(path, "a", encoding="utf-8") as fh:
        fh.write(json.dumps(entry, default=str) + "\n")
