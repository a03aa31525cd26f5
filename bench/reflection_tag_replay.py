"""Replays a `full` run's first updates from its SFT checkpoint and watches one reflection format tag.

Session 25's `learn` run stopped writing valid reflections after its step-1 reflection update: the policy
closed its rubric list with ``</reflection`` + ``>`` (the stop string) instead of ``</reflection_rubrics>``.
This script applies the run's own updates (the tables it wrote, in the order ``rl.learner.step_updates``
gives; bench/update_replay.py) to a fresh copy of its SFT policy and, after each, prints the
log-probability of ``_`` after ``</reflection`` at the rubric-closing position of one candidate of every
new-query step it replays or probes: near 0 the tag holds, far below it the list ends at the stop string.

``--format-tags untrained`` gives a valid candidate's format tags no advantage, as the RL loop now stores
them (``reflection.train_format_tags: false``); ``trained`` replays the stored masks of a run made before.
The run is only read. About 1.5 minutes an update on 2 CPU cores (SmolLM2-135M, ~1.1k-token candidates).

    .venv/bin/python bench/reflection_tag_replay.py --run-dir runs/learn/ablation/full --format-tags both
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.run_all import figure_line  # noqa: E402
from bench.update_replay import UpdateReplay, replay_arguments  # noqa: E402
from rubricem_core.offline import apply_offline_defaults  # noqa: E402

apply_offline_defaults()
TAG_PREFIX = "</reflection"  # what `</reflection_rubrics>` and the stop string `</reflection>` share


def probe_contexts(rows: list[dict[str, Any]], decode: Any, steps: list[int]) -> list[tuple[int, list[int]]]:
    """(step, token ids up to the first ``</reflection`` the policy wrote) of candidate 0 of each source
    rollout of ``steps``: the next token decides between the rubric list's end and the stop string."""
    out = []
    for row in sorted(rows, key=lambda r: (r["step"], r["source_rollout_id"])):
        if row["step"] not in steps or row["candidate"] != 0:
            continue
        ids, start = row["token_ids"], row["loss_mask"].index(1)
        for end in range(start + 1, len(ids) + 1):
            if decode(ids[start:end]).endswith(TAG_PREFIX):
                out.append((row["step"], ids[:end]))
                break
    return out


def replay(run_dir: Path, checkpoint: Path, n_steps: int, probe_steps: list[int], untrained_tags: bool) -> list[dict]:
    from rubricem_core.reflection.meta import trained_mask
    from rubricem_core.trajectory import NO_STAGE, TokenTrajectory

    replay = UpdateReplay(run_dir, checkpoint)
    decode = replay.tokenizer.decode
    underscore = replay.tokenizer.convert_tokens_to_ids("_")
    contexts = [ids for _, ids in probe_contexts(replay.store.read_rows("reflections"), decode, probe_steps)]
    if not contexts:
        raise SystemExit(f"{run_dir}: no reflection candidate of steps {probe_steps} writes {TAG_PREFIX!r}")

    def logp_underscore() -> list[float]:
        return [row[0] for row in replay.next_token_logp(contexts, [underscore])]

    def untrained(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
        for row in rows:
            if row["valid"]:
                n = len(row["token_ids"])
                traj = TokenTrajectory(row["token_ids"], row["loss_mask"], [NO_STAGE] * n, [0.0] * n)
                row["loss_mask"] = trained_mask(traj, decode)
        return rows

    results = [{"update": "SFT", "lr": None, "grad_norm": None, "logp": logp_underscore()}]
    print(_line(results[0]), flush=True)
    for update in replay.updates(n_steps, reflection_rows=untrained if untrained_tags else None):
        results.append(
            {"update": update.label, "lr": update.lr, "grad_norm": update.grad_norm, "logp": logp_underscore()}
        )
        print(_line(results[-1]), flush=True)
    return results


def _line(result: dict) -> str:
    lr = "" if result["lr"] is None else f"{result['lr']:.1e}"
    norm = "" if result["grad_norm"] is None else f"{result['grad_norm']:.2f}"
    return f"| {result['update']} | {lr} | {norm} | " + ", ".join(f"{x:.2f}" for x in result["logp"]) + " |"


def main() -> None:
    # the run, default steps, probed steps
    parser = replay_arguments(
        __doc__.split("\n\n")[0],
        "a `full` run (ablation/full of make learn)",
        3,
        "0,1,4",
        "new-query steps whose candidates are probed",
    )
    parser.add_argument("--format-tags", choices=["trained", "untrained", "both"], default="both")
    args = parser.parse_args()
    checkpoint = args.checkpoint or args.run_dir / "checkpoints" / "sft" / "final"
    probe_steps = [int(s) for s in args.probe_steps.split(",")]
    modes = ["trained", "untrained"] if args.format_tags == "both" else [args.format_tags]
    lowest = {}
    for mode in modes:
        print(f"\n== format tags {mode}: log p('_' | ...{TAG_PREFIX}) at the candidates of steps {probe_steps}")
        print("| after | lr | grad norm | log p |\n|---|---|---|---|")
        results = replay(args.run_dir, checkpoint, args.steps, probe_steps, untrained_tags=mode == "untrained")
        lowest[mode] = min(min(r["logp"]) for r in results)
    for mode, value in lowest.items():
        print(f"lowest log p('_'), format tags {mode}: {value:.2f}")
    mode, value = modes[-1], lowest[modes[-1]]
    print(figure_line(f"lowest_logp_rubrics_tag.{mode}", round(value, 3), "nats", "> -1 (the tag holds)", value > -1))


if __name__ == "__main__":
    main()
