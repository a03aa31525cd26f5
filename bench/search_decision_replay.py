"""Replays an `ss_grpo` run's first updates from its SFT policy and watches the decision to search again.

In session 25's `learn` run `ss_grpo` went from two searches a trajectory to one while the research stage's
advantages favoured two (docs/learning.md). The decision is the token after the first state evaluation,
which follows the first search's output: ``</state_evaluation>\n<`` then ``call`` (search again, the
research stage) or ``review`` (close the research: the first token of the review stage). Its verdict text
(``Verdict: continue``) does not decide it: late in that run the policy wrote "continue" and then reviewed.
This script applies the run's own updates (bench/update_replay.py: its tables, the learner's order) to a
fresh copy of its SFT policy and prints, after each update:

- p(``call`` | ...``</state_evaluation>\n<``) at the first such point of every rollout of the probed steps
  (mean, min);
- in the batch that update trained on: how many rollouts wrote ``call`` / ``review`` there, the mean
  advantage on that token (its stage's), i.e. which way the update was asked to push.

The run is only read. About 1–1.5 minutes an update on 2 CPU cores (SmolLM2-135M).

    .venv/bin/python bench/search_decision_replay.py --run-dir runs/learn/ablation/ss_grpo --steps 12
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.run_all import figure_line  # noqa: E402
from bench.update_replay import UpdateReplay, replay_arguments  # noqa: E402
from rubricem_core.offline import apply_offline_defaults  # noqa: E402

apply_offline_defaults()
MARK = "</state_evaluation>\n<"
AFTER = "</tool_output>"  # the first state evaluation that follows a search's output
CHOICES = ("call", "review")  # search again | close the research


def first_decision(token_ids: list[int], start: int, decode: Any) -> int | None:
    """Index of the token right after the first ``</state_evaluation>\n<`` written after the first tool
    output (from ``start``, the first generated token), or None."""
    text, seen_output = "", False
    for i in range(start, len(token_ids) - 1):
        text += decode([token_ids[i]])
        if not seen_output:
            seen_output = AFTER in text
            if seen_output:
                text = text[text.index(AFTER) :]
            continue
        if text.endswith(MARK):
            return i + 1
    return None


def main() -> None:
    # the run, default steps, probed steps
    parser = replay_arguments(
        __doc__.split("\n\n")[0],
        "an `ss_grpo` run (ablation/ss_grpo of make learn)",
        8,
        "0,4,8",
        "steps whose rollouts give the probed decisions",
    )
    parser.add_argument(
        "--stage-boundary",
        choices=["entering", "leaving", "both"],
        default="both",
        help="rl.stage_boundary to replay with: entering (the decision token scored with the review it opens, "
        "as before session 27), leaving (with the research it closes), or both in turn",
    )
    args = parser.parse_args()
    modes = ["entering", "leaving"] if args.stage_boundary == "both" else [args.stage_boundary]
    finals = {mode: replay_one(args, mode) for mode in modes}
    for mode, (sft, last) in finals.items():
        print(
            f"p(call) at the first decision, stage_boundary {mode}: SFT {sft:.3f}, after {args.steps} steps {last:.3f}"
        )
    mode = modes[-1]
    print(figure_line(f"p_second_search.{mode}", round(finals[mode][1], 3), "probability", "report", None))


def replay_one(args: argparse.Namespace, mode: str) -> tuple[float, float]:
    """The replay with ``rl.stage_boundary`` = ``mode``: (mean p(call) of the SFT policy, after the last update)."""
    print(f"\n== rl.stage_boundary: {mode}")
    replay = UpdateReplay(args.run_dir, args.checkpoint, rl={"stage_boundary": mode})
    decode = replay.tokenizer.decode
    choice_ids = [replay.tokenizer.convert_tokens_to_ids(word) for word in CHOICES]
    probe_steps = {int(s) for s in args.probe_steps.split(",")}
    contexts = []
    for row in replay.store.read_rows("rollouts"):
        if row["step"] in probe_steps:
            at = first_decision(list(row["token_ids"]), row["prompt_len"], decode)
            if at is not None:
                contexts.append(list(row["token_ids"][:at]))
    if not contexts:
        raise SystemExit(f"{args.run_dir}: no rollout of steps {sorted(probe_steps)} writes {MARK!r} after a search")
    print(f"{len(contexts)} decisions in the rollouts of steps {sorted(probe_steps)}; tokens {choice_ids}")

    def p_call() -> list[float]:
        import math

        return [math.exp(row[0]) for row in replay.next_token_logp(contexts, choice_ids[:1])]

    def batch_push(batch: Any) -> str:
        """How many rollouts of the batch wrote call / review at the decision, and their mean advantage there."""
        seen: dict[str, list[float]] = {word: [] for word in CHOICES}
        for traj, adv in zip(batch.trajectories, batch.token_advantages):
            start = traj.loss_mask.index(1) if 1 in traj.loss_mask else len(traj.token_ids)
            at = first_decision(list(traj.token_ids), start, decode)
            word = decode([traj.token_ids[at]]) if at is not None else ""
            if word in seen:
                seen[word].append(adv[at])
        return ", ".join(f"{w} {len(a)} (A {sum(a) / len(a):+.2f})" if a else f"{w} 0" for w, a in seen.items())

    def line(label: str, lr: str, norm: str, push: str, p: list[float]) -> str:
        return f"| {label} | {lr} | {norm} | {push} | {sum(p) / len(p):.3f} | {min(p):.3f} |"

    print("| after | lr | grad norm | decisions in its batch (mean advantage) | p(call) mean | min |")
    print("|---|---|---|---|---|---|")
    sft = p_call()
    print(line("SFT", "", "", "", sft), flush=True)
    last = sft
    for update in replay.updates(args.steps):
        push = batch_push(update.batch) if update.kind == "task" else ""
        last = p_call()
        print(line(update.label, f"{update.lr:.1e}", f"{update.grad_norm:.2f}", push, last), flush=True)
    return sum(sft) / len(sft), sum(last) / len(last)


if __name__ == "__main__":
    main()
