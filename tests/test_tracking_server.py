"""`tracking.uri` against a real `mlflow server` process on loopback (its own SQLite store and artifact root
under tmp, offline). Skipped when the server cannot start here."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from rubricem_core.config import config_to_yaml, load_config
from rubricem_core.offline import OFFLINE_DEFAULTS
from rubricem_core.report import write_report
from rubricem_core.tracking import Tracker
from tests.vllm_cpu import NO_VLLM_VENV, VLLM_PYTHON, cpu_server

pytestmark = pytest.mark.slow  # the server takes ~20 s to start on a busy machine

STARTUP_TIMEOUT_S = 120


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=2) as response:
            return response.status == 200
    except OSError:
        return False


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    """``(uri, artifact root)`` of a fresh `mlflow server`."""
    base = tmp_path_factory.mktemp("mlflow-server")
    mlflow = Path(sys.executable).with_name("mlflow")
    if not mlflow.is_file():
        pytest.skip(f"no mlflow command beside {sys.executable}")
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    artifacts = base / "artifacts"
    env = {**os.environ, **OFFLINE_DEFAULTS, "NO_PROXY": "127.0.0.1,localhost", "no_proxy": "127.0.0.1,localhost"}
    log_path = base / "server.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [
                str(mlflow),
                "server",
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
                "--workers",
                "1",
                "--backend-store-uri",
                f"sqlite:///{base / 'server.db'}",
                "--default-artifact-root",
                str(artifacts),
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,  # the server's workers go with it
        )
    try:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while not _healthy(url):
            if proc.poll() is not None or time.monotonic() > deadline:
                tail = log_path.read_text(errors="replace")[-1500:]
                pytest.skip(f"mlflow server did not start (exit {proc.poll()}): {tail}")
            time.sleep(0.5)
        yield url, artifacts
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


def _tracked_run_dir(path: Path, uri: str) -> Path:
    path.mkdir(parents=True)
    (path / "config.yaml").write_text(config_to_yaml(load_config("tiny", {"tracking.uri": uri})))
    return path


def test_runs_of_two_run_dirs_on_one_server(server: tuple[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture):
    uri, artifacts = server
    cfg = load_config("tiny", {"tracking.uri": uri})
    a = _tracked_run_dir(tmp_path / "runs" / "a", uri)
    b = _tracked_run_dir(tmp_path / "runs" / "b", uri)
    tracker = Tracker.from_config(a, cfg.tracking)
    assert tracker is not None and not tracker.is_local and tracker.tracking_uri == uri
    # a crash after step 1 and a retry: one series over both attempts, on the server
    with pytest.raises(RuntimeError, match="oom"):
        with tracker.child_run("rl", {"rl": {"n_windows": 2}}) as first:
            for step in range(2):
                first.log_metrics({"reward/mean": step / 10}, step=step)
            raise RuntimeError("oom")
    note = tmp_path / "note.txt"
    note.write_text("on the server")
    with Tracker.from_config(a, cfg.tracking).child_run("rl", {"rl": {"n_windows": 4}}) as second:  # type: ignore[union-attr]
        second.log_metrics({"reward/mean": 0.2}, step=2)
        second.log_artifact(note, "notes")
        assert (
            second.ui_url()
            == f"{uri}/#/experiments/{second.experiment_id}/runs/{second.run_id}?workflowType=machine_learning"
        )
    assert "View run" not in capsys.readouterr().out  # MLflow's own run links (GenAI view) stay unprinted
    client = tracker.client
    history = sorted((m.step, m.value) for m in client.get_metric_history(second.run_id, "reward/mean"))
    assert history == [(0, 0.0), (1, 0.1), (2, 0.2)]
    assert client.get_run(second.run_id).data.params["rl.n_windows"] == "4"
    assert client.get_run(first.run_id).data.params["rl.n_windows"] == "2"
    # artifacts are the server's; the run directory holds no MLflow store of its own
    assert [f.path for f in client.list_artifacts(second.run_id, "notes")] == ["notes/note.txt"]
    assert list(artifacts.rglob("note.txt")) and not (a / "mlflow").exists()
    state = json.loads((a / "state" / "mlflow_parent.json").read_text())
    assert state["store"] == uri and state["children"]["rl"] == second.run_id
    parent = client.get_run(tracker.parent_run_id())
    assert parent.data.params["profile"] == cfg.profile and parent.data.tags["rubricem.run_dir"] == str(a.resolve())
    assert tracker.links(second) == {"mlflow_url": second.ui_url(), "mlflow_db": None}
    # a second run directory: its own parent in the same experiment, so one UI compares them
    other = Tracker.from_config(b, cfg.tracking)
    assert other is not None
    with other.child_run("rl") as b_child:
        b_child.log_metrics({"reward/mean": 0.3}, step=0)
    assert other.experiment_id() == tracker.experiment_id() and other.parent_run_id() != tracker.parent_run_id()
    runs = client.search_runs([tracker.experiment_id()])
    parents = sorted(r.info.run_name for r in runs if "mlflow.parentRunId" not in r.data.tags)
    assert parents == ["a", "b"]

    # the report goes to the server's parent run; its page links the server's UI
    page = write_report(a).read_text()
    assert [f.path for f in client.list_artifacts(tracker.parent_run_id(), "report")][0] == "report/report.html"
    assert f'href="{uri}/#/experiments?workflowType=machine_learning"' in page
    assert f"parent run {tracker.parent_run_id()} on {uri}" in page
    assert not (a / "mlflow").exists()

    # a copy of a server-tracked run dir must not log into the original's runs; a moved one keeps them
    copy = tmp_path / "runs" / "copy"
    shutil.copytree(a, copy)
    copied = Tracker.from_config(copy, cfg.tracking)
    assert copied is not None and copied.recorded_parent_id() is None
    assert copied.parent_run_id() != tracker.parent_run_id()
    moved = tmp_path / "runs" / "moved"
    b_parent = other.parent_run_id()
    b.rename(moved)
    follows = Tracker.from_config(moved, cfg.tracking)
    assert follows is not None and follows.parent_run_id() == b_parent
    assert client.get_run(b_parent).data.tags["rubricem.run_dir"] == str(moved.resolve())


def test_switching_tracking_uri_starts_a_parent_on_the_new_store(server: tuple[str, Path], tmp_path: Path):
    uri, _ = server
    run_dir = tmp_path / "run"
    local = Tracker(run_dir)
    with local.child_run("sft"):
        pass
    remote = Tracker(run_dir, uri=uri)
    assert remote.recorded_parent_id() is None  # the state names a run of the local store
    with remote.child_run("sft") as child:
        pass
    assert remote.client.get_run(child.run_id).data.tags["rubricem.attempt"] == "1"
    assert json.loads((run_dir / "state" / "mlflow_parent.json").read_text())["store"] == uri


def test_the_registered_policy_is_on_the_server_and_vllm_serves_it(server: tuple[str, Path], tmp_path: Path):
    """The version's artifact lives in the server's artifact root; downloaded, `vllm serve` (the CPU build) answers."""
    import mlflow

    from rubricem_core.registry import register_stage_policy, weights_digest
    from rubricem_core.sim.tiny_policy import TinyPolicySpec, build_tiny_policy

    uri, artifacts = server
    cfg = load_config("tiny", {"tracking.uri": uri})
    run = _tracked_run_dir(tmp_path / "runs" / "served", uri)
    spec = TinyPolicySpec(vocab_size=600, hidden_size=128, n_layers=2, n_heads=2, n_kv_heads=1, intermediate_size=256)
    checkpoint = Path(build_tiny_policy(["a tiny corpus of words for the tokenizer"] * 20, run / "sft", spec))
    tracker = Tracker.from_config(run, cfg.tracking)
    assert tracker is not None
    with tracker.child_run("sft") as child:
        version = register_stage_policy(tracker, child, cfg.tracking, run, checkpoint, stage="sft")
    assert version is not None and version.url.startswith(f"{uri}/#/models/rubricem-served/versions/")
    assert [p for p in artifacts.rglob("model.safetensors")]  # copied to the server's store
    served = Path(mlflow.artifacts.download_artifacts(artifact_uri=version.source, dst_path=str(tmp_path / "dl")))
    assert weights_digest(served) == weights_digest(checkpoint)
    if not VLLM_PYTHON.exists():
        pytest.skip(NO_VLLM_VENV)
    vllm = cpu_server(served, tmp_path / "vllm.log", 512, python=str(VLLM_PYTHON))
    try:
        answer = vllm.http.post("/v1/completions", json={"model": "policy", "prompt": [1, 2, 3], "max_tokens": 4})
        assert answer.status_code == 200 and answer.json()["choices"][0]["text"] is not None
    finally:
        vllm.close()
