"""LoRA adapters (peft) on a policy: add one for training, read adapter checkpoints, merge for engines.

An adapter checkpoint holds peft's ``adapter_config.json`` and ``adapter_model.safetensors`` (megabytes) and
names its base model by reference: the directory the trained model was loaded from, which may itself be an
adapter checkpoint (RL's adapter over SFT's). ``checkpoint.json`` records the base relative to the checkpoint
(so a moved run still loads) and the SHA-256 of the base's own ``checkpoint.json`` (so a base that changed
since is refused, not silently used).

    model = add_adapter(model, cfg.policy.lora)        # SFT/RL: only the adapter trains
    reference = AdapterDisabled(model)                 # RL's KL reference: the same weights, adapter off
    merged_named_tensors(model)                        # what a weight push sends an engine (HF names)

The adapter checkpoint's files and its base reference are training/checkpoint.py's; loading one as a merged
plain model (for whatever samples) is policy/loading.py's.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from rubricem_core.config import LoraSettings

log = logging.getLogger(__name__)
# peft asks transformers a deprecated question on every wrap; the answer is the same, the warning noise
warnings.filterwarnings("ignore", message=r".*is_gradient_checkpointing.*deprecated", category=FutureWarning)

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_NAME = "default"


class AdapterError(RuntimeError):
    """An adapter checkpoint cannot be used: its base is missing or changed, or its files do not fit."""


def is_adapter_dir(path: str | os.PathLike[str]) -> bool:
    """A directory holding a LoRA adapter (and no full weights of its own)."""
    p = Path(path)
    return (p / ADAPTER_CONFIG).is_file() and not (p / "config.json").is_file()


def is_adapter_model(model: Any) -> bool:
    """A peft model with LoRA layers (what ``add_adapter`` returns)."""
    return hasattr(model, "peft_config") and hasattr(model, "disable_adapter")


def add_adapter(model: PreTrainedModel, lora: LoraSettings, base: str | os.PathLike[str], seed: int = 0) -> nn.Module:
    """``model`` with fresh LoRA adapters (B = 0: the wrapped model computes exactly what ``model`` did; A drawn
    from ``seed``, whatever the global RNG's state); only the adapters require gradients. ``base``: the
    directory ``model`` was loaded from, which the adapter's checkpoints name."""
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(
        r=lora.rank,
        lora_alpha=lora.alpha,
        target_modules=lora.target_modules,
        lora_dropout=lora.dropout,
        bias="none",
        task_type="CAUSAL_LM",
    )
    try:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            wrapped = get_peft_model(model, config)
    except ValueError as error:  # e.g. target modules that do not exist in this architecture
        raise AdapterError(f"policy.lora does not fit {type(model).__name__}: {error}") from error
    wrapped.peft_config[ADAPTER_NAME].base_model_name_or_path = str(Path(base).resolve())
    return wrapped


def base_model_of(model: nn.Module) -> nn.Module:
    """The plain HF model under a peft wrapper (the wrapper's LoRA layers still in it), or ``model``."""
    return model.get_base_model() if is_adapter_model(model) else model


class AdapterDisabled(nn.Module):
    """The model with its adapters switched off: the KL reference of a LoRA run without a second copy of the
    weights. Forward only (the caller runs it under ``torch.no_grad``)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        was_training = self.model.training
        self.model.eval()  # as a separate frozen reference would be: no dropout
        try:
            with self.model.disable_adapter():
                return self.model(*args, **kwargs)
        finally:
            self.model.train(was_training)


# --------------------------------------------------------------------------------- merged weights
def _lora_layers(model: nn.Module) -> dict[str, nn.Module]:
    from peft.tuners.lora import LoraLayer

    return {name: m for name, m in base_model_of(model).named_modules() if isinstance(m, LoraLayer)}


def _gathered(params: list[nn.Parameter]) -> contextlib.AbstractContextManager:
    if any(hasattr(p, "ds_id") for p in params):  # ZeRO-3 placeholders: gather them whole for the read
        import deepspeed

        return deepspeed.zero.GatheredParameters(params)
    return contextlib.nullcontext()


def merged_params(model: nn.Module) -> Iterator[tuple[str, nn.Parameter]]:
    """(HF name, base parameter) of every weight of the merged model, in ``named_parameters`` order (tied
    ones repeated): the names and shapes a weight push announces."""
    for name, param in base_model_of(model).named_parameters(remove_duplicate=False):
        if "lora_" in name:
            continue
        yield name.replace(".base_layer.", "."), param


def merged_named_tensors(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, weight) of the model with its adapters merged: base + (alpha / rank) · B A for every LoRA
    layer, computed beside the base (the base is never changed: merging in place and back would round it).
    A plain model's own parameters. Collective under ZeRO-3 (every rank iterates)."""
    if not is_adapter_model(model):
        for name, param in model.named_parameters(remove_duplicate=False):
            yield name, param.detach()
        return
    layers = _lora_layers(model)
    for name, param in base_model_of(model).named_parameters(remove_duplicate=False):
        if "lora_" in name:
            continue
        owner, _, leaf = name.rpartition(".base_layer.")
        layer = layers.get(owner) if leaf == "weight" else None
        hf_name = name.replace(".base_layer.", ".")
        if layer is None:
            with _gathered([param]):
                yield hf_name, param.detach().clone() if hasattr(param, "ds_id") else param.detach()
            continue
        own = [param, *layer.lora_A[ADAPTER_NAME].parameters(), *layer.lora_B[ADAPTER_NAME].parameters()]
        with _gathered(own), torch.no_grad():
            delta = layer.get_delta_weight(ADAPTER_NAME)
            yield hf_name, (param.detach() + delta.to(param.dtype)).detach()


def merged_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """``merged_named_tensors`` as a dict (first name of tied parameters wins, as ``state_dict`` does)."""
    out: dict[str, torch.Tensor] = {}
    for name, tensor in merged_named_tensors(model):
        out.setdefault(name, tensor)
    return out


def adapter_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The adapter's own tensors (peft's names, as saved in adapter_model.safetensors)."""
    from peft import get_peft_model_state_dict

    return {k: v.detach() for k, v in get_peft_model_state_dict(model, save_embedding_layers=False).items()}


def write_adapter(model: nn.Module, directory: str | os.PathLike[str], is_writer: bool = True) -> Path:
    """The adapter of ``model`` in peft's format (adapter_config.json, adapter_model.safetensors), written whole
    or not at all: what `vllm serve` loads at run time (``rollout.weight_transfer: adapter``). Collective under
    ZeRO-3 (every rank gathers the adapter's partitions); only ``is_writer`` writes."""
    from safetensors.torch import save_file

    directory = Path(directory)
    lora = [p for n, p in model.named_parameters() if "lora_" in n]
    with _gathered(lora):
        state = {k: v.to("cpu").contiguous().clone() for k, v in adapter_state_dict(model).items()}
    if not is_writer:
        return directory
    staging = directory.with_name(f".{directory.name}.tmp")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    model.peft_config[ADAPTER_NAME].save_pretrained(str(staging))
    save_file(state, str(staging / ADAPTER_WEIGHTS), metadata={"format": "pt"})
    shutil.rmtree(directory, ignore_errors=True)
    staging.rename(directory)
    return directory
