"""The reflection reward before and after the paper's rule (issue #46), on the candidates a run really sampled.

Reads a run's `reflections` table (every candidate its policy wrote, with the source rollout) and the step's
judge tables, and replays the reward under four rules: validity `strict` or `structural` (the paper's format
check) × invalid candidates scored `zero` without a call (the earlier rule) or `judged` like any other (the
paper, App. D). Every candidate is judged once with the run's reflection judge (`reflection.judge`, the
built-in one offline), so the rules differ only in what they do with the same scores. Prints per rule: the
share of valid candidates, the bank fill (source trajectories whose best valid candidate would be banked),
the mean reward of invalid and of valid candidates, and the share of groups with a non-zero GRPO signal.

    .venv/bin/python bench/reflection_reward.py --run-dir runs/learn/full    # a run of recipe full
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rubricem_core.offline import apply_offline_defaults  # noqa: E402

apply_offline_defaults()

from rubricem_core.judge.types import JudgeQuery  # noqa: E402
from rubricem_core.reflection.format import validate_reflection  # noqa: E402
from rubricem_core.reflection.judge import ReflectionJudge, ReflectionJudgeInput, ReflectionJudgeOptions  # noqa: E402
from rubricem_core.reflection.meta import judge_view  # noqa: E402
from rubricem_core.run_config import base_config  # noqa: E402
from rubricem_core.store import RunStore  # noqa: E402
from tasks.secrets import resolve_api_key  # noqa: E402

RULES = [(v, r) for v in ("strict", "structural") for r in ("zero", "judged")]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run-dir", required=True, help="a run with reflections (recipe full or meta_policy)")
    parser.add_argument("--json", default=None, help="also write the figures here")
    args = parser.parse_args()
    store = RunStore(args.run_dir)
    cfg = base_config(args.run_dir, None, [])
    rows = store.read_rows("reflections")
    if not rows:
        print(f"{args.run_dir}: no reflections table (run recipe full first)")
        return 2
    queries = {q["query_id"]: q for q in store.read_rows("queries")}
    rollouts = {r["rollout_id"]: r for r in store.read_rows("rollouts")}
    rubric_rows, score_rows = store.read_rows("judge_rubrics"), store.read_rows("judge_scores")
    groups: dict[tuple[int, str], list[dict]] = defaultdict(list)
    for row in sorted(rows, key=lambda r: (r["step"], r["source_rollout_id"], r["candidate"])):
        groups[(row["step"], row["source_rollout_id"])].append(row)

    # one judging of every candidate (the structural check: nothing is left out of the call)
    from rubricem_core.llm.endpoints import endpoint_for

    endpoint = cfg.reflection.judge
    options = ReflectionJudgeOptions.from_config(
        endpoint, seed=cfg.seed, max_trajectory_chars=endpoint.max_attempt_chars, validity="structural"
    )
    judge = ReflectionJudge(endpoint_for(endpoint, api_key=resolve_api_key(endpoint)), options)
    inputs, keys = [], []
    for (step, source), group in groups.items():
        qid = group[0]["query_id"]
        step_rubrics = [r for r in rubric_rows if r["step"] == step]
        step_scores = [r for r in score_rows if r["step"] == step]
        rubrics, judgment = judge_view(qid, source, step_rubrics, step_scores)
        query = JudgeQuery(qid, queries[qid]["question"])
        text = rollouts[source]["text"] if source in rollouts else ""
        inputs.append(ReflectionJudgeInput(query, source, text, [g["text"] for g in group], rubrics, judgment))
        keys.append((step, source))
    scored = iter(judge.score(inputs))  # in input order, then candidate order
    by_group = {key: [next(scored).score for _ in item.candidates] for key, item in zip(keys, inputs, strict=True)}

    figures = {}
    print(
        f"{args.run_dir}: {len(rows)} candidates of {len(groups)} source trajectories, min_score {cfg.reflection.min_score}"
    )
    print("validity    invalid    valid share  bank fill  reward invalid  reward valid  groups with signal")
    for validity, rule in RULES:
        valid_share, banked, invalid_rewards, valid_rewards, signal = [], 0, [], [], 0
        for key, group in groups.items():
            rollout = rollouts.get(key[1], {})
            question = queries[group[0]["query_id"]]["question"]
            valid = [
                not validate_reflection(g["text"], rollout.get("text"), question, validity=validity) for g in group
            ]
            scores = by_group[key]
            rewards = [s if ok or rule == "judged" else 0.0 for s, ok in zip(scores, valid, strict=True)]
            valid_share += valid
            banked += any(
                ok and s is not None and s > cfg.reflection.min_score for s, ok in zip(scores, valid, strict=True)
            )
            invalid_rewards += [r for r, ok in zip(rewards, valid, strict=True) if not ok and r is not None]
            valid_rewards += [r for r, ok in zip(rewards, valid, strict=True) if ok and r is not None]
            known = [r for r in rewards if r is not None]
            signal += len(known) > 1 and statistics.pstdev(known) > 1e-9

        def mean(xs: list[float]) -> float:
            return sum(xs) / len(xs) if xs else float("nan")

        row = {
            "valid_share": mean([float(v) for v in valid_share]),
            "bank_fill": banked / len(groups),
            "reward_invalid": mean(invalid_rewards),
            "n_invalid": len(invalid_rewards),
            "reward_valid": mean(valid_rewards),
            "groups_with_signal": signal / len(groups),
        }
        figures[f"{validity}/{rule}"] = row
        print(
            f"{validity:<11} {rule:<10} {row['valid_share']:>11.2f}  {row['bank_fill']:>9.2f}  "
            f"{row['reward_invalid']:>14.3f}  {row['reward_valid']:>12.3f}  {row['groups_with_signal']:>18.2f}"
            f"   ({row['n_invalid']} invalid)"
        )
    if args.json:
        Path(args.json).write_text(json.dumps({"run_dir": args.run_dir, "rules": figures}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
