"""What several benchmark scripts share."""

from __future__ import annotations

from pathlib import Path

from rubricem_core.layout import RunLayout


def has_sft_checkpoint(run_dir: Path, na_figure: str) -> bool:
    """True when ``run_dir`` holds checkpoints/sft/final; otherwise prints how to get one and the
    script's figure line marked n/a (run_all still finds a last line to parse)."""
    if RunLayout(run_dir).has_sft_policy():
        return True
    print(f"no SFT checkpoint under {run_dir}: run `make run` (or pass --run-dir)")
    print(na_figure)
    return False
