"""Faults a tiny RL run survives: each scenario breaks a run, the run is resumed, and the result is
compared with an uninterrupted run of the same config (tables row for row, weights, metrics).

Scenarios (README "Fault tolerance"):
- kill: `rubricem rl` SIGKILLed at every write boundary of a step (RUBRICEM_FAULT_POINT), rerun;
- kill between two checkpoints: with rl.checkpoint_every=2 step 0 writes none; killed once step 0 is
  done, then inside the resume's replay of its update, rerun (docs/checkpointing.md);
- disk full: the run directory on a tmpfs just larger than the SFT run, so RL runs out of space
  mid-step; the rerun after the space is grown (skipped with the reason where tmpfs cannot be mounted);
- concurrent writer: a second `rubricem rl` while the first runs (must be refused, the first intact);
- endpoint outage: every judge call fails for a step (connection refused), then the endpoint is back.

    .venv/bin/python bench/fault_matrix.py            # every kill point on its own copy (~10 min)
    .venv/bin/python bench/fault_matrix.py --quick    # one chain of kills on one copy (~4 min)

Figure: faults after which the resumed run equals the uninterrupted one, out of all injected.
"""

from __future__ import annotations

import argparse
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.run_all import figure_line  # noqa: E402
from rubricem_core.layout import RunLayout  # noqa: E402
from rubricem_core.offline import apply_offline_defaults  # noqa: E402
from rubricem_core.schemas import row_keys  # noqa: E402
from rubricem_core.testing import MICRO_PROFILE  # noqa: E402

apply_offline_defaults()

# The suite's micro profile, with SFT long enough for a checkpoint to resume from
SMALL = {
    "sft.max_steps": 4,
    "sft.checkpoint_every": 2,
    "reflection.schedule": "sync",  # a fixed order of write boundaries (deferred gives the same numbers)
}
SETS = ["--profile", MICRO_PROFILE, *(a for k, v in SMALL.items() for a in ("--set", f"{k}={v}"))]
CLI = [sys.executable, "-m", "flows.cli"]
# Write boundaries of the two steps, in the order a sync-schedule run reaches them (tests/test_fault_kill.py).
BOUNDARIES = [
    "rl.rollouts_written",
    "rl.judge_failures_written",
    "rl.judge_rubrics_written",
    "rl.judge_done",
    "checkpoint.weights_written",
    "rl.checkpoint_saved",
    "rl.step_done",
    "rl.bank_table_written",
    "rl.reflections_written",  # step 0's reflections (new-query step)
    "rl.rollouts_written",
    "rl.reflection_update_done",
    "rl.judge_done",
    "checkpoint.weights_written",
    "rl.step_done",
]


def fault_specs(chain: bool) -> list[str]:
    """RUBRICEM_FAULT_POINT values: in a chain every process is fresh after the previous kill (the
    first call is the next boundary); from a fresh copy the n-th call of a point is its n-th boundary."""
    if chain:
        return [f"{p}:1" for p in BOUNDARIES]
    return [f"{p}:{BOUNDARIES[: i + 1].count(p)}" for i, p in enumerate(BOUNDARIES)]


TABLES = row_keys("rollouts", "judge_scores", "judge_rubrics", "stage_rewards", "reflections", "bank")
VOLATILE_COLUMNS = {"latency_s", "submitted_at", "logged_at", "run_id"}
VOLATILE_METRIC = ("seconds", "_per_s", "step_time_s", "padding_fraction")


# ---- comparing two runs ---------------------------------------------------------------------------
def differences(run: Path, ref: Path, checkpoints: tuple[str, ...] = ("step-000000", "step-000001")) -> list[str]:
    """What differs between a resumed run and the uninterrupted one (empty: identical)."""
    from safetensors.torch import load_file

    from rubricem_core.store import RunStore

    out = []
    for table, key in TABLES.items():

        def canon(d: Path, table: str = table, key: tuple = key) -> list[dict]:
            rows = RunStore(d).read_rows(table) if RunStore(d).files(table) else []
            return sorted(
                ({k: v for k, v in r.items() if k not in VOLATILE_COLUMNS} for r in rows),
                key=lambda r: tuple(r[k] for k in key),
            )

        got, want = canon(run), canon(ref)
        if len(got) != len(want):
            out.append(f"{table}: {len(got)} rows, {len(want)} in the uninterrupted run")
        elif got != want:
            out.append(f"{table}: rows differ")
    for name in checkpoints:
        a, b = RunLayout(run).rl_checkpoints_dir / name, RunLayout(ref).rl_checkpoints_dir / name
        if not (a / "model.safetensors").exists():
            out.append(f"checkpoint {name} missing")
            continue
        wa, wb = load_file(str(a / "model.safetensors")), load_file(str(b / "model.safetensors"))
        worst = max(float((wa[k] - wb[k]).abs().max()) for k in wb)
        if worst > 1e-6:
            out.append(f"checkpoint {name}: weights differ by {worst:.2e}")

    def metrics(d: Path) -> dict[tuple[int, str], list[float]]:
        table: dict[tuple[int, str], list[float]] = {}
        for r in RunStore(d).read_rows("metrics"):
            if r["flow"] == "rl":
                table.setdefault((r["step"], r["name"]), []).append(r["value"])
        return table

    got, want = metrics(run), metrics(ref)
    if sorted(got) != sorted(want):
        out.append(f"metrics: missing {sorted(set(want) - set(got))[:3]}, extra {sorted(set(got) - set(want))[:3]}")
    for key, values in want.items():
        if key in got and not key[1].endswith(VOLATILE_METRIC):
            if len(got[key]) != 1 or not math.isclose(got[key][0], values[0], rel_tol=1e-5, abs_tol=1e-7):
                out.append(f"metric {key}: {got[key]} vs {values}")
                break
    return out


# ---- running ---------------------------------------------------------------------------------
def cli(
    command: str,
    run: Path,
    env: dict[str, str],
    fault: str | None = None,
    log: Path | None = None,
    preexec: Callable[[], None] | None = None,
    extra: tuple[str, ...] = (),
) -> int:
    env = {**env, **({"RUBRICEM_FAULT_POINT": fault} if fault else {})}
    with open(log or os.devnull, "ab") as out:
        return subprocess.run(
            [*CLI, command, "--run-dir", str(run), *SETS, *extra],
            cwd=REPO,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            preexec_fn=preexec,
            timeout=600,
        ).returncode


def scenario_kills(
    trained: Path, ref: Path, work: Path, env: dict[str, str], quick: bool
) -> list[tuple[str, bool, str]]:
    results = []
    if quick:  # one chain: each kill resumes the previous one
        run = work / "kill-chain"
        shutil.copytree(trained, run)
        for point in fault_specs(chain=True):
            rc = cli("rl", run, env, fault=point, log=work / "kill-chain.log")
            if rc != -signal.SIGKILL:
                results.append((f"kill at {point}", False, f"not reached (rc {rc})"))
        rc = cli("rl", run, env, log=work / "kill-chain.log")
        diff = differences(run, ref) if rc == 0 else [f"rerun exit {rc}"]
        results.append((f"kill chain of {len(BOUNDARIES)} boundaries", not diff, "; ".join(diff)))
        return results
    for i, point in enumerate(fault_specs(chain=False)):
        run = work / f"kill-{i:02d}"
        shutil.copytree(trained, run)
        rc = cli("rl", run, env, fault=point, log=work / f"kill-{i:02d}.log")
        if rc != -signal.SIGKILL:
            results.append((f"kill at {point}", False, f"not reached (rc {rc})"))
            continue
        rc = cli("rl", run, env, log=work / f"kill-{i:02d}.log")
        diff = differences(run, ref) if rc == 0 else [f"rerun exit {rc}"]
        results.append((f"kill at {point}", not diff, "; ".join(diff)))
        shutil.rmtree(run, ignore_errors=True)
    return results


def scenario_between_checkpoints(
    trained: Path, ref: Path, work: Path, env: dict[str, str]
) -> list[tuple[str, bool, str]]:
    """rl.checkpoint_every=2: step 0 is done with no checkpoint; killed there, then inside the resume's
    replay of step 0's update; the rerun must end as the run that checkpointed every step (whose step-0
    checkpoint this one never writes)."""
    run, log = work / "between-checkpoints", work / "between-checkpoints.log"
    shutil.copytree(trained, run)
    sparse = ("--set", "rl.checkpoint_every=2")
    problems = []
    for point in ("rl.step_done:1", "rl.update_replayed:1"):
        rc = cli("rl", run, env, fault=point, log=log, extra=sparse)
        if rc != -signal.SIGKILL:
            problems.append(f"kill at {point} not reached (rc {rc})")
    rc = cli("rl", run, env, log=log, extra=sparse)
    problems += differences(run, ref, checkpoints=("step-000001",)) if rc == 0 else [f"rerun exit {rc}"]
    if RunLayout(run).rl_step_checkpoint(0).exists():
        problems.append("step 0 wrote a checkpoint")
    return [("kill between two checkpoints (rl.checkpoint_every=2)", not problems, "; ".join(problems))]


def _du(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def scenario_disk_full(trained: Path, ref: Path, work: Path, env: dict[str, str]) -> list[tuple[str, bool, str]]:
    mount = work / "tmpfs"
    mount.mkdir()
    size_kb = _du(trained) // 1024 + 1536  # the SFT run plus 1.5 MB: the first RL checkpoint does not fit
    if (
        subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size_kb}k", "tmpfs", str(mount)], capture_output=True
        ).returncode
        != 0
    ):
        return [("disk full", None, "skipped: cannot mount a tmpfs here (needs root / CAP_SYS_ADMIN)")]
    try:
        run = mount / "run"
        shutil.copytree(trained, run)
        rc = cli("rl", run, env, log=work / "disk-full.log")
        text = (work / "disk-full.log").read_text(errors="replace")
        if rc == 0:
            return [("disk full", False, "the run exited 0 on a full disk")]
        loud = "No space left" in text or "disk is full" in text
        subprocess.run(["mount", "-o", f"remount,size={size_kb + 65536}k", str(mount)], check=True)
        rc = cli("rl", run, env, log=work / "disk-full.log")
        diff = differences(run, ref) if rc == 0 else [f"rerun exit {rc}"]
        if not loud:
            diff.append("the failure did not say the disk was full")
        return [("disk full, then space freed", not diff, "; ".join(diff))]
    finally:
        subprocess.run(["umount", "-l", str(mount)], capture_output=True)


def scenario_concurrent(trained: Path, ref: Path, work: Path, env: dict[str, str]) -> list[tuple[str, bool, str]]:
    from rubricem_core.runlock import lock_holder

    run = work / "concurrent"
    shutil.copytree(trained, run)
    log = open(work / "concurrent.log", "ab")
    first = subprocess.Popen(
        [*CLI, "rl", "--run-dir", str(run), *SETS], cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT
    )
    problems = []
    while not (lock_holder(run) or {}).get("pid") and first.poll() is None:
        time.sleep(0.1)
    second = subprocess.run(
        [*CLI, "rl", "--run-dir", str(run), *SETS], cwd=REPO, env=env, capture_output=True, text=True, timeout=600
    )
    if second.returncode != 2 or f"pid {first.pid}" not in second.stderr:
        problems.append(f"second writer: exit {second.returncode}, {second.stderr.strip()[-200:]!r}")
    if first.wait(timeout=600) != 0:
        problems.append(f"first writer exit {first.returncode}")
    log.close()
    problems += differences(run, ref)
    return [("concurrent writer", not problems, "; ".join(problems))]


def scenario_outage(trained: Path, ref: Path, work: Path) -> list[tuple[str, bool, str]]:
    """In this process: litellm's calls to the judge fail as with a dead endpoint, then succeed."""
    import litellm

    import rubricem_core.llm.concurrent as concurrent
    from flows.rl import rl
    from rubricem_core.sim.judge import MODEL

    run = work / "outage"
    shutil.copytree(trained, run)
    real = concurrent.litellm.acompletion

    async def endpoint_down(**kwargs):
        if kwargs["model"] == MODEL:
            raise litellm.APIConnectionError(message="Connection refused", llm_provider="openai", model=MODEL)
        return await real(**kwargs)

    problems = []
    concurrent.litellm.acompletion = endpoint_down
    try:
        rl(run_dir=str(run), profile=MICRO_PROFILE, overrides=SMALL)
        problems.append("the step with every judgment failed did not fail")
    except Exception as exc:  # noqa: BLE001 — the failure is what is measured
        if "judgments failed" not in str(exc):
            problems.append(f"unexpected failure {type(exc).__name__}: {exc}")
    finally:
        concurrent.litellm.acompletion = real
    if RunLayout(run).rl_checkpoints_dir.exists():
        problems.append("a checkpoint was written for the failed step")
    rl(run_dir=str(run), profile=MICRO_PROFILE, overrides=SMALL)  # a new flow run: a new session
    problems += differences(run, ref)
    return [("judge endpoint down for a step, then back", not problems, "; ".join(problems))]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="one chain of kills instead of one copy per kill point")
    parser.add_argument("--keep", action="store_true", help="keep the work directory (its path is printed)")
    args = parser.parse_args()
    from flows.prefect_server import owned_ephemeral_server

    work = Path(tempfile.mkdtemp(prefix="fault_matrix-"))
    with owned_ephemeral_server():
        from flows.collect_sft_data import collect_sft_data
        from flows.rl import rl
        from flows.sft import sft

        env = {**os.environ, "PYTHONPATH": str(REPO)}
        t0 = time.perf_counter()
        ref = work / "reference"
        collect_sft_data(run_dir=str(ref), profile=MICRO_PROFILE, overrides=SMALL)
        sft(run_dir=str(ref), profile=MICRO_PROFILE, overrides=SMALL)
        trained = work / "trained"
        shutil.copytree(ref, trained)
        rl(run_dir=str(ref), profile=MICRO_PROFILE, overrides=SMALL)
        print(f"uninterrupted reference run: {time.perf_counter() - t0:.0f} s")
        results = scenario_kills(trained, ref, work, env, args.quick)
        results += scenario_between_checkpoints(trained, ref, work, env)
        results += scenario_disk_full(trained, ref, work, env)
        results += scenario_concurrent(trained, ref, work, env)
        results += scenario_outage(trained, ref, work)
    print(f"\n{'scenario':58s} result")
    for name, ok, detail in results:
        flag = "skipped" if ok is None else ("identical" if ok else "DIFFERS")
        print(f"{name:58s} {flag}  {detail}")
    counted = [ok for _, ok, _ in results if ok is not None]
    survived = sum(counted)
    print(f"\n{survived} of {len(counted)} faults survived with the uninterrupted run's tables, weights and metrics")
    if args.keep:
        print(f"work directory: {work}")
    else:
        shutil.rmtree(work, ignore_errors=True)
    print(
        figure_line(
            "faults_survived_identical",
            survived / max(len(counted), 1),
            "of injected faults",
            "1.0 (every fault)",
            survived == len(counted),
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
