"""The naive multi-turn loop, kept ONLY as the benchmark's reference point (bench/rollout_engine.py).

Every turn re-encodes the whole text so far (prompt + turns + tool outputs) and calls
``model.generate`` on it with stop strings; the tool runs; repeat. Rows of a turn are batched
(left padding), as agent frameworks built on ``generate`` usually do. What it costs compared with
:class:`HFRolloutEngine`: the prefix is re-encoded and re-prefilled every turn, rows that finish a
turn early wait for the slowest row of that turn, and tokens are re-tokenized from text (so they
are not the sampled ids; no logprobs are kept). Do not train on its output.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from rubricem_core.rollout.rows import decode_ids
from rubricem_core.rollout.types import (
    ANSWERED,
    ERROR,
    TOOL_BUDGET,
    TRUNCATED,
    ForcedContext,
    ForcedPolicy,
    RolloutRequest,
    SamplingParams,
)
from rubricem_core.scaffold import STOP_STRINGS, TOOL_CALL_CLOSE, extract_tool_calls
from rubricem_core.tools.base import ToolEnv, error_result


@dataclass
class BaselineRollout:
    request_id: str
    sample_index: int
    prompt_text: str
    turns: list[str] = field(default_factory=list)  # decoded policy text of each turn
    tool_outputs: list[str] = field(default_factory=list)
    n_generated: int = 0  # tokens generate() produced (up to each turn's stop)
    finish_reason: str | None = None

    @property
    def text(self) -> str:
        """Generated text: turns interleaved with tool outputs."""
        parts: list[str] = []
        for i, turn in enumerate(self.turns):
            parts.append(turn)
            if i < len(self.tool_outputs):
                parts.append(self.tool_outputs[i])
        return "".join(parts)


class _ForceTokens:
    """A logits processor that applies a ForcedPolicy inside ``generate`` (benchmark only)."""

    def __init__(self, policy: ForcedPolicy, rows: list[BaselineRollout], start: int):
        self.policy, self.rows, self.start = policy, rows, start

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        for b, row in enumerate(self.rows):
            ctx = ForcedContext(
                row.request_id,
                row.sample_index,
                len(row.turns),
                input_ids[b, self.start :].tolist(),
                list(row.turns),
                list(row.tool_outputs),
            )
            token = self.policy(ctx)
            if token is not None:
                scores[b] = float("-inf")
                scores[b, token] = 0.0
        return scores


class NaiveRolloutBaseline:
    def __init__(
        self,
        model: torch.nn.Module,
        tokenizer: Any,
        tool_names: Sequence[str] | None = ("search", "browse"),
        forced_policy: ForcedPolicy | None = None,
    ):
        self.model, self.tokenizer, self.forced_policy = model, tokenizer, forced_policy
        self.tool_names = None if tool_names is None else tuple(tool_names)

    def _decode(self, ids: list[int]) -> str:
        return decode_ids(self.tokenizer, ids)

    def generate(self, requests: list[RolloutRequest], tools: ToolEnv) -> list[list[BaselineRollout]]:
        allowed = dict(tools.tools) if self.tool_names is None else {n: tools.tools[n] for n in self.tool_names}
        rows, envs, params = [], [], []
        for request in requests:
            for k in range(request.n):
                rows.append(BaselineRollout(request.request_id, k, self._decode(request.prompt_ids)))
                envs.append(ToolEnv(allowed, request.max_tool_calls))
                params.append(request)
        with torch.inference_mode():
            while True:
                live = [i for i, row in enumerate(rows) if row.finish_reason is None]
                if not live:
                    break
                # one generate() per distinct sampling setting (the benchmark uses one)
                groups: dict[SamplingParams, list[int]] = {}
                for i in live:
                    groups.setdefault(params[i].sampling, []).append(i)
                for sampling, members in groups.items():
                    self._turn(
                        [rows[i] for i in members], [envs[i] for i in members], [params[i] for i in members], sampling
                    )
        out, index = [], 0
        for request in requests:
            out.append(rows[index : index + request.n])
            index += request.n
        return out

    def _turn(
        self, rows: list[BaselineRollout], envs: list[ToolEnv], requests: list[RolloutRequest], sampling: SamplingParams
    ) -> None:
        tok = self.tokenizer
        texts = [row.prompt_text + row.text for row in rows]  # the naive part: re-encode everything
        encoded = [tok.encode(t, add_special_tokens=False) for t in texts]
        room = sampling.max_total_tokens - max(len(e) for e in encoded)
        if room <= 0:
            for row in rows:
                row.finish_reason = TRUNCATED
            return
        width = max(len(e) for e in encoded)
        pad = tok.pad_token_id if tok.pad_token_id is not None else 0
        ids = torch.tensor([[pad] * (width - len(e)) + e for e in encoded])
        mask = torch.tensor([[0] * (width - len(e)) + [1] * len(e) for e in encoded])
        kwargs: dict[str, Any] = dict(
            max_new_tokens=min(sampling.max_new_tokens, room),
            stop_strings=list(STOP_STRINGS),
            tokenizer=tok,
            pad_token_id=pad,
            eos_token_id=tok.eos_token_id,
        )
        if sampling.temperature == 0:
            kwargs.update(do_sample=False)
        else:
            kwargs.update(
                do_sample=True, temperature=sampling.temperature, top_p=sampling.top_p, top_k=sampling.top_k or None
            )
        if self.forced_policy is not None:
            kwargs["logits_processor"] = [_ForceTokens(self.forced_policy, rows, width)]
        if sampling.seed is not None:
            torch.manual_seed(sampling.seed + len(rows[0].turns))
        device = next(self.model.parameters()).device
        out = self.model.generate(input_ids=ids.to(device), attention_mask=mask.to(device), **kwargs)
        for b, (row, env, request) in enumerate(zip(rows, envs, requests)):
            new = out[b, width:].tolist()
            stop_at = len(new)
            for j, t in enumerate(new):
                if t == tok.eos_token_id:
                    stop_at = j + 1
                    break
            new = [t for t in new[:stop_at] if t != pad]
            turn = self._decode(new)
            cut = [turn.index(s) + len(s) for s in STOP_STRINGS if s in turn]
            if cut:
                turn = turn[: min(cut)]
            row.turns.append(turn)
            row.n_generated += len(new)
            if turn.endswith("</answer>"):
                row.finish_reason = ANSWERED
            elif turn.endswith(TOOL_CALL_CLOSE):
                if len(row.turns) > request.max_tool_calls + 1:
                    row.finish_reason = TOOL_BUDGET
                    continue
                calls = extract_tool_calls(turn)
                result = env.execute(calls[-1]) if calls else error_result("malformed tool call")
                row.tool_outputs.append(result.text)
            elif new and new[-1] == tok.eos_token_id:
                row.finish_reason = ANSWERED if "<answer>" in row.text else ERROR
            else:
                row.finish_reason = TRUNCATED
