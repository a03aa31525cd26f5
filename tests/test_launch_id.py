"""Which launch file a node joins: with a launch id (all pods of one Kubernetes Job share it) a launch file
counts if and only if it carries that id, however old; without one, the old time rule (written at most a
minute before the command started). No torchrun: the ranks are a stand-in that records its call."""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path

import pytest

from rubricem_core.config import load_config
from rubricem_core.distributed import nodes
from rubricem_core.distributed.launch import end_launch_file, wait_for_launch_file
from rubricem_core.distributed.spec import launch_path
from rubricem_core.store import atomic_write_text

HOUR = 3600.0


def _write(path: Path, payload: dict, age_s: float = 0.0) -> Path:
    """A launch file written ``age_s`` seconds ago (its mtime: what the time rule reads)."""
    atomic_write_text(path, json.dumps(payload))
    then = time.time() - age_s
    os.utime(path, (then, then))
    return path


def _launch(run_dir: Path, launch_id: str | None, age_s: float = 0.0) -> Path:
    """A real sft.json as node 0 writes it (2 nodes), stamped with ``launch_id`` through the environment."""
    cfg = load_config("tiny", {"distributed.nnodes": 2, "distributed.master_port": 29500})
    payload = {"config": cfg.model_dump(mode="json"), "env": {"RUBRICEM_CONTROL": "node0:29501"}}
    with pytest.MonkeyPatch.context() as mp:
        if launch_id is None:
            mp.delenv(nodes.LAUNCH_ID_ENV, raising=False)
        else:
            mp.setenv(nodes.LAUNCH_ID_ENV, launch_id)
        payload = nodes.with_launch_id(payload)
    return _write(launch_path(run_dir, "sft.json"), payload, age_s)


@pytest.fixture
def ranks(monkeypatch) -> list[dict]:
    """The calls join_launch makes to start ranks (none are started)."""
    calls: list[dict] = []
    monkeypatch.setattr(nodes, "run_ranks", lambda spec, module, args, **kw: calls.append({"spec": spec, **kw}))
    return calls


def test_node_0_stamps_its_launch_id_only_when_it_has_one(monkeypatch, tmp_path):
    monkeypatch.delenv(nodes.LAUNCH_ID_ENV, raising=False)
    assert nodes.with_launch_id({"a": 1}) == {"a": 1}
    monkeypatch.setenv(nodes.LAUNCH_ID_ENV, "")  # an empty value is no id
    assert nodes.launch_id_from_env() is None
    monkeypatch.setenv(nodes.LAUNCH_ID_ENV, "job-a")
    assert nodes.with_launch_id({"a": 1}) == {"a": 1, "launch_id": "job-a"}
    nodes.announce_no_launch(str(tmp_path), "rl", "all 3 RL steps are done")
    note = json.loads(launch_path(tmp_path, "rl.json").read_text())
    assert note == {"nothing_to_do": "all 3 RL steps are done", "launch_id": "job-a"}
    end_launch_file(launch_path(tmp_path, "rl.json"))  # the ended marker keeps the id
    assert json.loads(launch_path(tmp_path, "rl.json").read_text())["launch_id"] == "job-a"


def test_an_old_launch_file_with_the_same_id_is_joined_at_once(tmp_path, ranks):
    _launch(tmp_path, "job-a", age_s=HOUR)
    t0 = time.monotonic()
    nodes.join_launch(str(tmp_path), "sft", node_rank=1, wait_s=30, launch_id="job-a")
    assert time.monotonic() - t0 < 5
    (call,) = ranks
    assert (
        call["spec"].node_rank == 1 and call["spec"].nnodes == 2 and call["env"] == {"RUBRICEM_CONTROL": "node0:29501"}
    )


def test_a_launch_file_with_another_id_is_waited_past(tmp_path, ranks):
    path = _launch(tmp_path, "job-old")  # fresh, yet another Job's
    with pytest.raises(TimeoutError, match="launch id 'job-a'"):
        nodes.join_launch(str(tmp_path), "sft", node_rank=1, wait_s=0.2, launch_id="job-a")
    _write(path, {"nothing_to_do": "x"})  # nor is a file without an id this Job's
    with pytest.raises(TimeoutError):
        wait_for_launch_file(path, newer_than=0.0, wait_s=0.2, launch_id="job-a")
    assert not ranks


def test_the_matching_launch_file_is_taken_when_it_replaces_another_jobs(tmp_path):
    path = _write(launch_path(tmp_path, "sft.json"), {"launch_id": "job-old", "n": 1})
    later = threading.Timer(0.5, lambda: _write(path, {"launch_id": "job-a", "n": 2}, age_s=HOUR))
    later.start()
    try:
        assert wait_for_launch_file(path, newer_than=time.time(), wait_s=30, launch_id="job-a")["n"] == 2
    finally:
        later.cancel()


def test_an_ended_launch_with_the_same_id_is_not_joined(tmp_path):
    path = _write(launch_path(tmp_path, "sft.json"), {"launch_id": "job-a", "ended": True})
    with pytest.raises(TimeoutError):
        wait_for_launch_file(path, newer_than=0.0, wait_s=0.2, launch_id="job-a")


def test_an_old_nothing_to_do_note_with_the_same_id_ends_the_join(monkeypatch, tmp_path, ranks, capsys):
    monkeypatch.setenv(nodes.LAUNCH_ID_ENV, "job-a")
    nodes.announce_no_launch(str(tmp_path), "sft", "SFT already finished")
    then = time.time() - HOUR
    os.utime(launch_path(tmp_path, "sft.json"), (then, then))
    nodes.join_launch(str(tmp_path), "sft", node_rank=1, wait_s=0.2, launch_id="job-a")
    assert not ranks and "nothing to train" in capsys.readouterr().out


def test_the_ranks_command_takes_its_launch_id_from_the_environment(monkeypatch, tmp_path, ranks):
    from flows.cli import main

    monkeypatch.setenv(nodes.LAUNCH_ID_ENV, "job-a")
    nodes.announce_no_launch(str(tmp_path), "rl", "all steps done")
    then = time.time() - HOUR
    os.utime(launch_path(tmp_path, "rl.json"), (then, then))
    argv = ["ranks", "rl", "--run-dir", str(tmp_path), "--node-rank", "1", "--wait-s", "0.2"]
    assert main(argv) == 0  # the old note is this Job's
    assert main([*argv, "--launch-id", "job-b"]) == 1  # --launch-id wins over the environment: not this one
    monkeypatch.delenv(nodes.LAUNCH_ID_ENV)
    assert main(argv) == 1  # no id: the time rule, and the note is an hour old
    assert not ranks


def test_without_a_launch_id_the_time_rule_stays(tmp_path, ranks):
    path = _launch(tmp_path, "job-a", age_s=HOUR)  # an id in the file does not matter to a node without one
    with pytest.raises(TimeoutError, match="newer than this command"):
        nodes.join_launch(str(tmp_path), "sft", node_rank=1, wait_s=0.2)
    os.utime(path, (time.time() - 30, time.time() - 30))  # within the minute before the command started
    nodes.join_launch(str(tmp_path), "sft", node_rank=1, wait_s=0.2)
    assert len(ranks) == 1
    _write(path, {"nothing_to_do": "x", "ended": True})
    with pytest.raises(TimeoutError):
        nodes.join_launch(str(tmp_path), "sft", node_rank=1, wait_s=0.2)
