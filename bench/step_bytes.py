"""Bytes an RL step writes to the run directory, with checkpoints every N steps (rl.checkpoint_every).

A tiny run (collection, SFT, then RL over two windows: 4 steps with rl.checkpoint_every=3, so steps 0
and 1 write no checkpoint, step 2 and the last step do) on a policy of a few million parameters. A
thread watches the progress file and lists the run directory each time a step is marked done; a
step's bytes are the sizes of the files that appeared or changed since the previous listing (a file
rewritten whole counts whole: the `bank` table and the FAISS bank are rewritten every new-query step).
Tracking is off (MLflow's SQLite file is not the pipeline's output). The engine gets each step's
weights by transfer, so a step without a checkpoint writes Parquet and a few small JSON files only.

    .venv/bin/python bench/step_bytes.py                # ~3 min on 2 CPU cores
    .venv/bin/python bench/step_bytes.py --hidden 256   # a smaller policy

Figure: the largest non-checkpoint step's bytes as a fraction of the policy's weights (goal ≤ 1%). It
also prints what a Qwen3-8B step of the paper's shape would write at this run's bytes per rollout
token (an estimate: 32 queries × 8 rollouts × 16k tokens; the weights alone are 16.4 GB in bf16).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.run_all import figure_line  # noqa: E402
from rubricem_core.layout import RunLayout  # noqa: E402
from rubricem_core.offline import apply_offline_defaults  # noqa: E402

apply_offline_defaults()

QWEN3_8B_BF16_BYTES = 8.19e9 * 2
PAPER_STEP_TOKENS = 32 * 8 * 16384  # queries × rollouts × tokens (an upper bound: max_total_tokens)


def shapes(hidden: int) -> dict:
    return {
        "data.world.n_documents": 60,
        "data.world.n_queries": 8,
        "data.world.eval_fraction": 0.25,
        "teacher.trajectories_per_query": 1,
        "policy.vocab_size": 1024,
        "policy.hidden_size": hidden,
        "policy.n_layers": 4,
        "policy.n_heads": 4,
        "policy.n_kv_heads": 2,
        "policy.intermediate_size": 2 * hidden,
        "sft.max_steps": 2,
        "sft.warmup_steps": 1,
        "rl.window": 1,
        "rl.n_windows": 2,
        "rl.queries_per_step": 2,
        "rl.checkpoint_every": 3,
        "rl.keep_checkpoints": 4,
        "rollout.group_size": 2,
        "rollout.max_new_tokens": 48,
        "rollout.max_total_tokens": 1200,
        "tools.max_tool_calls": 2,
        "tracking.enabled": False,
    }


def listing(root: Path) -> dict[str, tuple[int, int]]:
    out = {}
    for p in root.rglob("*"):
        try:
            if p.is_file():
                st = p.stat()
                out[str(p.relative_to(root))] = (st.st_size, st.st_mtime_ns)
        except FileNotFoundError:  # a temp file renamed meanwhile
            continue
    return out


class StepWatcher:
    """Lists the run directory whenever the progress file names a newly finished step."""

    def __init__(self, run: Path) -> None:
        self.run, self.stop = run, threading.Event()
        self.snapshots: list[tuple[int, dict[str, tuple[int, int]]]] = [(-1, listing(run))]
        self.thread = threading.Thread(target=self._watch, daemon=True)

    def _watch(self) -> None:
        progress = RunLayout(self.run).rl_progress_file
        last = -1
        while not self.stop.is_set():
            try:
                step = int(json.loads(progress.read_text())["completed_step"])
            except (FileNotFoundError, ValueError, KeyError):
                step = last
            if step != last:
                self.snapshots.append((step, listing(self.run)))
                last = step
            time.sleep(0.005)

    def per_step(self) -> list[tuple[int, dict[str, int]]]:
        """(step, {kind: bytes}) for each step: kind is checkpoint, parquet or other."""
        out = []
        for (_, before), (step, after) in zip(self.snapshots, self.snapshots[1:]):
            kinds = {"checkpoint": 0, "parquet": 0, "other": 0}
            for path, (size, mtime) in after.items():
                if before.get(path) == (size, mtime):
                    continue
                kind = (
                    "checkpoint"
                    if path.startswith("checkpoints/rl/")
                    else "parquet"
                    if path.endswith(".parquet")
                    else "other"
                )
                kinds[kind] += size
            out.append((step, kinds))
        return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=512, help="policy hidden size (4 layers, MLP 2× it)")
    parser.add_argument("--quick", action="store_true", help="hidden 256 (a ~4 MB policy)")
    parser.add_argument("--keep", action="store_true", help="keep the run directory (its path is printed)")
    args = parser.parse_args()
    if args.quick:
        args.hidden = 256
    from flows.prefect_server import owned_ephemeral_server

    overrides = shapes(args.hidden)
    work = Path(tempfile.mkdtemp(prefix="step_bytes-"))
    run = work / "run"
    with owned_ephemeral_server():
        from flows.collect_sft_data import collect_sft_data
        from flows.rl import rl
        from flows.sft import sft

        collect_sft_data(run_dir=str(run), profile="tiny", overrides=overrides)
        sft(run_dir=str(run), profile="tiny", overrides=overrides)
        watcher = StepWatcher(run)
        watcher.thread.start()
        rl(run_dir=str(run), profile="tiny", overrides=overrides)
        time.sleep(0.1)
        watcher.stop.set()
        watcher.thread.join()
    from rubricem_core.store import RunStore

    model_bytes = (RunLayout(run).sft_final / "model.safetensors").stat().st_size
    rows = RunStore(run).read_rows("rollouts")
    tokens = sum(len(r["token_ids"]) for r in rows)
    rollout_bytes = sum(p.stat().st_size for p in RunLayout(run).table_dir("rollouts").rglob("*.parquet"))
    print(f"policy weights: {model_bytes / 1e6:.1f} MB (hidden {args.hidden}, fp32); rl.checkpoint_every=3, 4 steps")
    print(f"{'step':>4s} {'checkpoint':>12s} {'parquet':>10s} {'other':>9s} {'of weights':>11s}")
    worst = 0.0
    for step, kinds in watcher.per_step():
        total = sum(kinds.values())
        share = total / model_bytes
        if not kinds["checkpoint"]:
            worst = max(worst, share)
        print(f"{step:>4d} {kinds['checkpoint']:>12,d} {kinds['parquet']:>10,d} {kinds['other']:>9,d} {share:>10.2%}")
    per_token = rollout_bytes / max(tokens, 1)
    estimate = per_token * PAPER_STEP_TOKENS
    print(
        f"rollouts: {rollout_bytes:,d} B of Parquet for {tokens:,d} tokens ({per_token:.1f} B/token); at Qwen3-8B's "
        f"step shape ≈ {estimate / 1e6:.0f} MB = {estimate / QWEN3_8B_BF16_BYTES:.2%} of its bf16 weights (estimate)"
    )
    if args.keep:
        print(f"run directory: {run}")
    else:
        shutil.rmtree(work, ignore_errors=True)
    print(
        figure_line(
            "rl_uncheckpointed_step_bytes_fraction",
            worst,
            "of the policy's weight bytes",
            "<= 0.01",
            worst <= 0.01,
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
