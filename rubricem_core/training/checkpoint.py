"""Checkpoints: HF weights plus the trainer state, written atomically.

Layout of a checkpoint directory (a LoRA one holds adapter_config.json and adapter_model.safetensors
instead of the HF weights, and names its base model: see "adapter checkpoints" below)::

    config.json, model.safetensors (or shards + index)   save_pretrained: loadable by any HF tool
    tokenizer files                                        when a tokenizer is given
    trainer_state.pt                                       optimizer, scheduler, step, RNG, extra
    deepspeed/                                             DeepSpeed backend: its own optimizer shards
    rng_rank{r}.pt                                         DeepSpeed backend: RNG of every rank
    checkpoint.json                                        written last: step, backend, file sizes, SHA-256s

Everything is written into ``.<name>.tmp`` beside the final directory and renamed into place, so a
crash mid-save never leaves a half checkpoint under the final name; ``latest_checkpoint`` skips
dot-directories. ``checkpoint.json`` records every file's size and SHA-256, so a truncated or changed
file (a flipped bit too) is reported by name instead of loading silently or surfacing as an unpickling
error deep inside torch.
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import random
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from rubricem_core.faults import fault_point
from rubricem_core.training.adapters import (
    ADAPTER_CONFIG,
    ADAPTER_NAME,
    ADAPTER_WEIGHTS,
    AdapterError,
    adapter_state_dict,
    is_adapter_dir,
    is_adapter_model,
)

log = logging.getLogger(__name__)

STATE_FILE = "trainer_state.pt"
META_FILE = "checkpoint.json"
FORMAT_VERSION = 1
_WEIGHTS_SINGLE = "model.safetensors"
_WEIGHTS_INDEX = "model.safetensors.index.json"


class CheckpointError(RuntimeError):
    """A checkpoint is missing, incomplete or corrupt; the message names the directory and file."""


@dataclass
class Checkpoint:
    path: Path
    trainer_state: dict[str, Any]
    meta: dict[str, Any]
    model: nn.Module | None = None


# ----------------------------------------------------------------------------------------- RNG
def capture_rng_state() -> dict[str, Any]:
    """RNG states of python, numpy and torch (CPU and every CUDA device), in plain types so the
    file loads with ``torch.load(weights_only=True)``."""
    np_state = np.random.get_state()
    state: dict[str, Any] = {
        "python": _to_lists(random.getstate()),
        "numpy": [np_state[0], np_state[1].tolist(), *np_state[2:]],  # type: ignore[index]
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng_state(state: dict[str, Any]) -> None:
    random.setstate(_to_tuples(state["python"]))
    kind, key, *rest = state["numpy"]
    np.random.set_state((kind, np.asarray(key, dtype=np.uint32), *rest))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _to_lists(x: Any) -> Any:
    return [_to_lists(v) for v in x] if isinstance(x, (tuple, list)) else x


def _to_tuples(x: Any) -> Any:
    return tuple(_to_tuples(v) for v in x) if isinstance(x, list) else x


# -------------------------------------------------------------------------------------- writing
def staging_dir(final: str | Path) -> Path:
    """Where a checkpoint is assembled before the rename. Deterministic (not random) so every
    rank of a DeepSpeed job writes its shards into the same place."""
    final = Path(final)
    return final.parent / f".{final.name}.tmp"


def write_checkpoint_files(
    directory: Path,
    model: nn.Module,
    tokenizer: Any = None,
    trainer_state: dict[str, Any] | None = None,
    state_dict: dict[str, torch.Tensor] | None = None,
) -> None:
    """Write weights, tokenizer and trainer_state.pt into ``directory`` (no meta file, no rename).

    ``state_dict`` replaces the model's own (ZeRO-3 passes the gathered full weights)."""
    save_pretrained = getattr(model, "save_pretrained", None)
    if save_pretrained is None:
        raise TypeError(f"{type(model).__name__} has no save_pretrained(); checkpoints need a Hugging Face model")
    try:
        # safetensors (the only format in transformers 5); a LoRA model writes its adapter alone
        kwargs = {"save_embedding_layers": False} if is_adapter_model(model) else {}
        save_pretrained(str(directory), state_dict=state_dict, **kwargs)
        if kwargs:
            (directory / "README.md").unlink(missing_ok=True)  # peft's model-card template, nothing of the run's
        fault_point("checkpoint.weights_written")
        if tokenizer is not None:
            tokenizer.save_pretrained(str(directory))
        state = dict(trainer_state or {})
        state.setdefault("rng", capture_rng_state())
        torch.save(state, directory / STATE_FILE)
        readable_like_siblings(directory)
    except Exception as exc:
        raise write_error(directory, exc) from exc


def readable_like_siblings(directory: Path) -> None:
    """Give files written private (transformers writes model.safetensors through a 0600 temporary file) the
    mode of the directory's other files (config.json: the process's umask), so a serving process or another
    user reads the weights as it reads the rest of the run directory."""
    reference = next((directory / n for n in ("config.json", "adapter_config.json") if (directory / n).is_file()), None)
    if reference is None:
        return
    mode = reference.stat().st_mode & 0o777
    for path in directory.iterdir():
        if path.is_file() and path.stat().st_mode & 0o777 != mode:
            path.chmod(mode)


LOW_DISK_BYTES = 64 * 2**20


def write_error(directory: Path, exc: BaseException) -> CheckpointError:
    """A failed checkpoint write, saying so when the disk is full: torch.save then fails with
    "unexpected pos …" and safetensors with an I/O error, neither naming the cause."""
    try:
        free = shutil.disk_usage(directory).free
    except OSError:
        free = None
    full = getattr(exc, "errno", None) == errno.ENOSPC or (free is not None and free < LOW_DISK_BYTES)
    if full:
        return CheckpointError(
            f"cannot write checkpoint files into {directory}: the disk is full ({(free or 0) / 2**20:.1f} MiB free); "
            f"free space and rerun: the run resumes from its last complete checkpoint"
        )
    return CheckpointError(f"cannot write checkpoint files into {directory}: {type(exc).__name__}: {exc}")


def commit(staging: Path, final: str | Path, meta: dict[str, Any]) -> Path:
    """Write the meta file last, then move ``staging`` to ``final`` (replacing an older one)."""
    final = Path(final)
    paths = [p for p in sorted(staging.rglob("*")) if p.is_file()]
    files = {str(p.relative_to(staging)): p.stat().st_size for p in paths}
    digests = {str(p.relative_to(staging)): file_sha256(p) for p in paths}
    meta = {"format": FORMAT_VERSION, **meta, "files": files, "sha256": digests}
    _write_json(staging / META_FILE, meta)
    if final.exists():
        # Two renames: the old checkpoint leaves under a dot-name (ignored by latest_checkpoint) and
        # is deleted only after the new one is in place.
        old = final.parent / f".{final.name}.old"
        shutil.rmtree(old, ignore_errors=True)
        os.replace(final, old)
        os.replace(staging, final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(staging, final)
    return final


def save_checkpoint(
    directory: str | Path,
    model: nn.Module,
    tokenizer: Any = None,
    trainer_state: dict[str, Any] | None = None,
    meta: dict[str, Any] | None = None,
) -> Path:
    """Save an HF model (+ tokenizer) and ``trainer_state`` (RNG states added unless present)
    atomically under ``directory``. ``meta`` goes into checkpoint.json (``step`` orders
    ``latest_checkpoint``; taken from ``trainer_state["global_step"]`` when absent)."""
    final = Path(directory)
    staging = staging_dir(final)
    shutil.rmtree(staging, ignore_errors=True)  # leftovers of a crashed save
    staging.mkdir(parents=True)
    try:
        write_checkpoint_files(staging, model, tokenizer, trainer_state)
        meta = {**(meta or {}), **adapter_meta_of(model, final)}
        meta.setdefault("step", int((trainer_state or {}).get("global_step", 0)))
        return commit(staging, final, meta)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def adapter_meta_of(model: nn.Module, final: Path) -> dict[str, Any]:
    """``{"adapter": ...}`` for a LoRA model (its base by reference), else nothing."""
    return {"adapter": adapter_meta(model, final)} if is_adapter_model(model) else {}


def _write_json(path: Path, obj: Any) -> None:
    tmp = path.with_name(path.name + ".part")
    tmp.write_text(json.dumps(obj, indent=1, sort_keys=True))
    os.replace(tmp, path)


# -------------------------------------------------------------------------------------- reading
def read_meta(directory: str | Path) -> dict[str, Any]:
    """checkpoint.json of a complete checkpoint, with every recorded file present at its size."""
    directory = Path(directory)
    if not directory.is_dir():
        raise CheckpointError(f"no checkpoint directory at {directory}")
    meta_path = directory / META_FILE
    if not meta_path.is_file():
        raise CheckpointError(
            f"{directory} is not a complete checkpoint: {META_FILE} is missing (it is written last, "
            "so the save did not finish or the directory was not made by save_checkpoint)"
        )
    try:
        meta = json.loads(meta_path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{meta_path} is corrupt: {exc}") from exc
    if not isinstance(meta, dict) or not isinstance(meta.get("files"), dict):
        raise CheckpointError(f"{meta_path} is corrupt: expected an object with a 'files' map")
    if meta.get("format") != FORMAT_VERSION:
        raise CheckpointError(
            f"{meta_path}: unsupported checkpoint format {meta.get('format')!r} (expected {FORMAT_VERSION})"
        )
    check_recorded_files(directory, meta["files"])
    check_recorded_digests(directory, meta.get("sha256") or {})  # checkpoints written before it have none
    return meta


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 22):
            digest.update(chunk)
    return digest.hexdigest()


def check_recorded_digests(directory: Path, digests: dict[str, str]) -> None:
    """Every file's SHA-256 is the one recorded at the save: a same-size change (a flipped bit) is refused too."""
    for name, expected in digests.items():
        if file_sha256(directory / name) != expected:
            raise CheckpointError(
                f"checkpoint {directory}: {name} is corrupt: its SHA-256 is not the one {META_FILE} records "
                "(changed after the save)"
            )


def check_recorded_files(directory: Path, files: dict[str, int]) -> None:
    """Every file recorded in checkpoint.json is present at its recorded size (a stat each, no reads)."""
    for name, size in files.items():
        path = directory / name
        if not path.is_file():
            raise CheckpointError(f"checkpoint {directory} is incomplete: {name} is missing")
        actual = path.stat().st_size
        if actual != size:
            raise CheckpointError(
                f"checkpoint {directory} is corrupt: {name} has {actual} bytes, {META_FILE} records {size} "
                "(truncated or changed after the save)"
            )


def load_trainer_state(directory: str | Path) -> dict[str, Any]:
    path = Path(directory) / STATE_FILE
    if not path.is_file():
        raise CheckpointError(f"checkpoint {directory} has no {STATE_FILE}")
    return load_torch_file(path)


def load_torch_file(path: Path) -> dict[str, Any]:
    """A torch-saved dict of plain types and tensors; unreadable → CheckpointError naming the file."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # torch raises several types (EOFError, UnpicklingError, RuntimeError)
        raise CheckpointError(f"{path} is corrupt or unreadable: {type(exc).__name__}: {exc}") from exc


def weight_files(directory: str | Path) -> list[Path]:
    """The safetensors files of a checkpoint, each with a readable header (cheap: no tensor data)."""
    from safetensors import SafetensorError, safe_open

    directory = Path(directory)
    if (directory / ADAPTER_WEIGHTS).is_file() and not (directory / "config.json").is_file():
        names = [ADAPTER_WEIGHTS]  # a LoRA checkpoint: the adapter's weights, the base named by reference
    elif (directory / _WEIGHTS_INDEX).is_file():
        try:
            names = sorted(set(json.loads((directory / _WEIGHTS_INDEX).read_text())["weight_map"].values()))
        except (OSError, KeyError, TypeError, AttributeError, json.JSONDecodeError) as exc:
            raise CheckpointError(f"{directory / _WEIGHTS_INDEX} is corrupt: {exc}") from exc
    elif (directory / _WEIGHTS_SINGLE).is_file():
        names = [_WEIGHTS_SINGLE]
    else:
        raise CheckpointError(f"checkpoint {directory} has no weights ({_WEIGHTS_SINGLE} or {_WEIGHTS_INDEX})")
    paths = [directory / name for name in names]
    for path in paths:
        try:
            with safe_open(str(path), framework="pt") as f:
                f.keys()
        except (SafetensorError, OSError) as exc:
            raise CheckpointError(f"{path} is corrupt: {exc}") from exc
    return paths


def load_weights_into(model: nn.Module, directory: str | Path) -> None:
    """Load the checkpoint's safetensors weights into an existing model (in place, exact)."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    if is_adapter_model(model) or is_adapter_dir(directory):
        if not (is_adapter_model(model) and is_adapter_dir(directory)):
            kind = "a LoRA adapter" if is_adapter_dir(directory) else "full weights"
            raise CheckpointError(
                f"checkpoint {directory} holds {kind}, the model {'has' if is_adapter_model(model) else 'has no'} "
                "adapters: resume with the policy.lora setting the checkpoint was trained with"
            )
        weight_files(directory)
        try:
            load_adapter_into(model, Path(directory))
        except (AdapterError, SafetensorError, OSError) as exc:
            raise CheckpointError(str(exc)) from exc
        return
    state: dict[str, torch.Tensor] = {}
    for path in weight_files(directory):
        try:
            state.update(load_file(str(path)))
        except (SafetensorError, OSError) as exc:
            raise CheckpointError(f"{path} is corrupt: {exc}") from exc
    result = model.load_state_dict(state, strict=False)
    # Tied weights (e.g. lm_head = embed_tokens) are saved once; a missing key is fine only when
    # its tensor is the same storage as a loaded one.
    own = model.state_dict()
    loaded_ptrs = {t.data_ptr() for name, t in own.items() if name in state}
    missing = [k for k in result.missing_keys if own[k].data_ptr() not in loaded_ptrs]
    if missing or result.unexpected_keys:
        raise CheckpointError(
            f"weights in {directory} do not match the model: missing {missing[:5]}, "
            f"unexpected {result.unexpected_keys[:5]}"
        )


def load_checkpoint(directory: str | Path, model: nn.Module | None = None) -> Checkpoint:
    """Validate and read a checkpoint. With ``model`` the weights are loaded into it in place;
    without, a fresh model is built with ``AutoModelForCausalLM.from_pretrained`` (local files).
    Everything is validated before the model is touched, so a bad checkpoint leaves it as it was."""
    directory = Path(directory)
    meta = read_meta(directory)
    state = load_trainer_state(directory)
    weight_files(directory)
    if model is None:
        from transformers import AutoModelForCausalLM

        if is_adapter_dir(directory):
            raise CheckpointError(
                f"{directory} holds a LoRA adapter, not a model: load it with its base through "
                "rubricem_core.policy.loading.load_policy (merged), or into an adapter model with model="
            )
        try:
            model = AutoModelForCausalLM.from_pretrained(str(directory), local_files_only=True)
        except Exception as exc:
            raise CheckpointError(f"cannot load the model in {directory}: {type(exc).__name__}: {exc}") from exc
    else:
        load_weights_into(model, directory)
    return Checkpoint(path=directory, trainer_state=state, meta=meta, model=model)


def latest_checkpoint(root: str | Path) -> Path | None:
    """The complete checkpoint under ``root`` with the highest step (ties: the later name), or None.

    Staging directories (``.name.tmp``) and directories without checkpoint.json are ignored."""
    root = Path(root)
    if not root.is_dir():
        return None
    best: tuple[int, str] | None = None
    best_path: Path | None = None
    for child in root.iterdir():
        if child.name.startswith(".") or not child.is_dir() or not (child / META_FILE).is_file():
            continue
        try:
            step = int(json.loads((child / META_FILE).read_text()).get("step", -1))
        except (OSError, ValueError, TypeError, AttributeError) as exc:
            log.warning("ignoring checkpoint %s: unreadable %s (%s)", child, META_FILE, exc)
            continue
        key = (step, child.name)
        if best is None or key > best:
            best, best_path = key, child
    return best_path


# ------------------------------------------------------------------------------ adapter checkpoints
# A LoRA checkpoint holds peft's adapter_config.json and adapter_model.safetensors (megabytes) and names its
# base model by reference: the directory the trained model was loaded from, which may itself be an adapter
# checkpoint (RL's adapter over SFT's). checkpoint.json records the base relative to the checkpoint (a moved
# run still loads) and the SHA-256 of the base's own checkpoint.json (a base that changed since is refused).
def adapter_meta(model: nn.Module, directory: Path) -> dict[str, Any]:
    """What checkpoint.json records of an adapter: its base (relative to the checkpoint's final directory,
    and absolute), the base's fingerprint, and the LoRA shape."""
    config = model.peft_config[ADAPTER_NAME]
    base = Path(config.base_model_name_or_path)
    return {
        "base": os.path.relpath(base, Path(directory).resolve()),
        "base_abs": str(base),
        "base_sha256": base_fingerprint(base),
        "rank": int(config.r),
        "alpha": float(config.lora_alpha),
    }


def base_fingerprint(base: Path) -> str | None:
    """SHA-256 of the base's checkpoint.json (which records every file's digest); None for a directory not
    written by save_checkpoint (a converted or downloaded model)."""
    meta = base / META_FILE
    return file_sha256(meta) if meta.is_file() else None


def adapter_base(directory: str | os.PathLike[str]) -> Path:
    """The base model directory an adapter checkpoint names: the recorded relative path, else the absolute
    one; refused when neither exists or the base's checkpoint changed since the adapter was trained."""
    directory = Path(directory)
    try:
        config = json.loads((directory / ADAPTER_CONFIG).read_text())
        meta_path = directory / META_FILE
        meta = json.loads(meta_path.read_text()).get("adapter", {}) if meta_path.is_file() else {}
    except (OSError, json.JSONDecodeError) as error:
        raise AdapterError(f"adapter {directory}: cannot read {ADAPTER_CONFIG} or {META_FILE}: {error}") from error
    candidates = [directory / meta["base"]] if meta.get("base") else []
    candidates.append(Path(config.get("base_model_name_or_path") or ""))
    base = next((c.resolve() for c in candidates if str(c) and c.is_dir()), None)
    if base is None:
        named = ", ".join(str(c) for c in candidates if str(c)) or "nothing"
        raise AdapterError(
            f"adapter {directory}: its base model is missing (it names {named}); the adapter holds only the "
            "low-rank weights, so the base it was trained on must be where it was"
        )
    expected = meta.get("base_sha256")
    if expected and base_fingerprint(base) != expected:
        raise AdapterError(
            f"adapter {directory}: its base {base} changed after the adapter was trained (its checkpoint.json "
            "digest differs from the one the adapter recorded); retrain the adapter or restore that base"
        )
    return base


def load_adapter_into(model: nn.Module, directory: Path) -> None:
    """Load an adapter checkpoint's weights into a model that has the same adapters (resume), exactly."""
    from peft import set_peft_model_state_dict
    from safetensors.torch import load_file

    state = load_file(str(directory / ADAPTER_WEIGHTS))
    result = set_peft_model_state_dict(model, state)
    own = {k for k in adapter_state_dict(model)}
    missing = sorted(own - set(state))
    unexpected = [k for k in getattr(result, "unexpected_keys", []) if "lora_" in k]
    if missing or unexpected:
        raise AdapterError(
            f"the adapter in {directory} does not fit the model: missing {missing[:5]}, unexpected {unexpected[:5]}"
        )
