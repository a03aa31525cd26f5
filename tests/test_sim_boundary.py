"""The offline stand-ins live in rubricem_core/sim/ and the method reaches them only by name.

- no module of the method (rubricem_core outside sim/ and testing/, the fakes tests and benches share) imports
  rubricem_core.sim (statically, or by a module-name string for importlib) except the one lazy door,
  rubricem_core/stand_ins.py;
- every name in the table resolves, and every stand-in a profile names is in the table;
- asking for one stand-in imports its own module and no other.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

from rubricem_core import stand_ins
from rubricem_core.config import load_config
from rubricem_core.llm.endpoints import builtin_provider
from rubricem_core.sim import STAND_INS

REPO = Path(__file__).resolve().parents[1]
CORE = REPO / "rubricem_core"
SIM = "rubricem_core.sim"
DOOR = CORE / "stand_ins.py"


def _method_modules() -> list[Path]:
    outside = (CORE / "sim", CORE / "testing")
    return [p for p in sorted(CORE.rglob("*.py")) if not any(d in p.parents for d in outside)]


def _imported_modules(tree: ast.AST) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def _sim_strings(tree: ast.AST) -> list[str]:
    """String constants that name the sim package or a module in it (what importlib could load)."""
    return [
        node.value
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and SIM in node.value.replace("/", ".")
    ]


def test_the_method_never_imports_sim():
    importers, strings = {}, {}
    for path in _method_modules():
        tree = ast.parse(path.read_text(), filename=str(path))
        rel = str(path.relative_to(REPO))
        hits = sorted(m for m in _imported_modules(tree) if m == SIM or m.startswith(SIM + "."))
        if hits:
            importers[rel] = hits
        if path != DOOR and (found := _sim_strings(tree)):
            strings[rel] = found
    assert not importers, f"method modules import the offline stand-ins directly: {importers}"
    assert not strings, f"method modules name the sim package outside {DOOR.name}: {strings}"
    # the door names the package once, as a string (a lazy import), and imports nothing of it
    assert _sim_strings(ast.parse(DOOR.read_text())).count(SIM) == 1


@pytest.mark.parametrize("kind,name", [(kind, name) for kind, table in STAND_INS.items() for name in table])
def test_every_stand_in_resolves(kind, name):
    target = STAND_INS[kind][name]
    module, _, attribute = target.partition(":")
    assert module.startswith(SIM + ".") and attribute, target
    obj = stand_ins.stand_in(kind, name)
    assert callable(obj) and obj.__module__ == module and obj.__name__ == attribute
    assert stand_ins.is_stand_in(kind, name) and name in stand_ins.stand_in_names(kind)


def test_an_unknown_stand_in_is_a_clear_error():
    assert not stand_ins.is_stand_in("policy", "Qwen/Qwen3-8B")
    assert builtin_provider("openai/gpt-4.1") is None
    with pytest.raises(KeyError, match=r"no policy stand-in named 'Qwen/Qwen3-8B' \(known: tiny\)"):
        stand_ins.stand_in("policy", "Qwen/Qwen3-8B")


@pytest.mark.parametrize("profile", ["tiny", "small", "learn", "gpu", "research"])
def test_the_stand_ins_a_profile_names_are_registered(profile):
    cfg = load_config(profile)
    models = [cfg.teacher.model, cfg.judge.model, cfg.reflection.judge.model, cfg.eval.grader.model]
    named = {m.partition("/")[0] for m in models if m.startswith("rubricem-")}
    assert {builtin_provider(m) for m in models if m.startswith("rubricem-")} == named
    assert named <= set(stand_ins.stand_in_names("provider"))
    if profile == "tiny":  # everything offline: four built-in providers, the tiny policy, the synthetic benchmark
        assert len(named) == 4
        assert stand_ins.is_stand_in("policy", cfg.policy.name_or_path)
        assert all(stand_ins.is_stand_in("benchmark", b) for b in cfg.eval.benchmarks)
    if profile == "research":  # real endpoints and a real model: no stand-in
        assert not named and not stand_ins.is_stand_in("policy", cfg.policy.name_or_path)


LOOKUP = r"""
import json, sys
from rubricem_core.stand_ins import stand_in
before = {m for m in sys.modules if m.startswith("rubricem_core.sim")}
stand_in(sys.argv[1], sys.argv[2])
after = {m for m in sys.modules if m.startswith("rubricem_core.sim")}
print(json.dumps({"before": sorted(before), "after": sorted(after)}))
"""


def test_a_lookup_loads_only_its_own_module():
    proc = subprocess.run(
        [sys.executable, "-c", LOOKUP, "benchmark", "synthetic"], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["before"] == []  # importing the door loads nothing of sim
    # the synthetic grader needs the built-in judge's criteria (and the world and provider under it), but
    # not the teacher, the reflection judge, the benchmark grader or the tiny policy (torch/transformers)
    loaded = set(report["after"])
    assert {"rubricem_core.sim", "rubricem_core.sim.world_grader", "rubricem_core.sim.judge"} <= loaded
    assert not loaded & {f"{SIM}.{m}" for m in ("teacher", "reflection_judge", "grader", "tiny_policy")}
