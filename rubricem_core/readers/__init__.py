"""Readers for real query sets -> list[Query] (the `queries` table).

One function per format; `read_queries` picks one from `format` or from the file's content.
Benchmark sets default to the "eval" split, training sets (DR Tulu RL rows, plain files) to "train".

Rubric `check` objects written here:
  {"type": "final", "value", "aliases"}        short-form answer, checkable by string match
  {"type": "benchmark", "benchmark", ...}       judged by an LLM; carries the source's own details
                                                (HealthBench points/tags, ScholarQA evidence,
                                                DeepResearchBench dimension and weights, ResearchQA
                                                item type, ResearchRubrics signed weight and axis)

ResearchQA, ResearchRubrics, WebWalkerQA and DeepSearchQA are read in their published formats; the
comment above each reader names the source (repository / dataset card, commit) and the fields followed.
"""

from __future__ import annotations

import csv
import os
from collections.abc import Callable
from pathlib import Path

import pyarrow.parquet as pq

from rubricem_core.readers.answer_benchmarks import (
    DEEPSEARCHQA_ANSWER_TYPES,
    read_2wiki,
    read_deepsearchqa,
    read_simpleqa,
    read_webwalkerqa,
)
from rubricem_core.readers.dr_tulu import read_dr_tulu
from rubricem_core.readers.plain import read_plain_queries
from rubricem_core.readers.records import QueryFileError, _first_record_keys
from rubricem_core.readers.rubric_benchmarks import (
    DRB_REFERENCE_KEY,
    attach_drb_references,
    read_deep_research_bench,
    read_drb_references,
    read_healthbench,
    read_researchqa,
    read_researchrubrics,
    read_scholarqa_cs,
)
from rubricem_core.readers.sft_sources import read_openscholar, read_searcharena
from rubricem_core.schemas import Query

__all__ = [
    "DEEPSEARCHQA_ANSWER_TYPES",
    "DRB_REFERENCE_KEY",
    "FORMATS",
    "QueryFileError",
    "attach_drb_references",
    "detect_format",
    "read_2wiki",
    "read_deep_research_bench",
    "read_deepsearchqa",
    "read_dr_tulu",
    "read_drb_references",
    "read_healthbench",
    "read_openscholar",
    "read_plain_queries",
    "read_queries",
    "read_researchqa",
    "read_researchrubrics",
    "read_scholarqa_cs",
    "read_searcharena",
    "read_simpleqa",
    "read_webwalkerqa",
]

FORMATS: tuple[str, ...] = (
    "dr_tulu",
    "healthbench",
    "scholarqa_cs",
    "deep_research_bench",
    "simpleqa",
    "2wiki",
    "researchqa",
    "researchrubrics",
    "webwalkerqa",
    "deepsearchqa",
    "searcharena",
    "openscholar",
    "jsonl",
    "parquet",
)


# ---- dispatch ----------------------------------------------------------------------------------


def detect_format(path: str | os.PathLike[str]) -> str:
    """Guess a file's format from its content (first record's fields), falling back to its suffix."""
    path = Path(path)
    suffix = path.suffix.lower()
    if suffix == ".csv":
        with open(path, encoding="utf-8", errors="replace", newline="") as fh:
            header = next(csv.reader(fh), [])
        return "deepsearchqa" if {"problem", "answer_type"} <= set(header) else "simpleqa"
    if suffix == ".parquet":
        try:
            names = set(pq.read_schema(path).names)
        except Exception as exc:  # pyarrow raises several types for unreadable files
            raise QueryFileError(path, None, f"unreadable Parquet file: {exc}") from exc
        return "dr_tulu" if {"messages", "ground_truth"} <= names else "parquet"
    keys = _first_record_keys(path)
    if "ground_truth" in keys and ("messages" in keys or "prompt" in keys):
        return "dr_tulu"
    if {"prompt_id", "rubrics", "prompt"} <= keys:
        return "healthbench"
    if {"sample_id", "rubrics", "prompt"} <= keys:
        return "researchrubrics"
    if {"query", "rubric"} <= keys:
        return "researchqa"
    if {"question", "answer", "root_url"} <= {k.lower() for k in keys}:
        return "webwalkerqa"
    if {"problem", "answer", "answer_type"} <= keys:
        return "deepsearchqa"
    if "metric_config" in keys and "initial_prompt" in keys:
        return "scholarqa_cs"
    if "criterions" in keys or {"id", "topic", "language", "prompt"} <= keys:
        return "deep_research_bench"
    if {"question", "answer"} <= keys and keys & {"_id", "test_id", "supporting_facts", "evidences"}:
        return "2wiki"
    if "messages_a" in keys and ("model_a" in keys or "winner" in keys):
        return "searcharena"
    return "jsonl"


_READERS: dict[str, Callable[..., list[Query]]] = {
    "dr_tulu": read_dr_tulu,
    "healthbench": read_healthbench,
    "scholarqa_cs": read_scholarqa_cs,
    "deep_research_bench": read_deep_research_bench,
    "simpleqa": read_simpleqa,
    "2wiki": read_2wiki,
    "researchqa": read_researchqa,
    "researchrubrics": read_researchrubrics,
    "webwalkerqa": read_webwalkerqa,
    "deepsearchqa": read_deepsearchqa,
    "searcharena": read_searcharena,
    "openscholar": read_openscholar,
    "jsonl": read_plain_queries,
    "parquet": read_plain_queries,
}


def read_queries(path: str | os.PathLike[str], format: str | None = None, split: str | None = None) -> list[Query]:
    """Read a query file in any supported format; `split` overrides the format's default split."""
    path = Path(path)
    if not path.is_file():
        raise QueryFileError(path, None, "no such file")
    chosen = format or detect_format(path)
    if chosen not in _READERS:
        raise ValueError(f"unknown query format {chosen!r}; choose one of {FORMATS}")
    if chosen == "deep_research_bench" and "criterions" in _first_record_keys(path):
        # Given the criteria file itself: its records carry the prompt too.
        reader = _READERS[chosen]
        return reader(path, criteria_path=path, split=split) if split else reader(path, criteria_path=path)
    return _READERS[chosen](path, split=split) if split else _READERS[chosen](path)
