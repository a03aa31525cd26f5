"""What several benchmark scripts share."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from rubricem_core.layout import RunLayout


def has_sft_checkpoint(run_dir: Path, na_figure: str) -> bool:
    """True when ``run_dir`` holds checkpoints/sft/final; otherwise prints how to get one and the
    script's figure line marked n/a (run_all still finds a last line to parse)."""
    if RunLayout(run_dir).has_sft_policy():
        return True
    print(f"no SFT checkpoint under {run_dir}: run `make run` (or pass --run-dir)")
    print(na_figure)
    return False


def add_set_argument(parser: argparse.ArgumentParser, help: str = "config override (YAML value; repeatable)") -> None:
    """``--set KEY=VALUE`` (repeatable) into ``args.overrides``; parse_overrides reads them."""
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE", help=help)


def parse_overrides(items: list[str]) -> dict[str, Any]:
    """``--set`` items as the dotted overrides load_config takes (YAML values)."""
    from rubricem_core.config import parse_override

    return dict(parse_override(item) for item in items)


def add_threads_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch CPU threads (1: steadiest on a shared machine, where spinning threads stall)",
    )
