from __future__ import annotations

import json
from pathlib import Path

import duckdb
import pytest

from rubricem_core.sql import RunSqlError, open_run_db, read_only_statements, run_sql, table_names
from rubricem_core.store import RunStore


@pytest.fixture()
def run_dir(tmp_path: Path) -> Path:
    store = RunStore(tmp_path / "run")
    for step in (1, 2):
        store.write_table(
            "metrics",
            [{"step": step, "name": "reward/mean", "value": 0.5 * step}, {"step": step, "name": "kl", "value": 0.01}],
            partition={"step": step},
        )
    # a later file with an extra column: union_by_name must merge them
    store.write_table(
        "metrics", [{"step": 3, "name": "kl", "value": 0.02, "flow": "rl_step"}], partition={"step": 3}, part="extra"
    )
    store.write_table(
        "rollouts",
        [
            {"step": 1, "rollout_id": "r1", "token_ids": [1, 2, 3], "valid_scaffold": True},
            {"step": 1, "rollout_id": "r2", "token_ids": [4], "valid_scaffold": False},
        ],
        partition={"step": 1},
    )
    # an in-flight atomic write and a stray non-table directory must both be ignored
    (store.table_dir("metrics") / "step=0003" / ".part.parquet.deadbeef.tmp").write_bytes(b"half a file")
    (store.tables_dir / "Not-A-Table").mkdir()
    return store.run_dir


def files_under(path: Path) -> set[Path]:
    return {p for p in path.rglob("*")}


def test_views_and_partition_columns(run_dir: Path):
    assert table_names(run_dir) == ["metrics", "rollouts"]
    con = open_run_db(run_dir)
    rows = con.execute("SELECT step, name, value, flow FROM metrics ORDER BY step, name").fetchall()
    assert rows == [
        (1, "kl", 0.01, None),
        (1, "reward/mean", 0.5, None),
        (2, "kl", 0.01, None),
        (2, "reward/mean", 1.0, None),
        (3, "kl", 0.02, "rl_step"),
    ]
    assert con.execute("SELECT token_ids FROM rollouts WHERE rollout_id = 'r1'").fetchall()[0][0] == [1, 2, 3]


def test_table_output_lists_and_truncation(run_dir: Path):
    out = run_sql(run_dir, "SELECT rollout_id, token_ids FROM rollouts ORDER BY rollout_id")
    assert "rollout_id" in out and "[1, 2, 3]" in out and "r2" in out and "│" in out
    assert "showing the first" not in out
    assert "[0, 1, 2, 3, 4, 5, 6, 7, … (100 items)]" in run_sql(run_dir, "SELECT range(100) AS ids")
    cut = run_sql(run_dir, "SELECT * FROM metrics ORDER BY step, name", max_rows=2)
    assert "showing the first 2 rows" in cut
    assert "reward/mean" in cut and "0.02" not in cut


def test_csv_and_json_output(run_dir: Path):
    csv_out = run_sql(run_dir, "SELECT rollout_id, token_ids, valid_scaffold FROM rollouts ORDER BY 1", fmt="csv")
    assert csv_out.splitlines() == ["rollout_id,token_ids,valid_scaffold", 'r1,"[1, 2, 3]",True', "r2,[4],False"]
    records = json.loads(
        run_sql(run_dir, "SELECT step, avg(value) AS v FROM metrics GROUP BY step ORDER BY step", fmt="json")
    )
    assert records == [{"step": 1, "v": 0.255}, {"step": 2, "v": 0.505}, {"step": 3, "v": 0.02}]
    assert json.loads(run_sql(run_dir, "SELECT 'nan'::DOUBLE AS x", fmt="json")) == [{"x": None}]
    with pytest.raises(RunSqlError, match="exactly one statement"):
        run_sql(run_dir, "SELECT 1; SELECT 2", fmt="json")
    with pytest.raises(RunSqlError, match="unknown output format"):
        run_sql(run_dir, "SELECT 1", fmt="xml")  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "sql",
    [
        "SELECT * FROM metrics",
        "WITH m AS (SELECT * FROM metrics) SELECT count(*) FROM m",
        "FROM metrics SELECT name",
        "DESCRIBE metrics",
        "SHOW TABLES",
        "SUMMARIZE metrics",
        "EXPLAIN SELECT * FROM metrics",
        "EXPLAIN ANALYZE SELECT count(*) FROM metrics",
        "PIVOT metrics ON name USING avg(value) GROUP BY step",
        "SELECT 1; SELECT 2;",
    ],
)
def test_read_only_statements_are_allowed(run_dir: Path, sql: str):
    assert run_sql(run_dir, sql).strip()


@pytest.mark.parametrize(
    ("sql", "kind"),
    [
        ("INSERT INTO metrics VALUES (1, 'x', 1.0)", "INSERT"),
        ("CREATE TABLE t AS SELECT * FROM metrics", "CREATE"),
        ("DROP VIEW metrics", "DROP"),
        ("COPY (SELECT 1) TO 'x.csv'", "COPY"),
        ("ATTACH 'other.db'", "ATTACH"),
        ("SET threads = 1", "SET"),
        ("PRAGMA show_tables", "PRAGMA"),
        ("INSTALL httpfs", "LOAD"),
        ("LOAD httpfs", "LOAD"),
        ("CALL pragma_version()", "CALL"),
        ("EXPORT DATABASE 'dump'", "EXPORT"),
        ("EXPLAIN ANALYZE COPY (SELECT 1) TO 'x.csv'", "COPY"),
        ("SELECT 1; COPY (SELECT 1) TO 'x.csv'", "COPY"),
    ],
)
def test_writing_statements_are_rejected(run_dir: Path, sql: str, kind: str):
    before = files_under(run_dir)
    with pytest.raises(RunSqlError, match=f"read-only.*rejected {kind} statement"):
        run_sql(run_dir, sql)
    assert files_under(run_dir) == before


def test_syntax_error_and_empty_sql():
    with pytest.raises(RunSqlError, match="syntax error"):
        read_only_statements("SELEC 1")
    with pytest.raises(RunSqlError, match="empty"):
        read_only_statements("  ")


def test_connection_is_locked_down(run_dir: Path, tmp_path: Path):
    con = open_run_db(run_dir)
    target = run_dir / "x.csv"
    inside = run_dir / "tables" / "metrics" / "y.parquet"
    attempts = [
        f"COPY (SELECT 1) TO '{target}'",
        f"COPY (SELECT 1) TO '{inside}' (FORMAT parquet)",
        f"COPY metrics TO '{run_dir / 'tables'}' (FORMAT parquet, PARTITION_BY (step))",
        f"EXPORT DATABASE '{run_dir / 'dump'}'",
        f"ATTACH '{run_dir / 'x.db'}'",
        "SELECT * FROM read_csv('/etc/hostname')",
        f"SELECT * FROM glob('{run_dir}/**')",
        "SET enable_external_access = true",
        "SET lock_configuration = false",
    ]
    for sql in attempts:
        with pytest.raises(duckdb.Error):
            con.execute(sql)
    assert not target.exists() and not inside.exists()
    assert not (run_dir / "dump").exists() and not (run_dir / "x.db").exists()
    assert con.execute("SELECT count(*) FROM metrics").fetchall() == [(5,)]  # the views still read


def test_missing_run_dir(tmp_path: Path):
    with pytest.raises(RunSqlError, match="does not exist"):
        run_sql(tmp_path / "nope", "SELECT 1")
    with pytest.raises(RunSqlError, match="does not exist"):
        table_names(tmp_path / "nope")


def test_run_without_tables(tmp_path: Path):
    assert table_names(tmp_path) == []
    assert "42" in run_sql(tmp_path, "SELECT 42 AS answer")


DAMAGE = {
    "truncated": lambda data: data[: len(data) // 2],
    "empty": lambda data: b"",
    "foreign": lambda data: b"step,name\n1,kl\n" * 20,
    "zeroed_footer": lambda data: data[:-8] + b"\0" * 8,
}


def damage(path: Path, kind: str) -> Path:
    path.write_bytes(DAMAGE[kind](path.read_bytes()))
    return path


@pytest.mark.parametrize("kind", sorted(DAMAGE))
def test_corrupt_file_leaves_other_tables_queryable(run_dir: Path, kind: str):
    victim = damage(RunStore(run_dir).files("rollouts")[0], kind)
    assert json.loads(run_sql(run_dir, "SELECT count(*) AS n FROM metrics", fmt="json")) == [{"n": 5}]
    assert run_sql(run_dir, "SELECT step, name FROM metrics ORDER BY 1, 2", fmt="csv").splitlines()[1] == "1,kl"
    shown = run_sql(run_dir, "SHOW TABLES", fmt="csv").splitlines()
    assert shown == ["name", "metrics", "rollouts"]  # the damaged table is still listed
    with pytest.raises(
        RunSqlError, match=f"table 'rollouts' is unreadable: corrupt or truncated Parquet file {victim}"
    ):
        run_sql(run_dir, "SELECT * FROM rollouts")


@pytest.mark.parametrize(
    "sql",
    [
        "SELECT * FROM rollouts",
        "SELECT count(*) FROM rollouts",  # must not be answered without reading the table
        "SELECT rollout_id FROM rollouts",  # a real column: the placeholder view does not have it
        "SELECT 1 FROM rollouts LIMIT 1",
        "SELECT * FROM ROLLOUTS",
        "SELECT * FROM main.rollouts",
        "DESCRIBE rollouts",
        "SUMMARIZE rollouts",
        "EXPLAIN SELECT * FROM rollouts",
        "PIVOT rollouts ON valid_scaffold USING count(*)",
        "SELECT m.step FROM metrics m JOIN rollouts r USING (step)",
        "SELECT * FROM metrics WHERE step IN (SELECT step FROM rollouts)",
        "SELECT 1; SELECT * FROM rollouts",
    ],
)
@pytest.mark.parametrize("fmt", ["table", "json"])
def test_query_of_the_corrupt_table_names_the_file(run_dir: Path, sql: str, fmt: str):
    victim = damage(RunStore(run_dir).files("rollouts")[0], "truncated")
    if fmt == "json" and ";" in sql:
        fmt = "table"  # json takes one statement
    with pytest.raises(RunSqlError, match=f"corrupt or truncated Parquet file {victim}"):
        run_sql(run_dir, sql, fmt=fmt)  # type: ignore[arg-type]


def test_every_damaged_file_is_named_and_the_lock_holds(run_dir: Path):
    files = RunStore(run_dir).files("metrics")
    assert len(files) == 3
    victims = [damage(files[0], "truncated"), damage(files[2], "foreign")]
    with pytest.raises(RunSqlError) as raised:
        run_sql(run_dir, "SELECT * FROM metrics")
    assert all(str(v) in str(raised.value) for v in victims) and str(files[1]) not in str(raised.value)
    assert json.loads(run_sql(run_dir, "SELECT rollout_id FROM rollouts ORDER BY 1", fmt="json")) == [
        {"rollout_id": "r1"},
        {"rollout_id": "r2"},
    ]
    # the damaged table's intact file is no longer readable either: allowed_paths lists healthy tables only
    before = files_under(run_dir)
    with pytest.raises(RunSqlError):
        run_sql(run_dir, f"SELECT * FROM read_parquet('{files[1]}')")
    with pytest.raises(RunSqlError, match="rejected COPY"):
        run_sql(run_dir, f"COPY (SELECT 1) TO '{run_dir / 'x.csv'}'")
    assert files_under(run_dir) == before


def test_open_run_db_is_strict_by_default(run_dir: Path):
    victim = damage(RunStore(run_dir).files("rollouts")[0], "truncated")
    with pytest.raises(
        RunSqlError, match=f"table 'rollouts' is unreadable: corrupt or truncated Parquet file {victim}"
    ):
        open_run_db(run_dir)
    con = open_run_db(run_dir, strict=False)
    try:
        assert con.execute("SELECT count(*) FROM metrics").fetchall() == [(5,)]
        with pytest.raises(duckdb.Error, match=f"corrupt or truncated Parquet file {victim}"):
            con.execute("SELECT count(*) FROM rollouts").fetchall()
        with pytest.raises(duckdb.Error):
            con.execute("SET lock_configuration = false")  # still locked down
    finally:
        con.close()


def test_csv_output_writes_control_bytes_as_text(run_dir: Path):
    out = run_sql(run_dir, "SELECT 'a' || chr(27) || '[31mred' || chr(7) AS s, 'x' || chr(10) || 'y' AS t", fmt="csv")
    assert "\x1b" not in out and "\x07" not in out
    assert "a\\x1b[31mred\\x07" in out and '"x\ny"' in out  # line breaks stay data, quoted as CSV does


def test_a_symlink_out_of_the_tables_is_not_read(run_dir: Path, tmp_path: Path):
    outside = RunStore(tmp_path / "elsewhere")
    outside.write_table("metrics", [{"step": 9, "name": "secret", "value": 1.0}])
    (RunStore(run_dir).tables_dir / "stolen").symlink_to(outside.table_dir("metrics"), target_is_directory=True)
    assert "stolen" not in table_names(run_dir)
    link = RunStore(run_dir).table_dir("metrics") / "step=0009"
    link.symlink_to(outside.table_dir("metrics"), target_is_directory=True)
    assert run_sql(run_dir, "SELECT count(*) AS n FROM metrics WHERE name = 'secret'", fmt="csv").splitlines() == [
        "n",
        "0",
    ]


def test_the_cli_reads_a_query_from_a_file_or_standard_input(run_dir: Path, tmp_path: Path, monkeypatch, capsys):
    import io

    from flows.cli import main

    query = tmp_path / "q.sql"
    query.write_text("SELECT count(*) AS n FROM rollouts" + " " * 200_000)  # longer than an argument list holds
    assert main(["sql", "--run-dir", str(run_dir), "--format", "csv", "--file", str(query)]) == 0
    assert capsys.readouterr().out.split() == ["n", "2"]
    monkeypatch.setattr("sys.stdin", io.StringIO("SELECT 7 AS n"))
    assert main(["sql", "--run-dir", str(run_dir), "--format", "csv", "-"]) == 0
    assert capsys.readouterr().out.split() == ["n", "7"]
    assert main(["sql", "--run-dir", str(run_dir), "--file", str(query), "SELECT 1"]) == 2
    assert "not both" in capsys.readouterr().err
