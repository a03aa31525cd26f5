"""After SFT: how often the policy writes a valid reflection on its own, with no forcing.

The policy samples trajectories for held-out queries with the real tools (what RL's reflect task
reflects on), then one reflection per trajectory from the meta-policy's prompt
(`reflection_messages`, the run's `reflection.*` settings); each is checked by the meta-policy's
validator. Also prints the rate on teacher trajectories (the SFT data's own distribution) and the
reject codes. Goal (issue #19): >= 0.5 on `tiny`, >= 0.8 on `small`.

    .venv/bin/python bench/reflection_validity.py --run-dir runs/tiny     # after `make run`
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import has_sft_checkpoint, held_out_sampling, rollout_requests  # noqa: E402
from bench.run_all import figure_line  # noqa: E402
from rubricem_core.offline import apply_offline_defaults  # noqa: E402

apply_offline_defaults()

from rubricem_core.reflection.meta import sample_reflections  # noqa: E402
from rubricem_core.rollout import HFRolloutEngine, SamplingParams  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run-dir", default="runs/tiny")
    parser.add_argument("--checkpoint", default=None, help="default: <run-dir>/checkpoints/sft/final")
    parser.add_argument("--max-queries", type=int, default=12)
    parser.add_argument("--samples", type=int, default=2, help="trajectories per held-out query")
    parser.add_argument("--quick", action="store_true", help="4 queries × 1 sample")
    args = parser.parse_args()
    goal = ">= 0.5 (tiny), >= 0.8 (small) valid"
    if args.checkpoint is None and not has_sft_checkpoint(
        Path(args.run_dir), figure_line("reflection_valid", float("nan"), "of reflections", goal, None)
    ):
        return 0
    if args.quick:
        args.max_queries, args.samples = 4, 1
    store, cfg, checkpoint, model, tokenizer, queries, env = held_out_sampling(
        args.run_dir, args.checkpoint, args.max_queries
    )
    engine = HFRolloutEngine(model, tokenizer)
    questions = {q["query_id"]: q["question"] for q in store.read_rows("queries")}
    t0 = time.perf_counter()
    sampling = SamplingParams(
        temperature=cfg.rollout.temperature,
        top_p=cfg.rollout.top_p,
        max_new_tokens=cfg.rollout.max_new_tokens,
        max_total_tokens=cfg.rollout.max_total_tokens,
        seed=cfg.seed,
    )
    groups = engine.generate(rollout_requests(tokenizer, queries, cfg, args.samples, sampling), env)
    own = [
        {
            "source": f"{q['query_id']}-{i}",
            "query_id": q["query_id"],
            "text": "".join(s.text for s in traj.segments if s.kind != "prompt"),
        }
        for q, group in zip(queries, groups)
        for i, traj in enumerate(group)
    ]
    teacher = [
        {"source": r["trajectory_id"], "query_id": r["query_id"], "text": r["text"]}
        for r in store.read_rows("sft_trajectories")
        if r["accepted"]
    ][: len(own)]
    reflect = SamplingParams(
        temperature=cfg.reflection.temperature,
        top_p=cfg.rollout.top_p,
        max_new_tokens=cfg.reflection.max_new_tokens,
        max_total_tokens=cfg.rollout.max_total_tokens,
        seed=cfg.seed + 1,
    )
    results = {}
    for name, sources in (("own held-out rollouts", own), ("teacher trajectories", teacher)):
        rows = sample_reflections(
            engine,
            tokenizer,
            sources,
            questions,
            reflect,
            cfg.reflection.max_trajectory_chars,
            env,
            cfg.reflection.max_trajectory_tokens,
        )
        codes = Counter(c for r in rows for c in r["codes"])
        results[name] = sum(r["valid"] for r in rows) / max(len(rows), 1)
        print(
            f"{name}: {sum(r['valid'] for r in rows)} of {len(rows)} valid ({results[name]:.3f}); codes {dict(codes.most_common())}"
        )
    print(f"checkpoint {checkpoint}, profile {cfg.profile}, {time.perf_counter() - t0:.0f} s")
    share = results["own held-out rollouts"]
    target = 0.8 if cfg.profile == "small" else 0.5
    print(figure_line("reflection_valid", share, "of reflections on own held-out rollouts", goal, share >= target))
    return 0


if __name__ == "__main__":
    sys.exit(main())
