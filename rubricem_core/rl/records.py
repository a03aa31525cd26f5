"""One conversion each way between a sampled trajectory and its `rollouts` row."""

from __future__ import annotations

import json
from typing import Any

from rubricem_core.rl.curriculum import StepPlan
from rubricem_core.scaffold import validate, violation_stages
from rubricem_core.schemas import nan_to_none
from rubricem_core.trajectory import TokenTrajectory


def rollout_row(
    plan: StepPlan,
    query_id: str,
    rollout_id: str,
    traj: TokenTrajectory,
    max_tool_calls: int,
    guidance: str | None,
    trace_format: str = "scaffold",
) -> dict[str, Any]:
    """The `rollouts` row of one trajectory (judge_failed False until the judge says otherwise);
    ``valid_scaffold``: valid in the run's trace format."""
    text = rollout_text(traj)
    violations = sorted({v.code for v in validate(text, max_tool_calls=max_tool_calls, trace_format=trace_format)})
    return {
        "step": plan.step,
        "query_id": query_id,
        "rollout_id": rollout_id,
        "phase": plan.phase,
        "retrieval": plan.retrieval,
        "token_ids": traj.token_ids,
        "loss_mask": traj.loss_mask,
        "stage_ids": traj.stage_ids,
        "logprobs": [nan_to_none(x) for x in traj.logprobs],
        "n_tool_calls": traj.n_tool_calls,
        "finish_reason": traj.finish_reason,
        "valid_scaffold": not violations,
        "judge_failed": False,
        "judge_error": None,
        "violations": violations,
        "n_tokens": len(traj),
        "n_policy_tokens": traj.n_policy_tokens,
        "prompt_len": traj.prompt_len,
        "text": text,
        "segments": json.dumps([s.__dict__ for s in traj.segments], ensure_ascii=False),
        "guidance": guidance,
    }


def broken_stages(text: str, max_tool_calls: int | None) -> set[str]:
    """The stages a scaffold trace breaks (its violations placed by ``scaffold.violation_stages``), checked
    as its `rollouts` row's ``valid_scaffold`` is (``rl.scaffold_violations`` gates their rewards)."""
    return violation_stages(text, validate(text, max_tool_calls=max_tool_calls))


def rollout_text(traj: TokenTrajectory) -> str:
    """The `text` of a trajectory's row (what the judge reads): everything after the prompt."""
    return "".join(s.text for s in traj.segments if s.kind != "prompt")


def rollout_trajectory(row: dict[str, Any]) -> TokenTrajectory:
    """A `rollouts` row as the token trajectory it was sampled as (NULL logprobs: never sampled)."""
    return TokenTrajectory.from_row({k: row[k] for k in ("token_ids", "loss_mask", "stage_ids", "logprobs")})
