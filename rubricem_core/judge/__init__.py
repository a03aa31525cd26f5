"""The stagewise rubric judge.

- ``types``: Rubric, RubricScore, TrajectoryJudgment, JudgeUsage, JudgeQuery, JudgeRollout
- ``prompts``: the two calls' prompts, JSON schemas and reply validation
- ``llm_judge``: LLMJudge (generation + scoring through litellm, repair, failure handling), judge_group
  (one query's group), judge_step (a step's groups at once)
- ``stream``: StreamingJudge, judge_group on each group as soon as it has finished sampling
- ``buffer``: RubricBuffer, the evolving per-query rubric set
- ``aggregate``: stage_scores, R[i, k] = Σ w·s′ / (2 Σ w)

Names are imported lazily, each from the module named in ``_LAZY``: ``llm_judge`` pulls in
litellm, which takes seconds to import; table and buffer code should not pay for it.
"""

from __future__ import annotations

import importlib
from typing import Any

_TYPES = ("JudgeError", "JudgeQuery", "JudgeRollout", "JudgeUsage", "Rubric", "RubricScore", "TrajectoryJudgment")

_LAZY = {
    **{name: "rubricem_core.judge.types" for name in _TYPES},
    "RubricBuffer": "rubricem_core.judge.buffer",
    "stage_scores": "rubricem_core.judge.aggregate",
    "stage_scores_loop": "rubricem_core.judge.aggregate",
    "stage_reward_rows": "rubricem_core.judge.aggregate",
    "LLMJudge": "rubricem_core.judge.llm_judge",
    "JudgeOptions": "rubricem_core.judge.llm_judge",
    "GenerationInput": "rubricem_core.judge.llm_judge",
    "ScoringInput": "rubricem_core.judge.llm_judge",
    "GroupJudgment": "rubricem_core.judge.llm_judge",
    "judge_group": "rubricem_core.judge.llm_judge",
    "judge_step": "rubricem_core.judge.llm_judge",
    "StreamingJudge": "rubricem_core.judge.stream",
}

__all__ = list(_LAZY)


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'rubricem_core.judge' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
