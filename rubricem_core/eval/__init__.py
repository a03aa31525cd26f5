"""Evaluation: run a checkpoint on held-out and benchmark queries and grade it independently of
training rewards.

- ``types``: EvalSample, GradeResult, benchmark → grader family
- ``prompts``: grading prompts, schemas, reply validation and per-family aggregation
- ``llm_grader``: BenchmarkGrader, one structured-JSON litellm call per answer (HealthBench per_criterion:
  per criterion; DeepResearchBench race: relative to a reference report)
- ``run``: query selection (first / seeded random), guidance retrieval, sampling, grading,
  ``eval_results`` rows (run_eval; retrieval="sequential": two trials with a reflection between)

``llm_grader`` pulls in litellm (seconds to import), so these names are imported lazily.
"""

from __future__ import annotations

import importlib
from typing import Any

from rubricem_core.eval.types import BENCHMARKS, FAMILIES, EvalError, EvalSample, GradeResult, family_of

_LAZY = {
    "BenchmarkGrader": "rubricem_core.eval.llm_grader",
    "GraderOptions": "rubricem_core.eval.llm_grader",
    "EvalOptions": "rubricem_core.eval.run",
    "SequentialOptions": "rubricem_core.eval.run",
    "select_queries": "rubricem_core.eval.run",
    "EvalOutcome": "rubricem_core.eval.run",
    "EVAL_RESULTS_SCHEMA": "rubricem_core.eval.run",
    "run_eval": "rubricem_core.eval.run",
    "checkpoint_tag": "rubricem_core.eval.run",
    "guidance_for": "rubricem_core.eval.run",
}

__all__ = ["BENCHMARKS", "FAMILIES", "EvalError", "EvalSample", "GradeResult", "family_of", *_LAZY]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'rubricem_core.eval' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
