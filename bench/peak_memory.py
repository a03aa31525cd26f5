"""Peak memory of the whole `tiny` pipeline (collection → SFT → RL) run as `rubricem run` in a subprocess.

Two figures: the peak of the summed RSS of the command's whole process tree (the CLI and its
children, e.g. the ephemeral Prefect server), sampled with psutil every ``--interval`` seconds, and
the exact peak RSS of the largest single descendant from ``getrusage(RUSAGE_CHILDREN)``. The run
directory is a temporary one (deleted afterwards unless ``--keep``). No goal: the figure is printed
with the profile and overrides used.

    .venv/bin/python bench/peak_memory.py                    # the full tiny profile (~10 min on 2 cores)
    .venv/bin/python bench/peak_memory.py --quick            # a smaller world, model and step counts (~1-2 min)
    .venv/bin/python bench/peak_memory.py --set rl.window=1  # any `rubricem run --set` override
"""

from __future__ import annotations

import argparse
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import psutil  # noqa: E402

from bench.common import add_set_argument  # noqa: E402
from bench.run_all import figure_line  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parents[1]
# the small configuration the RL flow tests use: every stage runs, on a toy scale
QUICK = (
    "data.world.n_documents=120",
    "data.world.n_queries=10",
    "data.world.eval_fraction=0.2",
    "policy.vocab_size=1024",
    "policy.hidden_size=64",
    "policy.n_layers=2",
    "policy.intermediate_size=128",
    "sft.max_steps=4",
    "sft.warmup_steps=1",
    "rl.window=1",
    "rl.queries_per_step=2",
    "rollout.group_size=2",
    "rollout.max_new_tokens=48",
    "rollout.max_total_tokens=1200",
    "tools.max_tool_calls=2",
)


def tree_rss(proc: psutil.Process) -> tuple[int, int]:
    """(summed RSS of the process and all its descendants, number of processes), in bytes."""
    total, count = 0, 0
    try:
        members = [proc, *proc.children(recursive=True)]
    except psutil.NoSuchProcess:
        return 0, 0
    for p in members:
        try:
            total += p.memory_info().rss
            count += 1
        except psutil.NoSuchProcess:
            pass
    return total, count


def rubricem_command() -> list[str]:
    script = Path(sys.executable).with_name("rubricem")
    return [str(script)] if script.exists() else [sys.executable, "-m", "flows.cli"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--profile", default="tiny")
    add_set_argument(parser, "passed to `rubricem run --set` (repeatable)")
    parser.add_argument("--interval", type=float, default=0.2, help="seconds between RSS samples")
    parser.add_argument("--run-dir", default=None, help="default: a temp dir, deleted afterwards")
    parser.add_argument("--keep", action="store_true", help="keep the run directory")
    parser.add_argument("--quick", action="store_true", help="the RL tests' small world, model and steps")
    args = parser.parse_args()
    overrides = [*(QUICK if args.quick else ()), *args.overrides]

    tmp = None
    run_dir = Path(args.run_dir) if args.run_dir else Path(tmp := tempfile.mkdtemp(prefix="rubricem-mem-")) / "run"
    cmd = [*rubricem_command(), "run", "--profile", args.profile, "--run-dir", str(run_dir)]
    for item in overrides:
        cmd += ["--set", item]
    log_path = run_dir.parent / f"{run_dir.name}.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    print("command: " + " ".join(cmd), flush=True)
    peak, peak_count, samples = 0, 0, 0
    started = time.perf_counter()
    try:
        with open(log_path, "w", encoding="utf-8") as log:
            child = subprocess.Popen(cmd, cwd=REPO_ROOT, stdout=log, stderr=subprocess.STDOUT)
            proc = psutil.Process(child.pid)
            while child.poll() is None:
                rss, count = tree_rss(proc)
                samples += 1
                if rss > peak:
                    peak, peak_count = rss, count
                time.sleep(args.interval)
        seconds = time.perf_counter() - started
        if child.returncode != 0:
            tail = log_path.read_text(encoding="utf-8", errors="replace").splitlines()[-20:]
            print("\n".join(tail), file=sys.stderr)
            raise SystemExit(f"`rubricem run` exited with {child.returncode} (log: {log_path})")
        # Linux reports ru_maxrss in KiB: the largest resident set of any waited-for descendant
        largest = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024
        print(f"pipeline finished in {seconds:.0f}s; {samples} RSS samples every {args.interval}s")
        print(
            f"peak RSS of the process tree: {peak / 2**20:.0f} MiB over {peak_count} processes; "
            f"largest single process: {largest / 2**20:.0f} MiB (getrusage)"
        )
        profile = f"profile {args.profile}" + (
            f" with {len(overrides)} overrides (--quick)"
            if args.quick
            else (f" with {' '.join(overrides)}" if overrides else ", no overrides")
        )
        print(figure_line("tiny_pipeline_peak_rss", round(peak / 2**20), "MiB", f"report ({profile})", None))
    finally:
        if tmp is not None and not args.keep:
            shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
