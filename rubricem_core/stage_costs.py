"""What each stage of the pipeline costs, measured, so its progress lines give a truthful ETA.

A finished pipeline records its stages' seconds in ``state/stage_seconds.json``; a rerun of that run
directory uses them. A new run directory uses its profile's measurement in ``data/profiles/stage_seconds.json``
(written from a real run, with when and where). Without either, the ETA is linear in stages done.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from rubricem_core.config import PROFILES_DIR
from rubricem_core.store import atomic_write_text

PROFILE_COSTS = PROFILES_DIR / "stage_seconds.json"
STAGE_SECONDS = "stage_seconds.json"  # in a run directory's state/


def _costs(data: object, stages: Sequence[str]) -> list[float] | None:
    if not isinstance(data, dict) or not all(isinstance(data.get(s), int | float) for s in stages):
        return None
    return [float(data[s]) for s in stages]


def expected_costs(state_dir: Path, profile: str, stages: Sequence[str]) -> tuple[list[float] | None, str]:
    """(seconds per stage, where they come from); (None, why not) when nothing was measured. ``state_dir``:
    the run directory's ``state/``."""
    own = state_dir / STAGE_SECONDS
    for path, source in ((own, "this run directory's last pipeline"), (PROFILE_COSTS, f"{profile}'s measured run")):
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError):
            continue
        costs = _costs(data if path == own else data.get(profile), stages)
        if costs is not None:
            return costs, source
    return None, "no measured stage costs"


def record_stage_seconds(state_dir: Path, seconds: dict[str, float]) -> Path:
    """Write this pipeline's stage seconds for the next run of the directory."""
    path = state_dir / STAGE_SECONDS
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, json.dumps({k: round(v, 1) for k, v in seconds.items()}, indent=1))
    return path
