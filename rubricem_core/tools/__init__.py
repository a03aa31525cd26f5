"""Research tools (search, browse) behind one interface, and the per-trajectory tool environment."""

from rubricem_core.tools.base import (
    Tool,
    ToolBudget,
    ToolCall,
    ToolEnv,
    ToolError,
    ToolResult,
    ToolSpec,
    error_result,
    format_search_results,
    neutralize_tags,
    no_results,
)
from rubricem_core.tools.local import LocalBrowseTool, LocalSearchTool, load_corpus

__all__ = [
    "LocalBrowseTool",
    "LocalSearchTool",
    "Tool",
    "ToolBudget",
    "ToolCall",
    "ToolEnv",
    "ToolError",
    "ToolResult",
    "ToolSpec",
    "error_result",
    "format_search_results",
    "load_corpus",
    "neutralize_tags",
    "no_results",
]
