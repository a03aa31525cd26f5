"""After SFT: sample the policy on held-out queries with the real tools; print the fraction of
trajectories that pass the scaffold validator (goal: >= 0.8). Also prints a copy probe (can the
policy copy from its context at all; see rubricem_core/policy/copy_probe.py and docs/sft_tiny_validity.md).

    .venv/bin/python bench/sft_scaffold_validity.py --run-dir runs/tiny      # after `make run`

The run directory must hold `queries`, `corpus` and checkpoints/sft/final (from `rubricem run` or
`rubricem sft`). Sampling uses the transformers rollout engine at the configured temperature.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rubricem_core.offline import apply_offline_defaults  # noqa: E402

apply_offline_defaults()

from bench.common import held_out_sampling, rollout_requests  # noqa: E402
from rubricem_core.policy.copy_probe import probe_copying  # noqa: E402
from rubricem_core.rollout import HFRolloutEngine, SamplingParams  # noqa: E402
from rubricem_core.scaffold import validate  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run-dir", default="runs/tiny")
    parser.add_argument("--checkpoint", default=None, help="default: <run-dir>/checkpoints/sft/final")
    parser.add_argument("--samples", type=int, default=2, help="samples per held-out query")
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--max-queries", type=int, default=24)
    parser.add_argument(
        "--dump", default=None, help="write each sampled trajectory (text, violations) to this JSONL file"
    )
    args = parser.parse_args()

    _, cfg, checkpoint, model, tokenizer, queries, env = held_out_sampling(
        args.run_dir, args.checkpoint, args.max_queries
    )
    sampling = SamplingParams(
        temperature=args.temperature,
        max_new_tokens=cfg.rollout.max_new_tokens,
        max_total_tokens=cfg.rollout.max_total_tokens,
        seed=cfg.seed,
    )
    requests = rollout_requests(tokenizer, queries, cfg, args.samples, sampling)
    engine = HFRolloutEngine(model, tokenizer)
    t0 = time.perf_counter()
    groups = engine.generate(requests, env)
    seconds = time.perf_counter() - t0

    valid, codes, finish = 0, Counter(), Counter()
    n = generated = 0
    dumped = []
    for query, group in zip(queries, groups):
        for traj in group:
            n += 1
            generated += traj.n_policy_tokens
            text = "".join(seg.text for seg in traj.segments if seg.kind != "prompt")
            violations = validate(text, max_tool_calls=cfg.tools.max_tool_calls)
            valid += not violations
            codes.update({v.code for v in violations})
            finish[traj.finish_reason] += 1
            dumped.append(
                {
                    "query_id": query["query_id"],
                    "finish_reason": traj.finish_reason,
                    "text": text,
                    "violations": [{"code": v.code, "message": v.message} for v in violations],
                }
            )
    if args.dump:
        Path(args.dump).write_text("".join(json.dumps(row) + "\n" for row in dumped))
    print(f"checkpoint: {checkpoint}")
    print(
        f"held-out queries: {len(queries)} x {args.samples} samples = {n} trajectories, "
        f"{generated} generated tokens in {seconds:.1f}s ({generated / max(seconds, 1e-9):.0f} tok/s)"
    )
    print(f"finish reasons: {dict(finish)}")
    print(f"violations (trajectories with each code): {dict(codes.most_common())}")
    # names and ids in a trace are copied from the context; 0 here means no induction mechanism
    probe = probe_copying(model, tokenizer)
    print(
        "copy probe (argmax accuracy on a repeated random span): "
        + ", ".join(f"spans up to {span} tokens {acc:.3f}" for span, acc in probe.items())
    )
    share = valid / max(n, 1)
    print(
        f"figure: scaffold_valid={share:.3f} of trajectories  goal: >= 0.8 pass the scaffold validator  "
        f"met: {'yes' if share >= 0.8 else 'no'}"
    )


if __name__ == "__main__":
    main()
