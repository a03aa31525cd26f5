"""The policy in MLflow's Model Registry, on the run's default SQLite store: a version's artifact is the
checkpoint's serving files (never the optimizer state) with the same weights, its tags the lineage; the
same weights register once; a large checkpoint is registered by reference; evaluation tags its scores."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from rubricem_core.config import config_to_yaml, load_config
from rubricem_core.registry import (
    WEIGHTS_TAG,
    RegistryError,
    model_name,
    register_stage_policy,
    serving_files,
    tag_scores,
    version_link,
    weights_digest,
)
from rubricem_core.sim.tiny_policy import TinyPolicySpec, build_tiny_policy
from rubricem_core.tracking import Tracker

SPEC = TinyPolicySpec(vocab_size=600, hidden_size=32, n_layers=1, n_heads=2, n_kv_heads=1, intermediate_size=64)


@pytest.fixture()
def tracked(tmp_path: Path):
    run = tmp_path / "runs" / "my run"
    run.mkdir(parents=True)
    cfg = load_config("tiny", {"tracking.enabled": True})
    (run / "config.yaml").write_text(config_to_yaml(cfg))
    checkpoint = build_tiny_policy(
        ["words for a tokenizer of a tiny policy"] * 20, run / "checkpoints" / "sft" / "final", SPEC
    )
    (Path(checkpoint) / "trainer_state.pt").write_bytes(b"optimizer state, not served")
    tracker = Tracker.from_config(run, cfg.tracking)
    assert tracker is not None
    return run, cfg, Path(checkpoint), tracker


def test_a_version_holds_the_serving_files_and_the_lineage(tracked):
    run, cfg, checkpoint, tracker = tracked
    with tracker.child_run("sft") as child:
        version = register_stage_policy(tracker, child, cfg.tracking, run, checkpoint, stage="sft")
    assert version is not None and version.created and version.name == "rubricem-my-run" and version.version == "1"
    client = tracker.client
    mv = client.get_model_version(version.name, version.version)
    assert mv.run_id == child.run_id and mv.source == version.source and version.source.endswith("/policy")
    assert mv.tags["stage"] == "sft" and mv.tags["run_dir"] == str(run.resolve()) and mv.tags["artifact"] == "copy"
    assert len(mv.tags["config_hash"]) == 16 and mv.tags[WEIGHTS_TAG] == weights_digest(checkpoint)
    listed = sorted(Path(f.path).name for f in client.list_artifacts(child.run_id, "policy"))
    assert listed == sorted(p.name for p in serving_files(checkpoint))
    assert "trainer_state.pt" not in listed and "config.json" in listed and "model.safetensors" in listed
    # the artifact is the same weights, and a Hugging Face directory that loads
    import mlflow

    local = Path(mlflow.artifacts.download_artifacts(artifact_uri=mv.source, tracking_uri=tracker.tracking_uri))
    assert weights_digest(local) == weights_digest(checkpoint)
    from transformers import AutoModelForCausalLM

    assert AutoModelForCausalLM.from_pretrained(local).config.num_hidden_layers == 1
    assert client.get_run(child.run_id).data.tags["rubricem.model_version"] == "rubricem-my-run/1"
    assert version_link(version) == f"- registered model: [rubricem-my-run version 1]({version.url})"
    assert version.url.endswith("/#/models/rubricem-my-run/versions/1")


def test_the_same_weights_register_once_and_new_weights_get_a_new_version(tracked):
    run, cfg, checkpoint, tracker = tracked
    with tracker.child_run("sft") as child:
        first = register_stage_policy(tracker, child, cfg.tracking, run, checkpoint, stage="sft")
    with tracker.child_run("sft") as child:  # a rerun of the flow
        again = register_stage_policy(tracker, child, cfg.tracking, run, checkpoint, stage="sft")
    assert first is not None and again is not None
    assert (again.version, again.created) == (first.version, False)
    wider = TinyPolicySpec(vocab_size=600, hidden_size=32, n_layers=1, n_heads=2, n_kv_heads=1, intermediate_size=96)
    other = build_tiny_policy(
        ["words for a tokenizer of a tiny policy"] * 20, run / "checkpoints" / "rl" / "step-000003", wider
    )
    with tracker.child_run("rl") as child:
        rl = register_stage_policy(tracker, child, cfg.tracking, run, other, stage="rl", step=3, recipe="full")
    assert rl is not None and rl.created and rl.version == "2"
    tags = tracker.client.get_model_version(rl.name, "2").tags
    assert (tags["stage"], tags["step"], tags["recipe"]) == ("rl", "3", "full")


def test_a_large_checkpoint_is_registered_by_reference(tracked):
    run, cfg, checkpoint, tracker = tracked
    cfg.tracking.model_copy_max_gb = 0.0
    with tracker.child_run("sft") as child:
        version = register_stage_policy(tracker, child, cfg.tracking, run, checkpoint, stage="sft")
    assert version is not None and version.source == checkpoint.resolve().as_uri()
    assert tracker.client.get_model_version(version.name, version.version).tags["artifact"] == "reference"
    assert not tracker.client.list_artifacts(child.run_id, "policy")


def test_evaluation_scores_land_on_the_version_of_those_weights(tracked):
    run, cfg, checkpoint, tracker = tracked
    name = model_name(run, cfg.tracking.model_name)
    assert tag_scores(tracker, name, checkpoint, {"eval.synthetic.none.score_mean": 0.5}) is None  # nothing registered
    with tracker.child_run("sft") as child:
        register_stage_policy(tracker, child, cfg.tracking, run, checkpoint, stage="sft")
    version = tag_scores(tracker, name, checkpoint, {"eval.synthetic.none.score_mean": 0.752})
    assert version is not None
    assert tracker.client.get_model_version(name, version.version).tags["eval.synthetic.none.score_mean"] == "0.752"


def test_off_registers_nothing_and_a_bad_checkpoint_is_named(tracked, tmp_path):
    run, cfg, checkpoint, tracker = tracked
    cfg.tracking.register_model = False
    with tracker.child_run("sft") as child:
        assert register_stage_policy(tracker, child, cfg.tracking, run, checkpoint, stage="sft") is None
    assert register_stage_policy(None, None, cfg.tracking, run, checkpoint, stage="sft") is None
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(RegistryError, match="is not a policy checkpoint"):
        serving_files(empty)


@pytest.mark.parametrize(
    ("run_dir", "configured", "name"),
    [("out/tiny", "", "rubricem-tiny"), ("out/a b+c", "", "rubricem-a-b-c"), ("out/x", "my-policy", "my-policy")],
)
def test_model_names(run_dir, configured, name):
    assert model_name(run_dir, configured) == name


def test_the_recorded_digest_is_the_weights_digest(tracked):
    _, _, checkpoint, _ = tracked
    computed = weights_digest(checkpoint)
    (checkpoint / "checkpoint.json").write_text(json.dumps({"sha256": {"model.safetensors": computed}}))
    assert weights_digest(checkpoint) == computed
    copy = checkpoint.parent / "copy"
    shutil.copytree(checkpoint, copy)
    (copy / "checkpoint.json").unlink()
    assert weights_digest(copy) == computed


def test_register_on_demand_names_the_version_and_refuses_what_is_no_policy(tracked, capsys, tmp_path, monkeypatch):
    from flows.cli import main

    run, cfg, checkpoint, tracker = tracked
    assert main(["register", "--run-dir", str(run), "--checkpoint", "sft"]) == 0
    out = capsys.readouterr().out
    assert "registered: rubricem-my-run version 1" in out and "#/models/rubricem-my-run/versions/1" in out
    mv = tracker.client.get_model_version("rubricem-my-run", "1")
    assert mv.tags["stage"] == "sft" and mv.tags[WEIGHTS_TAG] == weights_digest(checkpoint)
    runs = tracker.client.search_runs([tracker.experiment_id()], "tags.`rubricem.flow` = 'register'")
    assert [r.info.run_id for r in runs] == [mv.run_id]
    import mlflow  # the docs' download: the version's models:/ URI on the run's store

    monkeypatch.setenv("MLFLOW_TRACKING_URI", tracker.tracking_uri)
    served = mlflow.artifacts.download_artifacts(artifact_uri="models:/rubricem-my-run/1", dst_path=str(tmp_path / "d"))
    assert weights_digest(Path(served)) == weights_digest(checkpoint) and (Path(served) / "tokenizer.json").is_file()
    assert main(["register", "--run-dir", str(run), "--checkpoint", "sft"]) == 0  # same weights: same version
    assert "already registered: rubricem-my-run version 1" in capsys.readouterr().out
    assert main(["register", "--run-dir", str(run), "--checkpoint", "step:2"]) == 2
    assert "no policy checkpoint" in capsys.readouterr().err
    assert main(["register", "--run-dir", str(tmp_path / "nowhere")]) == 2
    assert "is not a run directory" in capsys.readouterr().err


def test_the_report_links_each_version_with_its_scores(tracked):
    from rubricem_core.report import write_report

    run, cfg, checkpoint, tracker = tracked
    with tracker.child_run("sft") as child:
        version = register_stage_policy(tracker, child, cfg.tracking, run, checkpoint, stage="sft")
    tag_scores(tracker, version.name, checkpoint, {"eval.synthetic.none.score_mean": 0.75})
    page = write_report(run).read_text(encoding="utf-8")
    assert f'<a href="{version.url}">rubricem-my-run version 1</a> (sft; synthetic.none.score_mean 0.75)' in page
