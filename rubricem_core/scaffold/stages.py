"""The stage machine both scanners share: it labels tags and text with (stage, is_tool_output).

The two scanners (:func:`~rubricem_core.scaffold.segments.parse_segments` over a whole text and
:class:`~rubricem_core.scaffold.stream.StreamParser` incrementally) share only this machine, so
tests comparing them check the incremental tag scanning for real.
"""

from __future__ import annotations


class _StageMachine:
    """Labels each tag and text run with (stage, is_tool_output) as tags arrive in order."""

    __slots__ = ("stage", "research_started", "in_tool_output", "finished")

    def __init__(self) -> None:
        self.stage = "plan"  # text before the first tag belongs to the plan
        self.research_started = False
        self.in_tool_output = False
        self.finished = False

    def open_tag(self, name: str) -> tuple[str, bool]:
        if name == "structured_plan":
            # A plan written once research is under way is a revision, trained as research.
            self.stage = "research" if self.research_started else "plan"
        elif name in ("call_tool", "state_evaluation", "tool_output"):
            self.stage = "research"
            self.research_started = True
            if name == "tool_output":
                self.in_tool_output = True
                return self.stage, True
        elif name in ("review", "answer"):
            self.stage = name
        return self.stage, False

    def close_tag(self, name: str) -> tuple[str, bool]:
        if name == "tool_output" and self.in_tool_output:
            self.in_tool_output = False
            return self.stage, True
        if name == "answer":
            self.finished = True
        return self.stage, False
