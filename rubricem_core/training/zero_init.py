"""ZeRO-3 ranks that load the policy straight into their partitions (``deepspeed.zero.Init``).

Without it every rank first builds the whole model in host memory and only ``deepspeed.initialize``
partitions it: an 8B bf16 policy costs 16 GB per rank before training starts, 128 GB of host memory on
an 8-GPU node. While a ``HfDeepSpeedConfig`` is alive, transformers' ``from_pretrained`` constructs the
model under ``deepspeed.zero.Init``: each parameter is a 0-size placeholder from the start and the
checkpoint's values are scattered into the 1/N partitions as they are read. The trainer then wraps the
already partitioned module (DeepSpeed sees its ``ds_id``s), so the weights, and every number trained
from them, are the same as loading whole and partitioning afterwards.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from rubricem_core.training.config import TrainerConfig


def loads_partitioned(cfg: TrainerConfig) -> bool:
    """Whether a policy for ``cfg`` is loaded into ZeRO-3 partitions: DeepSpeed ZeRO-3 on several ranks
    (on one rank there is nothing to partition, and the plain load keeps one-process runs as they are)."""
    from rubricem_core.distributed.ranks import world_size

    return cfg.backend == "deepspeed" and cfg.zero_stage == 3 and world_size() > 1


def parameter_count(model_dir: str | Path) -> int:
    """The parameters of the model a directory (or hub name) describes, built on the meta device: no
    weights are read or allocated (the DeepSpeed config's bucket sizes follow the model's size)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(str(model_dir))
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    # tied weights are one parameter, as DeepSpeed counts them
    return sum(p.numel() for p in model.parameters())


def policy_ds_config(model_dir: str | Path, cfg: TrainerConfig) -> dict[str, Any]:
    """The DeepSpeed config the trainer will use for the model in ``model_dir`` (its buckets sized by the
    model's parameter count, as the trainer sizes them)."""
    from rubricem_core.training.deepspeed_trainer import build_ds_config

    return build_ds_config(cfg, parameter_count(model_dir))


@contextmanager
def partitioned_loading(ds_config: dict[str, Any]) -> Iterator[None]:
    """``from_pretrained`` inside builds its model in ZeRO-3 partitions over this process group (as
    ``ds_config`` says: dtype, parameter offload). Only inside: a model loaded after it (the frozen
    reference, an engine's copy) is loaded whole unless it is loaded under its own block."""
    from transformers.integrations import HfDeepSpeedConfig
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config

    from rubricem_core.distributed.ranks import init_process_group
    from rubricem_core.training.deepspeed_trainer import import_deepspeed

    import_deepspeed()
    init_process_group()  # zero.Init scatters over the ranks' process group
    # transformers finds the config through a weak reference: held here for the block
    active = HfDeepSpeedConfig(ds_config)
    try:
        yield
    finally:
        unset_hf_deepspeed_config()
        del active
