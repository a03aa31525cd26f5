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
from rubricem_core.schemas import TABLE_SCHEMAS

TABLE_NAME = re.compile(r"^[a-z][a-z0-9_]*$")


class StoreError(RuntimeError):
    """A run directory or one of its tables is missing, unreadable or corrupt."""


class TableSchemaError(ValueError):
    """A table has no registered schema, or data that does not fit it; the message names the table."""


def table_schema(table: str) -> pa.Schema:
    """The schema ``table`` is written with (``rubricem_core.schemas.TABLE_SCHEMAS``)."""
    schema = TABLE_SCHEMAS.get(table)
    if schema is None:
        raise TableSchemaError(
            f"table {table!r} has no schema: register one in rubricem_core.schemas.TABLE_SCHEMAS "
            f"(known tables: {', '.join(sorted(TABLE_SCHEMAS))})"
        )
    return schema


def conform(table: str, data: pa.Table | Iterable[dict[str, Any]], schema: pa.Schema) -> pa.Table:
    """``data`` as a table of exactly ``schema``: columns in its order, a missing column all null. Rows
    may carry keys the schema lacks (they are not stored); a table may not (its extra columns would be
    lost). A value that does not convert raises TableSchemaError naming the table and the column."""
    if isinstance(data, pa.Table):
        extra = [name for name in data.column_names if name not in schema.names]
        if extra:
            raise TableSchemaError(f"table {table!r}: columns {extra} are not in its schema (rubricem_core.schemas)")
        columns = []
        for field in schema:
            if field.name not in data.column_names:
                columns.append(pa.nulls(data.num_rows, field.type))
                continue
            try:
                columns.append(data[field.name].cast(field.type))
            except (pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError) as exc:
                raise TableSchemaError(
                    f"table {table!r}: column {field.name!r} of type {data[field.name].type} does not fit "
                    f"the schema's {field.type}: {exc}"
                ) from exc
        return _check_nulls(table, pa.Table.from_arrays(columns, schema=schema))
    rows = list(data)
    try:
        return _check_nulls(table, pa.Table.from_pylist(rows, schema=schema))
    except (pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError) as exc:
        for field in schema:  # name the column that does not convert
            try:
                pa.array([row.get(field.name) for row in rows], type=field.type)
            except (pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError) as column_exc:
                raise TableSchemaError(
                    f"table {table!r}: column {field.name!r} does not fit the schema's {field.type}: {column_exc}"
                ) from exc
        raise TableSchemaError(f"table {table!r}: rows do not fit its schema: {exc}") from exc


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


def _check_nulls(table: str, data: pa.Table) -> pa.Table:
    for field in data.schema:
        if not field.nullable and data[field.name].null_count:
            raise TableSchemaError(f"table {table!r}: column {field.name!r} may not be null (missing in a row?)")
    return data


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
        """Write one whole file of ``table`` atomically; replaces the same partition+part if present.

        The data is written with the table's registered schema (``table_schema``): a table without one
        is refused. ``schema`` (older callers) must be that same schema."""
        registered = table_schema(table)
        if schema is not None and not schema.equals(registered):
            raise TableSchemaError(
                f"table {table!r}: written with a schema other than its registered one (rubricem_core.schemas)"
            )
        data = conform(table, data, registered)
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
