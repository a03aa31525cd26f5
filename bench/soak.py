"""Soak: does step 40 of `rubricem rl` cost what step 1 did? Many RL steps of the tiny profile (shortened
shapes, the `full` recipe: judge, rubric buffers, reflections and their bank, MLflow, a checkpoint per
step pruned to rl.keep_checkpoints), with what each step costs and what the run has accumulated.

The run is the CLI as users run it: `rubricem collect-sft-data` and `rubricem sft` once (skipped when
``--run-dir`` already has an SFT policy), then `rubricem rl` in a subprocess. A sampler thread here
watches the progress file (state/rl_progress.json) and, each time a step is marked done, records:

- the step's wall time (since the previous step was marked done), CPU seconds of the flow process and
  of its Prefect API server (the CLI's own uvicorn child) and ranks, and the flow process's read()
  calls and bytes (/proc/<pid>/io: a step that reads every earlier step's Parquet shows here whatever
  the machine's load);
- RSS of the flow process, of its Prefect server and of any other descendants (trainer ranks with
  distributed.nproc_per_node > 1); the flow process's open file descriptors (/proc/<pid>/fd);
- Parquet files and bytes under tables/, the MLflow store's bytes (mlflow/), the local Prefect
  server's database (shared by every run of this user), RL checkpoints kept, and the reflection
  bank's size (the rollout task's bank/size metric).

Rows are appended to ``<run-dir>/soak.jsonl``; rerunning with the same ``--run-dir`` after a kill
resumes the RL run (the flow resumes itself) and keeps the rows already recorded.

    .venv/bin/python bench/soak.py                 # 40 steps (~5 min on 2 busy cores, 1 of it SFT)
    .venv/bin/python bench/soak.py --quick         # 10 steps (~2 min)
    .venv/bin/python bench/soak.py --steps 60 --run-dir /tmp/soak --set rollout.max_new_tokens=96

Figures compare the last 5 steps with the first 5 after step 0 (step 0 also loads the models; windows
of 3 with --quick): CPU seconds per step of the flow process and its Prefect server (the figure, goal
≤ 1.1×: on a shared machine the wall time follows the other processes' load, so it is printed but not
judged), flow RSS growth (goal ≤ 10%), open fds (goal: flat, +2 at most), and Parquet files and bytes
added per step. Both windows hold the same mix of new-query and replay steps (an even step count).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.common import add_set_argument  # noqa: E402
from bench.run_all import figure_line  # noqa: E402
from rubricem_core.layout import RunLayout  # noqa: E402
from rubricem_core.offline import apply_offline_defaults  # noqa: E402
from rubricem_core.testing import MICRO_PROFILE  # noqa: E402

apply_offline_defaults()

import psutil  # noqa: E402

# The suite's micro profile (a 2-layer policy, 2 queries × 2 rollouts a step, short turns) with more queries
SHAPES: dict[str, Any] = {
    "data.world.n_queries": 16,
    "sft.max_steps": 4,
    "sft.checkpoint_every": 2,
    "reflection.n_candidates": 2,
    "reflection.max_new_tokens": 48,
}
WINDOW = 5
GOAL_TIME, GOAL_RSS, GOAL_FDS = 1.10, 0.10, 2
CLI = [sys.executable, "-m", "flows.cli"]


def dir_bytes(root: Path, suffix: str = "") -> tuple[int, int]:
    """(files, bytes) under ``root`` whose names end with ``suffix`` (hidden temp files skipped)."""
    files = size = 0
    for dirpath, _, names in os.walk(root):
        for name in names:
            if name.startswith(".") or not name.endswith(suffix):
                continue
            try:
                size += os.stat(os.path.join(dirpath, name)).st_size
                files += 1
            except FileNotFoundError:  # replaced meanwhile
                continue
    return files, size


def read_io(pid: int) -> dict[str, int]:
    """/proc/<pid>/io: bytes and read calls, which do not depend on how busy the machine is."""
    try:
        text = Path(f"/proc/{pid}/io").read_text()
    except (FileNotFoundError, PermissionError, ProcessLookupError):
        return {}
    return {k: int(v) for k, v in (line.split(": ") for line in text.splitlines())}


def process_tree(pid: int) -> dict[str, float]:
    """The flow process's RSS (MiB), CPU seconds, read bytes/calls and open fds; RSS and CPU of its
    Prefect API server (the CLI's uvicorn child) and of its other descendants (trainer ranks)."""
    out: dict[str, float] = {
        "rss_flow_mib": float("nan"),
        "rss_server_mib": 0.0,
        "rss_ranks_mib": 0.0,
        "n_ranks": 0,
        "fds": -1,
        "cpu_flow": float("nan"),
        "cpu_server": 0.0,
        "cpu_ranks": 0.0,
    }
    try:
        proc = psutil.Process(pid)
        out["rss_flow_mib"] = proc.memory_info().rss / 2**20
        out["cpu_flow"] = sum(proc.cpu_times()[:2])
        out["fds"] = len(os.listdir(f"/proc/{pid}/fd"))
        io = read_io(pid)
        out["rchar"], out["syscr"] = io.get("rchar", 0), io.get("syscr", 0)
        children = proc.children(recursive=True)
    except (psutil.NoSuchProcess, FileNotFoundError):
        return out
    for child in children:
        try:
            rss = child.memory_info().rss / 2**20
            cpu = sum(child.cpu_times()[:2])
            cmd = " ".join(child.cmdline())
        except psutil.NoSuchProcess:
            continue
        kind = "server" if "uvicorn" in cmd and "prefect" in cmd else "ranks"
        out[f"rss_{kind}_mib"] += rss
        out[f"cpu_{kind}"] += cpu
        out["n_ranks"] += kind == "ranks"
    return out


def prefect_db_mib() -> float:
    """The local Prefect server's SQLite database (with its WAL): shared by every run of this user."""
    home = Path(os.environ.get("PREFECT_HOME", Path.home() / ".prefect"))
    return sum(p.stat().st_size for p in home.glob("prefect.db*") if p.is_file()) / 2**20


def bank_size(run: Path, step: int) -> float:
    path = RunLayout(run).task_metrics_file("rollout", step)
    try:
        return float(json.loads(path.read_text()).get("bank/size", float("nan")))
    except (FileNotFoundError, ValueError):
        return float("nan")


# counters of the process tree whose per-step increase is recorded (the rest are levels)
DELTAS = ("cpu_flow", "cpu_server", "cpu_ranks", "rchar", "syscr")


def sample(run: Path, pid: int, step: int, seconds: float, before: dict[str, float]) -> dict[str, Any]:
    """One step's row; ``before``: the process tree's counters when the step started (updated here)."""
    tree = process_tree(pid)
    deltas = {k: tree.pop(k, float("nan")) - before.get(k, 0.0) for k in DELTAS}
    before.update({k: before.get(k, 0.0) + v for k, v in deltas.items()})
    parquet_files, parquet_bytes = dir_bytes(RunLayout(run).tables_dir, ".parquet")
    _, mlflow_bytes = dir_bytes(RunLayout(run).mlflow_dir)
    ckpts = RunLayout(run).rl_checkpoints_dir
    return {
        "step": step,
        "seconds": seconds,
        "cpu_s": deltas["cpu_flow"],
        "cpu_server_s": deltas["cpu_server"],
        "cpu_ranks_s": deltas["cpu_ranks"],
        "read_mib": deltas["rchar"] / 2**20,
        "read_calls": deltas["syscr"],
        **tree,
        "parquet_files": parquet_files,
        "parquet_mib": parquet_bytes / 2**20,
        "mlflow_mib": mlflow_bytes / 2**20,
        "prefect_db_mib": prefect_db_mib(),
        "checkpoints": sum(1 for p in ckpts.glob("step-*") if p.is_dir()) if ckpts.is_dir() else 0,
        "bank": bank_size(run, step),
    }


class Sampler:
    """Polls the progress file; records one row each time a new step is marked done."""

    def __init__(self, run: Path, pid: int, rows_file: Path, done: int) -> None:
        self.run, self.pid, self.rows_file, self.last = run, pid, rows_file, done
        self.resumed = done >= 0  # the first step recorded also restarted the process
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._watch, daemon=True)

    def _watch(self) -> None:
        progress = RunLayout(self.run).rl_progress_file
        started = time.perf_counter()
        tree = process_tree(self.pid)
        before = {k: tree.get(k, 0.0) for k in DELTAS}
        while not self.stop.is_set():
            try:
                step = int(json.loads(progress.read_text())["completed_step"])
            except (FileNotFoundError, ValueError, KeyError):
                step = self.last
            if step > self.last:
                now = time.perf_counter()
                row = sample(self.run, self.pid, step, now - started, before)
                row["resumed"] = self.resumed or step != self.last + 1
                self.resumed = False
                started, self.last = now, step
                with open(self.rows_file, "a", encoding="utf-8") as fh:
                    fh.write(json.dumps(row) + "\n")
                print(format_row(row), flush=True)
            time.sleep(0.05)


COLUMNS = (  # (row key, header, format)
    ("step", "step", "{:.0f}"),
    ("seconds", "wall_s", "{:.1f}"),
    ("cpu_s", "cpu_s", "{:.2f}"),
    ("cpu_server_s", "srv_cpu_s", "{:.2f}"),
    ("read_mib", "read_MiB", "{:.2f}"),
    ("read_calls", "reads", "{:.0f}"),
    ("rss_flow_mib", "flow_MiB", "{:.0f}"),
    ("rss_server_mib", "srv_MiB", "{:.0f}"),
    ("rss_ranks_mib", "rank_MiB", "{:.0f}"),
    ("fds", "fds", "{:.0f}"),
    ("parquet_files", "pq_files", "{:.0f}"),
    ("parquet_mib", "pq_MiB", "{:.2f}"),
    ("mlflow_mib", "mlflow_MiB", "{:.2f}"),
    ("prefect_db_mib", "pf_db_MiB", "{:.1f}"),
    ("checkpoints", "ckpts", "{:.0f}"),
    ("bank", "bank", "{:.0f}"),
)
HEADER = "  ".join(f"{h:>9}" for _, h, _ in COLUMNS)


def format_row(row: dict[str, Any]) -> str:
    cells = []
    for key, _, fmt in COLUMNS:
        value = row.get(key, float("nan"))
        cells.append(fmt.format(value) if value == value else "nan")  # noqa: PLR0124 (nan check)
    return "  ".join(f"{c:>9}" for c in cells) + ("  (resumed)" if row.get("resumed") else "")


def read_rows(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    rows = {}
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.strip():
            row = json.loads(line)
            rows[row["step"]] = row
    return [rows[s] for s in sorted(rows)]


def run_cli(command: str, run: Path, sets: list[str], log: Path) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    with open(log, "ab") as out:
        return subprocess.Popen(
            [*CLI, command, "--run-dir", str(run), *sets], cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT
        )


def window_size(n_steps: int) -> int:
    """Steps per compared window: odd, so with an even step count both windows start on a replay step."""
    return WINDOW if n_steps >= 2 * (WINDOW + 1) else 3


def ratio(rows: list[dict[str, Any]], key: str, average: Any = statistics.fmean) -> tuple[float, float, float]:
    """(average of the first window after step 0, of the last window, last / first)."""
    w = window_size(len(rows))
    a = average([r[key] for r in rows[1 : 1 + w]])
    b = average([r[key] for r in rows[-w:]])
    return a, b, b / a if a else float("nan")


def per_step_growth(rows: list[dict[str, Any]], key: str, window: slice) -> float:
    """Mean increase of ``key`` per step over the rows in ``window``."""
    sel = rows[window]
    return (sel[-1][key] - sel[0][key]) / max(1, sel[-1]["step"] - sel[0]["step"])


def with_cpu_total(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each row with ``cpu_total_s``: the flow process's, its Prefect server's and its ranks' CPU seconds."""
    return [{**r, "cpu_total_s": r["cpu_s"] + r.get("cpu_server_s", 0.0) + r.get("cpu_ranks_s", 0.0)} for r in rows]


@dataclass(frozen=True)
class Summary:
    window: int
    wall: tuple[float, float, float]  # first window, last window, ratio (medians)
    cpu: tuple[float, float, float]  # flow + Prefect server + ranks CPU seconds (medians)
    reads: tuple[float, float, float]  # read() calls of the flow process (medians)
    rss: tuple[float, float, float]  # flow RSS MiB (means)
    server_rss: tuple[float, float, float]
    ranks_rss: tuple[float, float, float]  # all trainer ranks together (0: none)
    fds: tuple[float, float, float]
    parquet_files: tuple[float, float]  # added per step, first and last window
    parquet_kib: tuple[float, float]
    mlflow_kib: tuple[float, float]
    max_checkpoints: int

    @property
    def rss_growth(self) -> float:
        return self.rss[1] / self.rss[0] - 1

    @property
    def met(self) -> bool:
        return self.cpu[2] <= GOAL_TIME and self.rss_growth <= GOAL_RSS and self.fds[1] - self.fds[0] <= GOAL_FDS

    def line(self, n_steps: int) -> str:
        return (
            f"soak ({n_steps} steps, last {self.window}/first {self.window}): CPU {self.cpu[2]:.2f}x, "
            f"wall {self.wall[2]:.2f}x, reads {self.reads[2]:.2f}x, RSS {100 * self.rss_growth:+.1f}%, "
            f"fds {self.fds[0]:.0f}->{self.fds[1]:.0f}, Parquet/step {self.parquet_files[0]:.1f}->"
            f"{self.parquet_files[1]:.1f} files {self.parquet_kib[0]:.0f}->{self.parquet_kib[1]:.0f} KiB"
        )


def summarize(rows: list[dict[str, Any]]) -> Summary:
    rows = with_cpu_total(rows)
    w = window_size(len(rows))
    first, last = slice(0, 1 + w), slice(-w - 1, None)
    kib = 1024.0
    return Summary(
        window=w,
        wall=ratio(rows, "seconds", statistics.median),
        cpu=ratio(rows, "cpu_total_s", statistics.median),
        reads=ratio(rows, "read_calls", statistics.median),
        rss=ratio(rows, "rss_flow_mib"),
        server_rss=ratio(rows, "rss_server_mib"),
        ranks_rss=ratio([{**r, "rss_ranks_mib": r.get("rss_ranks_mib", 0.0)} for r in rows], "rss_ranks_mib"),
        fds=ratio(rows, "fds"),
        parquet_files=(per_step_growth(rows, "parquet_files", first), per_step_growth(rows, "parquet_files", last)),
        parquet_kib=(
            kib * per_step_growth(rows, "parquet_mib", first),
            kib * per_step_growth(rows, "parquet_mib", last),
        ),
        mlflow_kib=(kib * per_step_growth(rows, "mlflow_mib", first), kib * per_step_growth(rows, "mlflow_mib", last)),
        max_checkpoints=max(r["checkpoints"] for r in rows),
    )


def print_summary(rows: list[dict[str, Any]], s: Summary) -> None:
    w = s.window
    print(
        f"last {w} / first {w} steps (1-{w} vs {rows[-w]['step']}-{rows[-1]['step']}; medians of time, means of "
        f"the rest): CPU of flow + Prefect server + ranks {s.cpu[0]:.2f}s -> {s.cpu[1]:.2f}s ({s.cpu[2]:.2f}x), wall "
        f"{s.wall[0]:.2f}s -> {s.wall[1]:.2f}s ({s.wall[2]:.2f}x), read calls {s.reads[0]:.0f} -> {s.reads[1]:.0f}, "
        f"flow RSS {s.rss[0]:.0f} -> {s.rss[1]:.0f} MiB ({100 * s.rss_growth:+.1f}%), Prefect server RSS "
        f"{s.server_rss[0]:.0f} -> {s.server_rss[1]:.0f} MiB, "
        + (f"ranks' RSS {s.ranks_rss[0]:.0f} -> {s.ranks_rss[1]:.0f} MiB, " if s.ranks_rss[0] else "")
        + f"fds {s.fds[0]:.1f} -> {s.fds[1]:.1f}"
    )
    print(
        f"added per step (first vs last {w}): Parquet {s.parquet_files[0]:.1f} -> {s.parquet_files[1]:.1f} files, "
        f"{s.parquet_kib[0]:.0f} -> {s.parquet_kib[1]:.0f} KiB; MLflow {s.mlflow_kib[0]:.0f} -> "
        f"{s.mlflow_kib[1]:.0f} KiB; RL checkpoints kept: at most {s.max_checkpoints}"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40, help="RL steps (even; rl.window 1: new-query, replay, ...)")
    parser.add_argument("--quick", action="store_true", help="10 steps")
    parser.add_argument(
        "--run-dir", default=None, help="run directory (default: a new temp dir); an existing one is resumed"
    )
    add_set_argument(parser, "config override on top of the soak's shapes (repeatable)")
    parser.add_argument("--keep", action="store_true", help="keep a temp run directory (its path is printed)")
    args = parser.parse_args()
    if args.quick:
        args.steps = 10
    if args.steps < 8 or args.steps % 2:
        parser.error("--steps must be even and >= 8")
    run = Path(args.run_dir) if args.run_dir else Path(tempfile.mkdtemp(prefix="soak-")) / "run"
    shapes = {**SHAPES, "rl.n_windows": args.steps // 2}
    sets = ["--profile", MICRO_PROFILE, *(a for k, v in shapes.items() for a in ("--set", f"{k}={v}"))]
    sets += [a for s in args.overrides for a in ("--set", s)]
    run.mkdir(parents=True, exist_ok=True)
    log = run.parent / f"{run.name}-soak.log"
    print(f"run dir {run}, log {log}; torch threads: OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')}")
    print("shapes: " + " ".join(f"{k}={v}" for k, v in shapes.items()) + " " + " ".join(args.overrides))

    t0 = time.perf_counter()
    if not RunLayout(run).has_sft_policy():
        for command in ("collect-sft-data", "sft"):
            if run_cli(command, run, sets, log).wait() != 0:
                print(f"`rubricem {command}` failed; see {log}")
                return 1
        print(f"collect-sft-data + sft: {time.perf_counter() - t0:.0f} s")

    rows_file = run / "soak.jsonl"
    progress = RunLayout(run).rl_progress_file
    done = int(json.loads(progress.read_text())["completed_step"]) if progress.exists() else -1
    print(HEADER)
    for row in read_rows(rows_file):
        print(format_row(row) + "  (recorded before)")
    t0 = time.perf_counter()
    proc = run_cli("rl", run, sets, log)
    sampler = Sampler(run, proc.pid, rows_file, done)
    sampler.thread.start()
    rc = proc.wait()
    time.sleep(0.2)
    sampler.stop.set()
    sampler.thread.join()
    print(f"rubricem rl: exit {rc} after {time.perf_counter() - t0:.0f} s")
    if rc != 0:
        print(f"`rubricem rl` failed; see {log}")
        return 1
    rows = read_rows(rows_file)
    if len(rows) < 8:
        print(f"only {len(rows)} steps recorded: too few to compare a first and a last window")
        return 1
    summary = summarize(rows)
    print_summary(rows, summary)
    if args.run_dir is None and not args.keep:
        import shutil

        shutil.rmtree(run.parent, ignore_errors=True)
    w = summary.window
    print(
        figure_line(
            "soak_cpu_time_ratio",
            round(summary.cpu[2], 3),
            "x",
            f"last {w}/first {w} steps: CPU time <= {GOAL_TIME}x, flow RSS growth <= {100 * GOAL_RSS:.0f}%, "
            f"fds flat ({summary.line(len(rows))})",
            summary.met,
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
