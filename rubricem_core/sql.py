"""Read-only DuckDB SQL over the Parquet tables of one run directory.

Each table directory under ``<run_dir>/tables`` becomes a view over its Parquet files. Two locks
keep queries from touching the run: statements are parsed and only SELECT-like ones run, and the
connection itself is locked down (no file access except reading exactly those Parquet files, no
extension installs, configuration frozen), so even a statement that slipped past the parser check
could not write a file.

A table whose Parquet files are unreadable (a truncated footer, a foreign file) does not take the
other tables down with it: ``run_sql`` replaces its view with one that raises naming the damaged
files, so queries of that table fail with a RunSqlError while every other table, and ``SHOW
TABLES``, still work. ``open_run_db`` raises on such a table by default (``strict``), so callers
that would read a missing view as "no data" (the report) fail loudly instead.
"""

from __future__ import annotations

import contextlib
import csv
import io
import json
import math
import os
import re
import shutil
from datetime import date, datetime, time, timedelta
from decimal import Decimal
from pathlib import Path
from typing import Any, Literal

import duckdb
import pyarrow as pa
import pyarrow.parquet as pq

from rubricem_core.layout import RunLayout
from rubricem_core.store import TABLE_NAME

OutputFormat = Literal["table", "csv", "json"]
DEFAULT_MAX_ROWS = 200
READ_ONLY_HELP = "only read-only statements are allowed (SELECT, WITH … SELECT, EXPLAIN, DESCRIBE, SHOW, SUMMARIZE)"


class RunSqlError(RuntimeError):
    """The run directory, one of its Parquet files, or the SQL statement is unusable."""


def _parquet_files(table_dir: Path) -> list[Path]:
    # hidden files are in-flight atomic writes (".part.parquet.<id>.tmp"); they never end in .parquet
    # but a hidden directory or file must be skipped all the same
    return sorted(
        p
        for p in table_dir.rglob("*.parquet")
        if p.is_file() and not any(part.startswith(".") for part in p.relative_to(table_dir).parts)
    )


def _require_run_dir(run_dir: str | os.PathLike[str]) -> Path:
    path = Path(run_dir).expanduser().resolve()
    if path.exists() and not path.is_dir():
        raise RunSqlError(f"run directory {path} is a file, not a directory")
    if not path.is_dir():
        raise RunSqlError(f"run directory {path} does not exist")
    return path


def _table_files(run_dir: Path) -> dict[str, list[Path]]:
    tables_dir = RunLayout(run_dir).tables_dir
    if not tables_dir.is_dir():
        return {}
    root = tables_dir.resolve()
    out = {}
    for child in sorted(tables_dir.iterdir()):
        # directory names that are not table names (editor backups, ".trash", ...) are not tables
        if child.is_dir() and TABLE_NAME.match(child.name):
            # confined after resolving links: a symlink that leads out of tables/ reads nothing outside
            files = [f for f in _parquet_files(child) if f.resolve().is_relative_to(root)]
            if files:
                out[child.name] = files
    return out


def table_names(run_dir: str | os.PathLike[str]) -> list[str]:
    """Names of the tables (views) that ``open_run_db`` will create, sorted."""
    return list(_table_files(_require_run_dir(run_dir)))


def _footer_problem(path: Path) -> str | None:
    try:
        pq.read_metadata(path)  # cheap: the footer only, no data pages
    except Exception as exc:  # pyarrow raises ArrowInvalid/OSError for truncated or foreign files
        return f"corrupt or truncated Parquet file {path}: {exc}"
    return None


def _sql_string(value: str) -> str:
    return "'" + value.replace("'", "''") + "'"


def _create_view(con: duckdb.DuckDBPyConnection, root: Path, name: str, files: list[Path]) -> str | None:
    """Create the table's view; the reason it cannot be created, or None."""
    file_list = "[" + ", ".join(_sql_string(str(p)) for p in files) + "]"
    try:
        con.execute(
            f'CREATE VIEW "{name}" AS SELECT * FROM read_parquet({file_list}, '
            "union_by_name = true, hive_partitioning = false)"
        )
    except duckdb.Error as exc:
        return f"cannot read {root / 'tables' / name}: {exc}"
    return None


def _table_problem(con: duckdb.DuckDBPyConnection, root: Path, name: str, files: list[Path]) -> str | None:
    """Create the view of one table; None when it worked, else why not (every damaged file named)."""
    corrupt = [problem for problem in map(_footer_problem, files) if problem is not None]
    if corrupt:
        return "; ".join(corrupt)
    return _create_view(con, root, name, files)


def _create_placeholder(con: duckdb.DuckDBPyConnection, name: str, message: str) -> None:
    # The name stays listed (SHOW TABLES) and any read raises the message. error() sits in a filter,
    # not a projected column, so the optimizer cannot drop it (count(*) would otherwise succeed).
    con.execute(f'CREATE VIEW "{name}" AS SELECT NULL AS unreadable WHERE error({_sql_string(message)}) IS NULL')


def _lock(con: duckdb.DuckDBPyConnection, allowed: list[str]) -> None:
    allowed_list = "[" + ", ".join(_sql_string(p) for p in allowed) + "]"
    con.execute(f"SET allowed_paths = {allowed_list}")
    con.execute("SET enable_external_access = false")
    con.execute("SET autoinstall_known_extensions = false")
    con.execute("SET autoload_known_extensions = false")
    con.execute("SET lock_configuration = true")


def _open_views(
    run_dir: str | os.PathLike[str], lock: bool, strict: bool
) -> tuple[duckdb.DuckDBPyConnection, dict[str, str]]:
    """The connection and, per unreadable table, the message naming its damaged files."""
    root = _require_run_dir(run_dir)
    con = duckdb.connect(":memory:")
    allowed: list[str] = []
    broken: dict[str, str] = {}
    try:
        for name, files in _table_files(root).items():
            problem = _table_problem(con, root, name, files)
            if problem is None:
                allowed.extend(str(p) for p in files)
                continue
            message = f"table {name!r} is unreadable: {problem}"
            if strict:
                raise RunSqlError(message)
            broken[name] = message
            _create_placeholder(con, name, message)
        if lock:
            _lock(con, allowed)  # a broken table's files are not allowed: its placeholder reads none
    except BaseException:
        con.close()
        raise
    return con, broken


def open_run_db(run_dir: str | os.PathLike[str], lock: bool = True, strict: bool = True) -> duckdb.DuckDBPyConnection:
    """In-memory DuckDB with one view per table of the run; locked to read-only file access by default.

    The views list the files present when the connection is opened (a snapshot), because the
    lock allows reading exactly those paths and nothing else. A table with an unreadable Parquet
    file raises RunSqlError naming it (``strict``), or else gets a view that raises when read.
    """
    return _open_views(run_dir, lock, strict)[0]


def _referenced_tables(query: str) -> set[str]:
    try:
        names = duckdb.get_table_names(query)
    except duckdb.Error:  # some statements (PIVOT) cannot be analysed; _query_error covers them
        return set()
    return {n.lower() for n in names}  # identifiers are case-insensitive; table names are lower case


def _refuse_broken(query: str, broken: dict[str, str]) -> None:
    # Checked before running: DESCRIBE and EXPLAIN of a placeholder would not raise on their own.
    hit = sorted(_referenced_tables(query) & broken.keys()) if broken else []
    if hit:
        raise RunSqlError("; ".join(broken[name] for name in hit))


def _query_error(exc: duckdb.Error, query: str, broken: dict[str, str]) -> RunSqlError:
    """A failed query; when it mentions an unreadable table, that table's damage is the reason."""
    hit = [name for name in sorted(broken) if re.search(rf"\b{name}\b", query, re.IGNORECASE)]
    if hit:
        return RunSqlError("; ".join(broken[name] for name in hit) + f" (query failed: {exc})")
    return RunSqlError(f"query failed: {exc}")  # duckdb names the Parquet file when a data page is corrupt


# ---- statement checks ----------------------------------------------------------------------
_EXPLAIN_PREFIX = re.compile(r"^\s*EXPLAIN\s+(?:ANALY[SZ]E\s+)?(?:\([^()]*\)\s*)?", re.IGNORECASE)
_PIVOT_PREFIX = re.compile(r"^\s*(?:UN)?PIVOT\b", re.IGNORECASE)


def _reject(statement_type: str, query: str) -> RunSqlError:
    shown = " ".join(query.split())
    shown = shown if len(shown) <= 80 else shown[:77] + "..."
    return RunSqlError(f"{READ_ONLY_HELP}; rejected {statement_type} statement: {shown}")


def _check_statement(statement: Any) -> None:
    kind = statement.type
    query = statement.query
    if kind == duckdb.StatementType.SELECT:  # also covers WITH, DESCRIBE, SHOW, SUMMARIZE, FROM-first
        return
    if kind == duckdb.StatementType.MULTI and _PIVOT_PREFIX.match(query):
        return  # PIVOT expands into helper statements in memory; it reads only
    if kind == duckdb.StatementType.EXPLAIN:
        # EXPLAIN ANALYZE runs its statement, so what is explained must be read-only too
        inner = _EXPLAIN_PREFIX.sub("", query, count=1)
        try:
            inner_statements = duckdb.extract_statements(inner)
        except duckdb.Error as exc:
            raise _reject("EXPLAIN", query) from exc
        if len(inner_statements) != 1:
            raise _reject("EXPLAIN", query)
        _check_statement(inner_statements[0])
        return
    raise _reject(kind.name, query)


def read_only_statements(sql: str) -> list[str]:
    """Split ``sql`` into statements, raising RunSqlError unless every one is read-only."""
    try:
        statements = duckdb.extract_statements(sql)
    except duckdb.Error as exc:
        raise RunSqlError(f"SQL syntax error: {exc}") from exc
    if not statements:
        raise RunSqlError("empty SQL statement")
    for statement in statements:
        _check_statement(statement)
    return [s.query for s in statements]


# ---- output --------------------------------------------------------------------------------
def _jsonable(value: Any) -> Any:
    if isinstance(value, float):
        return value if math.isfinite(value) else None  # strict JSON has no NaN/Infinity
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, (datetime, date, time)):
        return value.isoformat()
    if isinstance(value, timedelta):
        return value.total_seconds()
    if isinstance(value, Decimal):
        return float(value)
    if isinstance(value, bytes):
        return value.hex()
    return value


# C0 controls but tab and line breaks, DEL and C1 controls: a terminal acts on them (ESC starts a sequence)
_CONTROL = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f-\x9f]")


def _visible(text: str) -> str:
    """Control bytes written as ``\\xNN`` text, so data cannot drive the terminal it is printed to."""
    return _CONTROL.sub(lambda m: f"\\x{ord(m.group()):02x}", text)


def _csv_cell(value: Any) -> Any:
    if value is None:
        return ""
    if isinstance(value, (list, tuple, dict)):
        return _visible(json.dumps(_jsonable(value), ensure_ascii=False))
    if isinstance(value, (datetime, date, time)):
        return value.isoformat()
    if isinstance(value, str):
        return _visible(value)
    return value


LIST_PREVIEW_ITEMS = 8


def _preview(value: Any, max_chars: int) -> str | None:
    """One readable cell: long lists show their first items and their length, long text is cut."""
    if value is None:
        return None
    if isinstance(value, (list, tuple)):
        shown = ", ".join(str(_jsonable(v)) for v in value[:LIST_PREVIEW_ITEMS])
        text = f"[{shown}, … ({len(value)} items)]" if len(value) > LIST_PREVIEW_ITEMS else f"[{shown}]"
    elif isinstance(value, dict):
        text = json.dumps(_jsonable(value), ensure_ascii=False)
    else:
        text = str(value)
    return text if len(text) <= max_chars else text[: max_chars - 1] + "…"


def _display_table(data: pa.Table, max_col_width: int) -> pa.Table:
    columns = []
    for column in data.columns:
        kind = column.type
        nested = pa.types.is_list(kind) or pa.types.is_large_list(kind) or pa.types.is_fixed_size_list(kind)
        nested = nested or pa.types.is_struct(kind) or pa.types.is_map(kind)
        if nested or pa.types.is_string(kind) or pa.types.is_large_string(kind):
            columns.append(pa.array([_preview(v, max_col_width) for v in column.to_pylist()], type=pa.string()))
        else:
            columns.append(column)
    return pa.table(columns, names=data.column_names)


def _render_table(
    con: duckdb.DuckDBPyConnection,
    data: pa.Table,
    truncated: bool,
    max_rows: int,
    max_width: int | None,
    max_col_width: int,
) -> str:
    if data.num_columns == 2 and data.column_names == ["explain_key", "explain_value"]:
        return "\n".join(str(v) for v in data.column("explain_value").to_pylist())  # plans are pre-drawn
    if max_width is None:
        max_width = shutil.get_terminal_size((200, 40)).columns
    buffer = io.StringIO()
    with contextlib.redirect_stdout(buffer):  # duckdb's box renderer prints to sys.stdout
        con.from_arrow(_display_table(data, max_col_width)).show(max_rows=max_rows, max_width=max_width)
    text = buffer.getvalue().rstrip("\n")
    if truncated:
        text += (
            f"\n(showing the first {max_rows} rows; the query returned more: add a LIMIT, "
            "raise the row limit, or use csv/json output for all rows)"
        )
    return text


def _execute(con: duckdb.DuckDBPyConnection, query: str, broken: dict[str, str]) -> duckdb.DuckDBPyRelation | None:
    _refuse_broken(query, broken)
    try:
        return con.sql(query)
    except duckdb.Error as exc:
        raise _query_error(exc, query, broken) from exc


def _fetch(relation: duckdb.DuckDBPyRelation, limit: int | None, query: str, broken: dict[str, str]) -> pa.Table:
    try:
        if limit is None:
            return relation.to_arrow_table()
        return relation.limit(limit).to_arrow_table()
    except duckdb.Error as exc:  # relations are lazy: most read errors surface here
        raise _query_error(exc, query, broken) from exc


def run_sql(
    run_dir: str | os.PathLike[str],
    sql: str,
    fmt: OutputFormat = "table",
    max_rows: int = DEFAULT_MAX_ROWS,
    max_width: int | None = None,
    max_col_width: int = 60,
) -> str:
    """Run read-only SQL against a run's tables. ``table`` shows up to ``max_rows`` rows per statement
    (and says when it cut); ``csv`` and ``json`` return every row of a single statement."""
    if fmt not in ("table", "csv", "json"):
        raise RunSqlError(f"unknown output format {fmt!r}: use table, csv or json")
    if max_rows <= 0:
        raise RunSqlError(f"max_rows must be positive, got {max_rows}")
    queries = read_only_statements(sql)
    if fmt != "table" and len(queries) != 1:
        raise RunSqlError(f"{fmt} output needs exactly one statement, got {len(queries)}")
    con, broken = _open_views(run_dir, lock=True, strict=False)  # one bad table must not block the rest
    try:
        if fmt == "table":
            outputs = []
            for query in queries:
                relation = _execute(con, query, broken)
                if relation is None:
                    outputs.append("OK")
                    continue
                data = _fetch(relation, max_rows + 1, query, broken)
                truncated = data.num_rows > max_rows
                outputs.append(
                    _render_table(con, data.slice(0, max_rows), truncated, max_rows, max_width, max_col_width)
                )
            return "\n\n".join(outputs)
        relation = _execute(con, queries[0], broken)
        data = _fetch(relation, None, queries[0], broken) if relation is not None else pa.table({})
        if fmt == "json":
            return json.dumps([_jsonable(r) for r in data.to_pylist()], ensure_ascii=False, indent=1)
        buffer = io.StringIO()
        writer = csv.writer(buffer, lineterminator="\n")
        writer.writerow(data.column_names)
        columns = [data.column(i).to_pylist() for i in range(data.num_columns)]  # by position: names may repeat
        for row in zip(*columns):
            writer.writerow([_csv_cell(v) for v in row])
        return buffer.getvalue()
    finally:
        con.close()
