"""The research environment the policy acts in: local tools over a corpus and prompt assembly.

One place builds both, so SFT data collection, rollouts and evaluation see the same tools and the
same prompt (system prompt with an optional guidance block, then the query).
"""

from __future__ import annotations

import json
from typing import Any

import pyarrow as pa

from rubricem_core.config import ToolsConfig
from rubricem_core.embedders import make_embedder
from rubricem_core.scaffold.prompt import COMPACT_GUIDANCE_BEGIN, plain_system_prompt, system_prompt
from rubricem_core.tools.base import ToolEnv
from rubricem_core.tools.local import LocalBrowseTool, LocalSearchTool


def local_tool_env(corpus: pa.Table, tools: ToolsConfig) -> ToolEnv:
    """`search` (BM25, fused with dense retrieval when an embedder is set) and `browse` over a corpus, or
    the tools of ``tools.specs`` (web search, MCP, … each behind a timeout, a concurrency limit and the
    optional on-disk cache). The budget here is unlimited: callers enforce the per-trajectory budget."""
    if tools.specs:
        from rubricem_core.tools.registry import build_tools

        built = build_tools(
            tools.specs, corpus=corpus, cache_dir=tools.cache_dir, embedder=make_embedder(tools.embedder)
        )
        return ToolEnv(built, max_calls=2**31 - 1)
    if corpus.num_rows == 0:
        raise ValueError("the corpus is empty: set data.corpus to use the local search tool")
    embedder = make_embedder(tools.embedder)
    search = LocalSearchTool(corpus, top_k=tools.top_k, snippet_chars=tools.snippet_chars, embedder=embedder)
    browse = LocalBrowseTool(corpus, max_chars=tools.browse_chars)
    return ToolEnv({"search": search, "browse": browse}, max_calls=2**31 - 1)


COMPACT_PROMPT = (
    "You are a research agent. Write <structured_plan> (deep_analysis, rubric, research_plan), then search "
    'with <call_tool name="search">query</call_tool> and judge each result in <state_evaluation>, then '
    '<review>, then an <answer> that cites retrieved ids with <cite id="...">claim</cite>.'
)


def policy_system_prompt(style: str = "full", guidance: str | None = None) -> str:
    """``full``: the scaffold's complete instructions; ``compact``: one paragraph, for tiny models
    that learn the format from SFT data and gain nothing from 1k tokens of masked instructions; ``react``:
    no scaffold (the paper's Fig. 6 ReAct comparison), the tools and a cited final answer only."""
    if style == "full":
        return system_prompt(guidance=guidance)
    if style == "compact":
        if guidance:
            return COMPACT_PROMPT + f"\n\n{COMPACT_GUIDANCE_BEGIN}\n" + guidance + "\n=== END GUIDANCE ==="
        return COMPACT_PROMPT
    if style == "react":
        return plain_system_prompt(guidance=guidance)
    raise ValueError(f"unknown prompt style {style!r}; expected 'full', 'compact' or 'react'")


def trace_format(style: str) -> str:
    """The format a prompt style asks for: ``react`` (unstructured: tool calls, then a cited answer) or the
    four-stage ``scaffold`` (``full`` and ``compact``)."""
    return "react" if style == "react" else "scaffold"


def prompt_messages(query: dict[str, Any], guidance: str | None = None, style: str = "full") -> list[dict[str, str]]:
    """System prompt (with the retrieved guidance block, if any) followed by the query's conversation."""
    conversation = (
        json.loads(query["messages"]) if query.get("messages") else [{"role": "user", "content": query["question"]}]
    )
    return [{"role": "system", "content": policy_system_prompt(style, guidance)}, *conversation]
