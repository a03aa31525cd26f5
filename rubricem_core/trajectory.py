"""Token-level trajectories: the one representation SFT, rollouts, the judge and RL share.

Token in, token out: a trajectory is built from token ids as they were sampled (rollouts) or as
each segment was tokenized once (SFT). Training never re-tokenizes the text. Every token carries
a stage id, a loss-mask bit and — for sampled tokens — the sampling logprob.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

from rubricem_core.scaffold import STAGE_IDS, STAGES
from rubricem_core.schemas import none_to_nan

NO_STAGE = -1  # prompt tokens (system prompt, guidance, query) belong to no stage
REFLECTION_STAGE = len(STAGES)  # SFT: tokens of a reflection (the meta-policy's task), after the four research stages
SEGMENT_KINDS = ("prompt", "policy", "tool_output")


@dataclass
class TokenSegment:
    """A run of tokens of one kind and stage: ``token_ids[start:end]`` of the trajectory."""

    kind: str  # prompt | policy | tool_output
    stage: str | None  # one of STAGES, None for the prompt
    start: int
    end: int
    text: str


@dataclass
class TokenTrajectory:
    token_ids: list[int]
    loss_mask: list[int]
    stage_ids: list[int]
    logprobs: list[float]  # sampling logprob of policy tokens; NaN where nothing was sampled
    segments: list[TokenSegment] = field(default_factory=list)
    prompt_len: int = 0
    n_tool_calls: int = 0
    finish_reason: str | None = None
    meta: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        n = len(self.token_ids)
        if not (len(self.loss_mask) == len(self.stage_ids) == len(self.logprobs) == n):
            raise ValueError(
                f"token arrays differ in length: ids {n}, mask {len(self.loss_mask)}, "
                f"stages {len(self.stage_ids)}, logprobs {len(self.logprobs)}"
            )

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def n_policy_tokens(self) -> int:
        return sum(self.loss_mask)

    def append(
        self, kind: str, stage: str | None, ids: list[int], text: str, logprobs: list[float] | None = None
    ) -> None:
        """Append one segment; policy tokens train (mask 1), prompt and tool output never do."""
        if kind not in SEGMENT_KINDS:
            raise ValueError(f"unknown segment kind {kind!r}")
        if stage is not None and stage not in STAGE_IDS:
            raise ValueError(f"unknown stage {stage!r}; expected one of {STAGES}")
        start = len(self.token_ids)
        self.token_ids.extend(ids)
        self.loss_mask.extend([1 if kind == "policy" else 0] * len(ids))
        self.stage_ids.extend([STAGE_IDS[stage] if stage is not None else NO_STAGE] * len(ids))
        if logprobs is None:
            logprobs = [math.nan] * len(ids)
        if len(logprobs) != len(ids):
            raise ValueError("logprobs must have one value per appended token")
        self.logprobs.extend(logprobs)
        self.segments.append(TokenSegment(kind, stage, start, len(self.token_ids), text))

    @classmethod
    def empty(cls) -> TokenTrajectory:
        return cls(token_ids=[], loss_mask=[], stage_ids=[], logprobs=[])

    def to_row(self) -> dict[str, Any]:
        row = asdict(self)
        row["segments"] = [asdict(s) for s in self.segments]
        return row

    @classmethod
    def from_row(cls, row: dict[str, Any]) -> TokenTrajectory:
        data = dict(row)
        data["segments"] = [TokenSegment(**s) for s in data.get("segments") or []]
        data["logprobs"] = [none_to_nan(v) for v in data["logprobs"]]
        known = set(cls.__dataclass_fields__)
        return cls(**{k: v for k, v in data.items() if k in known})
