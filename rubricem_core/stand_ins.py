"""Offline stand-ins, resolved by name: the method's one door to the ``sim`` package.

Where the gpu and research profiles name a real component, the offline profiles name a stand-in:
- a built-in litellm provider, by the provider part of a model string (``teacher.model:
  rubricem-teacher/scripted``, ``judge.model: rubricem-judge/builtin``, ``reflection.judge.model:
  rubricem-reflection-judge/builtin``, ``eval.grader.model: rubricem-grader/builtin``);
- the tiny policy (``policy.name_or_path: tiny``);
- the grader of the synthetic benchmark (``eval.benchmarks: [synthetic]``).
The method's packages look such a name up here (``stand_in("provider", "rubricem-judge")``) and never
import the ``sim`` package. The table (kind → name → "module:attr") is ``STAND_INS`` in that package's
``__init__``; it is read through importlib on the first lookup, from the string ``SIM_PACKAGE`` below
(the only place the method names that package), and a target's module is imported only when its name is
asked for, so a run against real endpoints and a real model never loads a stand-in.
"""

from __future__ import annotations

import importlib
from functools import cache
from typing import Any

SIM_PACKAGE = "rubricem_core.sim"  # imported lazily, by name (see the docstring); sim imports the method, not back


@cache
def _table() -> dict[str, dict[str, str]]:
    table: dict[str, dict[str, str]] = importlib.import_module(SIM_PACKAGE).STAND_INS
    return table


def stand_in_names(kind: str) -> tuple[str, ...]:
    """The names of one kind of stand-in: ``provider``, ``policy`` or ``benchmark``."""
    return tuple(_table().get(kind, {}))


def is_stand_in(kind: str, name: str) -> bool:
    return name in _table().get(kind, {})


def stand_in(kind: str, name: str) -> Any:
    """The object a stand-in's name resolves to; its module is imported now."""
    target = _table().get(kind, {}).get(name)
    if target is None:
        known = ", ".join(stand_in_names(kind)) or "none"
        raise KeyError(f"no {kind} stand-in named {name!r} (known: {known})")
    module, _, attribute = target.partition(":")
    return getattr(importlib.import_module(module), attribute)
