"""How much of a run's trained text gets an advantage under each ``rl.unscored_stage_return``, from its own tables.

The built-in judge writes a stage's adaptive rubric only where it separates a group, so on `learn` most
groups have no plan rubric and about half no research rubric. Under ``none`` such a stage has no return and
its tokens train with advantage 0, whatever the answer they led to; under ``downstream`` (causal Λ) it
takes the later stages' scores. This script reads a run's `rollouts` and `stage_rewards` (the R the run
trained on, gated as it was), rebuilds each group's advantages with the run's Λ under both rules
(``rl.update.group_advantages``) and counts, per stage, the generated tokens whose advantage is not 0
(``rl.update.training_batch``; each stage's opening tag counted with the stage it opens). Nothing trains;
the run is only read; seconds on a CPU.

    .venv/bin/python bench/unscored_stage_replay.py --run-dir runs/learn/ablation/full
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.judged_groups import judged_groups, run_dir_argument  # noqa: E402
from bench.run_all import figure_line  # noqa: E402
from rubricem_core.offline import apply_offline_defaults  # noqa: E402

apply_offline_defaults()


def advantage_token_counts(run_dir: Path) -> dict[str, dict[str, list[int]]]:
    """Per rule and stage: [generated tokens with a nonzero advantage, generated tokens]."""
    from rubricem_core.rl.session import recipe_settings
    from rubricem_core.rl.update import group_advantages, reward_rows, training_batch
    from rubricem_core.scaffold import STAGES
    from rubricem_core.ssgrpo import UNSCORED_STAGE_RETURNS as RULES

    cfg, groups = judged_groups(run_dir)
    lam = recipe_settings(cfg).lam
    counts = {rule: {s: [0, 0] for s in STAGES} for rule in RULES}
    for group in groups:
        ids = [r["rollout_id"] for r in group.rows]
        for rule in RULES:
            table = reward_rows(group.step, group.query_id, ids, group_advantages(group.R, lam, group.failed, rule))
            for stage_id, (nonzero, trained) in training_batch(group.rows, table).advantaged_tokens_by_stage().items():
                if 0 <= stage_id < len(STAGES):
                    cell = counts[rule][STAGES[stage_id]]
                    cell[0] += nonzero
                    cell[1] += trained
    return counts


def main() -> int:
    counts = advantage_token_counts(run_dir_argument(__doc__.split("\n")[0]))
    print("rule        stage     tokens with A != 0  generated tokens  share")
    share = {}
    for rule, stages in counts.items():
        for stage, (nonzero, total) in stages.items():
            print(f"{rule:<11} {stage:<9} {nonzero:>18} {total:>17}  {nonzero / max(total, 1):.3f}")
        nonzero = sum(c[0] for c in stages.values())
        total = sum(c[1] for c in stages.values())
        share[rule] = nonzero / max(total, 1)
    print(f"generated tokens with an advantage: none {share['none']:.3f}, downstream {share['downstream']:.3f}")
    print(
        figure_line(
            "advantaged_token_share_downstream",
            share["downstream"],
            "fraction",
            f"report (none: {share['none']:.3f})",
            None,
        )
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
