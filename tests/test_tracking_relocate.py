"""A copied or moved run directory reads and writes its own MLflow artifacts, never the original's."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from rubricem_core.tracking import Tracker


def _files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def _make_run(run_dir: Path, tmp: Path) -> dict[str, str]:
    """A tracked run dir with an artifact under a child and under the parent; returns the run ids."""
    note = tmp / "note.txt"
    note.write_text("from the original")
    tracker = Tracker(run_dir)
    with tracker.child_run("sft") as child:
        child.log_artifact(note, artifact_path="notes")
        child.log_metrics({"loss": 0.5}, step=0)
    parent = tracker.log_parent_artifact(note, "report")
    return {"parent": parent, "sft": child.run_id}


def _artifact_text(tracker: Tracker, run_id: str, path: str, dst: Path) -> str:
    dst.mkdir(parents=True, exist_ok=True)
    return Path(tracker.client.download_artifacts(run_id, path, str(dst))).read_text()


@pytest.fixture(scope="module")
def original(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, str]]:
    base = tmp_path_factory.mktemp("relocate")
    run_dir = base / "runs" / "a"
    return run_dir, _make_run(run_dir, base)


def _assert_own_locations(tracker: Tracker, run_ids: dict[str, str]) -> None:
    root = tracker.artifact_uri
    experiment = tracker.client.get_experiment(tracker.experiment_id())
    assert experiment.artifact_location == root
    for run_id in run_ids.values():
        assert tracker.client.get_run(run_id).info.artifact_uri.startswith(root + "/")
    assert tracker.client.get_run(run_ids["parent"]).data.tags["rubricem.run_dir"] == str(tracker.run_dir)


def test_copied_run_dir_uses_its_own_artifacts(original: tuple[Path, dict[str, str]], tmp_path: Path):
    a, ids = original
    b = a.parent / "b"
    shutil.copytree(a, b)
    before = _files(a)
    tracker = Tracker(b)
    _assert_own_locations(tracker, ids)
    assert json.loads((b / "state" / "mlflow_parent.json").read_text())["run_dir"] == str(b.resolve())
    # the old runs' artifacts are read from the copy
    assert _artifact_text(tracker, ids["sft"], "notes/note.txt", tmp_path / "d1") == "from the original"
    # new artifacts land in the copy, for a new attempt of a stage and for the parent
    extra = tmp_path / "extra.txt"
    extra.write_text("from the copy")
    with tracker.child_run("sft") as child:
        assert child.run_id != ids["sft"]
        assert tracker.client.get_run(child.run_id).info.artifact_uri.startswith(tracker.artifact_uri + "/")
        child.log_artifact(extra, artifact_path="notes")
    tracker.log_parent_artifact(extra, "report")
    assert len(list((b / "mlflow" / "artifacts").rglob("extra.txt"))) == 2
    assert _files(a) == before  # the original is untouched ...
    original_tracker = Tracker(a)  # ... and still uses its own locations
    assert (
        original_tracker.client.get_experiment(original_tracker.experiment_id()).artifact_location
        == original_tracker.artifact_uri
    )
    assert _files(a) == before
    # the copy survives the original's deletion
    shutil.rmtree(a)
    fresh = Tracker(b)
    assert [Path(f.path).name for f in fresh.client.list_artifacts(ids["sft"], "notes")] == ["note.txt"]
    assert [Path(f.path).name for f in fresh.client.list_artifacts(child.run_id, "notes")] == ["extra.txt"]
    assert [(m.step, m.value) for m in fresh.client.get_metric_history(child.run_id, "loss")] == [(0, 0.5)]
    assert _artifact_text(fresh, ids["sft"], "notes/note.txt", tmp_path / "d2") == "from the original"
    assert _artifact_text(fresh, ids["parent"], "report/extra.txt", tmp_path / "d3") == "from the copy"
    assert not a.exists()


def test_moved_run_dir_follows_the_move(tmp_path: Path):
    old = tmp_path / "runs" / "before"
    ids = _make_run(old, tmp_path)
    state_path = old / "state" / "mlflow_parent.json"
    state = json.loads(state_path.read_text())
    assert state["run_dir"] == str(old.resolve())
    del state["run_dir"]  # a state file written before the path was recorded: the store tells
    state_path.write_text(json.dumps(state))
    new = tmp_path / "moved" / "after"
    new.parent.mkdir()
    old.rename(new)
    tracker = Tracker(new)
    _assert_own_locations(tracker, ids)
    assert _artifact_text(tracker, ids["parent"], "report/note.txt", tmp_path / "d") == "from the original"
    note = tmp_path / "later.txt"
    note.write_text("after the move")
    with tracker.child_run("sft") as child:
        child.log_artifact(note)
    assert [p.parent.parent.name for p in (new / "mlflow" / "artifacts").rglob("later.txt")] == [child.run_id]
    assert not old.exists()
    assert json.loads((new / "state" / "mlflow_parent.json").read_text())["run_dir"] == str(new.resolve())
