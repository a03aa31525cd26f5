from __future__ import annotations

import json
from pathlib import Path

import pytest

from rubricem_core.config import ConfigError, TrackingConfig, config_to_yaml, load_config
from rubricem_core.redact import is_secret_name
from rubricem_core.sql import run_sql
from rubricem_core.tracking import (
    HEADLINE_KEYS,
    Tracker,
    TrackingError,
    flatten_params,
    mlflow_ui_command,
    mlflow_ui_url,
    ui_base,
    ui_instructions,
)
from tests.threads import run_in_threads


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # one MLflow database for the module: creating its schema takes seconds
    return tmp_path_factory.mktemp("tracking") / "run-0001"


@pytest.fixture(scope="module")
def tracker(run_dir: Path) -> Tracker:
    return Tracker(run_dir)


def test_parent_and_child_structure(tracker: Tracker, run_dir: Path):
    parent = tracker.parent_run_id()
    assert tracker.parent_run_id() == parent
    state = json.loads((run_dir / "state" / "mlflow_parent.json").read_text())
    assert state["run_id"] == parent
    assert tracker.tracking_uri == f"sqlite:///{run_dir.resolve()}/mlflow/mlflow.db"
    assert (run_dir / "mlflow" / "mlflow.db").exists()
    experiment = tracker.client.get_experiment(tracker.experiment_id())
    assert experiment.name == "rubricem"
    assert experiment.artifact_location == (run_dir.resolve() / "mlflow" / "artifacts").as_uri()

    with tracker.child_run(
        "collect_sft_data", {"teacher": {"model": "builtin", "rounds": 3}, "tags": ["a", "b"]}
    ) as child:
        run = tracker.client.get_run(child.run_id)
        assert run.info.status == "RUNNING"
        assert run.data.tags["mlflow.parentRunId"] == parent
        assert run.info.run_name == "collect_sft_data"
        assert run.data.tags["rubricem.flow"] == "collect_sft_data" and run.data.tags["rubricem.attempt"] == "1"
        assert run.data.params == {"teacher.model": "builtin", "teacher.rounds": "3", "tags": '["a", "b"]'}
        child.set_tags({"stage": "sft"})
    done = tracker.client.get_run(child.run_id)
    assert done.info.status == "FINISHED" and done.data.tags["stage"] == "sft"


def test_retry_after_crash_starts_a_new_attempt(tracker: Tracker, run_dir: Path):
    with pytest.raises(RuntimeError, match="crash"):
        with tracker.child_run("rl_step/0001", {"lr": 1e-6}) as child:
            raise RuntimeError("crash")
    first_id = child.run_id
    assert tracker.client.get_run(first_id).info.status == "FAILED"
    # a new process (new Tracker) rerunning the failed flow gets a fresh run under the same parent
    again = Tracker(run_dir)
    with again.child_run("rl_step/0001", {"lr": 1e-6}) as retry:
        assert retry.run_id != first_id
        run = again.client.get_run(retry.run_id)
        assert run.info.status == "RUNNING" and run.info.run_name == "rl_step/0001 · attempt 2"
        assert run.data.tags["mlflow.parentRunId"] == again.parent_run_id()
        assert run.data.tags["rubricem.flow"] == "rl_step/0001" and run.data.tags["rubricem.attempt"] == "2"
        assert run.data.tags["rubricem.retry_of"] == first_id
        assert run.data.params == {"lr": "1e-06"}
    assert again.client.get_run(first_id).info.status == "FAILED"
    assert again.client.get_run(retry.run_id).info.status == "FINISHED"
    state = json.loads((run_dir / "state" / "mlflow_parent.json").read_text())
    assert state["children"]["rl_step/0001"] == retry.run_id and state["store"] == "local"
    # a finished flow run again is an attempt of its own too: its params and duration stay true
    with again.child_run("rl_step/0001", {"lr": 2e-6}) as rerun:
        assert rerun.run_id != retry.run_id
    runs = again.client.search_runs([again.experiment_id()], filter_string="tags.`rubricem.flow` = 'rl_step/0001'")
    attempts = {r.data.tags["rubricem.attempt"]: r for r in runs}
    assert sorted(attempts) == ["1", "2", "3"]
    assert {a: r.data.params["lr"] for a, r in attempts.items()} == {"1": "1e-06", "2": "1e-06", "3": "2e-06"}
    assert {a: r.data.tags["rubricem.current"] for a, r in attempts.items()} == {
        "1": "false",
        "2": "false",
        "3": "true",
    }
    assert all("rubricem.params_changed" not in r.data.tags for r in runs)


def test_run_left_running_by_a_crashed_process_is_failed_and_retried(tracker: Tracker, run_dir: Path):
    crashed = tracker.child_run_id("rl_step/0003")  # created RUNNING; its process "died" without closing it
    assert tracker.client.get_run(crashed).info.status == "RUNNING"
    with Tracker(run_dir).child_run("rl_step/0003") as retry:
        assert retry.run_id != crashed
    assert tracker.client.get_run(crashed).info.status == "FAILED"
    assert tracker.client.get_run(crashed).info.end_time is not None
    assert tracker.client.get_run(retry.run_id).data.tags["rubricem.attempt"] == "2"
    # killed (Ctrl-C) counts as not finished too
    with pytest.raises(KeyboardInterrupt):
        with tracker.child_run("rl_step/0003") as killed:
            raise KeyboardInterrupt
    assert tracker.client.get_run(killed.run_id).info.status == "KILLED"
    assert tracker.client.get_run(retry.run_id).info.status == "FINISHED"  # the attempt before keeps its end
    with tracker.child_run("rl_step/0003") as fourth:
        assert tracker.client.get_run(fourth.run_id).info.run_name == "rl_step/0003 · attempt 4"


def test_a_run_open_in_this_process_is_not_taken_for_a_crash(tracker: Tracker, run_dir: Path):
    with tracker.child_run("nested") as outer:
        assert Tracker(run_dir).child_run_id("nested") == outer.run_id
        assert tracker.client.get_run(outer.run_id).info.status == "RUNNING"
    assert tracker.client.get_run(outer.run_id).info.status == "FINISHED"
    assert tracker.child_run_id("nested") != outer.run_id  # closed: the next run is a new attempt


def test_retry_replaces_the_mirrored_rows_of_relogged_steps(tracker: Tracker, run_dir: Path):
    with pytest.raises(RuntimeError, match="oom"):
        with tracker.child_run("rl_retry") as first:
            for step in range(3):
                first.log_metrics({"loss": 1.0 - step / 10, "kl": 0.1}, step=step)
            raise RuntimeError("oom")
    with tracker.child_run("rl_retry") as second:  # resumes from the checkpoint of step 1
        for step in (2, 3):
            second.log_metrics({"loss": 0.5 - step / 10, "kl": 0.2}, step=step)
    # the retry's chart is the whole series: steps 0-1 carried from the first attempt, 2-3 its own
    history = sorted(tracker.client.get_metric_history(second.run_id, "loss"), key=lambda m: m.step)
    assert [(m.step, m.value) for m in history] == [(0, 1.0), (1, 0.9), (2, 0.3), (3, pytest.approx(0.2))]
    assert [m.step for m in tracker.client.get_metric_history(first.run_id, "loss")] == [0, 1, 2]
    out = json.loads(
        run_sql(
            run_dir,
            "SELECT step, name, value, run_id FROM metrics WHERE flow = 'rl_retry' ORDER BY step, name",
            fmt="json",
        )
    )
    assert [(r["step"], r["name"]) for r in out] == [(s, n) for s in range(4) for n in ("kl", "loss")]
    owner = {r["step"]: r["run_id"] for r in out}
    assert owner == {0: first.run_id, 1: first.run_id, 2: second.run_id, 3: second.run_id}
    assert [r["value"] for r in out if r["step"] == 2] == [0.2, pytest.approx(0.3)]
    columns = json.loads(run_sql(run_dir, "SELECT * FROM metrics LIMIT 1", fmt="json"))[0]
    assert list(columns) == ["step", "name", "value", "flow", "run_id", "logged_at"]


def test_child_run_tags_and_ui_links(tracker: Tracker, run_dir: Path):
    links = {"prefect.flow_run_id": "4f1c", "prefect.flow_run_url": "http://127.0.0.1:4200/runs/flow-run/4f1c"}
    with tracker.child_run("linked", tags=links) as child:
        assert {k: tracker.client.get_run(child.run_id).data.tags[k] for k in links} == links
    run = tracker.client.get_run(child.run_id)
    assert child.experiment_id == run.info.experiment_id == tracker.experiment_id()
    exp = run.info.experiment_id
    view = "?workflowType=machine_learning"
    assert child.ui_url() == f"http://127.0.0.1:5000/#/experiments/{exp}/runs/{child.run_id}{view}"
    assert child.ui_url("http://host:8080/") == f"http://host:8080/#/experiments/{exp}/runs/{child.run_id}{view}"
    assert tracker.experiment_ui_url() == f"http://127.0.0.1:5000/#/experiments/{exp}/runs{view}"
    assert tracker.links(child) == {"mlflow_url": child.ui_url(), "mlflow_db": tracker.tracking_uri}
    assert tracker.links()["mlflow_url"] == tracker.run_ui_url(tracker.parent_run_id())
    # secret-like tag names are refused before any run is created
    with pytest.raises(ValueError, match="looks like a secret"):
        with tracker.child_run("leaky", tags={"prefect.api_token": "x"}):
            pass
    state = json.loads((run_dir / "state" / "mlflow_parent.json").read_text())
    assert "leaky" not in state["children"]


def test_experiment_opens_in_the_model_training_view(tracker: Tracker, run_dir: Path):
    experiment = tracker.client.get_experiment(tracker.experiment_id())
    # the tag (and value) MLflow 3's UI reads for the experiment kind and its selector writes
    assert experiment.tags["mlflow.experimentKind"] == "custom_model_development"
    tracker.client.delete_experiment_tag(experiment.experiment_id, "mlflow.experimentKind")
    again = Tracker(run_dir)  # an existing experiment (e.g. made by an older version) is marked on open
    assert again.parent_run_id() == tracker.parent_run_id()
    assert again.experiment_id() == experiment.experiment_id
    assert (
        again.client.get_experiment(experiment.experiment_id).tags["mlflow.experimentKind"]
        == "custom_model_development"
    )


def test_metrics_are_mirrored_and_queryable(tracker: Tracker, run_dir: Path):
    with tracker.child_run("rl_step/0002") as child:
        child.log_metrics({"reward/mean": 0.25, "kl": 0.001, "n_failed": 2}, step=2)
        child.log_metrics({"reward/mean": 0.5}, step=3)
    history = tracker.client.get_metric_history(child.run_id, "reward/mean")
    assert [(m.step, m.value) for m in history] == [(2, 0.25), (3, 0.5)]
    out = json.loads(
        run_sql(
            run_dir,
            "SELECT step, name, value, flow, run_id, typeof(logged_at) AS t FROM metrics "
            "WHERE flow = 'rl_step/0002' ORDER BY step, name",
            fmt="json",
        )
    )
    assert [(r["step"], r["name"], r["value"]) for r in out] == [
        (2, "kl", 0.001),
        (2, "n_failed", 2.0),
        (2, "reward/mean", 0.25),
        (3, "reward/mean", 0.5),
    ]
    assert {r["run_id"] for r in out} == {child.run_id}
    assert out[0]["t"].startswith("TIMESTAMP")
    own = [p for p in tracker.store.files("metrics") if p.name.startswith("rl_step_0002-")]
    assert sorted(p.parent.name for p in own) == ["step=0002", "step=0003"]
    with pytest.raises(ValueError, match="metric 'bad'"):
        child.log_metrics({"bad": "high"}, step=4)


def test_secret_like_params_are_refused(tracker: Tracker):
    with tracker.child_run("secrets") as child:
        for params in (
            {"judge": {"api_key": "sk-123"}},
            {"hf_token": "x"},
            {"db_password": "x"},
            {"openaiApiKey": "x"},
        ):
            with pytest.raises(ValueError, match="looks like a secret"):
                child.log_params(params)
        with pytest.raises(ValueError, match="looks like a secret"):
            child.set_tags({"client_secret": "x"})
        logged = child.log_params(
            {"max_tokens": 512, "teacher": {"api_key_env": "OPENAI_API_KEY"}, "loss": {"token_level": True}}
        )
        assert set(logged) == {"max_tokens", "teacher.api_key_env", "loss.token_level"}
    assert "sk-123" not in json.dumps(tracker.client.get_run(child.run_id).data.params)


def test_secret_name_rule_and_flattening():
    for name in ("teacher.api_key", "ACCESS_TOKEN", "client_secret", "openaiApiKey", "db.password", "judge.apikey"):
        assert is_secret_name(name), name
    for name in (
        "max_new_tokens",
        "monkey",
        "token_budget",
        "teacher.api_key_env",
        "api_key_secret_block",
        "input_cost_per_token",
        "tokenizer",
        "key_findings",
    ):
        assert not is_secret_name(name), name
    assert flatten_params({"a": {"b": {"c": 1}, "d": {}}, "e": None}) == {"a.b.c": 1, "a.d": {}, "e": None}


def test_long_param_values_are_truncated(tracker: Tracker):
    with tracker.child_run("long-values") as child:
        logged = child.log_params({"prompt": "x" * 10_000})
    assert len(logged["prompt"]) == 6000 and logged["prompt"].endswith("…")
    assert tracker.client.get_run(child.run_id).data.params["prompt"] == logged["prompt"]


def test_artifacts(tracker: Tracker, tmp_path: Path):
    report = tmp_path / "report.txt"
    report.write_text("hello")
    with tracker.child_run("evaluate") as child:
        child.log_artifact(report, artifact_path="reports")
        child.log_dict({"score": 0.5}, "summary")
        with pytest.raises(FileNotFoundError, match="does not exist"):
            child.log_artifact(tmp_path / "missing.txt")
    paths = {a.path for a in tracker.client.list_artifacts(child.run_id)}
    assert paths == {"reports", "summary.json"}
    artifact_root = Path(tracker.artifact_uri.removeprefix("file://"))
    assert list(artifact_root.rglob("summary.json"))[0].read_text().strip().startswith("{")


def test_evaluations_of_several_checkpoints_are_named_by_checkpoint_not_attempt(tracker: Tracker):
    names = []
    for tag in ("sft", "rl-step-000001", "rl-step-000003"):  # rl.eval_every: one evaluate run per checkpoint
        with tracker.child_run("evaluate", label=tag) as child:
            child.log_metrics({"eval/synthetic/none/score_mean": 0.1}, step=0 if tag == "sft" else int(tag[-1]) + 1)
        names.append(tracker.client.get_run(child.run_id).info.run_name)
    assert names == ["evaluate · sft", "evaluate · rl-step-000001", "evaluate · rl-step-000003"]
    # still one stage: the newest run carries the curve's earlier points forward
    history = tracker.client.get_metric_history(child.run_id, "eval/synthetic/none/score_mean")
    assert sorted(m.step for m in history) == [0, 2, 4]


def test_concurrent_children_in_threads(tracker: Tracker, run_dir: Path):
    errors: list[BaseException] = []

    def work(index: int) -> None:
        try:
            with tracker.child_run(f"reflection/{index}") as child:
                for step in range(3):
                    child.log_metrics({"score": float(index + step)}, step=10 + step)
        except BaseException as exc:  # collected and asserted in the main thread
            errors.append(exc)

    run_in_threads(work, 4)
    assert errors == []
    rows = json.loads(
        run_sql(
            run_dir,
            "SELECT count(*) AS n, count(DISTINCT run_id) AS runs FROM metrics WHERE flow LIKE 'reflection/%'",
            fmt="json",
        )
    )
    assert rows == [{"n": 12, "runs": 4}]


def test_corrupt_state_file_is_reported(tmp_path: Path):
    state = tmp_path / "run" / "state" / "mlflow_parent.json"
    state.parent.mkdir(parents=True)
    state.write_text("{not json")
    with pytest.raises(TrackingError, match="mlflow_parent.json"):
        Tracker(tmp_path / "run")._read_state()


def test_parent_run_follows_its_stages(tracker: Tracker):
    parent = tracker.parent_run_id()
    status = lambda: tracker.client.get_run(parent).info.status  # noqa: E731
    with tracker.child_run("collect_sft_data"):
        assert status() == "RUNNING"
    assert status() == "FINISHED"
    assert tracker.client.get_run(parent).info.end_time is not None
    with pytest.raises(RuntimeError, match="boom"):
        with tracker.child_run("sft"):
            raise RuntimeError("boom")
    assert status() == "FAILED"  # the pipeline stopped in a stage
    with tracker.child_run("sft") as retry:  # the rerun (a new attempt) resumes the parent too
        assert status() == "RUNNING"
        assert tracker.client.get_run(retry.run_id).data.tags["mlflow.parentRunId"] == parent
    assert status() == "FINISHED"


def test_soft_deleted_runs(tracker: Tracker):
    """A deleted attempt stays deleted (the next run is a new attempt); a deleted parent is restored."""
    with tracker.child_run("restorable") as child:
        pass
    tracker.client.delete_run(child.run_id)
    with tracker.child_run("restorable") as again:
        assert again.run_id != child.run_id
    assert tracker.client.get_run(again.run_id).data.tags["rubricem.attempt"] == "2"
    assert tracker.client.get_run(child.run_id).info.lifecycle_stage == "deleted"
    parent = tracker.parent_run_id()
    tracker.client.delete_run(parent)
    assert tracker.parent_run_id() == parent
    assert tracker.client.get_run(parent).info.lifecycle_stage == "active"


def _history(tracker: Tracker, run_id: str, name: str) -> list[tuple[int, float]]:
    return sorted((m.step, m.value) for m in tracker.client.get_metric_history(run_id, name))


def test_one_metric_series_per_stage_over_attempts(tracker: Tracker, run_dir: Path):
    """RL crashes after step 4 with n_windows 2; the retry (n_windows 4) runs steps 5-7: the current
    attempt's chart holds steps 0-7, each attempt keeps its own params, duration and Prefect link."""
    reward = {s: 0.1 * s for s in range(8)}
    with pytest.raises(RuntimeError, match="oom"):
        with tracker.child_run("rl_curve", {"rl": {"n_windows": 2}}, tags={"prefect.flow_run_id": "a"}) as first:
            for step in range(5):
                first.log_metrics({"reward/mean": reward[step]}, step=step)
            raise RuntimeError("oom")
    first_points = {m.step: m.timestamp for m in tracker.client.get_metric_history(first.run_id, "reward/mean")}
    with tracker.child_run("rl_curve", {"rl": {"n_windows": 4}}, tags={"prefect.flow_run_id": "b"}) as second:
        second.log_metrics({"reward/mean": reward[5], "rl/kl": 0.5}, step=5)
        # live: the chart is whole from the attempt's first point on
        assert _history(tracker, second.run_id, "reward/mean") == [(s, pytest.approx(reward[s])) for s in range(6)]
        for step in (6, 7):
            second.log_metrics({"reward/mean": reward[step], "rl/kl": 0.5}, step=step)
    assert _history(tracker, second.run_id, "reward/mean") == [(s, pytest.approx(reward[s])) for s in range(8)]
    assert [s for s, _ in _history(tracker, second.run_id, "rl/kl")] == [5, 6, 7]
    assert [s for s, _ in _history(tracker, first.run_id, "reward/mean")] == [0, 1, 2, 3, 4]
    carried = {m.step: m.timestamp for m in tracker.client.get_metric_history(second.run_id, "reward/mean")}
    assert {s: carried[s] for s in first_points} == first_points  # the original timestamps
    # the series equals the metrics table, which names the attempt that logged each step
    table = json.loads(
        run_sql(
            run_dir,
            "SELECT step, value, run_id FROM metrics WHERE flow = 'rl_curve' AND name = 'reward/mean' ORDER BY step",
            fmt="json",
        )
    )
    assert [(r["step"], pytest.approx(r["value"])) for r in table] == _history(tracker, second.run_id, "reward/mean")
    assert [r["run_id"] for r in table] == [first.run_id] * 5 + [second.run_id] * 3
    # each attempt's params, link and duration are its own: no stretch over both
    a, b = (tracker.client.get_run(r.run_id) for r in (first, second))
    assert (a.data.params["rl.n_windows"], b.data.params["rl.n_windows"]) == ("2", "4")
    assert (a.data.tags["prefect.flow_run_id"], b.data.tags["prefect.flow_run_id"]) == ("a", "b")
    assert (a.info.status, b.info.status) == ("FAILED", "FINISHED")
    assert a.info.end_time <= b.info.start_time <= b.info.end_time
    assert (a.data.tags["rubricem.current"], b.data.tags["rubricem.current"]) == ("false", "true")
    assert b.info.run_name == "rl_curve · attempt 2" and b.data.tags["rubricem.retry_of"] == first.run_id
    # a rerun with everything done logs nothing itself and still ends with the whole series
    with tracker.child_run("rl_curve", {"rl": {"n_windows": 4}}) as third:
        assert tracker.client.get_metric_history(third.run_id, "reward/mean") == []
    assert _history(tracker, third.run_id, "reward/mean") == _history(tracker, second.run_id, "reward/mean")
    current = tracker.client.search_runs(
        [tracker.experiment_id()], "tags.`rubricem.flow` = 'rl_curve' AND tags.`rubricem.current` = 'true'"
    )
    assert [r.info.run_id for r in current] == [third.run_id]


def test_a_recomputed_step_is_logged_once_per_attempt(tracker: Tracker):
    """A retry that starts over (SFT without a checkpoint) logs every step itself: nothing is carried
    below its first step, and the first attempt's later steps complete the series at the end."""
    with pytest.raises(RuntimeError):
        with tracker.child_run("sft_over") as first:
            for step in range(6):
                first.log_metrics({"loss": 2.0 - step / 10}, step=step)
            raise RuntimeError("killed")
    with pytest.raises(RuntimeError):
        with tracker.child_run("sft_over") as second:
            for step in range(3):
                second.log_metrics({"loss": 1.0 - step / 10}, step=step)
            raise RuntimeError("killed again")
    # one point per step: 0-2 its own, 3-5 the first attempt's (still the table's rows)
    assert _history(tracker, second.run_id, "loss") == [
        (0, 1.0),
        (1, 0.9),
        (2, 0.8),
        (3, pytest.approx(1.7)),
        (4, 1.6),
        (5, 1.5),
    ]


def test_parent_run_holds_headline_params_and_eval_scores(tracker: Tracker, run_dir: Path):
    cfg = load_config("tiny")
    (run_dir / "config.yaml").write_text(config_to_yaml(cfg))
    assert set(tracker.headline_params()) == set(HEADLINE_KEYS)  # every key names a config field
    with tracker.child_run("collect_headline"):
        pass
    parent = tracker.client.get_run(tracker.parent_run_id())
    assert parent.data.params["profile"] == cfg.profile
    assert parent.data.params["rl.recipe"] == cfg.rl.recipe
    assert parent.data.params["rl.n_windows"] == str(cfg.rl.n_windows)
    assert parent.data.params["eval.benchmarks"] == json.dumps(cfg.eval.benchmarks)
    # more RL windows later: MLflow keeps the first value, the tag says what holds now
    grown = cfg.model_copy(update={"rl": cfg.rl.model_copy(update={"n_windows": cfg.rl.n_windows + 2})})
    (run_dir / "config.yaml").write_text(config_to_yaml(grown))
    with tracker.child_run("collect_headline"):
        pass
    parent = tracker.client.get_run(tracker.parent_run_id())
    assert json.loads(parent.data.tags["rubricem.params_changed"]) == {"rl.n_windows": str(cfg.rl.n_windows + 2)}
    # the evaluation scores, by checkpoint updates: the latest value is the newest checkpoint's
    tracker.log_parent_metrics({"eval/synthetic/none/score_mean": 0.25}, step=0)
    tracker.log_parent_metrics({"eval/synthetic/none/score_mean": 0.5}, step=8)
    parent = tracker.client.get_run(tracker.parent_run_id())
    assert parent.data.metrics["eval/synthetic/none/score_mean"] == 0.5
    assert _history(tracker, parent.info.run_id, "eval/synthetic/none/score_mean") == [(0, 0.25), (8, 0.5)]
    (run_dir / "config.yaml").unlink()


def test_every_link_opens_the_model_training_view(monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    monkeypatch.delenv("MLFLOW_UI_URL", raising=False)
    base = "http://127.0.0.1:5000"
    assert mlflow_ui_url(base) == f"{base}/#/experiments?workflowType=machine_learning"
    assert mlflow_ui_url(base + "/", "3") == f"{base}/#/experiments/3/runs?workflowType=machine_learning"
    assert mlflow_ui_url(base, "3", "ab") == f"{base}/#/experiments/3/runs/ab?workflowType=machine_learning"
    with pytest.raises(ValueError, match="experiment id"):
        mlflow_ui_url(base, run_id="ab")
    assert ui_base("") == base
    assert ui_base("http://10.0.0.5:5001/") == "http://10.0.0.5:5001"  # a tracking server serves its UI
    monkeypatch.setenv("MLFLOW_UI_URL", "https://mlflow.example/")
    assert ui_base("") == ui_base("http://10.0.0.5:5001") == "https://mlflow.example"
    monkeypatch.delenv("MLFLOW_UI_URL")
    # `mlflow ui` as printed never reaches for the network: litellm's cost map is read locally
    command = mlflow_ui_command(f"sqlite:///{tmp_path}/mlflow.db")
    assert command.startswith("LITELLM_LOCAL_MODEL_COST_MAP=True MLFLOW_DISABLE_TELEMETRY=true mlflow ui ")
    assert command.endswith(f"--backend-store-uri sqlite:///{tmp_path}/mlflow.db")
    local = ui_instructions(tmp_path)
    assert local.splitlines() == [
        mlflow_ui_command(f"sqlite:///{tmp_path}/mlflow/mlflow.db"),
        f"(then open {base}/#/experiments?workflowType=machine_learning)",
    ]
    (tmp_path / "config.yaml").write_text("tracking:\n  uri: http://10.0.0.5:5001\n")
    assert ui_instructions(tmp_path) == (
        "open http://10.0.0.5:5001/#/experiments?workflowType=machine_learning (tracking server http://10.0.0.5:5001)"
    )


@pytest.mark.parametrize(
    ("uri", "stored"),
    [("", ""), ("  ", ""), (" http://127.0.0.1:5000 ", "http://127.0.0.1:5000"), ("https://mlflow.example", None)],
)
def test_tracking_uri_setting(uri: str, stored: str | None):
    assert TrackingConfig(uri=uri).uri == (uri.strip() if stored is None else stored)
    assert "tracking server" in TrackingConfig.model_fields["uri"].description


@pytest.mark.parametrize("uri", ["127.0.0.1:5000x/", "/tmp/mlflow.db", "mlflow server"])
def test_tracking_uri_without_a_scheme_is_refused(uri: str):
    with pytest.raises(ConfigError, match="tracking.uri"):
        load_config("tiny", {"tracking.uri": uri})
