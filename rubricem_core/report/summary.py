"""The end-of-run printout of `rubricem run`: the figures of each stage, what they mean for the
profile that produced them, and what to run next."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

# What a profile's figures can show, and the command worth running next; other profiles get no note.
PROFILE_NOTES: dict[str, tuple[str, str | None]] = {
    "tiny": (
        "tiny is a plumbing check: every stage runs offline in minutes, but its policy is a random-init "
        "model that cannot learn on CPU to copy document ids, so valid_scaffold_rate and the scores stay near 0 "
        "by design. The small profile (the pretrained SmolLM2-135M) is the CPU profile that writes valid "
        "scaffolds after SFT; the learn profile (make learn) measures what RL adds to them.",
        "rubricem run --run-dir runs/small --profile small",
    ),
    "small": (
        "small fine-tunes a real pretrained 135M model on the synthetic world: valid scaffolds after SFT are "
        "expected (docs/sft_tiny_validity.md); its few RL steps show that training runs, not what RL gains. "
        "That needs the learn profile's curve (make learn, docs/learning.md) or the gpu profile on GPU nodes "
        "(deployments/gpu/README.md).",
        None,
    ),
}


def _num(value: Any) -> str:
    if isinstance(value, float):
        return "n/a" if not math.isfinite(value) else f"{value:.4g}"
    return str(value)


def pipeline_summary(result: Mapping[str, Any], profile: str, run_dir: str) -> str:
    """Lines for the terminal from the pipeline flow's result."""
    collected, tuned = result["collect_sft_data"], result["sft"]
    trained, evaluated = result["rl"], result["evaluate"]
    lines = [
        f"pipeline finished ({profile} profile, run directory {run_dir})",
        f"  SFT data:   {collected['accepted']} of {collected['trajectories']} teacher trajectories accepted "
        f"over {collected['rounds']} rounds",
        f"  SFT:        {tuned['final_dir']}"
        + ("" if tuned.get("cached") else f" ({tuned['steps']} steps, final loss {_num(tuned['final_loss'])})"),
        f"  RL:         {trained['steps']} steps of {trained['recipe']}; policy {trained['final_checkpoint']}",
    ]
    for name, value in sorted(trained.get("last_metrics", {}).items()):
        lines.append(f"              {name} {_num(value)}")
    lines.append(f"  evaluation: {evaluated['tag']} (retrieval {evaluated['retrieval']})")
    for name, summary in evaluated["benchmarks"].items():
        shown = {
            k: summary[k]
            for k in ("score_mean", "valid_scaffold_rate", "reflection_valid_rate", "n_samples")
            if k in summary
        }
        lines.append(f"              {name}: " + ", ".join(f"{k} {_num(v)}" for k, v in shown.items()))
    if result.get("report"):
        lines.append(f"  report:     {result['report']}")
    if profile in PROFILE_NOTES:
        meaning, command = PROFILE_NOTES[profile]
        lines += ["", "what these figures mean:", *_wrap(meaning, "  ")]
        if command:
            lines += ["next:", f"  {command}"]
    return "\n".join(lines)


def _wrap(text: str, indent: str, width: int = 100) -> list[str]:
    out, line = [], indent
    for word in text.split():
        if len(line) + len(word) + 1 > width and line.strip():
            out.append(line.rstrip())
            line = indent
        line += word + " "
    if line.strip():
        out.append(line.rstrip())
    return out
