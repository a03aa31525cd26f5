"""The `evaluate` flow end to end on a tiny run directory: eval_results parts, MLflow metrics, reruns,
test-time reflection retrieval, explicit checkpoints and the CLI.

The run directory is built without teacher collection or SFT (queries + corpus + a random-init tiny
policy as the "SFT" checkpoint): grading quality is tested in test_eval_graders.py; here the point is
the plumbing around a real policy sampling with the real tools.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rubricem_core.config import load_config
from rubricem_core.sql import run_sql
from rubricem_core.store import RunStore
from rubricem_core.tracking import Tracker
from tests.flow_overrides import FLOW_TINY

pytestmark = pytest.mark.slow  # runs flows end to end; `make test-fast` leaves it out

SMALL = {**FLOW_TINY, "data.world.n_queries": 12, "data.world.eval_fraction": 0.25, "eval.samples_per_query": 1}
UNTRACKED = {"tracking.enabled": False}  # MLflow is checked once, in the first test


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory, prefect_harness):
    from rubricem_core.sft import prepare_policy
    from tests.untrained_run import write_untrained_run

    cfg = load_config("tiny", SMALL)
    run = tmp_path_factory.mktemp("evaluate") / "run"
    texts = write_untrained_run(cfg, run)
    prepare_policy(cfg.policy, run.parent / "other-policy", texts, seed=1)
    return str(run)


def _overrides(**extra):
    return {**SMALL, **extra}


def test_evaluate_writes_eval_results_metrics_and_skips_on_rerun(run_dir, shared_data, monkeypatch):
    import rubricem_core.eval.benchmark as eval_benchmark
    from flows.evaluate import evaluate

    simpleqa = shared_data / "simpleqa" / "simple_qa_test_set.csv"
    if not simpleqa.exists():
        pytest.skip(f"shared data file missing: {simpleqa}")
    overrides = _overrides(**{"eval.paths": {"simpleqa": str(simpleqa)}})
    result = evaluate(run_dir=run_dir, profile="tiny", overrides=overrides, benchmarks=["synthetic", "simpleqa"])
    assert result["tag"] == "sft" and result["retrieval"] == "none"
    assert result["checkpoint"].endswith("checkpoints/sft/final")

    store = RunStore(run_dir)
    rows = store.read_rows("eval_results")
    assert len(rows) == 2 * 2 * 1  # benchmarks × queries × samples
    for column in (
        "checkpoint",
        "benchmark",
        "query_id",
        "retrieval",
        "score",
        "details",
        "sample",
        "grade_failed",
        "valid_scaffold",
        "finish_reason",
        "text",
    ):
        assert column in rows[0]
    held_out = {q["query_id"] for q in store.read_rows("queries") if q["split"] == "eval"}
    assert {r["query_id"] for r in rows if r["benchmark"] == "synthetic"} <= held_out
    assert {r["query_id"] for r in rows if r["benchmark"] == "simpleqa"} == {"simpleqa-00000", "simpleqa-00001"}
    # the chosen ids, in order, beside each part (the paper's fixed evaluation sets are checkable)
    chosen = json.loads((Path(run_dir) / "state" / "eval_queries" / "sft--simpleqa--none.json").read_text())
    assert chosen["query_ids"] == ["simpleqa-00000", "simpleqa-00001"] and chosen["sample"] == "first"
    assert chosen["max_queries"] == 2 and chosen["benchmark"] == "simpleqa" and chosen["checkpoint"] == "sft"
    for row in rows:
        assert 0.0 <= row["score"] <= 1.0 and not row["grade_failed"]
        details = json.loads(row["details"])
        assert (
            ("rubrics" in details)
            if row["benchmark"] == "synthetic"
            else (details["grade"] in ("correct", "incorrect", "not_attempted"))
        )
    assert sorted(p.name for p in store.files("eval_results")) == [
        "sft--simpleqa--none.parquet",
        "sft--synthetic--none.parquet",
    ]

    means = json.loads(
        run_sql(
            run_dir,
            "SELECT benchmark, avg(score) AS s, count(*) AS n FROM eval_results GROUP BY ALL ORDER BY benchmark",
            fmt="json",
        )
    )
    for mean in means:
        assert mean["n"] == 2
        assert mean["s"] == pytest.approx(result["benchmarks"][mean["benchmark"]]["score_mean"])
    logged = json.loads(run_sql(run_dir, "SELECT step, name, value FROM metrics WHERE flow = 'evaluate'", fmt="json"))
    names = {m["name"]: m for m in logged}
    assert {
        "eval/synthetic/none/score_mean",
        "eval/simpleqa/none/score_mean",
        "eval/simpleqa/none/grader/score_calls",
        "eval/synthetic/none/valid_scaffold_rate",
    } <= set(names)
    assert names["eval/simpleqa/none/grader/score_calls"]["value"] == 2.0
    assert {m["step"] for m in logged} == {0}  # the SFT policy: no RL updates
    # the scores are the parent run's headline metrics too
    tracker = Tracker(run_dir)
    parent = tracker.client.get_run(tracker.parent_run_id()).data.metrics
    assert parent["eval/synthetic/none/score_mean"] == pytest.approx(names["eval/synthetic/none/score_mean"]["value"])
    assert parent["eval/simpleqa/none/grader/score_calls"] == 2.0

    # a rerun reads the parts back instead of sampling again
    def no_sampling(*args, **kwargs):
        raise AssertionError("a finished benchmark was evaluated again")

    monkeypatch.setattr(eval_benchmark, "run_eval", no_sampling)
    again = evaluate(run_dir=run_dir, profile="tiny", overrides=overrides, benchmarks=["synthetic", "simpleqa"])
    assert all(s["cached"] for s in again["benchmarks"].values())
    assert again["benchmarks"]["synthetic"]["score_mean"] == pytest.approx(
        result["benchmarks"]["synthetic"]["score_mean"]
    )


def _save_bank(run_dir: str, query_ids: list[str]) -> None:
    """Saved where and as RL's reflect task saves it, with an embedder other than evaluation's fallback:
    evaluation must find it at bank_dir and search it with the embedder recorded with it."""
    from rubricem_core.embedders import HashingEmbedder
    from rubricem_core.reflection.bank import BankEntry, ReflectionBank
    from rubricem_core.reflection.format import Reflection
    from tasks.reflection import _write_bank

    queries = {q["query_id"]: q for q in RunStore(run_dir).read_rows("queries")}
    bank = ReflectionBank(HashingEmbedder(dim=64))
    for qid in query_ids:
        reflection = Reflection((f"Find the values for {qid}",), (f"Search each entity of {qid} by name",))
        bank.add(BankEntry(qid, queries[qid]["question"], reflection.render(), 0.8, 0))
    _write_bank(RunStore(run_dir), bank)


@pytest.mark.parametrize("mode,expected_guided", [("none", 0.0), ("within", 0.5), ("cross", 1.0)])
def test_retrieval_modes_inject_bank_guidance(run_dir, mode, expected_guided):
    from flows.evaluate import evaluate

    store = RunStore(run_dir)
    held_out = [q["query_id"] for q in store.read_rows("queries") if q["split"] == "eval"][:2]
    train = [q["query_id"] for q in store.read_rows("queries") if q["split"] == "train"][:3]
    _save_bank(run_dir, [held_out[0], *train])  # the first held-out query has its own reflection
    result = evaluate(
        run_dir=run_dir, profile="tiny", overrides=_overrides(**UNTRACKED), benchmarks=["synthetic"], retrieval=mode
    )
    assert result["benchmarks"]["synthetic"]["guided_rate"] == pytest.approx(expected_guided)
    rows = store.read_table("eval_results", {}, f"sft--synthetic--{mode}").to_pylist()
    assert {r["retrieval"] for r in rows} == {mode}
    guided = {r["query_id"] for r in rows if r["guidance"]}
    if mode == "within":
        assert guided == {held_out[0]}
        assert all(held_out[0] in r["guidance"] for r in rows if r["guidance"])
    if mode == "cross":
        own = [r for r in rows if r["query_id"] == held_out[0]]
        assert all(held_out[0] not in r["guidance"] for r in own)  # never its own reflection


def test_cross_retrieval_without_a_bank_names_the_directory(tmp_path, run_dir):
    from flows.evaluate import evaluate

    missing = tmp_path / "no-bank"
    with pytest.raises(FileNotFoundError, match="no-bank"):
        evaluate(
            run_dir=run_dir,
            profile="tiny",
            overrides=_overrides(**UNTRACKED, **{"eval.bank_dir": str(missing)}),
            checkpoint=str(Path(run_dir).parent / "other-policy"),
            benchmarks=["synthetic"],
            retrieval="cross",
        )


def test_cli_evaluates_an_explicit_checkpoint(run_dir, capsys):
    from flows.cli import main
    from flows.evaluate import evaluate

    evaluate(run_dir=run_dir, profile="tiny", overrides=_overrides(**UNTRACKED), benchmarks=["synthetic"])  # or cached

    other = str(Path(run_dir).parent / "other-policy")
    sets = [f"--set={k}={json.dumps(v)}" for k, v in {**SMALL, **UNTRACKED}.items()]
    assert main(["evaluate", "--run-dir", run_dir, *sets, "--checkpoint", other, "--benchmark", "synthetic"]) == 0
    out = capsys.readouterr().out
    assert "synthetic: score" in out and "other-policy-" in out
    parts = [p.name for p in RunStore(run_dir).files("eval_results") if p.name.startswith("other-policy-")]
    assert len(parts) == 1 and parts[0].endswith("--synthetic--none.parquet")
    rows = RunStore(run_dir).read_table("eval_results", {}, parts[0][: -len(".parquet")]).to_pylist()
    sft = RunStore(run_dir).read_table("eval_results", {}, "sft--synthetic--none").to_pylist()
    assert [r["text"] for r in rows] != [r["text"] for r in sft]  # another policy samples other text
    assert main(["evaluate", "--run-dir", run_dir, *sets, "--benchmark", "nope"]) == 2
    assert "eval.benchmarks" in capsys.readouterr().err


def test_a_rerun_with_other_settings_evaluates_again(run_dir):
    """Cached results are keyed by the settings that produced them: the same settings read the part
    back; another temperature samples again and replaces it (rows carry their settings digest)."""
    from flows.evaluate import evaluate

    first = evaluate(run_dir=run_dir, profile="tiny", overrides=_overrides(**UNTRACKED), benchmarks=["synthetic"])
    same = evaluate(run_dir=run_dir, profile="tiny", overrides=_overrides(**UNTRACKED), benchmarks=["synthetic"])
    assert same["benchmarks"]["synthetic"]["cached"]
    store = RunStore(run_dir)
    before = {r["settings"] for r in store.read_table("eval_results", {}, "sft--synthetic--none").to_pylist()}
    other = evaluate(
        run_dir=run_dir,
        profile="tiny",
        overrides=_overrides(**UNTRACKED, **{"eval.temperature": 0.3}),
        benchmarks=["synthetic"],
    )
    assert not other["benchmarks"]["synthetic"]["cached"]
    rows = store.read_table("eval_results", {}, "sft--synthetic--none").to_pylist()
    after = {r["settings"] for r in rows}
    assert (
        len(before) == len(after) == 1
        and before != after
        and len(rows) == first["benchmarks"]["synthetic"]["n_samples"]
    )
    assert {r["sample"] for r in store.read_table("eval_reflections", {}, "sft--synthetic--none").to_pylist()} == {0}


def test_queries_without_rubrics_are_recorded_and_the_rest_graded(run_dir, tmp_path):
    """Issue #21: a user's benchmark file where some queries have no rubric items — the others are
    sampled and graded, the rubric-less ones get a row with score NULL and the reason, and the
    summary counts them apart; a file where no query can be graded fails naming the benchmark."""
    from flows.evaluate import evaluate
    from rubricem_core.eval.types import EvalError

    props = [{"name": "rag", "criterion": "Mentions retrieval", "weight": 1, "evidence": []}]
    cases = [
        {
            "case_id": f"c{i}",
            "initial_prompt": f"Question {i}?",
            "metric_config": {"name": "rubric", "config": {"other_properties": props if i != 1 else []}},
        }
        for i in range(3)
    ]
    path = tmp_path / "mine.json"
    path.write_text(json.dumps(cases), encoding="utf-8")
    overrides = _overrides(**UNTRACKED, **{"eval.paths": {"scholarqa_cs": str(path)}, "eval.max_queries": 3})
    result = evaluate(run_dir=run_dir, profile="tiny", overrides=overrides, benchmarks=["scholarqa_cs"])
    summary = result["benchmarks"]["scholarqa_cs"]
    assert (summary["n_samples"], summary["n_queries"], summary["n_ungraded"], summary["n_no_rubrics"]) == (2, 2, 1, 1)
    rows = RunStore(run_dir).read_table("eval_results", {}, "sft--scholarqa_cs--none").to_pylist()
    by_id = {r["query_id"]: r for r in rows}
    assert len(rows) == 3 and by_id["scholarqa_cs-c1"]["score"] is None
    assert by_id["scholarqa_cs-c1"]["error"].startswith("no_rubrics") and by_id["scholarqa_cs-c1"]["text"] is None
    assert all(by_id[q]["score"] is not None for q in ("scholarqa_cs-c0", "scholarqa_cs-c2"))
    assert summary["score_mean"] == pytest.approx(
        (by_id["scholarqa_cs-c0"]["score"] + by_id["scholarqa_cs-c2"]["score"]) / 2
    )
    reflected = RunStore(run_dir).read_table("eval_reflections", {}, "sft--scholarqa_cs--none").to_pylist()
    assert {r["query_id"] for r in reflected} == {"scholarqa_cs-c0", "scholarqa_cs-c2"}  # nothing sampled for c1
    cached = evaluate(run_dir=run_dir, profile="tiny", overrides=overrides, benchmarks=["scholarqa_cs"])
    assert cached["benchmarks"]["scholarqa_cs"]["cached"]
    assert cached["benchmarks"]["scholarqa_cs"]["n_ungraded"] == 1

    path.write_text(
        json.dumps([{**c, "metric_config": {"name": "rubric", "config": {"other_properties": []}}} for c in cases]),
        encoding="utf-8",
    )
    with pytest.raises(EvalError, match="'scholarqa_cs': none of its 3 queries can be graded"):
        evaluate(run_dir=run_dir, profile="tiny", overrides=overrides, benchmarks=["scholarqa_cs"])


def test_an_api_model_is_evaluated_with_and_without_the_scaffold_from_the_cli(run_dir, capsys):
    """Fig. 6c as a command: the built-in teacher (offline) as the model behind an API, prompted with the
    scaffold (api:) and without it (api-plain:), graded as any checkpoint; the two parts side by side by SQL."""
    from flows.cli import main

    sets = [f"--set={k}={json.dumps(v)}" for k, v in {**SMALL, **UNTRACKED, "eval.max_queries": 3}.items()]
    for spec in ("api:rubricem-teacher/scripted", "api-plain:rubricem-teacher/scripted"):
        assert main(["evaluate", "--run-dir", run_dir, *sets, "--checkpoint", spec, "--benchmark", "synthetic"]) == 0
    table = json.loads(
        run_sql(
            run_dir,
            "SELECT checkpoint, count(*) AS n, avg(score) AS score, avg(valid_scaffold::INT) AS valid, "
            "avg(n_tool_calls) AS calls FROM eval_results WHERE checkpoint LIKE 'api%' GROUP BY ALL ORDER BY checkpoint",
            fmt="json",
        )
    )
    print(
        "\n".join(
            f"{r['checkpoint']}: score {r['score']:.3f}, valid {r['valid']:.2f}, calls {r['calls']:.2f}" for r in table
        )
    )
    by_tag = {r["checkpoint"]: r for r in table}
    plain, scaffold = by_tag["api-plain-rubricem-teacher_scripted"], by_tag["api-rubricem-teacher_scripted"]
    assert plain["n"] == scaffold["n"] == 3 and plain["calls"] >= 1 and scaffold["calls"] >= 1
    assert (scaffold["valid"], plain["valid"]) == (1.0, 0.0) and scaffold["score"] > 0 and plain["score"] > 0
    assert main(["evaluate", "--run-dir", run_dir, *sets, "--checkpoint", "api:", "--benchmark", "synthetic"]) != 0
    assert (
        main(
            [
                "evaluate",
                "--run-dir",
                run_dir,
                *sets,
                "--checkpoint",
                "api:rubricem-teacher/scripted",
                "--retrieval",
                "sequential",
            ]
        )
        != 0
    )
