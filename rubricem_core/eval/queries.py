"""Which evaluation queries a benchmark part runs: its file read, the held-out split, the selection."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from pathlib import Path

from rubricem_core.eval.types import EvalError, family_of
from rubricem_core.schemas import Query

SAMPLES: tuple[str, ...] = ("first", "random")  # how max_queries queries are chosen (select_queries)


def select_queries(
    queries: Sequence[Query], max_queries: int | str, sample: str = "first", seed: int = 0
) -> list[Query]:
    """``max_queries`` of ``queries`` (``"all"``: every one, in file order): the first ones, or (``random``) a
    seeded sample.

    The random sample ranks each query by a hash of (seed, query_id) and keeps the lowest ranks: the
    same seed picks the same queries whatever the file order, and a larger ``max_queries`` picks a
    superset. The chosen queries keep their order in ``queries``."""
    if sample not in SAMPLES:
        raise EvalError(f"eval.sample must be one of {SAMPLES}, got {sample!r}")
    if not isinstance(max_queries, int):  # "all"
        return list(queries)
    if sample == "first" or max_queries >= len(queries):
        return list(queries[:max_queries])
    rank = {q.query_id: hashlib.sha256(f"{seed}\0{q.query_id}".encode()).hexdigest() for q in queries}
    chosen = set(sorted(rank, key=rank.__getitem__)[:max_queries])
    return [q for q in queries if q.query_id in chosen]


def load_benchmark_queries(
    benchmark: str,
    path: str | Path | None,
    max_queries: int | str,
    sample: str = "first",
    seed: int = 0,
    reference_path: str | Path | None = None,
) -> list[Query]:
    """``max_queries`` queries of a benchmark file (``select_queries``), read with the benchmark's own reader;
    with ``reference_path`` (DeepResearchBench) each gets its reference report (``attach_drb_references``)."""
    from rubricem_core.readers import attach_drb_references, read_queries

    if family_of(benchmark) == "synthetic":
        raise EvalError("the synthetic benchmark's queries are the run's held-out split, not a file")
    if not path:
        raise EvalError(f"benchmark {benchmark!r} has no file: set eval.paths.{benchmark}")
    if not Path(path).is_file():
        raise FileNotFoundError(
            f"eval.paths.{benchmark}: no such file {path} (relative paths resolve against {Path.cwd()})"
        )
    queries = select_queries(read_queries(path, format=benchmark), max_queries, sample, seed)
    if reference_path is None:
        return queries
    if family_of(benchmark) != "dimension_criteria":
        raise EvalError(f"benchmark {benchmark!r} has no reference reports (only deep_research_bench does)")
    if not Path(reference_path).is_file():
        raise FileNotFoundError(
            f"eval.paths.{benchmark}_reference: no such file {reference_path} (relative paths "
            f"resolve against {Path.cwd()})"
        )
    return attach_drb_references(queries, reference_path)
