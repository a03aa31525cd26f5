"""An evaluated checkpoint's name in `eval_results` (``sft``, ``rl-step-000003``) and the RL step and policy
updates it stands for."""

from __future__ import annotations

import hashlib
import re
from pathlib import Path

from rubricem_core.eval.types import safe_name
from rubricem_core.layout import STEP_CHECKPOINT, RunLayout


def checkpoint_tag(run_dir: str | Path, checkpoint: str | Path) -> str:
    """A short stable name: ``sft``, ``rl-step-000003``, or the directory name plus a path hash."""
    run, path = RunLayout(Path(run_dir).resolve()), Path(checkpoint).resolve()
    if path == run.sft_final:
        return "sft"
    if path.parent == run.rl_checkpoints_dir and STEP_CHECKPOINT.fullmatch(path.name):
        return f"rl-{path.name}"
    return f"{safe_name(path.name)}-{hashlib.sha1(str(path).encode()).hexdigest()[:8]}"


def checkpoint_step(tag: str) -> int | None:
    """The RL step whose checkpoint ``tag`` names (``rl-step-000003`` → 3); None for the SFT policy or a
    checkpoint from elsewhere (`eval_results.step`: SQL over a learning curve)."""
    match = re.fullmatch(r"rl-step-(\d+)", tag)
    return int(match.group(1)) if match else None


def checkpoint_updates(tag: str) -> int:
    """Policy updates in a checkpoint (the MLflow step of its metrics): SFT 0, RL step N → N + 1."""
    step = checkpoint_step(tag)
    return 0 if step is None else step + 1
