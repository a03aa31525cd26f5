"""Prefect orchestration overhead per RL step: the `rl_step` subflow vs the same task bodies called
directly (goal < 10%).

Both paths start from copies of one finished run (its SFT checkpoint, queries and corpus) and run
the same steps with the same config and seeds (the run's own config.yaml, smaller steps with
``--quick``; ``--set rollout.max_new_tokens=1024`` etc. for bigger ones — Prefect's cost per step is
roughly fixed, so the bigger the step, the smaller the share):

- prefect: a parent flow calls `flows.rl.rl_step` once per step (a subflow with the rollout, judge
  and ss-grpo-update task runs, their states and logs sent to the Prefect API);
- direct:  the tasks' own functions (`.fn` of `rollout_task`, `judge_task`, `update_task`, the
  order `rl_step` runs them in) with Prefect's run logger disabled — the same core code, Parquet
  writes and checkpoints, no orchestration.

Overhead = (prefect − direct) / direct over the summed step times. The ephemeral Prefect server's
start-up is timed separately (a one-off per process, not per step), and one untimed warm-up step
runs first. With ``--repeats 2`` the second repeat runs the paths in the opposite order, so warm
caches favour neither. Both paths must
produce the same rollouts (checked). Timings on a shared CPU machine are noisy.

    .venv/bin/python bench/orchestration_overhead.py --run-dir runs/tiny          # after `make run`
    .venv/bin/python bench/orchestration_overhead.py --run-dir runs/tiny --quick
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rubricem_core.offline import apply_offline_defaults  # noqa: E402

apply_offline_defaults()

import psutil  # noqa: E402
import pyarrow.compute as pc  # noqa: E402
import torch  # noqa: E402
from prefect import flow  # noqa: E402
from prefect.logging import disable_run_logger  # noqa: E402

from bench.common import add_set_argument, add_threads_argument  # noqa: E402
from bench.run_all import figure_line  # noqa: E402
from flows.rl import rl_step  # noqa: E402
from rubricem_core.config import RunConfig, load_config, parse_override  # noqa: E402
from rubricem_core.layout import RunLayout  # noqa: E402
from rubricem_core.rl.curriculum import StepPlan, windowed_schedule  # noqa: E402
from rubricem_core.rl.session import open_session  # noqa: E402
from rubricem_core.store import RunStore  # noqa: E402
from tasks.rl import judge_task, rollout_task, update_task  # noqa: E402

GOAL = 0.10
QUICK = {"rollout.group_size": 2, "rollout.max_new_tokens": 128, "rl.queries_per_step": 2}


def copy_run(src: Path, dst: Path) -> str:
    """Copy only what RL reads (config, queries, corpus, SFT policy), so each path starts from the same
    clean state."""
    needed = lambda run: (run.config_file, run.table_dir("queries"), run.table_dir("corpus"), run.sft_final)  # noqa: E731
    for source, target in zip(needed(RunLayout(src)), needed(RunLayout(dst))):
        if source.is_dir():
            shutil.copytree(source, target)
        else:
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, target)
    return str(dst)


@flow(name="bench-empty")
def empty_flow() -> int:
    return 1


@flow(name="bench-rl-steps")
def prefect_steps(run_dir: str, cfg: RunConfig, plans: list[StepPlan]) -> list[float]:
    """Each step through the `rl_step` subflow, as the `rl` flow runs it (with its own session)."""
    seconds = []
    with open_session(RunStore(run_dir), cfg) as session:
        for plan in plans:
            started = time.perf_counter()
            rl_step(run_dir, cfg, plan, session)
            seconds.append(time.perf_counter() - started)
    return seconds


def direct_steps(run_dir: str, cfg: RunConfig, plans: list[StepPlan]) -> list[float]:
    """The bodies of the same tasks in the order `rl_step` calls them, without Prefect."""
    seconds = []
    # disable_run_logger: lets get_run_logger() inside the task bodies run without a flow
    with disable_run_logger(), open_session(RunStore(run_dir), cfg) as session:
        for plan in plans:
            started = time.perf_counter()
            rollout_task.fn(session, plan)
            judge_task.fn(session, plan)
            update_task.fn(session, plan)
            seconds.append(time.perf_counter() - started)
    return seconds


def cpu_seconds() -> float:
    """CPU time of this process and its live children (the ephemeral Prefect server is one)."""
    me = psutil.Process()
    total = sum(me.cpu_times()[:2])
    for child in me.children(recursive=True):
        try:
            total += sum(child.cpu_times()[:2])
        except psutil.NoSuchProcess:
            pass
    return total


def run_path(name: str, run_dir: str, cfg: RunConfig, plans: list[StepPlan]) -> tuple[list[float], float]:
    """(wall seconds per step, CPU seconds of the whole path)."""
    # each path opens its own session: it loads the SFT policy itself, inside its first step
    cpu = cpu_seconds()
    seconds = prefect_steps(run_dir, cfg, plans) if name == "prefect" else direct_steps(run_dir, cfg, plans)
    return seconds, cpu_seconds() - cpu


def same_rollouts(a: str, b: str, steps: list[int]) -> bool:
    for step in steps:
        ta = RunStore(a).read_table("rollouts", {"step": step}).sort_by("rollout_id")
        tb = RunStore(b).read_table("rollouts", {"step": step}).sort_by("rollout_id")
        if not (
            ta["token_ids"].equals(tb["token_ids"]) and pc.all(pc.equal(ta["judge_failed"], tb["judge_failed"])).as_py()
        ):
            return False
    return True


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--run-dir", default="runs/tiny", help="finished run with checkpoints/sft/final; only read")
    parser.add_argument("--steps", type=int, default=2, help="RL steps per path")
    parser.add_argument(
        "--repeats",
        type=int,
        default=None,
        help="repeats on fresh copies; the order alternates (default 2, 1 with --quick)",
    )
    add_set_argument(parser, "config override on top of the run's config.yaml (repeatable)")
    add_threads_argument(parser)
    parser.add_argument("--keep", action="store_true", help="keep the temporary run copies")
    parser.add_argument(
        "--quick", action="store_true", help="2 steps of 2 queries x 2 samples, 128 tokens per turn, 1 repeat"
    )
    args = parser.parse_args()
    if args.repeats is None:
        args.repeats = 1 if args.quick else 2
    if args.steps < 1 or args.repeats < 1:
        parser.error("--steps and --repeats must be >= 1")
    torch.set_num_threads(args.threads)
    src = Path(args.run_dir)
    if not RunLayout(src).has_sft_policy():
        raise SystemExit(f"{src} has no {RunLayout(src).sft_final}: run `make run` (or `rubricem run`) first")

    # all steps fresh batches (window = steps); no MLflow (the `rl` parent flow owns tracking, not rl_step)
    overrides: dict = {"rl.recipe": "ss_grpo", "rl.window": args.steps, "rl.n_windows": 1, "tracking.enabled": False}
    if args.quick:
        overrides.update(QUICK)
    cfg = load_config(RunLayout(src).config_file, {**overrides, **dict(parse_override(s) for s in args.overrides)})
    train = [q["query_id"] for q in RunStore(src).read_rows("queries") if q["split"] == "train"]
    plans = windowed_schedule(
        train, cfg.rl.window, cfg.rl.n_windows, cfg.rl.queries_per_step, cfg.seed, reflection=False
    )[: args.steps]
    print(
        f"{args.steps} steps x {cfg.rl.queries_per_step} queries x {cfg.rollout.group_size} samples, "
        f"{cfg.rollout.max_new_tokens} tokens per turn, recipe {cfg.rl.recipe}, from {src}"
    )

    started = time.perf_counter()
    empty_flow()
    startup_s = time.perf_counter() - started
    started = time.perf_counter()
    empty_flow()
    empty_s = time.perf_counter() - started
    print(f"prefect: first flow (ephemeral server start) {startup_s:.2f}s, then an empty flow run {empty_s:.2f}s")

    work = Path(tempfile.mkdtemp(prefix="rubricem-orch-"))
    totals = {"direct": 0.0, "prefect": 0.0}
    cpu = {"direct": 0.0, "prefect": 0.0}
    identical = True
    try:
        # one untimed step first: lazy imports, the judge provider's registration and first-call
        # initialisation would otherwise land on whichever path runs first
        started = time.perf_counter()
        run_path("direct", copy_run(src, work / "warmup"), cfg, plans[:1])
        print(f"warm-up step (untimed path): {time.perf_counter() - started:.2f}s")
        for rep in range(args.repeats):
            order = ("direct", "prefect") if rep % 2 == 0 else ("prefect", "direct")
            dirs = {name: copy_run(src, work / f"r{rep}-{name}") for name in order}
            for name in order:
                seconds, cpu_s = run_path(name, dirs[name], cfg, plans)
                totals[name] += sum(seconds)
                cpu[name] += cpu_s
                print(
                    f"repeat {rep} {name:<7}: "
                    + " ".join(f"{s:.2f}s" for s in seconds)
                    + f"  (sum {sum(seconds):.2f}s wall, {cpu_s:.2f}s CPU)"
                )
            same = same_rollouts(dirs["direct"], dirs["prefect"], [p.step for p in plans])
            identical &= same
            print(f"repeat {rep}: both paths wrote the same rollouts: {'yes' if same else 'NO'}")
    finally:
        if args.keep:
            print(f"run copies kept in {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)

    n = args.steps * args.repeats
    overhead = (totals["prefect"] - totals["direct"]) / totals["direct"]
    cpu_overhead = (cpu["prefect"] - cpu["direct"]) / cpu["direct"]
    print(
        f"per step: direct {totals['direct'] / n:.2f}s, prefect {totals['prefect'] / n:.2f}s "
        f"({(totals['prefect'] - totals['direct']) / n:+.2f}s wall); CPU incl. the Prefect server "
        f"{cpu['direct'] / n:.2f}s vs {cpu['prefect'] / n:.2f}s ({100 * cpu_overhead:+.1f}%)"
    )
    print(
        f"torch threads {torch.get_num_threads()}, load average {psutil.getloadavg()[0]:.1f} on "
        f"{psutil.cpu_count()} CPUs: wall timings on a shared machine are noisy"
    )
    if not identical:
        print("warning: the paths wrote different rollouts, so they did not do the same work")
    print(
        figure_line(
            "prefect_overhead",
            round(100 * overhead, 2),
            "%",
            f"< {100 * GOAL:.0f}% per RL step (rl_step subflow vs direct task bodies)",
            overhead < GOAL,
        )
    )


if __name__ == "__main__":
    main()
