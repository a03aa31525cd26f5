"""A run directory's local MLflow store moved or copied: stored artifact locations rewritten to the new path."""

from __future__ import annotations

import logging
import os
import sqlite3
from pathlib import Path
from typing import TYPE_CHECKING

from rubricem_core.layout import RunLayout

if TYPE_CHECKING:
    pass

from rubricem_core.tracking.links import _LOCATION_COLUMNS, RUN_DIR_TAG, TrackingError

log = logging.getLogger(__name__)


def _artifact_root(run_dir: str | os.PathLike[str]) -> str:
    return RunLayout(run_dir).mlflow_artifacts_dir.as_uri()


def _tables(conn: sqlite3.Connection) -> set[str]:
    return {name for (name,) in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}


def _stored_roots(conn: sqlite3.Connection) -> set[str]:
    """Artifact roots (``file://…/mlflow/artifacts``) of the run-dir paths the experiments were made in."""
    rows = conn.execute("SELECT artifact_location FROM experiments").fetchall()
    return {
        loc
        for (loc,) in rows
        if isinstance(loc, str) and loc.startswith("file://") and loc.endswith("/mlflow/artifacts")
    }


def _rewrite_prefix(conn: sqlite3.Connection, tables: set[str], old: str, new: str) -> int:
    """Replace the prefix ``old`` (a whole path component) by ``new`` in every stored location."""
    changed = 0
    for table, column, condition in _LOCATION_COLUMNS:
        if table in tables:
            cursor = conn.execute(
                f"UPDATE {table} SET {column} = ? || substr({column}, ?) "
                f"WHERE {condition}({column} = ? OR substr({column}, 1, ?) = ?)",
                (new, len(old) + 1, old, len(old) + 1, old + "/"),
            )
            changed += cursor.rowcount
    return changed


def relocate_store(db: Path, run_dir: Path, recorded_run_dir: str | None = None) -> list[str]:
    """Point the artifact locations of the SQLite store ``db`` at ``run_dir``'s ``mlflow/artifacts``.

    MLflow stores absolute locations, so a copied or moved run dir would otherwise read and write
    the original's artifacts. Old roots are those of the experiments plus ``recorded_run_dir``'s;
    everything changes in one transaction. Returns the old roots that were rewritten.
    """
    own = _artifact_root(run_dir)
    conn = sqlite3.connect(db, timeout=60, isolation_level=None)
    try:
        conn.execute("BEGIN IMMEDIATE")
        try:
            tables = _tables(conn)
            old = _stored_roots(conn) if "experiments" in tables else set()
            if recorded_run_dir:
                old.add(_artifact_root(recorded_run_dir))
            old.discard(own)
            moved = [root for root in sorted(old) if _rewrite_prefix(conn, tables, root, own)]
            if moved and "tags" in tables:
                conn.execute(
                    "UPDATE tags SET value = ? WHERE key = ? AND value != ?", (str(run_dir), RUN_DIR_TAG, str(run_dir))
                )
            conn.execute("COMMIT")
        except BaseException:
            conn.execute("ROLLBACK")
            raise
    except sqlite3.Error as exc:
        raise TrackingError(f"cannot update the artifact locations in {db}: {exc}") from exc
    finally:
        conn.close()
    return moved


def _forget_foreign_artifact_repos(own_root: str) -> None:
    """Drop MLflow's cached artifact repositories that point into another run dir's artifacts.

    MLflow caches them per run id for the whole process, whatever the store; a copied run dir has
    the original's run ids, so a process that touched both would send the copy's artifact reads
    and writes to the original (or, after a move, recreate the old path).
    """
    try:
        from mlflow.tracking._tracking_service import utils as service_utils

        cache = service_utils._artifact_repos_cache
        entries = list(cache.items())
    except (ImportError, AttributeError, RuntimeError):
        return
    for resource_id, repo in entries:
        uri = getattr(repo, "artifact_uri", None)
        if (
            isinstance(uri, str)
            and uri.startswith("file://")
            and "/mlflow/artifacts/" in uri
            and not uri.startswith(own_root + "/")
        ):
            cache.pop(resource_id, None)
