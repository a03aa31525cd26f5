"""An evaluated checkpoint's name in `eval_results` (``sft``, ``rl-step-000003``) and the RL step and policy
updates it stands for."""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from pathlib import Path

from rubricem_core.eval.types import safe_name
from rubricem_core.layout import STEP_CHECKPOINT, RunLayout

API_PREFIXES = {"api": True, "api-plain": False}  # checkpoint spec prefix → prompted with the scaffold


@dataclass(frozen=True)
class APIPolicySpec:
    """A model behind an API as the evaluated policy: ``api:<model>`` (the scaffold's prompt) or
    ``api-plain:<model>`` (the plain prompt, no scaffold)."""

    model: str
    scaffold: bool

    @property
    def tag(self) -> str:
        return f"{'api' if self.scaffold else 'api-plain'}-{safe_name(self.model)}"


def api_policy_spec(checkpoint: str | Path) -> APIPolicySpec | None:
    """The API policy a checkpoint argument names, or None for a policy directory."""
    prefix, colon, model = str(checkpoint).partition(":")
    if not colon or prefix not in API_PREFIXES:
        return None
    if not model.strip():
        raise ValueError(f"checkpoint {checkpoint!r}: name the model after {prefix}:, e.g. {prefix}:openai/gpt-4.1")
    return APIPolicySpec(model.strip(), API_PREFIXES[prefix])


def checkpoint_tag(run_dir: str | Path, checkpoint: str | Path) -> str:
    """A short stable name: ``sft``, ``rl-step-000003``, ``api-<model>`` / ``api-plain-<model>`` for a model
    behind an API, or the directory name plus a path hash."""
    spec = api_policy_spec(checkpoint)
    if spec is not None:
        return spec.tag
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
