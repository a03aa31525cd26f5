"""A finished RL run's judged groups, read back from its tables, for the replays that re-derive advantages
(``scaffold_gate_replay``, ``unscored_stage_replay``): nothing trains, the run is only read."""

from __future__ import annotations

import argparse
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np


@dataclass
class JudgedGroup:
    """One query's group at one step: its `rollouts` rows (by rollout id), the R the run trained on (NaN:
    no score) and which judgments failed."""

    step: int
    query_id: str
    rows: list[dict[str, Any]]
    R: np.ndarray
    failed: list[bool]


def judged_groups(run_dir: Path) -> tuple[Any, list[JudgedGroup]]:
    """The run's config and its judged groups in (step, query) order (a group not judged yet is left out);
    SystemExit naming what is missing."""
    from rubricem_core.run_config import stored_config
    from rubricem_core.scaffold import STAGES
    from rubricem_core.store import RunStore

    cfg = stored_config(run_dir)
    if cfg is None:
        raise SystemExit(f"{run_dir}: no config.yaml (not a run directory)")
    store = RunStore(run_dir)
    if not (store.files("rollouts") and store.files("stage_rewards")):
        raise SystemExit(f"{run_dir}: no rollouts or stage_rewards yet")
    rewards = {(r["rollout_id"], r["stage"]): r["R"] for r in store.read_rows("stage_rewards")}
    by_key: dict[tuple[int, str], list[dict[str, Any]]] = defaultdict(list)
    for row in store.read_rows("rollouts"):
        by_key[(int(row["step"]), row["query_id"])].append(row)
    groups = []
    for (step, query_id), rows in sorted(by_key.items()):
        rows.sort(key=lambda r: r["rollout_id"])
        missing = [r["rollout_id"] for r in rows if (r["rollout_id"], STAGES[0]) not in rewards]
        if len(missing) == len(rows):
            continue  # a step the run has not judged yet (it is still running, or was stopped there)
        if missing:
            raise SystemExit(f"{run_dir}: step {step} rollout {missing[0]} has no `stage_rewards` rows")
        R = np.array(
            [
                [np.nan if rewards[(r["rollout_id"], s)] is None else rewards[(r["rollout_id"], s)] for s in STAGES]
                for r in rows
            ]
        )
        groups.append(JudgedGroup(step, query_id, rows, R, [bool(r["judge_failed"]) for r in rows]))
    return cfg, groups


def run_dir_argument(description: str) -> Path:
    """The replays' one argument, ``--run-dir``."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--run-dir", type=Path, required=True, help="an RL run directory (e.g. <work>/ablation/full)")
    return parser.parse_args().run_dir
