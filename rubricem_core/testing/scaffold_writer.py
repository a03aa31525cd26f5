"""Scaffold traces of three kinds forced into the transformers engine (the streaming-judge tests and
benchmark): per group, sample 0 answers right with a citation, 1 names the wrong subject uncited, 2 is
sampled freely (a tiny random policy writes noise), so the judge has groups to tell apart."""

from __future__ import annotations

import json
import re
from typing import Any

from rubricem_core.rollout import ForcedContext, RolloutRequest, SamplingParams
from rubricem_core.scaffold import EXAMPLE_TRACE

KINDS = 3  # sample_index % KINDS picks the kind
PLAN = EXAMPLE_TRACE[: EXAMPLE_TRACE.index("<call_tool")]


class ScaffoldWriter:
    """``forced_policy`` of an HFRolloutEngine over ``queries`` (rows of the `queries` table)."""

    def __init__(self, tok: Any, queries: list[dict[str, Any]]) -> None:
        self.tok = tok
        self.queries = {q["query_id"]: q for q in queries}
        self.texts: dict[tuple[str, int, int], list[int]] = {}

    def text(self, ctx: ForcedContext) -> str | None:
        q = self.queries[ctx.request_id]
        subjects = json.loads(q["spec"])["subjects"]
        if ctx.sample_index % KINDS == 2 or ctx.turn > 1:
            return None
        if ctx.turn == 0:
            return PLAN + f'<call_tool name="search">{subjects[0]}</call_tool>'
        ids = re.findall(r'<snippet id="([^"]+)"', ctx.tool_outputs[0]) or ["D0"]
        right = ctx.sample_index % KINDS == 0
        answer = f'{q["reference_answer"]} <cite id="{ids[0]}">as the snippet says</cite>' if right else subjects[-1]
        return (
            "<state_evaluation>Evidence found. Verdict: ready</state_evaluation>\n<review>\n<rubric_review>"
            f"Answer -> {ids[0]}.</rubric_review>\n<writing_plan><thesis>t</thesis><outline>1.</outline>"
            f"</writing_plan>\n</review>\n<answer>The answer is {answer}.</answer>"
        )

    def __call__(self, ctx: ForcedContext) -> int | None:
        key = (ctx.request_id, ctx.sample_index, ctx.turn)
        if key not in self.texts:
            text = self.text(ctx)
            self.texts[key] = [] if text is None else self.tok.encode(text, add_special_tokens=False)
        ids = self.texts[key]
        return ids[len(ctx.turn_ids)] if len(ctx.turn_ids) < len(ids) else None


def scaffold_requests(tok: Any, queries: list[dict[str, Any]], n: int, seed: int = 5) -> list[RolloutRequest]:
    """One request of ``n`` samples per query, its question as the user turn."""
    sampling = SamplingParams(temperature=1.0, max_new_tokens=200, max_total_tokens=1500, seed=seed)
    out = []
    for q in queries:
        prompt = tok.apply_chat_template(
            [{"role": "user", "content": q["question"]}], add_generation_prompt=True, tokenize=False
        )
        out.append(RolloutRequest(q["query_id"], tok.encode(prompt, add_special_tokens=False), n=n, sampling=sampling))
    return out
