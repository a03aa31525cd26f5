"""What every flow does first: resolve the run config and record it in the run directory."""
from __future__ import annotations

from pathlib import Path
from typing import Any

from rubricem_core.config import ConfigError, RunConfig, config_to_yaml, load_config
from rubricem_core.offline import apply_offline_defaults
from rubricem_core.store import atomic_write_text

apply_offline_defaults()


def resolve_config(
    run_dir: str, profile: str = "tiny", overrides: dict[str, Any] | None = None, config: RunConfig | None = None
) -> RunConfig:
    """A full ``config`` (e.g. from the Prefect UI form) wins; else the profile plus dotted overrides.

    The resolved config is written to ``<run_dir>/config.yaml`` so a run is reproducible from its
    directory alone.
    """
    cfg = config if config is not None else load_config(profile, overrides or {})
    if Path(run_dir).exists() and not Path(run_dir).is_dir():
        raise ConfigError(f"run directory {run_dir} is a file, not a directory")
    Path(run_dir).mkdir(parents=True, exist_ok=True)
    atomic_write_text(Path(run_dir) / "config.yaml", config_to_yaml(cfg))
    return cfg
