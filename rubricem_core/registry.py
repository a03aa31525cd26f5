"""The trained policy as a version of a registered model in MLflow's Model Registry.

At the end of SFT and of RL, and on demand (``rubricem register``), a policy checkpoint becomes a model version: its
serving files (the Hugging Face directory `vllm serve` loads: config, weights, tokenizer, chat template —
never the optimizer state) are logged as the stage run's ``policy/`` artifact and the version's source
points there; a checkpoint larger than ``tracking.model_copy_max_gb`` is registered by reference to its
directory instead (tag ``artifact: reference``). A LoRA checkpoint registers its merged copy (what a server
loads; ``rubricem export`` writes the adapter alone in peft's format). Tags carry the lineage: stage, step, recipe, run
directory, the run's config hash, the weights' SHA-256; ``evaluate`` adds the held-out scores of the
version it graded. Registering the same weights again returns the existing version.
"""

from __future__ import annotations

import hashlib
import json
import re
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rubricem_core.layout import STEP_CHECKPOINT, RunLayout
from rubricem_core.policy.loading import servable_dir
from rubricem_core.tracking import ChildRun, Tracker, _retry
from rubricem_core.training.adapters import ADAPTER_WEIGHTS, is_adapter_dir
from rubricem_core.training.checkpoint import adapter_base

# what a checkpoint holds beyond the model a server loads
NOT_SERVED = frozenset({"trainer_state.pt", "checkpoint.json"})
WEIGHTS_TAG = "rubricem.weights_sha256"


class RegistryError(RuntimeError):
    """A checkpoint cannot be registered; the message names it."""


@dataclass(frozen=True)
class RegisteredVersion:
    name: str
    version: str
    source: str
    url: str  # the version's page in the MLflow UI
    created: bool  # False: the same weights were registered before


def model_name(run_dir: str | Path, configured: str = "") -> str:
    """``tracking.model_name``, else ``rubricem-<run directory's name>`` (MLflow names: letters, digits, ``-_.``)."""
    name = configured or f"rubricem-{Path(run_dir).resolve().name}"
    return re.sub(r"[^A-Za-z0-9_.-]+", "-", name).strip("-") or "rubricem"


def serving_files(checkpoint: Path) -> list[Path]:
    files = sorted(
        p for p in checkpoint.iterdir() if p.is_file() and p.name not in NOT_SERVED and not p.name.startswith(".")
    )
    if not any(p.name == "config.json" for p in files) or not any(p.suffix == ".safetensors" for p in files):
        raise RegistryError(f"{checkpoint} is not a policy checkpoint (no config.json and .safetensors weights)")
    return files


def weights_digest(checkpoint: Path) -> str:
    """The SHA-256 of the weights: the checkpoint's own record when it has one, else computed. A LoRA
    checkpoint's: of its adapter's recorded digest and its base's (the pair fixes the merged weights)."""
    meta_file = checkpoint / "checkpoint.json"
    if meta_file.is_file():
        meta = json.loads(meta_file.read_text(encoding="utf-8"))
        adapter = meta.get("adapter")
        if adapter and (meta.get("sha256") or {}).get(ADAPTER_WEIGHTS):
            pair = f"{meta['sha256'][ADAPTER_WEIGHTS]}:{adapter.get('base_sha256') or adapter.get('base_abs')}"
            return hashlib.sha256(pair.encode()).hexdigest()
        recorded = (meta.get("sha256") or {}).get("model.safetensors")
        if recorded:
            return str(recorded)
    digest = hashlib.sha256()
    for path in sorted(checkpoint.glob("*.safetensors")):
        with open(path, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                digest.update(block)
    return digest.hexdigest()


def config_hash(run_dir: str | Path) -> str:
    config = RunLayout(run_dir).config_file
    return hashlib.sha256(config.read_bytes()).hexdigest()[:16] if config.is_file() else ""


def version_url(tracker: Tracker, name: str, version: str) -> str:
    return f"{tracker.ui_base()}/#/models/{name}/versions/{version}"


def versions_of(tracker: Tracker, name: str) -> list[tuple[RegisteredVersion, dict[str, str]]]:
    """Every version of ``name`` (oldest first) with its tags; empty when nothing is registered."""
    from mlflow.exceptions import MlflowException

    try:
        found = _retry(tracker.client.search_model_versions, f"name = '{name}'")
    except MlflowException:
        return []
    out = []
    for v in sorted(found, key=lambda v: int(v.version)):
        ref = RegisteredVersion(name, str(v.version), v.source or "", version_url(tracker, name, str(v.version)), False)
        out.append((ref, dict(v.tags or {})))
    return out


def find_version(tracker: Tracker, name: str, digest: str) -> RegisteredVersion | None:
    """The version of ``name`` whose weights have ``digest``, or None."""
    return next((v for v, tags in versions_of(tracker, name) if tags.get(WEIGHTS_TAG) == digest), None)


def register_policy(
    tracker: Tracker,
    child: ChildRun,
    checkpoint: str | Path,
    *,
    name: str,
    tags: dict[str, Any],
    copy_max_bytes: float,
) -> RegisteredVersion:
    """Register ``checkpoint`` as a new version of ``name`` from the stage run ``child`` (see the module doc)."""
    from mlflow.exceptions import MlflowException

    path = Path(checkpoint).resolve()
    files = serving_files(servable_dir(path))  # a LoRA checkpoint: its merged copy is what a server loads
    digest = weights_digest(path)
    client = tracker.client
    existing = find_version(tracker, name, digest)
    if existing is not None:
        return existing
    size = sum(p.stat().st_size for p in files)
    all_tags = {**{k: str(v) for k, v in tags.items()}, WEIGHTS_TAG: digest, "rubricem.checkpoint": str(path)}
    if is_adapter_dir(path):
        all_tags["rubricem.adapter_base"] = str(adapter_base(path))
    if size <= copy_max_bytes:
        with tempfile.TemporaryDirectory() as tmp:
            staged = Path(tmp) / "policy"
            staged.mkdir()
            for p in files:
                _link_or_copy(p, staged / p.name)
            child.log_artifact(staged, artifact_path="policy")
        source = f"{client.get_run(child.run_id).info.artifact_uri}/policy"
        all_tags["artifact"] = "copy"
    else:
        source = path.as_uri()
        all_tags["artifact"] = "reference"
    try:
        _retry(
            client.create_registered_model, name, description="RubricEM policy checkpoints (rubricem_core/registry.py)"
        )
    except MlflowException as exc:
        if "RESOURCE_ALREADY_EXISTS" not in str(exc.error_code) and "already exists" not in str(exc):
            raise
    version = _retry(client.create_model_version, name, source, run_id=child.run_id, tags=all_tags)
    child.set_tags({"rubricem.model_version": f"{name}/{version.version}"})
    return RegisteredVersion(name, str(version.version), source, version_url(tracker, name, str(version.version)), True)


def tag_scores(
    tracker: Tracker, name: str, checkpoint: str | Path, scores: dict[str, float]
) -> RegisteredVersion | None:
    """Add held-out scores to the version registered from ``checkpoint``'s weights (None: not registered)."""
    path = Path(checkpoint).resolve()
    if not (path / "config.json").is_file() and not is_adapter_dir(path):
        return None
    found = find_version(tracker, name, weights_digest(path))
    if found is None:
        return None
    for key, value in scores.items():
        _retry(tracker.client.set_model_version_tag, name, found.version, key, f"{value:.6g}")
    return found


def _link_or_copy(src: Path, dst: Path) -> None:
    try:
        dst.hardlink_to(src)  # the staging copy of multi-GB weights costs nothing on the same filesystem
    except OSError:
        shutil.copy2(src, dst)


def register_stage_policy(
    tracker: Tracker | None,
    child: ChildRun | None,
    tracking: Any,
    run_dir: str | Path,
    checkpoint: str | Path,
    *,
    stage: str,
    step: int | None = None,
    recipe: str = "",
) -> RegisteredVersion | None:
    """What the SFT and RL flows call at their end: None when tracking or ``tracking.register_model`` is off."""
    if tracker is None or child is None or not tracking.register_model:
        return None
    tags = {
        "stage": stage,
        "step": "" if step is None else step,
        "recipe": recipe,
        "run_dir": str(Path(run_dir).resolve()),
        "config_hash": config_hash(run_dir),
    }
    return register_policy(
        tracker,
        child,
        checkpoint,
        name=model_name(run_dir, tracking.model_name),
        tags=tags,
        copy_max_bytes=tracking.model_copy_max_gb * 2**30,
    )


def checkpoint_stage(layout: RunLayout, checkpoint: Path) -> tuple[str, int | None]:
    """("sft", None), ("rl", N) for RL step N's checkpoint, or ("external", None) for any other directory."""
    if checkpoint == layout.sft_final.resolve():
        return "sft", None
    if checkpoint.parent == layout.rl_checkpoints_dir.resolve() and STEP_CHECKPOINT.fullmatch(checkpoint.name):
        return "rl", int(checkpoint.name.split("-")[1])
    return "external", None


def register_checkpoint(
    run_dir: str | Path, tracking: Any, checkpoint: str | Path, recipe: str = ""
) -> RegisteredVersion:
    """``rubricem register``: one checkpoint of the run (SFT, an RL step's or any policy directory) as a version,
    logged from a child run ``register`` labelled by the checkpoint. Works with ``tracking.register_model`` off."""
    if not tracking.enabled:
        raise RegistryError("tracking.enabled is false for this run: there is no MLflow store to register into")
    tracker = Tracker.from_config(run_dir, tracking)
    assert tracker is not None
    path = Path(checkpoint).resolve()
    serving_files(path)  # refuse a directory that is not a policy before a run is opened
    stage, step = checkpoint_stage(tracker.store.layout, path)
    label = stage if step is None else f"{stage} step {step}"
    with tracker.child_run("register", params={"checkpoint": str(path)}, label=label) as child:
        version = register_stage_policy(
            tracker,
            child,
            tracking.model_copy(update={"register_model": True}),
            run_dir,
            path,
            stage=stage,
            step=step,
            recipe=recipe if stage == "rl" else "",
        )
    assert version is not None
    return version


def version_link(version: RegisteredVersion | None) -> str | None:
    """The Markdown line a flow's Prefect artifact shows for the version (None: nothing registered)."""
    if version is None:
        return None
    return f"- registered model: [{version.name} version {version.version}]({version.url})"
