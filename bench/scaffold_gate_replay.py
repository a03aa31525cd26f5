"""Re-derives a run's advantages with and without ``rl.scaffold_violations: zero`` from its own tables.

Session 28's `full` run on `learn` broke its plan scaffold on the guided repeat steps, and the judge, which
scores a stage's content, still paid those plans: a plan that never closed could earn the group's best
plan advantage. This script reads a run's `rollouts` and `stage_rewards` (the judge's R as the run stored
it; a run made with ``zero`` already stored zeroed R), places each rollout's scaffold violations in their
stages (``rl.records.broken_stages``) and builds each group's advantages with the run's Λ
(``rl.update.group_advantages``) under each rule (judged, zero, format: ``rl.update.gate_broken_stages``): how
many broken stages of broken rollouts got a positive advantage, and their summed advantage. Nothing trains; the run is only read; seconds on a CPU.

    .venv/bin/python bench/scaffold_gate_replay.py --run-dir runs/learn/ablation/full
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.judged_groups import judged_groups, run_dir_argument  # noqa: E402
from bench.run_all import figure_line  # noqa: E402
from rubricem_core.offline import apply_offline_defaults  # noqa: E402

apply_offline_defaults()


def gate_counts(run_dir: Path) -> dict[str, Any]:
    """Per phase and rule: broken stage-rows of invalid rollouts, how many of them had A > 0, their A sum."""
    from rubricem_core.environment import trace_format
    from rubricem_core.rl.records import broken_stages
    from rubricem_core.rl.session import recipe_settings
    from rubricem_core.rl.update import gate_broken_stages, group_advantages
    from rubricem_core.scaffold import STAGES

    cfg, groups = judged_groups(run_dir)
    if trace_format(cfg.policy.prompt_style) != "scaffold":
        raise SystemExit(f"{run_dir}: react traces have no stages to place a violation in")
    lam = recipe_settings(cfg).lam
    out: dict[str, Any] = {}
    for group in groups:
        rows, R, failed = group.rows, group.R, group.failed
        broken = [broken_stages(r["text"], cfg.tools.max_tool_calls) for r in rows]
        advantages = {
            "judged": group_advantages(R, lam, failed).A,
            "zero": group_advantages(gate_broken_stages(R, broken, "zero", failed), lam, failed).A,
            "format": group_advantages(gate_broken_stages(R, broken, "format", failed), lam, failed).A,
        }
        for i, row in enumerate(rows):
            for stage in broken[i]:
                k = STAGES.index(stage)
                for rule, A in advantages.items():
                    cell = out.setdefault(row["phase"], {}).setdefault(rule, {"rows": 0, "positive": 0, "sum": 0.0})
                    cell["rows"] += 1
                    cell["positive"] += int(A[i, k] > 1e-9)
                    cell["sum"] += float(np.nan_to_num(A[i, k]))
    return out


def main() -> int:
    counts = gate_counts(run_dir_argument(__doc__.split("\n")[0]))
    print("phase   rule    broken stage-rows  A > 0  sum of A")
    total = {"judged": [0, 0], "zero": [0, 0], "format": [0, 0]}
    for phase, rules in sorted(counts.items()):
        for rule, cell in rules.items():
            print(f"{phase:<7} {rule:<7} {cell['rows']:>17} {cell['positive']:>6} {cell['sum']:>9.2f}")
            total[rule][0] += cell["rows"]
            total[rule][1] += cell["positive"]
    if not total["judged"][0]:
        print("no rollout broke the scaffold")
        return 0
    judged, zero, fmt = (total[rule][1] / total[rule][0] for rule in ("judged", "zero", "format"))
    print(f"broken stages with A > 0: judged {judged:.3f}, zero {zero:.3f}, format {fmt:.3f}")
    print(figure_line("broken_stage_positive_share", zero, "fraction", f"report (judged: {judged:.3f})", None))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
