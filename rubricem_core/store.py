"""Run directory and its Parquet tables.

Tables of one run (the rest of the run directory: rubricem_core.layout)::

    <run_dir>/tables/<table>/part-*.parquet    unpartitioned tables (queries, corpus, sft_trajectories, ...)
    <run_dir>/tables/<table>/step=0003/part-*.parquet   tables with a step (rollouts, judge_scores, metrics, ...)
    <run_dir>/tables/<table>/round=0002/part-*.parquet  teacher tables, one partition per round

Every file is written atomically: to a hidden temp file in the same directory, fsync, then
``os.replace``; a reader never sees half a file and a killed writer leaves only a ``.tmp`` file
that readers ignore. Partition values are also stored as ordinary columns inside each file, so
readers do not need hive partitioning to see them.
"""

from __future__ import annotations

import json
import os
import re
import uuid
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from rubricem_core.faults import fault_point
from rubricem_core.layout import RunLayout

TABLE_NAME = re.compile(r"^[a-z][a-z0-9_]*$")


class StoreError(RuntimeError):
    """A run directory or one of its tables is missing, unreadable or corrupt."""


def _partition_dir(key: str, value: int) -> str:
    return f"{key}={int(value):04d}"


def atomic_write_bytes(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.parent / f".{path.name}.{uuid.uuid4().hex[:8]}.tmp"
    with open(tmp, "wb") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


def atomic_write_text(path: Path, text: str) -> None:
    atomic_write_bytes(path, text.encode("utf-8"))


class RunStore:
    """Reads and writes the Parquet tables of one run directory."""

    def __init__(self, run_dir: str | os.PathLike[str]):
        self.run_dir = Path(run_dir).resolve()
        self.layout = RunLayout(self.run_dir)
        self.tables_dir = self.layout.tables_dir
        self.state_dir = self.layout.state_dir

    # ---- paths -----------------------------------------------------------------------------
    def table_dir(self, table: str) -> Path:
        if not TABLE_NAME.match(table):
            raise StoreError(f"invalid table name {table!r}: use lower_snake_case")
        return self.layout.table_dir(table)

    def partition_path(self, table: str, partition: dict[str, int] | None = None, part: str = "part") -> Path:
        base = self.table_dir(table)
        for key, value in (partition or {}).items():
            base = base / _partition_dir(key, value)
        return base / f"{part}.parquet"

    # ---- writing ---------------------------------------------------------------------------
    def write_table(
        self,
        table: str,
        data: pa.Table | list[dict[str, Any]],
        partition: dict[str, int] | None = None,
        part: str = "part",
        schema: pa.Schema | None = None,
    ) -> Path:
        """Write one whole file of ``table`` atomically; replaces the same partition+part if present."""
        if not isinstance(data, pa.Table):
            data = pa.Table.from_pylist(list(data), schema=schema)
        elif schema is not None:
            data = data.cast(schema)
        path = self.partition_path(table, partition, part)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.parent / f".{path.name}.{uuid.uuid4().hex[:8]}.tmp"
        pq.write_table(data, tmp)
        with open(tmp, "rb") as fh:
            os.fsync(fh.fileno())
        fault_point("store.before_rename")
        os.replace(tmp, path)
        return path

    # ---- reading ---------------------------------------------------------------------------
    def files(self, table: str) -> list[Path]:
        tdir = self.table_dir(table)
        if not tdir.is_dir():
            return []
        return sorted(p for p in tdir.rglob("*.parquet") if not p.name.startswith("."))

    def has(self, table: str, partition: dict[str, int] | None = None, part: str = "part") -> bool:
        return self.partition_path(table, partition, part).exists()

    def tables(self) -> list[str]:
        if not self.tables_dir.is_dir():
            return []
        return sorted(p.name for p in self.tables_dir.iterdir() if p.is_dir() and self.files(p.name))

    def read_table(self, table: str, partition: dict[str, int] | None = None, part: str | None = None) -> pa.Table:
        """Read a whole table (or one partition). Raises StoreError naming a corrupt file."""
        if partition is not None and part is not None:
            paths = [self.partition_path(table, partition, part)]
        else:
            root = self.table_dir(table)
            for key, value in (partition or {}).items():
                root = root / _partition_dir(key, value)
            paths = sorted(p for p in root.rglob("*.parquet") if not p.name.startswith(".")) if root.is_dir() else []
        if not paths:
            raise StoreError(f"table {table!r} has no data in {self.table_dir(table)}")
        pieces = [read_parquet_file(p) for p in paths]
        return pa.concat_tables(pieces, promote_options="default")

    def read_rows(self, table: str, partition: dict[str, int] | None = None) -> list[dict[str, Any]]:
        return self.read_table(table, partition).to_pylist()

    def partitions(self, table: str, key: str) -> list[int]:
        tdir = self.table_dir(table)
        if not tdir.is_dir():
            return []
        out = []
        for p in tdir.iterdir():
            if p.is_dir() and p.name.startswith(f"{key}=") and any(p.glob("*.parquet")):
                out.append(int(p.name.split("=", 1)[1]))
        return sorted(out)


def save_task_metrics(store: RunStore, task: str, step: int, metrics: dict[str, float]) -> None:
    """A task's metrics next to its Parquet, so a retried run that skips the task still logs them."""
    path = store.layout.task_metrics_file(task, step)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, json.dumps(metrics))


def cached_task_metrics(store: RunStore, task: str, step: int) -> dict[str, float]:
    path = store.layout.task_metrics_file(task, step)
    return json.loads(path.read_text()) if path.exists() else {}


def read_parquet_file(path: Path) -> pa.Table:
    try:
        return pq.read_table(path)
    except Exception as exc:  # pyarrow raises several types for truncated/corrupt files
        raise StoreError(f"corrupt or unreadable Parquet file {path}: {exc}") from exc


def rows_to_table(rows: Iterable[dict[str, Any]], schema: pa.Schema) -> pa.Table:
    return pa.Table.from_pylist(list(rows), schema=schema)
