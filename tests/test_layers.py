"""The import graph, read from the source with ``ast`` (nothing is imported): no import cycle in the core,
and every import points down the layers: flows → tasks → rubricem_core, and inside the core down the
package order in ``CORE_LAYERS``. Module-level and function-level imports both count (a deferred import
is still a dependency); ``if TYPE_CHECKING:`` blocks count too.

``python tests/test_layers.py`` prints the graph between the core's rooms (packages and top-level
modules), which is how ``CORE_LAYERS`` was derived.
"""

from __future__ import annotations

import ast
import functools
import re
from collections import defaultdict
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("flows", "tasks", "rubricem_core")
CORE = "rubricem_core"

# The core's rooms (a subpackage, or a top-level module) floor by floor, from the bottom up. A room
# imports only rooms on its own floor or below (rooms on one floor may import each other one way: the
# cycle test forbids the round trip). Derived from the imports of #35 (`python tests/test_layers.py`
# prints them); docs/layout.md names the floors.
CORE_LAYERS: list[list[str]] = [
    # 0 plumbing and formats: secrets, offline defaults, processes, seeds, run-directory paths, table schemas
    # stand_ins: the registry of offline stand-ins, which loads sim/ lazily by name (no import edge)
    ["redact", "offline", "faults", "processes", "progress", "seeds", "layout", "schemas", "scaffold", "stand_ins"],
    # 1 data: the Parquet store, query readers and splits, corpus, tools, trajectories
    ["store", "splits", "corpus", "readers", "filtering", "trajectory", "ssgrpo", "tools", "embedders"],
    # 2 the run's config and what reads it flat: SQL, MLflow tracking, recipes, token batches
    ["config", "sql", "tracking", "recipes", "batching", "encoding", "relabel", "config_reference"],
    # 3 the run directory's own config and lock, LLM clients, the research environment, log-probs
    ["run_config", "runlock", "llm", "environment", "logprobs", "stage_costs"],
    # 4 the judge; trainers and their ranks (distributed/: process groups, shards, memory plans)
    ["judge", "distributed", "training"],
    # 5 the policy (loading it for training included) and the rollout engines
    ["policy", "rollout"],
    # 6 what trains or samples through them: reflection meta-policy, SFT, the teacher; the model registry
    # (a LoRA checkpoint registers its merged copy)
    ["reflection", "sft", "teacher", "registry", "export"],
    # 7 the RL loop and evaluation
    ["rl", "eval"],
    # 8 reports over everything, `rubricem ask` (a checkpoint on one question); the offline stand-ins (sim/: the synthetic world, the scripted teacher,
    # judge and grader, the fake provider, the tiny policy), which the method reaches only through stand_ins
    # testing/: the fakes of third-party services and tiny models that tests and benches share
    ["report", "sim", "ask", "dry_run", "testing"],
]

# RunStore(...) / RunLayout(...) constructions in flows/, tasks/ and rubricem_core/ (#35: one RunStore
# travels below the flows instead of run_dir strings; 35 and 33 before, the RL path now builds one): the
# counts may only go down. Tasks build theirs from the run_dir string Prefect gives them. bench/ is not
# counted (it builds its paths with RunLayout).
MAX_RUNSTORE_CALLS = 21
MAX_RUNLAYOUT_CALLS = 27


# ------------------------------------------------------------------------------------ the graph
def module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


@functools.cache
def project_files() -> dict[str, Path]:
    return {module_name(p): p for pkg in PACKAGES for p in sorted((REPO / pkg).rglob("*.py"))}


def imported_names(name: str, path: Path) -> list[tuple[str, int]]:
    """(dotted name, line) of every import in the file, relative ones resolved; ``from a import b``
    gives ``a.b`` (b may be a module or a name in a; ``resolve`` decides)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: list[tuple[str, int]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.extend((alias.name, node.lineno) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            found.extend((f"{base}.{alias.name}" if alias.name != "*" else base, node.lineno) for alias in node.names)
    return found


def resolve(dotted: str, modules: set[str]) -> str | None:
    """The project module a dotted import name lands in (the longest module prefix), None if external."""
    parts = dotted.split(".")
    for end in range(len(parts), 0, -1):
        candidate = ".".join(parts[:end])
        if candidate in modules:
            return candidate
    return None


@functools.cache
def import_graph() -> tuple[dict[str, dict[str, int]], dict[str, list[tuple[str, int]]]]:
    """(module → {imported project module: first line}, module → [(external top-level name, line)])."""
    files = project_files()
    modules = set(files)
    graph: dict[str, dict[str, int]] = {name: {} for name in files}
    external: dict[str, list[tuple[str, int]]] = defaultdict(list)
    for name, path in files.items():
        for dotted, line in imported_names(name, path):
            target = resolve(dotted, modules)
            if target is None:
                external[name].append((dotted.split(".")[0], line))
            elif target != name:
                graph[name].setdefault(target, line)
    return graph, external


def find_cycle(graph: dict[str, dict[str, int]], nodes: set[str]) -> list[str] | None:
    """One import cycle among ``nodes`` (as a closed path a → b → ... → a), or None."""
    state: dict[str, int] = {}  # 1 on the stack, 2 done
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if nxt not in nodes:
                continue
            if state.get(nxt) == 1:
                return [*stack[stack.index(nxt) :], nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(nodes):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def room(module: str) -> str:
    """The core room of a module: ``rubricem_core.rl.session`` → ``rl``; ``rubricem_core.config`` → ``config``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def floor_of() -> dict[str, int]:
    return {name: i for i, layer in enumerate(CORE_LAYERS) for name in layer}


def where(graph: dict[str, dict[str, int]], src: str, dst: str) -> str:
    return f"{src} → {dst} ({project_files()[src].relative_to(REPO)}:{graph[src][dst]})"


# ------------------------------------------------------------------------------------ the rules
def test_no_import_cycle_in_the_core():
    graph, _ = import_graph()
    cycle = find_cycle(graph, {m for m in graph if m.startswith(CORE)})
    assert cycle is None, "import cycle: " + " → ".join(cycle or [])


@pytest.mark.parametrize(
    "lower, higher",
    [("rubricem_core", "tasks"), ("rubricem_core", "flows"), ("tasks", "flows")],
)
def test_layers_import_downward_only(lower, higher):
    graph, _ = import_graph()
    upward = [
        where(graph, src, dst)
        for src in graph
        if src.split(".")[0] == lower
        for dst in graph[src]
        if dst.split(".")[0] == higher
    ]
    assert not upward, f"{lower} imports {higher}:\n" + "\n".join(upward)


def test_core_never_imports_prefect():
    _, external = import_graph()
    hits = [
        f"{m}:{line}" for m, names in external.items() if m.startswith(CORE) for top, line in names if top == "prefect"
    ]
    assert not hits, "rubricem_core imports prefect: " + ", ".join(hits)


def test_every_core_room_has_a_floor():
    rooms = {room(m) for m in project_files() if m.startswith(CORE + ".")}
    placed = [name for layer in CORE_LAYERS for name in layer]
    assert len(placed) == len(set(placed)), "a room is listed twice in CORE_LAYERS"
    # listed but absent is fine (sim/ is on its way in #35); present but unlisted is not
    assert rooms <= set(placed), f"rooms without a floor in CORE_LAYERS: {sorted(rooms - set(placed))}"


def test_core_rooms_import_their_own_floor_or_below():
    graph, _ = import_graph()
    floors = floor_of()
    upward = [
        where(graph, src, dst)
        + f"  [{room(src)} on floor {floors[room(src)]} → {room(dst)} on floor {floors[room(dst)]}]"
        for src in graph
        if src.startswith(CORE + ".")
        for dst in graph[src]
        if dst.startswith(CORE + ".") and floors[room(dst)] > floors[room(src)]
    ]
    assert not upward, "core imports up a floor:\n" + "\n".join(upward)


DISTRIBUTED_NEVER_IMPORTS = ("rl", "sft", "policy")


def test_distributed_never_imports_rl_sft_or_policy():
    graph, _ = import_graph()
    hits = [
        where(graph, src, dst)
        for src in graph
        if src.startswith(CORE + ".distributed")
        for dst in graph[src]
        if dst.startswith(CORE + ".") and room(dst) in DISTRIBUTED_NEVER_IMPORTS
    ]
    assert not hits, "distributed/ imports rl/, sft or policy/:\n" + "\n".join(hits)


def constructions(call: str) -> list[str]:
    """``file:line`` of every ``call(`` in flows/, tasks/ and rubricem_core/ (code, not text)."""
    hits = []
    for pkg in PACKAGES:
        for path in sorted((REPO / pkg).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Call):
                    func = node.func
                    name = (
                        func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else ""
                    )
                    if name == call:
                        hits.append(f"{path.relative_to(REPO)}:{node.lineno}")
    return hits


@pytest.mark.parametrize("call, bound", [("RunStore", MAX_RUNSTORE_CALLS), ("RunLayout", MAX_RUNLAYOUT_CALLS)])
def test_run_store_and_layout_constructions_only_go_down(call, bound):
    hits = constructions(call)
    print(f"{call}( constructed {len(hits)} times: " + ", ".join(hits))
    assert len(hits) <= bound, f"{call}( constructed {len(hits)} times (at most {bound}): " + ", ".join(hits)


if __name__ == "__main__":
    graph, _ = import_graph()
    edges: dict[tuple[str, str], list[str]] = defaultdict(list)
    for src in graph:
        for dst in graph[src]:
            if src.startswith(CORE + ".") and dst.startswith(CORE + ".") and room(src) != room(dst):
                edges[room(src), room(dst)].append(re.sub(r"^rubricem_core\.", "", src))
    for (a, b), srcs in sorted(edges.items()):
        print(f"{a} -> {b}: {', '.join(sorted(set(srcs)))}")


MAX_MODULE_LINES = 600  # #44: a module past this is split by concern (config by section, readers by source)


def test_no_module_of_the_project_is_over_600_lines():
    long = {
        str(path.relative_to(REPO)): n
        for path in project_files().values()
        if (n := len(path.read_text().splitlines())) > MAX_MODULE_LINES
    }
    assert not long, f"modules over {MAX_MODULE_LINES} lines (split them by concern): {long}"
