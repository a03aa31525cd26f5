"""Run reports: plots (PNG) and a one-page, self-contained HTML summary of a run directory."""

from rubricem_core.report.html import ReportError, write_report
from rubricem_core.report.plots import PLOTS, make_plots

__all__ = ["PLOTS", "ReportError", "make_plots", "write_report"]
