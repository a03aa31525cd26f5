"""Research tools (search, browse) behind one interface, and the per-trajectory tool environment."""

from rubricem_core.tools import base
from rubricem_core.tools.base import *  # noqa: F403  (base's __all__ is the interface: one list to keep)
from rubricem_core.tools.local import LocalBrowseTool, LocalSearchTool, load_corpus

__all__ = ["LocalBrowseTool", "LocalSearchTool", "load_corpus", *base.__all__]
