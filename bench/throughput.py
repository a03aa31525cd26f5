"""Rollout and training throughput of the tiny policy, with padding fractions (figures only: report).

Rollout: the run's SFT policy samples groups on training queries with HFRolloutEngine and the real
local tools (as the `rollout` task does); tokens/s counts generated policy tokens, the padding
figure is the share of chunk positions in the engine's forward calls that were not real tokens.
Training: ``rubricem_core.sft.run_sft`` from the run's base policy on its accepted
`sft_trajectories` for a few optimizer steps (length-bucketed batches); tokens/s counts real
(non-pad) tokens through forward and backward. For scale, the padding a random (unbucketed) batch
order would have at the same token budget is printed too.

    .venv/bin/python bench/throughput.py --run-dir runs/tiny        # after `make run`
    .venv/bin/python bench/throughput.py --run-dir runs/tiny --quick

The run directory is only read: the SFT steps write their checkpoint to a temp dir.
"""

from __future__ import annotations

import argparse
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rubricem_core.offline import apply_offline_defaults  # noqa: E402

apply_offline_defaults()

import torch  # noqa: E402

from bench.common import add_threads_argument, rollout_requests  # noqa: E402
from bench.run_all import figure_line  # noqa: E402
from rubricem_core.config import load_config  # noqa: E402
from rubricem_core.environment import local_tool_env  # noqa: E402
from rubricem_core.layout import RunLayout  # noqa: E402
from rubricem_core.policy.loading import load_policy  # noqa: E402
from rubricem_core.rollout import HFRolloutEngine, SamplingParams  # noqa: E402
from rubricem_core.sft import SFTRun, encode_sft_rows, run_sft  # noqa: E402
from rubricem_core.store import RunStore  # noqa: E402


def unbucketed_padding(lengths: list[int], max_tokens_per_batch: int, seed: int) -> float:
    """Padding fraction of batches filled in a random order under the same B × longest budget."""
    order = list(range(len(lengths)))
    random.Random(seed).shuffle(order)
    real = padded = 0
    batch: list[int] = []
    for i in order + [-1]:  # -1 flushes the last batch
        if i >= 0 and (len(batch) + 1) * max([lengths[j] for j in batch] + [lengths[i]]) <= max_tokens_per_batch:
            batch.append(i)
            continue
        if batch:
            real += sum(lengths[j] for j in batch)
            padded += len(batch) * max(lengths[j] for j in batch)
        batch = [i] if i >= 0 else []
    return 1.0 - real / max(1, padded)


def rollout_throughput(run_dir: Path, cfg, n_queries: int, group_size: int, max_new_tokens: int) -> dict[str, float]:
    store = RunStore(run_dir)
    model, tokenizer = load_policy(str(RunLayout(run_dir).sft_final), dtype=cfg.policy.dtype)
    queries = [q for q in store.read_rows("queries") if q["split"] == "train"][:n_queries]
    env = local_tool_env(store.read_table("corpus"), cfg.tools)
    sampling = SamplingParams(
        temperature=cfg.rollout.temperature,
        top_p=cfg.rollout.top_p,
        max_new_tokens=max_new_tokens,
        max_total_tokens=cfg.rollout.max_total_tokens,
        seed=cfg.seed,
    )
    requests = rollout_requests(tokenizer, queries, cfg, group_size, sampling)
    engine = HFRolloutEngine(model, tokenizer, max_batch_rows=cfg.rollout.max_batch_rows)
    started = time.perf_counter()
    groups = engine.generate(requests, env)
    seconds = time.perf_counter() - started
    trajs = [t for g in groups for t in g]
    generated = sum(t.n_policy_tokens for t in trajs)
    stats = engine.stats
    return {
        "trajectories": len(trajs),
        "generated": generated,
        "seconds": seconds,
        "tokens_per_s": generated / max(seconds, 1e-9),
        "tool_calls": sum(t.n_tool_calls for t in trajs),
        "forward_calls": stats.get("forward_calls", 0),
        "padding_fraction": 1.0 - stats["real_slots"] / max(1, stats["chunk_slots"]),
    }


def training_throughput(run_dir: Path, cfg, steps: int) -> dict[str, float]:
    rows = RunStore(run_dir).read_rows("sft_trajectories")
    base = RunLayout(run_dir).policy_base_dir
    _, tokenizer = load_policy(str(base), dtype=cfg.policy.dtype)
    lengths = [len(t) for t in encode_sft_rows(tokenizer, rows, cfg.policy.max_seq_len).trajectories]
    sft = cfg.sft.model_copy(update={"max_steps": steps, "log_every": 1, "checkpoint_every": 10**9, "warmup_steps": 0})
    logged: dict[str, float] = {}
    out_dir = Path(tempfile.mkdtemp(prefix="rubricem-throughput-"))
    try:
        result = run_sft(
            SFTRun(base, rows, out_dir / "sft", cfg.policy, sft, cfg.seed),
            log_metrics=lambda metrics, step: logged.update(metrics),
        )
    finally:
        shutil.rmtree(out_dir, ignore_errors=True)
    return {
        "steps": result["steps"],
        "trajectories": result["trajectories"],
        "tokens_per_s": logged["sft/tokens_per_s"],
        "padding_fraction": logged["sft/padding_fraction"],
        "unbucketed_padding_fraction": unbucketed_padding(lengths, sft.max_tokens_per_batch, cfg.seed),
        "mean_len": sum(lengths) / len(lengths),
        "max_len": max(lengths),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--run-dir",
        default="runs/tiny",
        help="a finished run (queries, corpus, sft_trajectories, policy/base, checkpoints/sft/final); only read",
    )
    parser.add_argument("--queries", type=int, default=4, help="training queries to roll out")
    parser.add_argument("--group-size", type=int, default=None, help="samples per query (default: the run's)")
    parser.add_argument("--max-new-tokens", type=int, default=None, help="per turn (default: the run's)")
    parser.add_argument("--train-steps", type=int, default=4, help="SFT optimizer steps to time")
    add_threads_argument(parser)
    parser.add_argument("--quick", action="store_true", help="2 queries x 2 samples, 128 tokens per turn, 2 steps")
    args = parser.parse_args()
    if args.quick:
        args.queries, args.group_size, args.max_new_tokens, args.train_steps = 2, 2, 128, 2
    torch.set_num_threads(args.threads)
    run_dir = Path(args.run_dir)
    layout = RunLayout(run_dir)
    if not layout.has_sft_policy():
        raise SystemExit(f"{run_dir} has no {layout.sft_final}: run `make run` (or `rubricem run`) first")
    cfg = load_config(layout.config_file)
    group = args.group_size or cfg.rollout.group_size
    max_new = args.max_new_tokens or cfg.rollout.max_new_tokens

    roll = rollout_throughput(run_dir, cfg, args.queries, group, max_new)
    print(
        f"rollout:  {roll['trajectories']} trajectories ({args.queries} queries x {group}), {roll['generated']} "
        f"generated tokens in {roll['seconds']:.1f}s = {roll['tokens_per_s']:.0f} tok/s; {roll['tool_calls']} tool "
        f"calls, {roll['forward_calls']:.0f} forward calls, padding {roll['padding_fraction']:.3f} of chunk positions"
    )
    train = training_throughput(run_dir, cfg, args.train_steps)
    print(
        f"training: {train['steps']} SFT steps over {train['trajectories']} trajectories (mean {train['mean_len']:.0f}, "
        f"max {train['max_len']} tokens), {train['tokens_per_s']:.0f} real tok/s; padding {train['padding_fraction']:.3f} "
        f"length-bucketed vs {train['unbucketed_padding_fraction']:.3f} in random order"
    )
    print(f"torch threads {torch.get_num_threads()}; numbers on a shared CPU machine are noisy")
    goal = (
        f"report (training {train['tokens_per_s']:.0f} tok/s, padding {train['padding_fraction']:.3f}; "
        f"rollout padding {roll['padding_fraction']:.3f})"
    )
    print(figure_line("rollout_tokens_per_s", round(roll["tokens_per_s"]), "tok/s", goal, None))


if __name__ == "__main__":
    main()
