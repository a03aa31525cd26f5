"""SFT on several ranks: what the sft task runs under torchrun, and the call that launches it.

    launch_sft(run_dir, cfg, policy_dir, on_line=log.info, on_metrics=child.log_metrics)

The task writes a launch file (the resolved config, the policy directory) under ``state/launch/``;
every rank reads it and the run's ``sft_trajectories`` (read only) and runs ``run_sft``; rank 0 prints
metric lines for the launching process and writes the result file. Checkpoints, resume and the final
directory are the ones of a one-process run (``checkpoints/sft``).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from torch.distributed.elastic.multiprocessing.errors import record

from rubricem_core.config import RunConfig
from rubricem_core.distributed.launch import emit_metrics, end_launch_file, run_ranks
from rubricem_core.distributed.nodes import with_launch_id
from rubricem_core.distributed.ranks import is_main, shutdown
from rubricem_core.distributed.spec import launch_path, launch_spec, resolve_master, start_rank
from rubricem_core.store import RunStore, atomic_write_text

MODULE = "rubricem_core.distributed.sft_worker"


def launch_sft(
    run_dir: str,
    cfg: RunConfig,
    policy_dir: str,
    checkpoint_root: Path,
    on_line: Callable[[str], None],
    on_metrics: Callable[[dict[str, float], int], None] | None,
) -> dict[str, Any]:
    """Run SFT on ``cfg.distributed``'s ranks; returns run_sft's result (rank 0's)."""
    spec_file, result_file = launch_path(run_dir, "sft.json"), launch_path(run_dir, "sft-result.json")
    result_file.unlink(missing_ok=True)  # a result is only ever this launch's
    cfg = resolve_master(cfg)  # the other nodes read the address from the launch file
    atomic_write_text(
        spec_file,
        json.dumps(
            with_launch_id(
                {
                    "run_dir": str(Path(run_dir).resolve()),
                    "config": cfg.model_dump(mode="json"),
                    "policy_dir": str(Path(policy_dir).resolve()) if Path(policy_dir).exists() else policy_dir,
                    "checkpoint_root": str(checkpoint_root.resolve()),
                    "result": str(result_file.resolve()),
                }
            )
        ),
    )
    try:
        run_ranks(
            launch_spec(cfg), MODULE, ["--spec", str(spec_file.resolve())], on_line=on_line, on_metrics=on_metrics
        )
    finally:
        end_launch_file(spec_file)
    if not result_file.exists():
        raise RuntimeError(f"the SFT ranks exited 0 but rank 0 wrote no result ({result_file})")
    return json.loads(result_file.read_text())


@record
def main(argv: list[str] | None = None) -> None:
    from rubricem_core.sft import run_sft, sft_inputs  # after the logging set-up

    spec, cfg = start_rank("One SFT rank (started by torchrun from the sft task).", argv)
    store = RunStore(spec["run_dir"])
    rows, reflections = sft_inputs(spec["run_dir"])
    doc_ids = store.read_table("corpus")["doc_id"].to_pylist() if cfg.sft.relabel_doc_ids else []
    result = run_sft(
        Path(spec["policy_dir"]),
        rows,
        Path(spec["checkpoint_root"]),
        cfg.policy,
        cfg.sft,
        cfg.seed,
        log_metrics=emit_metrics if is_main() else None,
        doc_ids=doc_ids,
        reflection_rows=reflections,
    )
    if is_main():
        atomic_write_text(Path(spec["result"]), json.dumps(result))
    shutdown()


if __name__ == "__main__":
    main()
