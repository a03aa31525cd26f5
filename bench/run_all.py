"""Run every benchmark script as a subprocess and print one table of their figures.

Each script prints its figure on its last line in one machine-readable format::

    figure: <name>=<value> <unit>  goal: <text>  met: yes|no|n/a

(two spaces separate the three fields; the unit may be empty). The runner parses that line and
prints name, figure, goal, met and seconds. It exits non-zero only when a script crashed or did not
print a parseable last line — an unmet goal is a result, not a failure. Scripts that need a finished
run directory (an SFT checkpoint) are skipped when it is absent.

    .venv/bin/python bench/run_all.py                    # everything, default sizes (tens of minutes)
    .venv/bin/python bench/run_all.py --quick            # small sizes (a few minutes)
    .venv/bin/python bench/run_all.py --only duckdb_latency,throughput --quick

Every figure a run parses is appended to ``bench/results.jsonl`` (``--results``): the figure, its goal and
whether it was met, the script's seconds, whether ``--quick`` sizes were used, and the date, commit and
machine it was measured on. ``python -m bench.results`` writes docs/benchmarks.md from it (the newest line
per figure and size); quote a figure in the docs from there, with its date.
"""

from __future__ import annotations

import argparse
import math
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from rubricem_core.layout import RunLayout

BENCH_DIR = Path(__file__).resolve().parent
REPO_ROOT = BENCH_DIR.parent

FIGURE_LINE = re.compile(
    r"^figure: (?P<name>[A-Za-z0-9_.\-/]+)=(?P<value>\S+)(?: (?P<unit>\S(?:.*?\S)?))?"
    r"  goal: (?P<goal>\S(?:.*?\S)?)  met: (?P<met>yes|no|n/a)\s*$"
)


class FigureParseError(ValueError):
    """A script's last line does not follow the `figure: name=value unit  goal: …  met: …` format."""


@dataclass(frozen=True)
class Figure:
    name: str
    value: float
    unit: str
    goal: str
    met: bool | None  # None: the goal is only to report the number


def format_value(value: float) -> str:
    """Short, parseable number: integers in full, others with 4 significant digits."""
    if math.isfinite(value) and value == int(value) and abs(value) < 1e15:
        return str(int(value))
    if math.isfinite(value) and abs(value) >= 1000:
        return f"{value:.0f}"
    return f"{value:.4g}"


def figure_line(name: str, value: float, unit: str, goal: str, met: bool | None) -> str:
    """The last line every benchmark prints (see the module docstring)."""
    if not re.fullmatch(r"[A-Za-z0-9_.\-/]+", name):
        raise ValueError(f"figure name {name!r} must be one word of letters, digits, _ . - /")
    if "  " in unit or "  " in goal or not goal.strip():
        raise ValueError("unit and goal must not contain two spaces in a row; goal must not be empty")
    flag = "n/a" if met is None else ("yes" if met else "no")
    unit_part = f" {unit.strip()}" if unit.strip() else ""
    return f"figure: {name}={format_value(float(value))}{unit_part}  goal: {goal.strip()}  met: {flag}"


def parse_figure_line(line: str) -> Figure:
    """Parse one last line; raises FigureParseError naming what is wrong."""
    match = FIGURE_LINE.match(line.strip())
    if match is None:
        raise FigureParseError(
            f"not a figure line (expected 'figure: name=value unit  goal: …  met: yes|no|n/a'): {line!r}"
        )
    try:
        value = float(match["value"])
    except ValueError as exc:
        raise FigureParseError(f"figure value {match['value']!r} is not a number in {line!r}") from exc
    met = {"yes": True, "no": False, "n/a": None}[match["met"]]
    return Figure(match["name"], value, match["unit"] or "", match["goal"], met)


def last_figure(stdout: str) -> Figure:
    lines = [ln for ln in stdout.splitlines() if ln.strip()]
    if not lines:
        raise FigureParseError("the script printed nothing on stdout")
    return parse_figure_line(lines[-1])


@dataclass(frozen=True)
class Script:
    name: str
    args: tuple[str, ...] = ()
    quick_args: tuple[str, ...] = ()
    needs_run_dir: bool = False  # takes --run-dir and needs its SFT checkpoint


# Order: cheap and self-contained first. The three older scripts have no --quick flag, so their
# small sizes are spelled out; the others take --quick themselves.
SCRIPTS: tuple[Script, ...] = (
    Script("duckdb_latency", quick_args=("--quick",)),
    Script("judge_calls", quick_args=("--queries", "3", "--rollouts", "4")),
    Script("judge_stream", quick_args=("--quick",)),
    Script("load_judge", quick_args=("--quick",)),
    Script("rollout_engine", quick_args=("--queries", "2", "--n", "2", "--layers", "2")),
    Script("reflection_deferral", quick_args=("--quick",), needs_run_dir=True),
    Script("rl_improvement", quick_args=("--quick",), needs_run_dir=True),
    Script("learning_curve", quick_args=("--quick",), needs_run_dir=True),
    Script("throughput", quick_args=("--quick",), needs_run_dir=True),
    Script("rl_step_time", quick_args=("--quick",), needs_run_dir=True),
    Script("orchestration_overhead", quick_args=("--quick",), needs_run_dir=True),
    Script("sft_scaffold_validity", quick_args=("--max-queries", "4", "--samples", "1"), needs_run_dir=True),
    Script("peak_memory", quick_args=("--quick",)),
    Script("distributed_scaling", quick_args=("--quick",)),
    Script("weight_sync", quick_args=("--quick",)),
    Script("fleet_throughput", quick_args=("--quick",)),  # n/a without a vLLM for its servers (.venv-vllm)
    Script("rollout_schedule", quick_args=("--quick",)),
    Script("step_timeline", quick_args=("--quick",)),
    Script("async_rl", quick_args=("--quick",)),
    Script("fault_matrix", quick_args=("--quick",)),
    Script("step_bytes", quick_args=("--quick",)),
    Script("soak", quick_args=("--quick",)),
    Script("reflection_validity", quick_args=("--quick",), needs_run_dir=True),
    Script("lora", quick_args=("--quick",)),
    Script("packing", quick_args=("--quick",), needs_run_dir=True),
)


@dataclass
class Result:
    name: str
    status: str  # ok | crashed | skipped
    seconds: float = 0.0
    figure: Figure | None = None
    note: str = ""
    tail: list[str] = field(default_factory=list)


def _supports_quick(path: Path) -> bool:
    return '"--quick"' in path.read_text(encoding="utf-8")


def script_command(script: Script, quick: bool, run_dir: str, python: str, bench_dir: Path = BENCH_DIR) -> list[str]:
    path = bench_dir / f"{script.name}.py"
    cmd = [python, str(path), *script.args]
    if script.needs_run_dir:
        cmd += ["--run-dir", run_dir]
    if quick:
        extra = script.quick_args
        if extra == ("--quick",) and not _supports_quick(path):
            extra = ()  # a script written later without the flag runs at its defaults
        cmd += list(extra)
    return cmd


def run_script(
    script: Script, quick: bool, run_dir: str, python: str, timeout_s: float, log_dir: Path, bench_dir: Path = BENCH_DIR
) -> Result:
    """Run one script and parse its last line; never raises for a script's failure."""
    path = bench_dir / f"{script.name}.py"
    if not path.exists():
        return Result(script.name, "skipped", note=f"{path.name} does not exist")
    if script.needs_run_dir and not RunLayout(run_dir).has_sft_policy():
        return Result(script.name, "skipped", note=f"no SFT checkpoint in {run_dir} (run `make run` first)")
    cmd = script_command(script, quick, run_dir, python, bench_dir)
    started = time.perf_counter()
    try:
        proc = subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired as exc:
        out = exc.stdout.decode() if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        return Result(
            script.name,
            "crashed",
            time.perf_counter() - started,
            note=f"timed out after {timeout_s:.0f}s",
            tail=out.splitlines()[-5:],
        )
    seconds = time.perf_counter() - started
    (log_dir / f"{script.name}.stdout.txt").write_text(proc.stdout, encoding="utf-8")
    (log_dir / f"{script.name}.stderr.txt").write_text(proc.stderr, encoding="utf-8")
    if proc.returncode != 0:
        return Result(
            script.name,
            "crashed",
            seconds,
            note=f"exit code {proc.returncode}",
            tail=(proc.stderr or proc.stdout).splitlines()[-8:],
        )
    try:
        figure = last_figure(proc.stdout)
    except FigureParseError as exc:
        return Result(script.name, "crashed", seconds, note=str(exc), tail=proc.stdout.splitlines()[-3:])
    return Result(script.name, "ok", seconds, figure)


def exit_code(results: list[Result]) -> int:
    """1 when a script crashed (or printed no figure); an unmet goal is a result, not a failure."""
    return 1 if any(r.status == "crashed" for r in results) else 0


def render_table(results: list[Result]) -> str:
    header = ("script", "figure", "goal", "met", "seconds")
    rows = []
    for r in results:
        if r.figure is not None:
            f = r.figure
            figure = f"{f.name}={format_value(f.value)}" + (f" {f.unit}" if f.unit else "")
            met = "n/a" if f.met is None else ("yes" if f.met else "no")
            rows.append((r.name, figure, f.goal, met, f"{r.seconds:.1f}"))
        else:
            rows.append((r.name, r.status, r.note, "-", f"{r.seconds:.1f}" if r.seconds else "-"))
    widths = [max(len(str(row[i])) for row in (header, *rows)) for i in range(len(header))]
    lines = ["  ".join(str(c).ljust(w) for c, w in zip(header, widths)).rstrip()]
    lines.append("  ".join("-" * w for w in widths))
    lines += ["  ".join(str(c).ljust(w) for c, w in zip(row, widths)).rstrip() for row in rows]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", default=None, help="comma-separated script names (default: all)")
    parser.add_argument("--quick", action="store_true", help="small sizes (passed to scripts that support them)")
    parser.add_argument(
        "--run-dir",
        default=str(REPO_ROOT / "runs" / "tiny"),
        help="finished run with an SFT checkpoint, read (never modified) by the scripts that need one",
    )
    parser.add_argument("--timeout", type=float, default=3600.0, help="seconds per script")
    parser.add_argument("--log-dir", default=None, help="where each script's stdout/stderr go (default: a temp dir)")
    parser.add_argument("--python", default=sys.executable, help="interpreter for the scripts")
    parser.add_argument(
        "--results", default=str(BENCH_DIR / "results.jsonl"), help="append each figure here ('' : nowhere)"
    )
    parser.add_argument("--note", default="", help="recorded with each figure, e.g. 'beside a training run'")
    args = parser.parse_args(argv)

    known = {s.name: s for s in SCRIPTS}
    if args.only:
        names = [n.strip() for n in args.only.split(",") if n.strip()]
        unknown = [n for n in names if n not in known]
        if unknown:
            parser.error(f"--only: unknown script(s) {unknown}; known: {sorted(known)}")
        selected = [known[n] for n in names]
    else:
        selected = list(SCRIPTS)
    log_dir = Path(args.log_dir) if args.log_dir else Path(tempfile.mkdtemp(prefix="rubricem-bench-"))
    log_dir.mkdir(parents=True, exist_ok=True)

    results = []
    for script in selected:
        print(f"[{script.name}] running ...", flush=True)
        result = run_script(script, args.quick, args.run_dir, args.python, args.timeout, log_dir)
        shown = result.note or (result.figure and f"{result.figure.name}={format_value(result.figure.value)}")
        print(f"[{script.name}] {result.status} in {result.seconds:.1f}s: {shown}", flush=True)
        for line in result.tail:
            print(f"    {line}")
        results.append(result)
        if args.results and result.figure is not None:
            sys.path.insert(0, str(REPO_ROOT))
            from bench.results import append_result

            append_result(Path(args.results), script.name, result.figure, result.seconds, args.quick, args.note)
    print(f"\nlogs: {log_dir}  (noisy numbers: timings on a shared machine vary from run to run)")
    print(render_table(results))
    return exit_code(results)


if __name__ == "__main__":
    sys.exit(main())
