"""``rubricem export``: a trained checkpoint in the forms other tools load, outside the run directory.

    <out>/merged    a Hugging Face directory (config, safetensors, tokenizer, chat template): what `vllm serve`,
                    transformers and the Hub load; for a LoRA checkpoint the adapter merged into its base
    <out>/adapter   LoRA checkpoints only: the adapter in peft's format (adapter_config.json naming a base that
                    transformers loads, adapter_model.safetensors, tokenizer), for `PeftModel.from_pretrained`
                    or `vllm serve --enable-lora --lora-modules name=<out>/adapter`

Nothing of the trainer (optimizer state, checkpoint.json) is exported. Each directory is written whole or not
at all, and an existing non-empty one is refused rather than overwritten.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

from rubricem_core.policy.loading import servable_dir, staged_directory, write_merged_dir
from rubricem_core.training.adapters import ADAPTER_CONFIG, ADAPTER_WEIGHTS, is_adapter_dir
from rubricem_core.training.checkpoint import META_FILE, STATE_FILE, adapter_base, read_meta

NOT_EXPORTED = frozenset({STATE_FILE, META_FILE, "README.md"})


@dataclass(frozen=True)
class Exported:
    merged: Path
    adapter: Path | None  # None: a full checkpoint has no adapter
    base: Path | None  # the HF directory the exported adapter names as its base


def export_checkpoint(checkpoint: str | Path, out: str | Path) -> Exported:
    """Write ``<out>/merged`` (and ``<out>/adapter`` for a LoRA checkpoint) from a complete checkpoint."""
    checkpoint, out = Path(checkpoint), Path(out)
    read_meta(checkpoint)  # complete and unchanged since the save, or a CheckpointError naming the file
    merged = out / "merged"
    if not is_adapter_dir(checkpoint):
        with staged_directory(merged) as staging:
            for path in sorted(checkpoint.iterdir()):
                if path.is_file() and path.name not in NOT_EXPORTED:
                    shutil.copy2(path, staging / path.name)
        return Exported(merged, None, None)
    write_merged_dir(checkpoint, merged)
    # peft loads the base by the name in adapter_config.json: a plain HF directory (a LoRA base, e.g. RL's
    # adapter over SFT's, is named by its merged copy beside it)
    base = servable_dir(adapter_base(checkpoint)).resolve()
    adapter = out / "adapter"
    with staged_directory(adapter) as staging:
        for path in sorted(checkpoint.iterdir()):
            if path.is_file() and path.name not in NOT_EXPORTED:
                shutil.copy2(path, staging / path.name)
        config = json.loads((staging / ADAPTER_CONFIG).read_text())
        config["base_model_name_or_path"] = str(base)
        (staging / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        if not (staging / ADAPTER_WEIGHTS).is_file():
            raise FileNotFoundError(f"{checkpoint} has no {ADAPTER_WEIGHTS}")
    return Exported(merged, adapter, base)
