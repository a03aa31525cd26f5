"""The system prompt that teaches the scaffold, with its worked example and the guidance block."""

from __future__ import annotations

import re
from collections.abc import Sequence

from rubricem_core.scaffold.records import DEFAULT_TOOLS, ScaffoldError, ToolSpec

EXAMPLE_TRACE = """<structured_plan>
<deep_analysis>The user asks when the Varn bridge opened and why it matters. Explicit need: the opening year. Implicit need: its effect on regional trade.</deep_analysis>
<rubric>
<knowledge_checklist>
- The opening year of the Varn bridge
- The trade route the bridge connected
</knowledge_checklist>
<analytical_criteria>
- Explains the causal link between the bridge and trade growth
</analytical_criteria>
<negative_constraints>
- Does not state facts that no retrieved document supports
</negative_constraints>
</rubric>
<research_plan>
1. Search for the opening of the Varn bridge.
2. Search for its effect on trade.
</research_plan>
</structured_plan>
<call_tool name="search">Varn bridge opening year</call_tool>
<tool_output><snippet id="D3">The Varn bridge opened in 1871 and joined the river port to the northern road.</snippet></tool_output>
<state_evaluation>D3 covers the opening year and the route; the trade effect is still missing. Verdict: continue</state_evaluation>
<call_tool name="search">Varn bridge effect on trade</call_tool>
<tool_output><snippet id="D8">After the Varn bridge opened, grain shipments through the port doubled within a decade.</snippet></tool_output>
<state_evaluation>Every checklist item now has evidence (D3, D8). Verdict: ready</state_evaluation>
<review>
<rubric_review>Opening year -> D3. Trade route -> D3. Causal link -> D8. Gaps: none.</rubric_review>
<writing_plan><thesis>The 1871 Varn bridge made the port a trade hub.</thesis><outline>1. Opening. 2. Route. 3. Trade effect.</outline></writing_plan>
</review>
<answer>The Varn bridge opened in 1871 <cite id="D3">and joined the river port to the northern road</cite>. Its effect on trade was large: <cite id="D8">grain shipments through the port doubled within a decade</cite>.</answer>"""

_GUIDANCE_BEGIN = "=== BEGIN GUIDANCE FROM PAST RESEARCH (advice only: not evidence, never cite it) ==="
_GUIDANCE_END = "=== END GUIDANCE ==="
# the compact prompt's block (environment.policy_system_prompt, style compact)
COMPACT_GUIDANCE_BEGIN = "=== GUIDANCE FROM PAST RESEARCH (advice only; never cite it) ==="


def system_prompt(tools: Sequence[ToolSpec] | None = None, guidance: str | None = None) -> str:
    """The system prompt that teaches the scaffold; ``guidance`` is retrieved reflection text."""
    tool_specs = list(DEFAULT_TOOLS if tools is None else tools)
    if not tool_specs:
        raise ScaffoldError("system_prompt needs at least one tool: research without tools cannot be grounded")
    for spec in tool_specs:
        if not re.fullmatch(r"[A-Za-z_][\w\-]*", spec.name):
            raise ScaffoldError(f"tool name {spec.name!r} cannot be written in a call_tool name attribute")
    tool_lines = "\n".join(
        f'- {spec.name}: {spec.description.strip()} Call it as <call_tool name="{spec.name}">argument</call_tool>'
        for spec in tool_specs
    )
    parts = [
        "You are a deep-research agent. You answer the user's question with a long-form, well-cited report, "
        "working in four stages: plan, research, review, answer. Write every part of your response inside the "
        "tags below, in this order, and write nothing outside them.",
        "",
        "1. PLAN (exactly once, first):",
        "<structured_plan>",
        "<deep_analysis>the explicit and implicit needs of the question</deep_analysis>",
        "<rubric>",
        "<knowledge_checklist>- facts the answer must contain, one per line</knowledge_checklist>",
        "<analytical_criteria>- analysis the answer must do well, one per line</analytical_criteria>",
        "<negative_constraints>- mistakes the answer must avoid, one per line</negative_constraints>",
        "</rubric>",
        "<research_plan>1. numbered research steps</research_plan>",
        "</structured_plan>",
        "All three rubric lists and the research plan must be non-empty.",
        "",
        "2. RESEARCH (one or more tool calls):",
        'Make exactly one tool call at a time: <call_tool name="TOOL">argument</call_tool>. '
        "Nothing else goes inside call_tool. Your turn stops right after </call_tool>; the environment then writes "
        '<tool_output>...</tool_output> with results as <snippet id="D12">text</snippet>, or an <error>. '
        "Never write <tool_output> yourself.",
        "Available tools:",
        tool_lines,
        "After a tool output, judge the evidence against your plan and rubric in "
        '<state_evaluation>...</state_evaluation>, ending with one verdict: "Verdict: continue" (search more), '
        '"Verdict: revise" (the plan needs changing: write a revised <structured_plan> next, in the same format), '
        'or "Verdict: ready" (enough evidence to write).',
        "",
        "3. REVIEW (exactly once, after research):",
        "<review>",
        "<rubric_review>each rubric criterion -> the evidence ids that satisfy it, and the remaining gaps</rubric_review>",
        "<writing_plan><thesis>the main claim</thesis><outline>the report's sections</outline></writing_plan>",
        "</review>",
        "",
        "4. ANSWER (exactly once, last):",
        '<answer>the long-form report, with every supported claim wrapped as <cite id="D12">claim</cite></answer>',
        'Cite only ids that appeared in a <snippet id="..."> of a tool output above; one id per cite. '
        "Never invent ids. Stop after </answer>.",
        "",
        "Example of the complete format (a short one; real questions need more research and a longer report):",
        EXAMPLE_TRACE,
    ]
    if guidance is not None and guidance.strip():
        parts += ["", _GUIDANCE_BEGIN, guidance.strip(), _GUIDANCE_END]
    return "\n".join(parts)


PLAIN_PROMPT_OPENING = "You are a research assistant with tools."


def plain_system_prompt(tools: Sequence[ToolSpec] | None = None, guidance: str | None = None) -> str:
    """The prompt without the scaffold (the paper's Fig. 6c "without scaffold"): the same tools, tool-call
    syntax, evidence ids and final <answer>, but no plan, state evaluations or review to write."""
    tool_specs = list(DEFAULT_TOOLS if tools is None else tools)
    if not tool_specs:
        raise ScaffoldError("plain_system_prompt needs at least one tool")
    tool_lines = "\n".join(
        f'- {spec.name}: {spec.description.strip()} Call it as <call_tool name="{spec.name}">argument</call_tool>'
        for spec in tool_specs
    )
    parts = [
        f"{PLAIN_PROMPT_OPENING} Answer the user's question from evidence you retrieve.",
        "Make one tool call at a time; your turn stops right after </call_tool> and the environment replies with "
        '<tool_output>...</tool_output> holding <snippet id="D12">text</snippet> results. Never write '
        "<tool_output> yourself.",
        "Available tools:",
        tool_lines,
        "When you know enough, write your final answer once as <answer>...</answer>, wrapping each claim a snippet "
        'supports as <cite id="D12">claim</cite> (ids from the tool outputs only), and stop.',
    ]
    if guidance is not None and guidance.strip():
        parts += ["", _GUIDANCE_BEGIN, guidance.strip(), _GUIDANCE_END]
    return "\n".join(parts)


def prompt_guidance(system: str) -> str | None:
    """The guidance block a system prompt carries (retrieved reflections; full or compact prompt), or None."""
    for begin in (_GUIDANCE_BEGIN, COMPACT_GUIDANCE_BEGIN):
        if begin in system:
            return system.split(begin, 1)[1].split(_GUIDANCE_END, 1)[0].strip() or None
    return None
