"""Load a policy (causal LM + tokenizer) from a local Hugging Face directory or, when allowed, the hub.

A LoRA checkpoint (training/adapters.py) loads as a plain model too: its base loaded, the adapter applied and
merged, so whatever samples (evaluation, ``rubricem ask``, the rollout engines) reads it as a full one;
engines that load weights from a directory (vLLM) get ``servable_dir``'s merged copy.

Everything downstream needs a chat template (prompts are rendered with it) and a pad token
(batched generation and training pad), so both are checked here, once, with the path named.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from huggingface_hub.utils import HFValidationError, validate_repo_id
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from rubricem_core.training.adapters import ADAPTER_WEIGHTS, AdapterError, add_adapter, is_adapter_dir
from rubricem_core.training.checkpoint import META_FILE, CheckpointError, adapter_base, file_sha256, read_meta

DTYPES: dict[str, torch.dtype | str] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "auto": "auto",  # whatever the checkpoint's config says
}
WEIGHT_FILES: tuple[str, ...] = (
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
)
if TYPE_CHECKING:
    from rubricem_core.config import LoraSettings
    from rubricem_core.training.config import TrainerConfig

log = logging.getLogger(__name__)
_TRUE = {"1", "true", "yes", "on"}
MERGED_MARKER = ".merged-from"  # in servable_dir's copy: the digest of the adapter it was merged from


class PolicyLoadError(RuntimeError):
    """A policy cannot be loaded: missing directory or weights, no chat template, or not available offline."""


def hub_offline() -> bool:
    # Read at call time: the project sets HF_HUB_OFFLINE after huggingface_hub may have been imported.
    return any(os.environ.get(key, "").strip().lower() in _TRUE for key in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"))


def _is_hub_name(name: str) -> bool:
    try:
        validate_repo_id(name)
    except HFValidationError:
        return False
    return True


def _check_local_dir(path: Path) -> None:
    if not path.exists():
        raise PolicyLoadError(f"policy directory {path} does not exist")
    if not path.is_dir():
        raise PolicyLoadError(f"policy path {path} is a file, not a model directory")
    if is_adapter_dir(path):  # a LoRA checkpoint: its own adapter weights, its base named inside
        if not (path / ADAPTER_WEIGHTS).is_file():
            raise PolicyLoadError(f"adapter directory {path} has no {ADAPTER_WEIGHTS}")
        _check_recorded_sizes(path)
        return
    if not (path / "config.json").is_file():
        raise PolicyLoadError(f"policy directory {path} has no config.json")
    if not any((path / name).is_file() for name in WEIGHT_FILES) and not any(path.glob("*.safetensors")):
        raise PolicyLoadError(f"policy directory {path} has no weights (expected one of {', '.join(WEIGHT_FILES)})")
    _check_recorded_sizes(path)


def _check_recorded_sizes(path: Path) -> None:
    """Check a saved checkpoint against its checkpoint.json before transformers reads it.

    Without this a truncated model.safetensors fails deep in safetensors ("incomplete metadata")
    naming no file. Directories without checkpoint.json (converted or downloaded models) pass.
    """
    if not (path / META_FILE).is_file():
        return
    try:
        read_meta(path)
    except CheckpointError as error:
        raise PolicyLoadError(f"cannot load the policy: {error}") from error  # names dir, file, both sizes


def resolve_dtype(dtype: str | torch.dtype) -> torch.dtype | str:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    return DTYPES[dtype]


def auto_device() -> torch.device:
    """The CUDA device when there is one, else the CPU: where policies sample and train by default."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def load_policy(
    name_or_path: str | os.PathLike[str],
    dtype: str | torch.dtype = "float32",
    device: str | torch.device = "cpu",
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load ``(model, tokenizer)`` from a local HF causal-LM directory or a hub name.

    A hub name is tried only when no such local path exists; with ``HF_HUB_OFFLINE`` set it must
    already be in the local Hugging Face cache. The model is returned in eval mode on ``device``.
    """
    torch_dtype = resolve_dtype(dtype)
    name = os.fspath(name_or_path)
    path = Path(name).expanduser()
    local = path.exists() or not _is_hub_name(name)
    if local:
        _check_local_dir(path)
        if is_adapter_dir(path):  # base + adapter, merged: whoever samples sees a plain model
            return load_adapter_policy(path, dtype=dtype, device=device)
        source, where = str(path), f"policy directory {path}"
    else:
        source, where = name, f"hub model {name!r}"
    offline = hub_offline()
    try:
        tokenizer = AutoTokenizer.from_pretrained(source, local_files_only=offline)
        model = AutoModelForCausalLM.from_pretrained(source, dtype=torch_dtype, local_files_only=offline)
    except OSError as error:
        if not local and offline:
            raise PolicyLoadError(
                f"{where} is not available locally: no directory of that name and not in the Hugging Face "
                f"cache, and HF_HUB_OFFLINE=1 forbids downloading it (build or convert a local model directory, "
                f"or unset HF_HUB_OFFLINE on a machine with hub access)"
            ) from error
        raise PolicyLoadError(f"cannot load {where}: {error}") from error
    except Exception as error:
        if not local:
            raise
        # A damaged local file surfaces as whatever its parser raises (SafetensorError, JSON or
        # tokenizers errors), none of which names the directory.
        raise PolicyLoadError(f"cannot load {where}: {type(error).__name__}: {error}") from error
    if not getattr(tokenizer, "chat_template", None):
        raise PolicyLoadError(
            f"the tokenizer of {where} has no chat template; prompts are rendered with it "
            f"(add chat_template.jinja or a chat_template entry in tokenizer_config.json)"
        )
    _ensure_pad_token(model, tokenizer, where)
    return model.to(device).eval(), tokenizer


def load_for_training(
    model_dir: str | Path, dtype: str, cfg: TrainerConfig, lora: LoraSettings | None = None
) -> tuple[Any, PreTrainedTokenizerBase]:
    """``(model, tokenizer)`` of a policy directory, for ``make_trainer(model, cfg)``. Under DeepSpeed
    ZeRO-3 on several ranks the model is built straight into this rank's partition (zero_init.py), so
    no rank ever holds the whole policy; otherwise it is loaded whole. With ``lora`` on, fresh LoRA adapters
    are added (policy/adapters.py) and only they train; ``model_dir`` (merged, if itself an adapter) is their base."""
    # Imported here: the trainers' package is needed only by training code, not by plain loading
    from rubricem_core.training.zero_init import loads_partitioned, partitioned_loading, policy_ds_config

    if not loads_partitioned(cfg):
        model, tokenizer = load_policy(str(model_dir), dtype=dtype)
    else:
        with partitioned_loading(policy_ds_config(model_dir, cfg)):
            model, tokenizer = load_policy(str(model_dir), dtype=dtype)
        held = sum(p.ds_tensor.numel() for p in model.parameters())
        total = sum(p.ds_numel for p in model.parameters())
        log.info("%s built into ZeRO-3 partitions: this rank holds %d of %d parameters", model_dir, held, total)
    if lora is not None and lora.enabled:
        model = add_adapter(model, lora, base=model_dir, seed=cfg.seed)  # model_dir: the adapter's base
    return model, tokenizer


def load_tokenizer(directory: str | os.PathLike[str]) -> PreTrainedTokenizerBase:
    """The tokenizer of a local policy directory, with the pad-token rule of ``load_policy``."""
    path = Path(directory)
    _check_local_dir(path)
    tokenizer = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    if tokenizer.pad_token is None:
        if tokenizer.eos_token is None:
            raise PolicyLoadError(f"the tokenizer of policy directory {path} has neither a pad nor an eos token")
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load_policy_tokenizer(name_or_path: str | os.PathLike[str]) -> PreTrainedTokenizerBase:
    """The tokenizer alone of a policy named as ``load_policy`` takes it: a local policy directory
    (``load_tokenizer``), or a hub name (from the Hugging Face cache only when ``HF_HUB_OFFLINE`` is set)."""
    name = os.fspath(name_or_path)
    path = Path(name).expanduser()
    if path.exists() or not _is_hub_name(name):
        return load_tokenizer(path)
    offline = hub_offline()
    try:
        tokenizer = AutoTokenizer.from_pretrained(name, local_files_only=offline)
    except OSError as error:
        hint = " (not in the Hugging Face cache, and HF_HUB_OFFLINE=1 forbids downloading it)" if offline else ""
        raise PolicyLoadError(f"cannot load the tokenizer of hub model {name!r}{hint}: {error}") from error
    if tokenizer.pad_token is None:
        if tokenizer.eos_token is None:
            raise PolicyLoadError(f"the tokenizer of hub model {name!r} has neither a pad nor an eos token")
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def _ensure_pad_token(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, where: str) -> None:
    if tokenizer.pad_token is None:
        if tokenizer.eos_token is None:
            raise PolicyLoadError(f"the tokenizer of {where} has neither a pad nor an eos token")
        tokenizer.pad_token = tokenizer.eos_token
    if model.config.pad_token_id is None:
        model.config.pad_token_id = tokenizer.pad_token_id
    generation = getattr(model, "generation_config", None)
    if generation is not None and generation.pad_token_id is None:
        generation.pad_token_id = tokenizer.pad_token_id


def model_summary(model: PreTrainedModel) -> dict[str, Any]:
    """Size and shape of a loaded policy, for logs and MLflow params."""
    config = model.config
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    first = next(model.parameters())
    return {
        "architecture": type(model).__name__,
        "params": sum(p.numel() for p in model.parameters()),
        "trainable_params": sum(p.numel() for p in model.parameters() if p.requires_grad),
        "layers": text_config.num_hidden_layers,
        "hidden_size": text_config.hidden_size,
        "vocab": text_config.vocab_size,
        "dtype": str(first.dtype).removeprefix("torch."),
        "device": str(first.device),
    }


def add_legacy_config_keys(model_dir: str | os.PathLike[str]) -> None:
    """Also write a saved config.json's RoPE theta and dtype under the transformers 4.x key names.

    transformers 5 saves ``rope_parameters`` and ``dtype``; 4.x (which a vLLM node may pin) reads
    ``rope_theta`` and ``torch_dtype`` and would silently fall back to its defaults. 5.x ignores
    the extra keys because ``rope_parameters`` is present.
    """
    path = Path(model_dir) / "config.json"
    config = json.loads(path.read_text())
    rope = config.get("rope_parameters")
    if isinstance(rope, dict) and rope.get("rope_type", "default") == "default" and "rope_theta" in rope:
        config.setdefault("rope_theta", rope["rope_theta"])
    if "dtype" in config:
        config.setdefault("torch_dtype", config["dtype"])
    path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


@contextmanager
def staged_directory(out_dir: str | os.PathLike[str]) -> Iterator[Path]:
    """Yield a sibling staging folder that is renamed to ``out_dir`` on success, removed on failure,
    so a model directory exists whole or not at all. ``out_dir`` must be absent or empty."""
    out = Path(out_dir)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise FileExistsError(f"{out} already exists and is not an empty directory; remove it or pick another")
    staging = out.with_name(f".{out.name}.partial-{os.getpid()}")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    try:
        yield staging
        if out.exists():
            out.rmdir()  # empty (checked above); rename needs the name free
        staging.rename(out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


# ------------------------------------------------ adapter checkpoints (training/adapters.py) as plain models
def load_adapter_policy(
    directory: str | os.PathLike[str], dtype: str | torch.dtype, device: str | torch.device
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """(merged model, tokenizer) of an adapter checkpoint: its base loaded (recursively: a base may be an
    adapter too), the adapter applied and merged. The model's ``name_or_path`` is ``directory``."""
    from peft import PeftModel

    directory = Path(directory)
    try:
        base = adapter_base(directory)
    except AdapterError as error:
        raise PolicyLoadError(str(error)) from error
    model, base_tokenizer = load_policy(base, dtype=dtype, device=device)
    try:
        merged = PeftModel.from_pretrained(model, str(directory)).merge_and_unload()
    except Exception as error:  # peft raises several types for a damaged or mismatched adapter
        raise PolicyLoadError(f"cannot apply the adapter in {directory}: {type(error).__name__}: {error}") from error
    merged.config._name_or_path = str(directory)
    tokenizer = load_tokenizer(directory) if (directory / "tokenizer_config.json").is_file() else base_tokenizer
    return merged.eval(), tokenizer


def write_merged_dir(directory: str | os.PathLike[str], out: str | os.PathLike[str], dtype: str = "auto") -> Path:
    """A Hugging Face directory (config, safetensors, tokenizer) of an adapter checkpoint's merged weights,
    written whole or not at all: what `vllm serve` and any HF tool load."""
    model, tokenizer = load_adapter_policy(directory, dtype=dtype, device="cpu")
    out = Path(out)
    with staged_directory(out) as staging:
        model.save_pretrained(str(staging))
        tokenizer.save_pretrained(str(staging))
        add_legacy_config_keys(staging)
    return out


def servable_dir(path: str | os.PathLike[str]) -> Path:
    """``path`` itself for a full model directory; for an adapter checkpoint, a merged copy beside it
    (``.<name>.merged``, ignored as a checkpoint; rewritten when the adapter changed), for engines that load
    weights from a directory (vLLM)."""
    path = Path(path)
    if not is_adapter_dir(path):
        return path
    source = path / META_FILE if (path / META_FILE).is_file() else path / ADAPTER_WEIGHTS
    stamp = file_sha256(source)
    out = path.parent / f".{path.name}.merged"
    marker = out / MERGED_MARKER
    if marker.is_file() and marker.read_text().strip() == stamp:
        return out
    shutil.rmtree(out, ignore_errors=True)
    write_merged_dir(path, out)
    marker.write_text(stamp + "\n")
    log.info("adapter %s merged into %s for a directory-loading engine", path, out)
    return out
