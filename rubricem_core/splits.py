"""Which queries each stage reads: SFT data collection (``data.sft_split``) and RL (split train,
``data.rl_filter``). Evaluation reads split eval. One home for the rules, used by the tasks and flows."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from rubricem_core.schemas import SHORT_FORM

SFT_SPLITS: dict[str, tuple[str, ...]] = {"train": ("train",), "sft": ("sft",), "sft+train": ("sft", "train")}


def is_long_form(query: dict[str, Any]) -> bool:
    """A query is long-form unless its reader marked it short-form (a short gold answer, no rubrics)."""
    return query["kind"] != SHORT_FORM


def sft_queries(queries: Sequence[dict[str, Any]], sft_split: str) -> list[dict[str, Any]]:
    """The queries the teacher writes SFT traces for, in table order."""
    if sft_split not in SFT_SPLITS:
        raise ValueError(f"data.sft_split must be one of {list(SFT_SPLITS)}, got {sft_split!r}")
    chosen = [q for q in queries if q["split"] in SFT_SPLITS[sft_split]]
    if not chosen:
        raise ValueError(
            f"data.sft_split={sft_split!r}: no query has split {' or '.join(SFT_SPLITS[sft_split])} "
            "(set data.queries[].split, data.world.sft_fraction, or data.sft_split: train)"
        )
    return chosen


def rl_queries(queries: Sequence[dict[str, Any]], rl_filter: str) -> list[dict[str, Any]]:
    """The train queries RL schedules, in table order."""
    if rl_filter not in ("none", "long_form"):
        raise ValueError(f"data.rl_filter must be none or long_form, got {rl_filter!r}")
    train = [q for q in queries if q["split"] == "train"]
    chosen = [q for q in train if rl_filter == "none" or is_long_form(q)]
    if not chosen:
        raise ValueError(
            f"no RL queries: {len(train)} of split train, none left by data.rl_filter={rl_filter!r}"
            if train
            else "no RL queries: no query has split train"
        )
    return chosen
