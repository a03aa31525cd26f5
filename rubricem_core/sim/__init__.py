"""The synthetic world and every built-in offline stand-in: what the offline profiles (tiny, small) run
instead of the web, a frontier teacher, LLM judges and graders, and a pretrained policy.

- ``world``: the seeded research world (entities, documents, queries with persistent rubrics)
- ``provider``: in-process litellm providers (a Python function answers chat calls), which the built-ins use
- ``teacher``: the scripted teacher (``rubricem-teacher/...``)
- ``judge``: the built-in stagewise judge (``rubricem-judge/builtin``)
- ``reflection_judge``: the built-in reflection judge (``rubricem-reflection-judge/builtin``)
- ``grader``: the built-in benchmark grader (``rubricem-grader/builtin``)
- ``world_grader``: the grader of the synthetic benchmark (``eval.benchmarks: [synthetic]``)
- ``tiny_policy``: the random-init tiny Qwen3 with its own BPE tokenizer (``policy.name_or_path: tiny``)

Imports point one way: sim imports the method's packages, never the reverse. The method reaches a
stand-in by the name a profile gives it, through ``rubricem_core.stand_ins`` (a registry the method
owns): on its first lookup that module imports this package by name (importlib, a string) and reads
``STAND_INS`` below; the module of a target is imported only when its name is asked for. This file
loads no stand-in: importing the package only applies the offline defaults (as ``rubricem_core.llm``
does, for the same reason: ``provider`` imports litellm, which reads them at import). The tasks layer
(``tasks/inputs.py``: ``data.source: synthetic``) and tests, benchmarks and scripts import these modules
directly.
"""

from __future__ import annotations

from rubricem_core.offline import apply_offline_defaults

# litellm reads LITELLM_LOCAL_MODEL_COST_MAP at import (else it fetches its price map from GitHub)
apply_offline_defaults()

# kind → the name a profile uses → "module:attribute" (see rubricem_core.stand_ins)
STAND_INS: dict[str, dict[str, str]] = {
    "provider": {  # the provider part of a litellm model string: register(...) → the model to call
        "rubricem-teacher": "rubricem_core.sim.teacher:register_builtin_teacher",
        "rubricem-judge": "rubricem_core.sim.judge:register_builtin_judge",
        "rubricem-reflection-judge": "rubricem_core.sim.reflection_judge:register_builtin_reflection_judge",
        "rubricem-grader": "rubricem_core.sim.grader:register_builtin_grader",
    },
    "policy": {"tiny": "rubricem_core.sim.tiny_policy:prepare_tiny_policy"},  # policy.name_or_path
    "benchmark": {"synthetic": "rubricem_core.sim.world_grader:grade_synthetic"},  # eval.benchmarks
}
