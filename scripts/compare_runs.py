"""Compare the tables of two run directories, timings and wall-clock columns left out.

    python scripts/compare_runs.py runs/before runs/after      # exit 0: identical; 1: a difference

A refactor must leave a run's numbers alone: every table present in either run is read whole (all its
partitions, rows in a stable order) and compared column by column; columns that measure time or name
a moment (``*_s``, ``*seconds*``, ``*time*``, ``*_at``, ``latency*``, ``duration*``), MLflow's ``run_id`` and the ``metrics``
rows of such names are left out, as are paths that embed the run directory's own name.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq

TIMING = re.compile(r"(_s$|_s_|seconds|time|_at$|latency|duration|per_s|tokens_per|throughput|elapsed|wall)")
RUN_IDS = {"run_id"}  # MLflow's run ids: new in every run


def timing(name: str) -> bool:
    return bool(TIMING.search(name.lower())) or name in RUN_IDS


def read_table(table_dir: Path) -> list[dict[str, Any]]:
    files = sorted(table_dir.rglob("*.parquet"))
    rows: list[dict[str, Any]] = []
    for f in files:
        part = {k: v for k, v in (p.split("=", 1) for p in f.relative_to(table_dir).parts[:-1] if "=" in p)}
        for row in pq.read_table(f).to_pylist():
            rows.append({**part, **row})
    return rows


def comparable(rows: list[dict[str, Any]], table: str, run_dir: Path) -> list[str]:
    out = []
    for row in rows:
        if table == "metrics" and timing(str(row.get("name", ""))):
            continue
        kept = {k: v for k, v in row.items() if not timing(k)}
        text = json.dumps(kept, sort_keys=True, default=_plain).replace(str(run_dir.resolve()), "<run>")
        out.append(text.replace(str(run_dir), "<run>"))
    return sorted(out)


def _plain(value: Any) -> Any:
    if isinstance(value, float) and math.isnan(value):
        return "nan"
    return str(value)


def compare(a: Path, b: Path) -> list[str]:
    differences = []
    tables_a = {p.name for p in (a / "tables").iterdir() if p.is_dir()}
    tables_b = {p.name for p in (b / "tables").iterdir() if p.is_dir()}
    for missing in sorted(tables_a ^ tables_b):
        differences.append(f"table {missing}: only in {a if missing in tables_a else b}")
    for table in sorted(tables_a & tables_b):
        ra = comparable(read_table(a / "tables" / table), table, a)
        rb = comparable(read_table(b / "tables" / table), table, b)
        if ra != rb:
            only_a = sorted(set(ra) - set(rb))[:2]
            only_b = sorted(set(rb) - set(ra))[:2]
            differences.append(
                f"table {table}: {len(ra)} vs {len(rb)} rows differ; e.g.\n  {a}: {only_a}\n  {b}: {only_b}"
            )
        else:
            print(f"same: {table} ({len(ra)} rows)")
    return differences


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("before", type=Path)
    parser.add_argument("after", type=Path)
    args = parser.parse_args(argv)
    differences = compare(args.before, args.after)
    for d in differences:
        print("DIFFERENT:", d[:2000])
    print(f"{len(differences)} table(s) differ")
    return 1 if differences else 0


if __name__ == "__main__":
    sys.exit(main())
