"""Smoke tests of the benchmark scripts: the runner's last-line format and the DuckDB latency bench
on a small table (its SQL answers are checked against the same numbers computed in Python)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

from bench.duckdb_latency import JUDGE_SCORES_SCHEMA, QUERIES, write_scores  # noqa: E402
from bench.run_all import (  # noqa: E402
    Figure,
    FigureParseError,
    Result,
    Script,
    exit_code,
    figure_line,
    parse_figure_line,
    render_table,
    run_script,
)
from rubricem_core.sql import run_sql  # noqa: E402
from rubricem_core.store import RunStore  # noqa: E402


@pytest.mark.parametrize(
    "line, expected",
    [
        (
            "figure: duckdb_max_latency=0.2412 s  goal: < 0.5 s over 1003520 judge_scores rows  met: yes",
            Figure("duckdb_max_latency", 0.2412, "s", "< 0.5 s over 1003520 judge_scores rows", True),
        ),
        (
            "figure: prefect_overhead=17.84 %  goal: < 10% per RL step  met: no",
            Figure("prefect_overhead", 17.84, "%", "< 10% per RL step", False),
        ),
        (
            "figure: judge_calls=72 calls  goal: < 1536 calls of per-rubric scoring  met: yes",
            Figure("judge_calls", 72.0, "calls", "< 1536 calls of per-rubric scoring", True),
        ),
        (
            "figure: rollout_tokens_per_s=97 tok/s  goal: report (training 347 tok/s, padding 0.010)  met: n/a",
            Figure("rollout_tokens_per_s", 97.0, "tok/s", "report (training 347 tok/s, padding 0.010)", None),
        ),
        (
            "figure: scaffold_valid=0.812 of trajectories  goal: >= 0.8 pass  met: yes",
            Figure("scaffold_valid", 0.812, "of trajectories", ">= 0.8 pass", True),
        ),
        ("figure: ratio=1.5e+03  goal: > 1  met: yes", Figure("ratio", 1500.0, "", "> 1", True)),
    ],
)
def test_parse_figure_line(line, expected):
    assert parse_figure_line(line) == expected


@pytest.mark.parametrize(
    "line",
    [
        "figure: 3 calls vs 5 calls  goal: ours < per-rubric",  # the old free-form line
        "figure: x=abc s  goal: < 1  met: yes",  # value not a number
        "figure: x=1 s goal: < 1 met: yes",  # single spaces between fields
        "figure: x=1 s  goal: < 1  met: maybe",  # met must be yes|no|n/a
        "result: x=1 s  goal: < 1  met: yes",
    ],
)
def test_parse_rejects_malformed_lines(line):
    with pytest.raises(FigureParseError):
        parse_figure_line(line)


@pytest.mark.parametrize(
    "value, unit, met, shown",
    [
        (0.123456, "s", True, "0.1235"),
        (17.5, "%", False, "17.5"),
        (1003520, "rows", None, "1003520"),
        (12345.678, "tok/s", None, "12346"),
        (3.0, "", True, "3"),
    ],
)
def test_figure_line_round_trips(value, unit, met, shown):
    line = figure_line("some.figure", value, unit, "< 1 s over 5 rows", met)
    assert line.startswith(f"figure: some.figure={shown}")
    parsed = parse_figure_line(line)
    assert parsed.name == "some.figure" and parsed.unit == unit and parsed.met is met
    assert math.isclose(parsed.value, value, rel_tol=1e-3)


def test_figure_line_refuses_unparseable_fields():
    with pytest.raises(ValueError, match="figure name"):
        figure_line("two words", 1.0, "s", "goal", True)
    with pytest.raises(ValueError, match="two spaces"):
        figure_line("x", 1.0, "s", "a  b", True)


def _script(tmp_path: Path, name: str, body: str) -> Script:
    (tmp_path / f"{name}.py").write_text(body, encoding="utf-8")
    return Script(name)


def test_runner_counts_crashes_but_not_unmet_goals(tmp_path):
    logs = tmp_path / "logs"
    logs.mkdir()
    unmet = _script(tmp_path, "unmet", "print('working')\nprint('figure: t=2.5 s  goal: < 1 s  met: no')\n")
    crash = _script(tmp_path, "crash", "raise SystemExit('boom')\n")
    garbled = _script(tmp_path, "garbled", "print('figure: 2.5 s')\n")
    needs = Script("needs_run", needs_run_dir=True)
    run = lambda s: run_script(s, False, str(tmp_path / "no-run"), sys.executable, 60, logs, bench_dir=tmp_path)  # noqa: E731

    r_unmet = run(unmet)
    assert r_unmet.status == "ok" and r_unmet.figure == Figure("t", 2.5, "s", "< 1 s", False)
    assert exit_code([r_unmet]) == 0
    r_crash, r_garbled, r_missing, r_needs = run(crash), run(garbled), run(Script("absent")), run(needs)
    assert (r_crash.status, r_garbled.status) == ("crashed", "crashed")
    assert "exit code 1" in r_crash.note and "not a figure line" in r_garbled.note
    assert (r_missing.status, r_needs.status) == ("skipped", "skipped")
    assert exit_code([r_unmet, r_missing, r_needs]) == 0 and exit_code([r_unmet, r_crash]) == 1
    table = render_table([r_unmet, r_crash, Result("absent", "skipped", note="absent.py does not exist")])
    assert "t=2.5 s" in table and "< 1 s" in table and "crashed" in table and "skipped" in table


def test_duckdb_bench_sql_matches_python(tmp_path):
    written, last_step, query_id = write_scores(tmp_path, rows=3000, n_queries=6, n_rollouts=4, n_rubrics=8, seed=1)
    assert written == 16 * 6 * 4 * 8  # whole steps: ceil(3000 / 192) steps of 6 queries x 4 rollouts x 8 rubrics
    assert RunStore(tmp_path).partitions("judge_scores", "step") == list(range(last_step + 1))
    rows = RunStore(tmp_path).read_rows("judge_scores")
    assert len(rows) == written and {r["score"] for r in rows} == {0, 1, 2}

    # stage means per step
    sums: dict[tuple[int, str], list[int]] = defaultdict(list)
    for r in rows:
        sums[(r["step"], r["stage"])].append(r["score"])
    out = run_sql(tmp_path, QUERIES["stage_means"], fmt="json")
    got = {(d["step"], d["stage"]): (d["mean_score"], d["n"]) for d in json.loads(out)}
    assert got.keys() == sums.keys()
    for key, scores in sums.items():
        assert got[key][1] == len(scores) and math.isclose(got[key][0], sum(scores) / len(scores))

    # top rollout: R = Σ w·s′ / (2 Σ w) with negative rubrics inverted
    num: dict[tuple, float] = defaultdict(float)
    den: dict[tuple, float] = defaultdict(float)
    for r in rows:
        s = 2 - r["score"] if r["polarity"] == "negative" else r["score"]
        key = (r["step"], r["query_id"], r["rollout_id"])
        num[key] += r["weight"] * s
        den[key] += r["weight"]
    best = max(num[k] / (2 * den[k]) for k in num)
    top = json.loads(run_sql(tmp_path, QUERIES["top_rollouts"], fmt="json"))
    assert len(top) == 10 and math.isclose(top[0]["R"], best)
    assert all(a["R"] >= b["R"] for a, b in zip(top, top[1:]))

    group = json.loads(
        run_sql(tmp_path, QUERIES["one_group"].format(last_step=last_step, query_id=query_id), fmt="json")
    )
    assert len(group) == 4 * 8  # every rollout of the group on every rubric of the query


def test_duckdb_bench_prints_a_figure(tmp_path):
    proc = subprocess.run(
        [
            sys.executable,
            str(REPO_ROOT / "bench" / "duckdb_latency.py"),
            "--rows",
            "2000",
            "--queries",
            "4",
            "--rollouts",
            "4",
            "--rubrics",
            "8",
            "--repeats",
            "1",
            "--run-dir",
            str(tmp_path / "run"),
        ],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    figure = parse_figure_line(proc.stdout.strip().splitlines()[-1])
    assert figure.name == "duckdb_max_latency" and figure.unit == "s" and 0 < figure.value < 30
    assert "over 2048 judge_scores rows" in figure.goal and figure.met is (figure.value < 0.5)


@pytest.mark.slow
def test_bench_schema_matches_the_judge_tasks_table(tiny_pipeline_run):
    part = sorted((tiny_pipeline_run / "tables" / "judge_scores").glob("step=*/*.parquet"))
    assert part, "the tiny pipeline run wrote no judge_scores"
    real = pq.read_schema(part[0])
    assert [(f.name, f.type) for f in real] == [(f.name, f.type) for f in JUDGE_SCORES_SCHEMA]


def test_rl_improvement_pairs_queries_and_reads_the_score_parts(tmp_path):
    from bench.rl_improvement import breakdown, paired_gain
    from rubricem_core.eval.run import EVAL_RESULTS_SCHEMA

    # worked by hand: diffs q1 +0.2, q2 +0.4, q3 0.0 → mean 0.2, sd 0.2, se 0.2/√3; q4 only in one policy
    gain, se = paired_gain({"q1": 0.5, "q2": 0.6, "q3": 0.1, "q4": 1.0}, {"q1": 0.3, "q2": 0.2, "q3": 0.1})
    assert gain == pytest.approx(0.2) and se == pytest.approx(0.2 / math.sqrt(3))
    assert math.isnan(paired_gain({"q1": 1.0}, {"q2": 0.0})[0])

    def row(qid, sample, score, answered, fact, final, checkpoint="rl-step-000003", failed=False):
        rubrics = [
            {"check": "fact", "score": fact},
            {"check": "final", "score": final},
            {"check": "wrong_value", "score": 0},
        ]
        return {
            "checkpoint": checkpoint,
            "benchmark": "synthetic",
            "query_id": qid,
            "retrieval": "none",
            "score": score,
            "sample": sample,
            "grade_failed": failed,
            "valid_scaffold": answered and fact == 2,
            "details": json.dumps({"answered": answered, "rubrics": rubrics}),
        }

    rows = [
        row("q1", 0, 0.2, True, 0, 0),
        row("q1", 1, 0.6, True, 2, 0),
        row("q2", 0, 0.0, False, 0, 0),
        row("q2", 1, 1.0, True, 2, 2),
        row("q3", 0, 0.9, True, 2, 2, checkpoint="sft"),
        row("q3", 0, 0.0, False, 0, 0, failed=True),
    ]
    RunStore(tmp_path).write_table("eval_results", rows, schema=EVAL_RESULTS_SCHEMA)
    parts = breakdown(str(tmp_path), "rl-step-000003")
    assert parts["n"] == 4 and parts["per_query"] == pytest.approx({"q1": 0.4, "q2": 0.5})
    assert parts["answered"] == 0.75 and parts["valid"] == 0.5
    assert parts["facts"] == 0.5 and parts["finals"] == 0.25


def test_breakdown_reads_the_answer_match_grade_beside_the_builtin_one(tmp_path):
    from bench.rl_improvement import breakdown
    from rubricem_core.eval.run import EVAL_RESULTS_SCHEMA

    def row(qid, sample, matched, final):
        details = {"answered": True, "rubrics": [], "answer_match": {"score": matched, "final_correct": final}}
        return {
            "checkpoint": "sft",
            "benchmark": "synthetic",
            "query_id": qid,
            "retrieval": "none",
            "score": 0.5,
            "sample": sample,
            "grade_failed": False,
            "valid_scaffold": True,
            "details": json.dumps(details),
        }

    rows = [row("q1", 0, 1.0, True), row("q1", 1, 0.5, False), row("q2", 0, 0.0, False)]
    RunStore(tmp_path).write_table("eval_results", rows, schema=EVAL_RESULTS_SCHEMA)
    parts = breakdown(str(tmp_path), "sft")
    assert parts["per_query_independent"] == pytest.approx({"q1": 0.75, "q2": 0.0})
    assert parts["independent"] == pytest.approx(0.5) and parts["independent_finals"] == pytest.approx(1 / 3)


def test_compare_checkpoints_splits_by_query_kind_where_the_answers_go_wrong(tmp_path, capsys):
    """Per kind: the share of trajectories stating every needed fact, and the final's accuracy given them;
    the gain over the first checkpoint paired over that kind's queries only. Worked by hand."""
    from bench.compare_checkpoints import kind_breakdown, print_kind_table
    from rubricem_core.eval.run import EVAL_RESULTS_SCHEMA
    from rubricem_core.schemas import QUERIES_SCHEMA

    def query(qid, kind):
        return {"query_id": qid, "source": "synthetic", "split": "eval", "kind": kind, "question": "?",
                "messages": "[]", "rubrics": [], "spec": "{}", "metadata": "{}"}  # fmt: skip

    def row(tag, qid, stated, final, score):
        match = {"facts_required": 2, "facts_stated": stated, "final_correct": final, "score": score}
        return {"checkpoint": tag, "benchmark": "synthetic", "query_id": qid, "retrieval": "none", "score": 0.5,
                "sample": 0, "grade_failed": False, "valid_scaffold": True,
                "details": json.dumps({"answer_match": match})}  # fmt: skip

    store = RunStore(tmp_path)
    kinds = {"c1": "comparison", "c2": "comparison", "m1": "multi_hop"}
    store.write_table("queries", [query(q, k) for q, k in kinds.items()], schema=QUERIES_SCHEMA)
    rows = [row("sft", "c1", 2, True, 1.0), row("sft", "c2", 2, False, 0.5), row("sft", "m1", 1, False, 0.25)]
    rows += [row("rl", "c1", 2, True, 1.0), row("rl", "c2", 2, True, 1.0), row("rl", "m1", 2, True, 1.0)]
    store.write_table("eval_results", rows, schema=EVAL_RESULTS_SCHEMA)
    sft = kind_breakdown(tmp_path, "sft")
    assert sft["comparison"] == {"trajectories": 2, "all_facts": 1.0, "final_given_facts": 0.5}
    assert sft["multi_hop"]["all_facts"] == 0.0 and math.isnan(sft["multi_hop"]["final_given_facts"])
    assert kind_breakdown(tmp_path, "rl")["multi_hop"] == {
        "trajectories": 1,
        "all_facts": 1.0,
        "final_given_facts": 1.0,
    }
    comparison = {"kinds": kinds, "checkpoints": [
        {"name": "sft", "independent": {"c1": 1.0, "c2": 0.5, "m1": 0.25}, "by_kind": sft},
        {"name": "rl", "independent": {"c1": 1.0, "c2": 1.0, "m1": 1.0}, "by_kind": kind_breakdown(tmp_path, "rl")},
    ]}  # fmt: skip
    print_kind_table(comparison)
    lines = capsys.readouterr().out.splitlines()
    (comparison_rl,) = [line for line in lines if line.startswith("comparison") and " rl " in line]
    assert comparison_rl.split()[2:7] == ["2", "1.000", "+0.250", "±", "0.250"]  # c2: 0.5 → 1.0; c1 unchanged
    (multi_rl,) = [line for line in lines if line.startswith("multi_hop") and " rl " in line]
    assert "+0.750" in multi_rl and multi_rl.split()[-2:] == ["1.00", "1.00"]


def test_learning_curve_json_holds_each_graders_per_query_scores_and_the_eta_counts_timed_work():
    from bench.learning_curve import Progress, curve_json, graded

    def ev(shift):
        per_query = {f"q{i}": min(1.0, 0.1 * i + shift) for i in range(5)}
        return {"per_query": {"independent": per_query, "builtin": dict(per_query)}, "n": 5}

    sft, late = ev(0.0), ev(0.2)
    late["graded"] = graded(late, sft)
    assert late["graded"]["independent"]["gain"] == pytest.approx(0.2) and late["graded"]["builtin"]["se"] < 1e-9
    doc = json.loads(json.dumps(curve_json(sft, {"full": [{"step": 8, **late}]}, {"full": []})))
    assert set(doc["sft"]) >= {"independent", "builtin"} and doc["sft"]["independent"]["q3"] == pytest.approx(0.3)
    assert doc["recipes"]["full"][0]["step"] == 8 and doc["recipes"]["full"][0]["builtin"]["q0"] == pytest.approx(0.2)

    progress = Progress(steps=10, evaluations=3)
    assert "ETA after" in progress.line()
    progress.ran("steps", 4, 2.0)  # read back from an earlier run: done, not timed
    progress.ran("steps", 2, 200.0)
    progress.ran("evals", 1, 60.0)
    assert progress.steps == 6 and progress.step_seconds == [100.0, 100.0]
    assert "ETA 9 min" in progress.line()  # 4 steps × 100 s + 2 evaluations × 60 s = 520 s


def test_the_final_comparison_pairs_each_checkpoint_with_sft_and_the_last_two_recipes(capsys):
    from bench.learning_curve import final_gains

    def scores(a, b, c):
        return {"independent": {"q1": a, "q2": b, "q3": c}, "builtin": {"q1": a / 2, "q2": b / 2, "q3": c / 2}}

    final = {
        "samples_per_query": 4,
        "checkpoints": [
            {"name": "sft", **scores(0.5, 0.5, 0.0)},
            {"name": "ss_grpo step 24", **scores(0.75, 0.5, 0.25)},
            {"name": "full step 24", **scores(1.0, 0.75, 0.25)},
        ],
    }
    gains = final_gains(final)
    # worked by hand: differences (.25, 0, .25), (.5, .25, .25) and (.25, .25, 0); each sd √(1/48), se 1/12
    assert gains["vs_first"]["ss_grpo step 24"]["independent"] == pytest.approx({"gain": 1 / 6, "se": 1 / 12})
    assert gains["vs_first"]["full step 24"]["independent"] == pytest.approx({"gain": 1 / 3, "se": 1 / 12})
    assert gains["vs_first"]["full step 24"]["builtin"] == pytest.approx({"gain": 1 / 6, "se": 1 / 24})
    assert gains["full step 24 − ss_grpo step 24"]["independent"] == pytest.approx({"gain": 1 / 6, "se": 1 / 12})
    table = capsys.readouterr().out
    assert "4 samples a query" in table and "+0.333 ± 0.083" in table


def test_a_curves_rl_settings_stay_out_of_the_source_run_it_makes():
    from bench.learning_curve import source_overrides

    overrides = {
        "tracking.enabled": False,
        "sft.epochs": 2,
        "data.world.n_queries": 16,
        "rl.queries_per_step": 4,
        "rollout.engine": "hf",
        "judge.cap_per_stage": 3,
        "eval.max_queries": 6,
        "reflection.n_candidates": 2,
    }
    assert source_overrides(overrides) == {
        "tracking.enabled": False,
        "sft.epochs": 2,
        "data.world.n_queries": 16,
        "reflection.n_candidates": 2,  # the teacher's reflections read this section
    }


def test_a_curve_prints_the_rl_settings_it_trains_with_and_their_source():
    from bench.learning_curve import rl_settings_line
    from rubricem_core.config import load_config

    cfg = load_config(
        "learn",
        {"rl.lr": 2e-5, "rl.queries_per_step": 4, "rl.async_steps": 1, "rl.importance_correction": "tis", "seed": 1},
    )
    line = rl_settings_line(cfg, "learn")
    assert line.startswith("RL settings (learn): 4 queries × 4 rollouts a step, async_steps 1, lr 2e-05")
    assert line.endswith("seed 1")
    default = rl_settings_line(load_config("learn"), "learn")
    assert "2 queries × 4 rollouts" in default and "async_steps 0" in default and "seed 0" in default
    assert "unscored_stage_return none" in default


def test_learning_curve_chunks_end_on_windows():
    from bench.learning_curve import chunk_ends

    assert chunk_ends(24, 6, 6) == [6, 12, 18, 24]
    assert chunk_ends(4, 2, 2) == [2, 4]
    for steps, every, per_window in ((24, 4, 6), (10, 4, 2)):  # a chunk ends mid-window / steps not a multiple
        with pytest.raises(SystemExit, match="multiple of"):
            chunk_ends(steps, every, per_window)


def test_learning_curve_splits_the_step_rows_by_phase_and_half():
    """Means worked by hand over four steps: new steps 0 and 2, repeat steps 1 and 3; a NaN is left out."""
    from bench.learning_curve import phase_means, phase_table

    nan = float("nan")
    rows = [
        {"step": 0, "phase": "new", "valid_scaffold": 1.0, "train_answer_match": 0.5, "kl": 0.0},
        {"step": 1, "phase": "repeat", "valid_scaffold": 0.5, "train_answer_match": nan, "kl": 0.01},
        {"step": 2, "phase": "new", "valid_scaffold": 0.75, "train_answer_match": 1.0, "kl": 0.002},
        {"step": 3, "phase": "repeat", "valid_scaffold": 0.25, "train_answer_match": 0.25, "kl": 0.03},
    ]
    means = phase_means(rows)
    assert means["valid_scaffold"] == {
        "new": {"steps 0–1": 1.0, "steps 2–3": 0.75},
        "repeat": {"steps 0–1": 0.5, "steps 2–3": 0.25},
    }
    assert math.isnan(means["train_answer_match"]["repeat"]["steps 0–1"])
    assert means["kl"]["repeat"]["steps 2–3"] == 0.03
    assert math.isnan(means["advantaged"]["new"]["steps 0–1"])  # rows from before the metric existed
    assert "valid scaffolds, repeat-query steps: steps 0–1 0.50, steps 2–3 0.25" in phase_table(means)
    assert phase_means([]) == {}


def test_scaffold_gate_replay_reads_a_run_and_counts_both_rules(tiny_pipeline_run):
    """The micro run's policy breaks every scaffold: judged, some broken stages still earn A > 0; zeroed,
    a stage every rollout broke has R = 0 for all and no advantage."""
    from bench.scaffold_gate_replay import gate_counts

    counts = gate_counts(tiny_pipeline_run)
    assert set(counts) == {"new", "repeat"}
    for rules in counts.values():
        assert rules["zero"]["rows"] == rules["judged"]["rows"] > 0
    assert sum(r["judged"]["positive"] for r in counts.values()) > 0
    assert sum(r["zero"]["positive"] for r in counts.values()) == 0
    with pytest.raises(SystemExit, match="no config.yaml"):
        gate_counts(tiny_pipeline_run / "tables")


def test_unscored_stage_replay_counts_the_same_tokens_under_both_rules(tiny_pipeline_run):
    """Both rules see every generated token; downstream only adds advantages (to stages with no score of
    their own) and never touches the answer, which always has its rubrics."""
    from bench.unscored_stage_replay import advantage_token_counts

    counts = advantage_token_counts(tiny_pipeline_run)
    for stage, (nonzero, total) in counts["none"].items():
        down_nonzero, down_total = counts["downstream"][stage]
        assert down_total == total > 0 and nonzero <= down_nonzero <= total
    assert counts["downstream"]["answer"] == counts["none"]["answer"]
    with pytest.raises(SystemExit, match="no config.yaml"):
        advantage_token_counts(tiny_pipeline_run / "tables")


def _soak_rows(n: int, cpu_growth: float, rss_growth: float, fds_growth: int) -> list[dict]:
    """Synthetic soak rows: step 0 is slow (model load), new-query (even) steps cost twice a replay."""
    rows = []
    for step in range(n):
        base = 2.0 if step % 2 == 0 else 1.0
        rows.append(
            {
                "step": step,
                "seconds": 20.0 if step == 0 else base * (1 + cpu_growth * step),
                "cpu_s": 10.0 if step == 0 else base * (1 + cpu_growth * step),
                "cpu_server_s": 0.1,
                "read_calls": 100,
                "rss_flow_mib": 1000.0 * (1 + rss_growth * step),
                "rss_server_mib": 200.0,
                "fds": 17 + fds_growth * step,
                "parquet_files": 20 + 5 * step,
                "parquet_mib": 0.3 + 0.04 * step,
                "mlflow_mib": 2.5 + 0.02 * step,
                "checkpoints": 2,
            }
        )
    return rows


@pytest.mark.parametrize(
    "n, cpu_growth, rss_growth, fds_growth, met",
    [
        (40, 0.0, 0.0, 0, True),
        (40, 0.01, 0.0, 0, False),  # +34% CPU per step by the end
        (40, 0.0, 0.005, 0, False),  # +17% RSS
        (40, 0.0, 0.0, 1, False),  # a leaked fd per step
        (10, 0.0, 0.0, 0, True),  # --quick: windows of 3
    ],
)
def test_soak_summary_compares_like_steps(n, cpu_growth, rss_growth, fds_growth, met):
    from bench.soak import summarize

    rows = _soak_rows(n, cpu_growth, rss_growth, fds_growth)
    s = summarize(rows)
    assert s.window == (5 if n >= 12 else 3)
    # step 0 (model load) is left out and both windows hold the same new/replay mix: flat costs give 1.0
    if cpu_growth == 0:
        assert s.cpu[2] == pytest.approx(1.0) and s.wall[2] == pytest.approx(1.0)
    else:
        assert s.cpu[2] > 1.1
    assert s.parquet_files == (5.0, 5.0)
    assert s.met is met


def test_soak_samples_a_process_tree(tmp_path):
    from bench.soak import process_tree, sample

    child = subprocess.Popen(
        [sys.executable, "-c", "import time; print('ready', flush=True); time.sleep(30)"],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "ready"  # a started interpreter
        tree = process_tree(child.pid)
        assert tree["rss_flow_mib"] > 1 and tree["fds"] >= 3 and tree["n_ranks"] == 0
        (tmp_path / "tables" / "t" / "step=0000").mkdir(parents=True)
        pq.write_table(pa.table({"x": [1, 2, 3]}), tmp_path / "tables" / "t" / "step=0000" / "part.parquet")
        row = sample(tmp_path, child.pid, 0, 1.0, {})
        assert row["parquet_files"] == 1 and row["parquet_mib"] > 0 and row["checkpoints"] == 0
    finally:
        child.kill()
        child.wait()


def test_results_file_lines_carry_when_where_and_what_and_the_page_shows_the_newest(tmp_path):
    from bench.results import append_result, read_results, render_page

    path = tmp_path / "results.jsonl"
    old = Figure("load_judge_wall_slots", 1.28, "x ideal", "<= 1.3 x ideal", True)
    new = Figure("load_judge_wall_slots", 1.18, "x ideal", "<= 1.3 x ideal", True)
    append_result(path, "load_judge", old, 40.2, quick=False)
    append_result(path, "load_judge", new, 38.0, quick=False)
    append_result(path, "load_judge", Figure("load_judge_wall_slots", 1.5, "x ideal", "<= 1.3 x ideal", False), 9, True)
    rows = read_results(path)
    assert len(rows) == 3 and all(r["commit"] and r["machine"] and r["date"].endswith("UTC") for r in rows)
    assert "CPUs" in rows[0]["machine"]
    page = render_page(rows)
    table = [line for line in page.splitlines() if line.startswith("| `load_judge_wall_slots`")]
    assert len(table) == 2  # the newest full-size and the newest quick measurement
    assert "| 1.18 x ideal |" in table[0] and "| yes |" in table[0] and "| full |" in table[0]
    assert "| 1.5 x ideal |" in table[1] and "| **no** |" in table[1] and "| quick |" in table[1]
    path.write_text(path.read_text() + "not json\n")
    with pytest.raises(ValueError, match=r"results.jsonl:4: not JSON"):
        read_results(path)


def test_the_committed_benchmarks_page_is_current():
    from bench.results import main

    assert main(["--check"]) == 0, "run: python -m bench.results"


def test_every_figure_the_docs_cite_is_printed_by_a_bench_script_and_unmeasured_ones_are_listed(tmp_path):
    from bench.results import cited_figures, printing_script, read_results, render_page

    cited = cited_figures()
    assert "judge_tail_ratio" in cited and "soak_cpu_time_ratio" in cited
    unknown = {name: pages for name, pages in cited.items() if printing_script(name) is None}
    assert not unknown, f"docs cite figures no bench script prints: {unknown}"
    assert printing_script("ss_grpo_minus_sft") == "learning_curve"  # a name with a recipe in it
    assert printing_script("rl_improvement.full_minus_sft") == "rl_improvement"

    (tmp_path / "a.md").write_text(
        "It is `judge_tail_ratio` in\n[benchmarks](benchmarks.md), and `x_y` in [benchmarks](benchmarks.md)."
    )
    here = cited_figures(tmp_path)
    assert here == {"judge_tail_ratio": ["a.md"], "x_y": ["a.md"]}
    page = render_page([r for r in read_results() if r["name"] == "judge_tail_ratio"], here)
    listed = page.split("## Cited in the docs, not in the results file yet")[1]
    assert "| `x_y` | ? | a.md |" in listed and "judge_tail_ratio" not in listed


def test_pooled_gain_averages_each_query_over_seeds_before_the_standard_error():
    from bench.pooled_gain import pooled_gain

    seed_a = ({"a": 1.0, "b": 0.5, "c": 1.0}, {"a": 0.0, "b": 0.5, "c": 1.0})  # gains 1, 0, 0
    seed_b = ({"a": 0.5, "b": 1.0, "c": 0.5, "d": 1.0}, {"a": 0.5, "b": 0.5, "c": 0.5})  # 0, .5, 0; d ungraded
    gain, se, n = pooled_gain([seed_a, seed_b])
    # per query 0.5, 0.25, 0: mean 0.25, sample variance (0.0625 + 0 + 0.0625) / 2, over 3 queries
    assert n == 3 and gain == pytest.approx(0.25) and se == pytest.approx(math.sqrt(0.0625 / 3))
    one_gain, one_se, _ = pooled_gain([seed_a])
    assert one_gain == pytest.approx(1 / 3) and one_se == pytest.approx(math.sqrt((4 / 9 + 1 / 9 + 1 / 9) / 2 / 3))


def test_pooled_gain_reads_comparisons_pairs_each_with_its_own_sft_and_counts_a_read_back_checkpoint_once(
    tmp_path, capsys, monkeypatch
):
    from bench.pooled_gain import between_runs, main, runs_of
    from bench.run_all import parse_figure_line

    def point(tag: str, scores: list[float]) -> dict:
        by_query = dict(zip("abc", scores))
        return {"name": f"/runs/{tag}", "tag": tag, "independent": by_query, "builtin": by_query}

    first = {"samples_per_query": 4, "checkpoints": [point("sft", [0.5, 0.5, 0.5]), point("x", [1.0, 0.5, 0.5])]}
    # the second file evaluated SFT again (another score) and read x back: x counts once, against the first SFT
    second = {
        "samples_per_query": 4,
        "checkpoints": [point("sft", [0.0, 0.5, 0.5]), point("x", [1.0, 0.5, 0.5]), point("y", [0.0, 0.5, 1.0])],
    }
    paths = []
    for name, data in (("one.json", first), ("two.json", second)):
        (tmp_path / name).write_text(json.dumps(data))
        paths.append(str(tmp_path / name))
    runs = runs_of(paths, "full", None, "sft")
    assert [name.rsplit(": ", 1)[1] for name, _, _ in runs] == ["/runs/x", "/runs/y"]
    gains = [sum(p["independent"][q] - r["independent"][q] for q in "abc") / 3 for _, p, r in runs]
    assert gains == pytest.approx([0.5 / 3, 0.5 / 3])  # x against the first SFT, y against the second
    assert between_runs([0.1, 0.3]) == pytest.approx((0.2, math.sqrt(0.02 / 2)))
    assert math.isnan(between_runs([0.1])[1])
    monkeypatch.setattr("sys.argv", ["pooled_gain.py", *paths])
    assert main() == 0
    figure = parse_figure_line(capsys.readouterr().out.strip().splitlines()[-1])
    assert figure.name == "pooled_gain_over_sft_independent" and figure.value == pytest.approx(0.5 / 3, abs=1e-4)
