"""Run reports: plots and the one-page HTML summary, from a synthetic run with known numbers and from
a copy of a finished tiny run that the session built itself (never the checkout's runs/)."""

from __future__ import annotations

import base64
import io
import json
import re
import shutil
import sqlite3
from datetime import UTC, datetime, timedelta
from html.parser import HTMLParser
from pathlib import Path
from urllib.parse import urlparse
from urllib.request import url2pathname

import numpy as np
import pytest
from matplotlib.image import imread

from rubricem_core.config import config_to_yaml, load_config
from rubricem_core.report import PLOTS, ReportError, make_plots, write_report
from rubricem_core.report.data import RunData
from rubricem_core.sql import RunSqlError
from rubricem_core.store import RunStore
from rubricem_core.tracking import METRICS_SCHEMA, Tracker, TrackingError

EVIL = "<script>alert('x')</script>"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


# ---- helpers ------------------------------------------------------------------------------------
class _Tables(HTMLParser):
    """Every <table> of a page as a list of rows of cell texts."""

    def __init__(self) -> None:
        super().__init__()
        self.tables: list[list[list[str]]] = []
        self._row: list[str] | None = None
        self._cell: list[str] | None = None

    def handle_starttag(self, tag: str, attrs: list) -> None:
        if tag == "table":
            self.tables.append([])
        elif tag == "tr":
            self._row = []
        elif tag in ("td", "th"):
            self._cell = []

    def handle_endtag(self, tag: str) -> None:
        if tag in ("td", "th") and self._cell is not None and self._row is not None:
            self._row.append("".join(self._cell))
            self._cell = None
        elif tag == "tr" and self._row is not None:
            self.tables[-1].append(self._row)
            self._row = None

    def handle_data(self, data: str) -> None:
        if self._cell is not None:
            self._cell.append(data)


def tables_of(page: str) -> list[list[list[str]]]:
    parser = _Tables()
    parser.feed(page)
    return parser.tables


def table_with_header(page: str, first_header: str, contains: str) -> list[dict[str, str]]:
    for table in tables_of(page):
        if table and table[0][0] == first_header and contains in table[0]:
            return [dict(zip(table[0], row)) for row in table[1:]]
    raise AssertionError(f"no table with headers starting {first_header!r} and containing {contains!r}")


def kv(page: str) -> dict[str, str]:
    out = {}
    for table in tables_of(page):
        for row in table:
            if len(row) == 2:
                out.setdefault(row[0], row[1])
    return out


def assert_real_png(path: Path) -> np.ndarray:
    raw = path.read_bytes()
    assert raw.startswith(PNG_MAGIC), f"{path} is not a PNG"
    pixels = imread(io.BytesIO(raw), format="png")
    assert pixels.shape[0] >= 300 and pixels.shape[1] >= 400, pixels.shape
    rgb = pixels[..., :3].reshape(-1, 3)
    packed = (rgb * 255).astype(np.uint32) @ np.array([1 << 16, 1 << 8, 1], dtype=np.uint32)
    colors = np.unique(packed)
    non_white = float((rgb.min(axis=1) < 0.9).mean())
    # axes, text and data: many colors and a real share of non-background pixels
    assert len(colors) > 20 and non_white > 0.02, (path, len(colors), non_white)
    return pixels


def metric_rows(flow: str, step: int, values: dict[str, float], when: datetime) -> list[dict]:
    return [
        {"step": step, "name": k, "value": v, "flow": flow, "run_id": "r", "logged_at": when} for k, v in values.items()
    ]


def copy_run(src: Path, dst: Path, *top_level: str) -> Path:
    """Copy a run directory as a user would, leaving out only the named entries of its top level (a name
    deeper down, like the ``report/`` folder of an MLflow run's artifacts, is copied)."""

    def ignore(directory: str, names: list[str]) -> list[str]:
        return [n for n in names if n in top_level] if Path(directory) == src else []

    shutil.copytree(src, dst, ignore=ignore)
    return dst


def parent_artifact(run_dir: Path, relative: str) -> Path:
    """The local file behind the artifact ``relative`` of ``run_dir``'s parent MLflow run, as the store
    resolves it (the run's recorded artifact location), read without reopening the run."""
    state = json.loads((run_dir / "state" / "mlflow_parent.json").read_text())
    info = Tracker(run_dir).client.get_run(state["run_id"]).info
    assert info.artifact_uri.startswith("file://"), info.artifact_uri
    return Path(url2pathname(urlparse(info.artifact_uri).path)) / relative


def artifact_locations(run_dir: Path) -> list[str]:
    """Every run's artifact location in the SQLite store, read directly (no MLflow, no relocation)."""
    conn = sqlite3.connect(run_dir / "mlflow" / "mlflow.db")
    try:
        return sorted(uri for (uri,) in conn.execute("SELECT artifact_uri FROM runs"))
    finally:
        conn.close()


def write_config(run_dir: Path, **overrides: object) -> None:
    cfg = load_config("tiny", {"rl.recipe": "ss_grpo", "teacher.model": f"teacher{EVIL}", **overrides})
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(config_to_yaml(cfg), encoding="utf-8")


ANSWER_R = {0: [0.25, 0.75, 0.5, 0.5], 1: [0.5, 1.0, 0.5, 0.5], 2: [1.0, 1.0, 0.75, 0.75]}  # means .5, .625, .875


def build_synthetic_run(run_dir: Path, answer_r: dict[int, list[float]] = ANSWER_R, metrics: bool = True) -> None:
    """A run dir with every table the report reads, filled with numbers whose summaries are known."""
    store = RunStore(run_dir)
    write_config(run_dir)
    store.write_table(
        "sft_trajectories",
        [
            {
                "trajectory_id": f"t{i}",
                "query_id": f"q{i}",
                "accepted": ok,
                "reject_reasons": codes,
                "n_tool_calls": 2,
                "text": "x",
            }
            for i, (ok, codes) in enumerate(
                [(True, []), (True, []), (True, []), (False, ["uncited_answer"]), (False, [EVIL, "uncited_answer"])]
            )
        ],
    )
    store.write_table(
        "teacher_responses",
        [{"request_id": f"r{i}", "prompt_tokens": 1000, "completion_tokens": 250, "cost_usd": 0.125} for i in range(4)],
    )
    for step, values in answer_r.items():
        rewards, rollouts = [], []
        for i, r in enumerate(values):
            rid = f"s{step}-q{i // 2}-{i % 2}"
            rollouts.append(
                {
                    "step": step,
                    "query_id": f"q{i // 2}",
                    "rollout_id": rid,
                    "phase": "new" if step < 2 else "repeat",
                    "retrieval": "cross" if step < 2 else "within",
                    "valid_scaffold": i != 0,
                    "finish_reason": "answered",
                    "n_tool_calls": 1,
                    "text": (
                        f"<plan>PLAN{step}-{i} {EVIL}</plan><research><search>founding</search>"
                        f"<tool_output>{'TOOL' * 200}</tool_output>looked</research><review>checked</review>"
                        f"<answer>ANSWER{step}-{i}</answer>"
                    ),
                }
            )
            for stage, value in (("plan", None), ("research", 0.2 * step), ("review", 0.4), ("answer", r)):
                rewards.append(
                    {
                        "step": step,
                        "query_id": f"q{i // 2}",
                        "rollout_id": rid,
                        "stage": stage,
                        "R": value,
                        "G": value,
                        "A": 0.0,
                    }
                )
        store.write_table("stage_rewards", rewards, partition={"step": step})
        store.write_table("rollouts", rollouts, partition={"step": step})
        rubrics = [
            {
                "step": step,
                "query_id": q,
                "rubric_id": f"{q}-{s}-{k}",
                "stage": s,
                "status": "active",
                "origin": "adaptive",
                "title": "t",
                "pruned_step": None,
            }
            for q in ("q0", "q1")
            for s in ("research", "answer")
            for k in range(2 + step)
        ]
        rubrics.append(
            {
                "step": step,
                "query_id": "q0",
                "rubric_id": f"p{step}",
                "stage": "answer",
                "status": "pruned",
                "origin": "adaptive",
                "title": "old",
                "pruned_step": step,
            }
        )
        store.write_table("judge_rubrics", rubrics, partition={"step": step})
        store.write_table(
            "reflections",
            [
                {
                    "step": step,
                    "query_id": "q0",
                    "source_rollout_id": f"s{step}-q0-0",
                    "candidate": c,
                    "text": "r",
                    "valid": c != 3,
                    "score": 0.2 * c,
                    "accepted": c == 2,
                }
                for c in range(4)
            ],
            partition={"step": step},
        )
    store.write_table(
        "eval_results",
        [
            {
                "checkpoint": "rl-final",
                "benchmark": bench,
                "query_id": f"e{i}",
                "retrieval": ret,
                "details": "{}",
                "score": 0.0 if s is None else s,
                "grade_failed": s is None,
            }  # a failed grade scores 0 but must not count
            for bench, ret, scores in (
                ("healthbench", "none", [0.5, 1.0, None]),
                ("healthbench", "cross", [0.75, 0.75]),
                (f"bench{EVIL}", "none", [0.25, 0.25]),
                ("qa $n$", "none", [1.0, 0.5]),
            )
            for i, s in enumerate(scores)
        ],
    )
    # a learning curve (rl.eval_every): the SFT policy and RL step 1's checkpoint on one benchmark
    store.write_table(
        "eval_results",
        [
            {
                "checkpoint": tag,
                "step": step,
                "benchmark": "curve",
                "query_id": f"c{i}",
                "retrieval": "none",
                "details": "{}",
                "score": s,
                "grade_failed": False,
            }
            for tag, step, scores in (("sft", None, [0.2, 0.4]), ("rl-step-000001", 1, [0.6, 0.8]))
            for i, s in enumerate(scores)
        ],
        part="curve",
    )
    if metrics:
        t0 = datetime(2025, 1, 1, tzinfo=UTC)
        rows = []
        for step in answer_r:
            rows += metric_rows(
                "rl",
                step,
                {
                    "rl/loss": 0.1 * (step + 1),
                    "rl/kl": 2e-4 * (step + 1),
                    "rl/clip_fraction": 0.05,
                    "judge/generate_calls": 2,
                    "judge/score_calls": 4,
                    "judge/cost_usd": 0.5 * (step + 1),
                    "judge/prompt_tokens": 6000,
                    "judge/completion_tokens": 400,
                    "judge/failed_trajectories": float(step == 1),
                    "rl/step_time_s": 3.0,
                },
                t0,
            )
        for step in (5, 10, 15):
            rows += metric_rows(
                "sft",
                step,
                {
                    "sft/loss": 3.0 / step,
                    "sft/nll/plan": 2.0 / step,
                    "sft/nll/answer": 4.0 / step,
                    "sft/tokens_per_s": 1000.0 + step,
                    "sft/padding_fraction": 0.3,
                },
                t0,
            )
        # a resumed flow re-logged step 15: the later value is the one to report
        rows += metric_rows("sft", 15, {"sft/loss": 0.1234}, t0 + timedelta(minutes=5))
        store.write_table("metrics", rows, partition={"step": 0}, schema=METRICS_SCHEMA)


@pytest.fixture(scope="module")
def synthetic(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, str]:
    run_dir = tmp_path_factory.mktemp("synthetic") / "run"
    build_synthetic_run(run_dir)
    out = write_report(run_dir, log_to_mlflow=False)
    return run_dir, out, out.read_text(encoding="utf-8")


# ---- the synthetic run: known numbers ---------------------------------------------------------------
def test_report_path_and_plot_files(synthetic: tuple[Path, Path, str]) -> None:
    run_dir, out, page = synthetic
    assert out == run_dir / "report" / "report.html"
    plots_dir = out.parent / "report_plots"
    embedded = re.findall(r'src="data:image/png;base64,([A-Za-z0-9+/=]+)"', page)
    assert len(embedded) == len(PLOTS)  # every table is present, so every plot is drawn
    for spec, data in zip(PLOTS, embedded):
        path = plots_dir / f"{spec.name}.png"
        assert_real_png(path)
        assert base64.b64decode(data) == path.read_bytes()  # the page carries the very same image
    assert "no data" not in page


def test_rl_table_has_known_means(synthetic: tuple[Path, Path, str]) -> None:
    rows = table_with_header(synthetic[2], "step", "R answer")
    assert [r["step"] for r in rows] == ["0", "1", "2"]
    assert [r["R answer"] for r in rows] == ["0.500", "0.625", "0.875"]
    assert [r["R research"] for r in rows] == ["0.000", "0.200", "0.400"]
    assert {r["R plan"] for r in rows} == {"–"}  # no rubrics: shown as missing, never as 0
    assert [r["loss"] for r in rows] == ["0.1", "0.2", "0.3"]
    assert [r["KL"] for r in rows] == ["2.00e-04", "4.00e-04", "6.00e-04"]
    assert [r["judge calls"] for r in rows] == ["6", "6", "6"]
    assert [r["failed judgments"] for r in rows] == ["0", "1", "0"]
    assert [r["judge cost"] for r in rows] == ["$0.5000", "$1.0000", "$1.5000"]
    assert [r["valid scaffold"] for r in rows] == ["75.0%"] * 3
    assert [(r["phase"], r["retrieval"]) for r in rows] == [("new", "cross"), ("new", "cross"), ("repeat", "within")]


def test_the_page_opens_with_plots_and_shows_one_trajectory_per_step(synthetic: tuple[Path, Path, str]) -> None:
    page = synthetic[2]
    headings = re.findall(r"<h2>(.*?)</h2>", page)
    assert headings[0] == "Plots" and headings.index("One trajectory per step") > headings.index("RL per step")
    assert headings[-2:] == ["Run configuration", "Dig further"]
    assert page.index('alt="Learning curve"') < page.index('alt="Stage rewards per step"')
    assert 'alt="RL update: loss, KL, clipping"' in page
    samples = re.findall(r"<details[^>]*><summary>(.*?)</summary>(.*?)</details>", page, re.S)
    assert [summary.split(" · ")[0] for summary, _ in samples] == ["step 0", "step 1", "step 2"]
    summary, body = samples[1]  # the step's first rollout by id, with its own stage rewards
    assert "R research 0.20 · R review 0.40 · R answer 0.50" in summary and "invalid scaffold" in summary
    assert "PLAN1-0" in body and "ANSWER1-0" in body and "PLAN1-1" not in body
    assert re.findall(r"<h4>(\w+)</h4>", body) == ["plan", "research", "review", "answer"]
    assert EVIL not in body and "&lt;script&gt;" in body
    assert "TOOL" * 70 in body and "TOOL" * 76 not in body  # a tool output is cut at 300 characters
    assert page.count("<details open>") == 1 and samples[-1][0] in page.split("<details open>")[1]


def test_sft_eval_reflection_numbers(synthetic: tuple[Path, Path, str]) -> None:
    page = synthetic[2]
    facts = kv(page)
    assert facts["trajectories"] == "5" and facts["accepted"] == "3 (60.0%)" and facts["rejected"] == "2"
    assert facts["teacher cost"] == "$0.5000"
    assert facts["teacher tokens (prompt / completion)"] == "4,000 / 1,000"
    assert facts["final loss"] == "0.1234"  # the value logged last for step 15
    assert facts["optimizer steps"] == "15" and facts["tokens/s"] == "1,015" and facts["padding fraction"] == "0.300"
    assert facts["recipe"] == "ss_grpo" and facts["Λ"] == "causal (recipe preset)"
    codes = {
        r["reject code"]: r["rejected trajectories"] for r in table_with_header(page, "reject code", "reject code")
    }
    assert codes == {"uncited_answer": "2", EVIL: "1"}
    evals = table_with_header(page, "checkpoint", "benchmark")
    assert {(r["benchmark"], r["retrieval"]): (r["queries"], r["failed grades"]) for r in evals}[
        ("healthbench", "none")
    ] == ("3", "1")
    assert {(r["benchmark"], r["retrieval"]): r["mean score"] for r in evals} == {
        ("healthbench", "cross"): "0.750",
        ("healthbench", "none"): "0.750",
        (f"bench{EVIL}", "none"): "0.250",
        ("qa $n$", "none"): "0.750",
        ("curve", "none"): "0.300",  # the last row of the key: the table is ordered by checkpoint, sft last
    }  # '$' pairs are literal text in the page and the plot
    refl = table_with_header(page, "step", "accepted")
    assert [(r["candidates"], r["valid"], r["accepted"], r["mean score (valid)"], r["best score"]) for r in refl] == [
        ("4", "3", "1", "0.200", "0.600")
    ] * 3
    lam = table_with_header(page, "Λ (row: stage k, column: reward of stage j)", "answer")
    assert [[r[s] for s in ("plan", "research", "review", "answer")] for r in lam] == [
        ["1", "1", "1", "1"],
        ["0", "1", "1", "1"],
        ["0", "0", "1", "1"],
        ["0", "0", "0", "1"],
    ]


def test_text_from_the_run_is_escaped(synthetic: tuple[Path, Path, str]) -> None:
    page = synthetic[2]
    assert "<script" not in page.lower()
    assert "&lt;script&gt;alert(&#x27;x&#x27;)&lt;/script&gt;" in page
    # the config value and the reject code and the benchmark name all came through, escaped
    assert page.count("&lt;script&gt;") >= 3


@pytest.mark.parametrize("answer_mean", [0.25, 0.9])
def test_reported_reward_follows_the_data(tmp_path: Path, answer_mean: float) -> None:
    run_dir = tmp_path / "run"
    build_synthetic_run(run_dir, {0: [answer_mean - 0.1, answer_mean + 0.1], 1: [answer_mean] * 2}, metrics=False)
    store = RunStore(run_dir)
    for table in ("reflections", "eval_results", "judge_rubrics", "sft_trajectories", "teacher_responses"):
        shutil.rmtree(store.table_dir(table))
    with RunData(run_dir) as data:
        from rubricem_core.report.plots import plot_stage_rewards

        png = plot_stage_rewards(data, tmp_path / "r.png")
    assert png is not None
    pixels = assert_real_png(png)
    # the answer line (its stage color; the legend sits right of the axes) is drawn at height ≈ R
    orange = np.array([0xDD, 0x84, 0x52]) / 255
    plot_area = pixels[:, : int(pixels.shape[1] * 0.7), :3]
    rows = np.where(np.abs(plot_area - orange).max(axis=2) < 0.02)[0]
    height = pixels.shape[0]
    assert len(rows) > 50
    line_row = np.median(rows)
    assert abs((1 - line_row / height) - answer_mean) < 0.15, (line_row, height, answer_mean)
    page = write_report(run_dir, log_to_mlflow=False).read_text()
    rows = table_with_header(page, "step", "R answer")
    assert [r["R answer"] for r in rows] == [f"{answer_mean:.3f}"] * 2


# ---- missing data -------------------------------------------------------------------------------------
def test_missing_tables_are_listed_as_no_data(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    write_config(run_dir)
    RunStore(run_dir).write_table(
        "sft_trajectories",
        [
            {
                "trajectory_id": "t0",
                "query_id": "q0",
                "accepted": True,
                "reject_reasons": [],
                "n_tool_calls": 1,
                "text": "x",
            }
        ],
    )
    out = write_report(run_dir, tmp_path / "elsewhere" / "r.html", log_to_mlflow=False)
    page = out.read_text()
    assert out.parent == tmp_path / "elsewhere"
    assert not list((tmp_path / "elsewhere" / "r_plots").glob("*.png"))  # no fake plots
    assert "data:image/png" not in page
    for spec in PLOTS:
        assert f"{spec.title}: no data" in page
    for section in ("RL per step", "Reflections", "Evaluation"):
        assert re.search(rf"<h2>{section}</h2><p class=nodata>no data", page), section
    assert kv(page)["trajectories"] == "1"
    assert "not requested" in page


def test_empty_table_is_no_data(tmp_path: Path) -> None:
    import pyarrow as pa

    run_dir = tmp_path / "run"
    build_synthetic_run(run_dir, {0: [0.5, 0.5]}, metrics=False)
    store = RunStore(run_dir)
    shutil.rmtree(store.table_dir("reflections"))
    schema = pa.schema(
        [
            ("step", pa.int64()),
            ("query_id", pa.string()),
            ("source_rollout_id", pa.string()),
            ("valid", pa.bool_()),
            ("score", pa.float64()),
            ("accepted", pa.bool_()),
        ]
    )
    store.write_table("reflections", pa.table({n: pa.array([], t) for n, t in zip(schema.names, schema.types)}))
    page = write_report(run_dir, log_to_mlflow=False).read_text()
    assert "Reflection acceptance: no data" in page
    assert "Stage rewards per step: no data" not in page


def test_stale_plot_is_removed(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    build_synthetic_run(run_dir, {0: [0.5, 0.5]}, metrics=False)
    with RunData(run_dir) as data:
        assert make_plots(data, tmp_path / "plots")["eval_scores"] is not None
    stale = tmp_path / "plots" / "eval_scores.png"
    assert stale.exists()
    shutil.rmtree(RunStore(run_dir).table_dir("eval_results"))
    with RunData(run_dir) as data:
        plots = make_plots(data, tmp_path / "plots")
    assert plots["eval_scores"] is None and not stale.exists()  # an old PNG never passes for this run's
    assert plots["stage_rewards"] is not None


def test_bad_run_directories(tmp_path: Path) -> None:
    with pytest.raises(ReportError, match="does not exist"):
        write_report(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ReportError, match="not a run directory"):
        write_report(tmp_path / "empty")
    run_dir = tmp_path / "run"
    build_synthetic_run(run_dir, {0: [0.5, 0.5]}, metrics=False)
    broken = RunStore(run_dir).partition_path("stage_rewards", {"step": 0})
    broken.write_bytes(broken.read_bytes()[:40])
    with pytest.raises(RunSqlError, match="stage_rewards"):
        write_report(run_dir, log_to_mlflow=False)


# ---- MLflow ------------------------------------------------------------------------------------------
def test_report_is_logged_under_the_parent_run(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    build_synthetic_run(run_dir, {0: [0.5, 1.0], 1: [0.25, 0.75]}, metrics=False)
    tracker = Tracker(run_dir)
    with tracker.child_run("rl") as child:
        for step in (0, 1):
            child.log_metrics({"judge/score_calls": 4 + step, "judge/cost_usd": 0.01}, step=step)
    out = write_report(run_dir)
    parent = tracker.parent_run_id()
    logged = {Path(f.path).name for f in tracker.client.list_artifacts(parent, "report")}
    drawn = {p.name for p in (out.parent / "report_plots").glob("*.png")}
    assert {"report.html", "judge_cost.png", "stage_rewards.png"} <= logged
    assert logged == {"report.html"} | drawn
    assert f"parent run {parent}" in out.read_text()
    calls = table_with_header(out.read_text(), "step", "judge calls")
    assert [r["judge calls"] for r in calls] == ["4", "5"]  # metrics written through the tracker itself


def test_report_written_elsewhere_is_logged_as_report_html(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    build_synthetic_run(run_dir, {0: [0.5, 1.0]}, metrics=False)
    Tracker(run_dir).parent_run_id()  # a tracked run
    out = write_report(run_dir, tmp_path / "elsewhere" / "mine.html")
    logged = parent_artifact(run_dir, "report")
    drawn = {p.name for p in (tmp_path / "elsewhere" / "mine_plots").glob("*.png")}
    assert drawn and {p.name for p in logged.iterdir()} == {"report.html"} | drawn  # not "mine.html"
    assert (logged / "report.html").read_bytes() == out.read_bytes()


def test_report_of_a_copied_run_is_logged_into_the_copy(tmp_path: Path) -> None:
    """`cp -r` of a tracked run, then `rubricem report` in the copy: the copy's page lands in the copy's
    MLflow artifacts (the store is relocated when opened), and nothing of the original changes."""
    original = tmp_path / "original"
    build_synthetic_run(original, {0: [0.5, 1.0]}, metrics=False)
    Tracker(original).parent_run_id()
    first = write_report(original).read_bytes()
    locations = artifact_locations(original)
    copy = copy_run(original, tmp_path / "moved" / "copy")
    out = write_report(copy)
    assert out == copy / "report" / "report.html"
    logged = parent_artifact(copy, "report/report.html")
    assert logged.is_relative_to(copy / "mlflow" / "artifacts")
    assert logged.read_bytes() == out.read_bytes() and str(copy) in out.read_text()
    assert parent_artifact(original, "report/report.html").read_bytes() == first  # the original's page, untouched
    assert artifact_locations(original) == locations
    assert all(uri.startswith((copy / "mlflow" / "artifacts").as_uri() + "/") for uri in artifact_locations(copy))


def test_mlflow_required_but_untracked(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    build_synthetic_run(run_dir, {0: [0.5, 0.5]}, metrics=False)
    with pytest.raises(TrackingError, match="no MLflow store"):
        write_report(run_dir, log_to_mlflow=True)
    write_config(run_dir, **{"tracking.enabled": False})
    page = write_report(run_dir).read_text()
    assert "not logged: tracking is disabled" in page


# ---- a finished tiny run, copied ----------------------------------------------------------------------
@pytest.mark.slow
def test_report_of_the_tiny_run(tiny_pipeline_run: Path, tmp_path: Path) -> None:
    """`rubricem run` (shrunk; built by the session, never the checkout's runs/tiny), then the run copied
    elsewhere and `rubricem report` there: numbers from the copy's tables, the page in the copy and in the
    copy's own MLflow artifacts, the original untouched."""
    original = tiny_pipeline_run
    assert (original / "report" / "report.html").is_file()  # the pipeline ends with the report
    original_artifacts = {
        p.relative_to(original): p.read_bytes() for p in (original / "mlflow" / "artifacts").rglob("*") if p.is_file()
    }
    original_locations = artifact_locations(original)
    # the copy keeps everything but the top-level checkpoints, policy and report: its MLflow artifacts
    # (with their own report/ folder) come along, as with `cp -r`
    run_dir = copy_run(original, tmp_path / "elsewhere" / "tiny", "checkpoints", "policy", "report")
    assert not (run_dir / "report").exists() and any((run_dir / "mlflow" / "artifacts").rglob("report/report.html"))
    from flows.cli import main

    assert main(["report", "--run-dir", str(run_dir)]) == 0
    out = run_dir / "report" / "report.html"
    page = out.read_text()
    store = RunStore(run_dir)
    rewards = [r for r in store.read_rows("stage_rewards") if r["stage"] == "answer" and r["R"] is not None]
    steps = sorted({r["step"] for r in rewards})
    assert steps
    table = table_with_header(page, "step", "R answer")
    for step in steps:
        mean = np.mean([r["R"] for r in rewards if r["step"] == step])
        assert table[steps.index(step)]["R answer"] == f"{mean:.3f}"
    trajectories = store.read_rows("sft_trajectories")
    assert kv(page)["trajectories"] == str(len(trajectories))
    assert kv(page)["rejected"] == str(sum(not t["accepted"] for t in trajectories))
    for name in ("stage_rewards", "buffer_size", "judge_cost", "sft_loss", "eval_curve"):
        assert_real_png(run_dir / "report" / "report_plots" / f"{name}.png")
    # rl.eval_every=1: the pipeline evaluated the SFT policy and each RL step's checkpoint (SQL over the curve)
    with RunData(run_dir) as data:
        curve = data.rows("SELECT DISTINCT checkpoint, step FROM eval_results ORDER BY step NULLS FIRST")
    assert [(r["checkpoint"], r["step"]) for r in curve] == [
        ("sft", None),
        ("rl-step-000000", 0),
        ("rl-step-000001", 1),
    ]

    # the copy's MLflow store follows the copy (rubricem_core.tracking relocates it): the parent run's
    # report/report.html resolves under the copy and is this page, not the original's
    assert "outside this run directory" not in page and "parent run " in page
    logged = parent_artifact(run_dir, "report/report.html")
    assert logged.is_relative_to(run_dir / "mlflow" / "artifacts")
    assert logged.read_bytes() == out.read_bytes()
    assert str(run_dir) in page and str(original) not in page
    own = (run_dir / "mlflow" / "artifacts").as_uri() + "/"
    assert all(uri.startswith(own) for uri in artifact_locations(run_dir))

    # --out elsewhere: the page in MLflow is still report/report.html (now that one)
    elsewhere = tmp_path / "tiny.html"
    assert main(["report", "--run-dir", str(run_dir), "--out", str(elsewhere)]) == 0
    assert logged.read_bytes() == elsewhere.read_bytes()
    assert not any((run_dir / "mlflow").rglob("tiny.html"))
    assert_real_png(tmp_path / "tiny_plots" / "stage_rewards.png")

    # nothing of the original changed: its artifacts, byte for byte, and where its store points
    after = {
        p.relative_to(original): p.read_bytes() for p in (original / "mlflow" / "artifacts").rglob("*") if p.is_file()
    }
    assert after == original_artifacts
    assert artifact_locations(original) == original_locations
