"""Run reports: plots (PNG) and a one-page, self-contained HTML summary of a run directory.

The names are imported lazily: the HTML report reads the run through DuckDB (rubricem_core.sql), and
the flows that only write Markdown (`rubricem_core.report.markdown`) must not need it (the GPU learning
check carries no DuckDB: scripts/gpu_pack.py).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rubricem_core.report.html import ReportError, write_report
    from rubricem_core.report.plots import PLOTS, make_plots

_LAZY = {
    "ReportError": "rubricem_core.report.html",
    "write_report": "rubricem_core.report.html",
    "PLOTS": "rubricem_core.report.plots",
    "make_plots": "rubricem_core.report.plots",
}

__all__ = ["PLOTS", "ReportError", "make_plots", "write_report"]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'rubricem_core.report' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
