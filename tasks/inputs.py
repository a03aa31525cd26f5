"""Inputs of a run: the `queries` and `corpus` tables, and the local tool environment over the corpus."""

from __future__ import annotations

import threading
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
from prefect import get_run_logger
from prefect.states import State

from rubricem_core.config import RunConfig
from rubricem_core.corpus import load_corpus
from rubricem_core.environment import local_tool_env
from rubricem_core.readers import read_queries
from rubricem_core.schemas import CORPUS_SCHEMA, queries_to_table
from rubricem_core.sim.world import generate_world
from rubricem_core.store import RunStore
from rubricem_core.tools.base import ToolEnv
from tasks.readback import parquet_task, read_back


class InputError(ValueError):
    """The configured queries or corpus cannot be used; the message names the file."""


def build_inputs(cfg: RunConfig) -> tuple[pa.Table, pa.Table]:
    """(queries, corpus) tables from the synthetic world or from the configured files."""
    if cfg.data.source == "synthetic":
        world = generate_world(cfg.data.world)
        return world.queries_table(), world.corpus_table()
    if not cfg.data.queries:
        raise InputError("data.source=files but data.queries is empty")
    tables, origin = [], {}
    for src in cfg.data.queries:
        queries = read_queries(src.path, format=src.format, split=src.split)
        if src.limit:
            queries = queries[: src.limit]
        for q in queries:
            if q.query_id in origin:
                raise InputError(f"duplicate query_id {q.query_id!r} in {src.path} (also in {origin[q.query_id]})")
            origin[q.query_id] = src.path
        tables.append(queries_to_table(queries))
    queries_table = pa.concat_tables(tables)
    if cfg.data.corpus is None:
        corpus = CORPUS_SCHEMA.empty_table()
    else:
        corpus = load_corpus(cfg.data.corpus)
    return queries_table, corpus


@parquet_task(name="prepare-inputs", task_run_name="prepare-inputs")
def prepare_inputs(run_dir: str, cfg: RunConfig) -> dict[str, Any] | State:
    """Write `corpus` then `queries` (once; a rerun reuses them, so ids and splits never shift)."""
    log = get_run_logger()
    store = RunStore(run_dir)
    written_before = store.has("queries") and store.has("corpus")
    if not written_before:
        queries, corpus = build_inputs(cfg)
        store.write_table("corpus", corpus)
        store.write_table("queries", queries)
    queries = store.read_table("queries")
    n_docs = store.read_table("corpus").num_rows
    n_train = pc.sum(pc.equal(queries["split"], "train")).as_py() or 0
    n_sft = pc.sum(pc.equal(queries["split"], "sft")).as_py() or 0
    log.info(
        "inputs: %d documents, %d queries (%d train, %d sft-only, %d eval)",
        n_docs,
        queries.num_rows,
        n_train,
        n_sft,
        queries.num_rows - n_train - n_sft,
    )
    figures = {"documents": n_docs, "queries": queries.num_rows, "train_queries": n_train}
    return read_back(figures, store.tables_dir, run_dir) if written_before else figures


_ENV_CACHE: dict[tuple, ToolEnv] = {}
_ENV_LOCK = threading.Lock()


def search_env(run_dir: str, cfg: RunConfig) -> ToolEnv:
    """A ToolEnv over the run's corpus. Index building is cached per process and corpus file,
    since every round of every task reuses the same index."""
    store = RunStore(run_dir)
    key = (
        str(store.run_dir),
        tuple((str(f), f.stat().st_mtime_ns) for f in store.files("corpus")),
        cfg.tools.model_dump_json(),
    )
    with _ENV_LOCK:
        env = _ENV_CACHE.get(key)
        if env is None:
            corpus = store.read_table("corpus")
            if corpus.num_rows == 0 and not cfg.tools.specs:
                raise InputError(f"corpus of {run_dir} is empty: set data.corpus to use the local search tool")
            env = local_tool_env(corpus, cfg.tools)
            _ENV_CACHE.clear()  # one corpus index in memory at a time
            _ENV_CACHE[key] = env
    return env.fork()
