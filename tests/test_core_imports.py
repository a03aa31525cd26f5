"""rubricem_core is the library under the Prefect layer: every module of it imports without Prefect.

Each module is imported in one fresh interpreter (this session has long imported prefect through the
tasks and flows), walking the package with pkgutil so that new modules are covered without a list here.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

IMPORT_ALL = r"""
import importlib, json, pkgutil, sys, traceback

import rubricem_core

names, failed, first_prefect = [], {}, None
for info in pkgutil.walk_packages(rubricem_core.__path__, "rubricem_core."):
    names.append(info.name)
    try:
        importlib.import_module(info.name)
    except BaseException:  # reported below, with the module's name
        failed[info.name] = traceback.format_exc(limit=3)
    if first_prefect is None and "prefect" in sys.modules:
        first_prefect = info.name
print(json.dumps({"names": names, "failed": failed, "first_prefect": first_prefect,
                  "prefect_loaded": sorted(m for m in sys.modules if m == "prefect" or m.startswith("prefect."))[:5]}))
"""


def test_every_core_module_imports_without_prefect():
    proc = subprocess.run([sys.executable, "-c", IMPORT_ALL], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    names = report["names"]
    # the walk saw the package, its subpackages and their modules
    assert {"rubricem_core.config", "rubricem_core.store", "rubricem_core.rl.session"} <= set(names), names
    assert not report["failed"], "\n".join(f"{name}:\n{tb}" for name, tb in report["failed"].items())
    assert report["first_prefect"] is None, (
        f"importing {report['first_prefect']} loaded prefect ({report['prefect_loaded']}): "
        "rubricem_core must never import prefect (that belongs in tasks/ and flows/)"
    )
