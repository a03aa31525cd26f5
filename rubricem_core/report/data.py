"""Read-only access to a run's tables for the report: DuckDB SQL over the run's Parquet.

Every table the report uses may be absent (a run that stopped after SFT has no ``stage_rewards``;
``reflections`` and ``eval_results`` exist only for recipes and flows that write them). Queries
against an absent table return an empty result instead of raising, so every section and plot can say
"no data" rather than crash.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rubricem_core.sql import open_run_db

STAGES = ("plan", "research", "review", "answer")


class RunData:
    """One read-only DuckDB connection over a run directory (a snapshot of its files when opened)."""

    def __init__(self, run_dir: str | os.PathLike[str]):
        self.run_dir = Path(run_dir).expanduser().resolve()
        self.con = open_run_db(self.run_dir)
        self.tables = {
            row[0] for row in self.con.execute("SELECT view_name FROM duckdb_views() WHERE NOT internal").fetchall()
        }
        self._columns: dict[str, set[str]] = {}

    def close(self) -> None:
        self.con.close()

    def __enter__(self) -> RunData:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def has(self, table: str, *columns: str) -> bool:
        """True when ``table`` exists and has every one of ``columns``."""
        if table not in self.tables:
            return False
        return set(columns) <= self.columns(table)

    def columns(self, table: str) -> set[str]:
        if table not in self.tables:
            return set()
        if table not in self._columns:
            rows = self.con.execute(f'DESCRIBE "{table}"').fetchall()
            self._columns[table] = {r[0] for r in rows}
        return self._columns[table]

    def rows(self, sql: str, params: Sequence[Any] = ()) -> list[dict[str, Any]]:
        """Rows of ``sql`` as dicts."""
        relation = self.con.execute(sql, list(params))
        names = [d[0] for d in relation.description]
        return [dict(zip(names, row)) for row in relation.fetchall()]

    def scalar(self, sql: str, params: Sequence[Any] = ()) -> Any:
        row = self.con.execute(sql, list(params)).fetchone()
        return None if row is None else row[0]

    def count(self, table: str) -> int:
        return int(self.scalar(f'SELECT count(*) FROM "{table}"')) if table in self.tables else 0

    # ---- the metrics table -------------------------------------------------------------------
    def metric_series(self, prefix: str, flow: str | None = None) -> dict[str, dict[int, float]]:
        """``{name: {step: value}}`` for metrics whose name starts with ``prefix``.

        A resumed flow may log the same (name, step) twice; the value logged last wins, which is
        what MLflow's UI shows as the latest value too.
        """
        if not self.has("metrics", "step", "name", "value"):
            return {}
        cols = self.columns("metrics")
        where = ["starts_with(name, ?)"]
        params: list[Any] = [prefix]
        if flow is not None and "flow" in cols:
            where.append("flow = ?")
            params.append(flow)
        value = "arg_max(value, logged_at)" if "logged_at" in cols else "last(value)"
        sql = (
            f"SELECT name, step, {value} AS value FROM metrics WHERE {' AND '.join(where)} "
            "GROUP BY name, step ORDER BY name, step"
        )
        out: dict[str, dict[int, float]] = {}
        for row in self.rows(sql, params):
            if row["value"] is None:
                continue
            out.setdefault(row["name"], {})[int(row["step"])] = float(row["value"])
        return out

    def metric_names(self) -> list[str]:
        if not self.has("metrics", "name"):
            return []
        return [r[0] for r in self.con.execute("SELECT DISTINCT name FROM metrics ORDER BY name").fetchall()]
