"""The rollout engine contract: sampling settings, requests, finish reasons and the engine protocol.

An engine turns prompt ids into multi-turn, tool-augmented :class:`TokenTrajectory` objects: tokens
are kept exactly as sampled, tool outputs are tokenized once (``encoding.encode_tool_output``) and
appended with loss mask 0, and every sampled token carries its stage id and sampling logprob.
The transformers engine (``hf_engine``) and a vLLM engine implement the same protocol.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import torch

from rubricem_core.tools.base import ToolEnv
from rubricem_core.trajectory import TokenTrajectory

# ---- finish reasons (the ``rollouts.finish_reason`` column) ---------------------------------------
ANSWERED = "answered"  # </answer> was written, or eos while the answer was open
TRUNCATED = "truncated"  # per-turn max_new_tokens or the context limit ran out first
TOOL_BUDGET = "tool_budget"  # the policy kept calling tools after being told the budget was spent
ERROR = "error"  # the model stopped without answering (eos early), or the prompt was unusable
FINISH_REASONS: tuple[str, ...] = (ANSWERED, TRUNCATED, TOOL_BUDGET, ERROR)


class RolloutError(ValueError):
    """A request or sampling setting is invalid; the message names the field."""


@dataclass(frozen=True)
class SamplingParams:
    """How each policy token is drawn. The recorded logprob is that of the distribution actually
    sampled from: log-softmax of logits / temperature after top-k and top-p filtering."""

    temperature: float = 1.0  # 0 = greedy (then the logprob recorded is the plain log-softmax, T=1)
    top_p: float = 1.0  # nucleus mass kept, in (0, 1]; 1 disables
    top_k: int = 0  # keep the k most likely tokens; 0 disables
    max_new_tokens: int = 512  # sampled tokens per turn (between two tool outputs)
    max_total_tokens: int = 4096  # context limit: prompt + sampled + tool-output tokens
    seed: int | None = None  # None: not reproducible
    # texts that end the trajectory when the policy writes them (kept in it), e.g. "</reflection>"
    stop_texts: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not (self.temperature >= 0 and math.isfinite(self.temperature)):
            raise RolloutError(f"SamplingParams.temperature must be a finite number >= 0, got {self.temperature}")
        if not (0 < self.top_p <= 1):
            raise RolloutError(f"SamplingParams.top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise RolloutError(f"SamplingParams.top_k must be >= 0 (0 disables), got {self.top_k}")
        if self.max_new_tokens < 1:
            raise RolloutError(f"SamplingParams.max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.max_total_tokens < 1:
            raise RolloutError(f"SamplingParams.max_total_tokens must be >= 1, got {self.max_total_tokens}")


@dataclass(frozen=True)
class TextPiece:
    """One labelled piece of a row's text as the scaffold parser resolves it while sampling runs: policy
    text (tags arrive as whole pieces) or, with ``in_tool_output``, the environment's reply."""

    sample_index: int
    text: str
    stage: str  # plan | research | review | answer
    in_tool_output: bool


@dataclass
class RolloutRequest:
    """One prompt to sample ``n`` trajectories from; ``prompt_ids`` are final (chat template applied)."""

    request_id: str
    prompt_ids: list[int]
    n: int = 1
    sampling: SamplingParams = field(default_factory=SamplingParams)
    max_tool_calls: int = 10
    meta: dict[str, Any] = field(default_factory=dict)  # copied into every trajectory's meta
    # False for free text (reflections): the research scaffold's </answer> and tool-call tags do not end
    # or interrupt it; only eos, sampling.stop_texts and the length limits do
    scaffold: bool = True
    # called with every TextPiece of the request's rows as it is known (a live view); not for training
    on_text: Callable[[TextPiece], None] | None = field(default=None, repr=False, compare=False)
    # the chat ``prompt_ids`` encode: what an engine without a tokenizer (a model behind an API) sends
    messages: list[dict[str, str]] | None = field(default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not isinstance(self.request_id, str) or not self.request_id:
            raise RolloutError(f"RolloutRequest.request_id must be a non-empty string, got {self.request_id!r}")
        if self.n < 1:
            raise RolloutError(f"RolloutRequest {self.request_id!r}: n must be >= 1, got {self.n}")
        if self.max_tool_calls < 0:
            raise RolloutError(
                f"RolloutRequest {self.request_id!r}: max_tool_calls must be >= 0, got {self.max_tool_calls}"
            )
        if not isinstance(self.sampling, SamplingParams):
            raise RolloutError(f"RolloutRequest {self.request_id!r}: sampling must be a SamplingParams")
        self.prompt_ids = [int(t) for t in self.prompt_ids]


@dataclass(frozen=True)
class ForcedContext:
    """What a ``forced_policy`` hook sees about one row before its next token is chosen."""

    request_id: str
    sample_index: int
    turn: int  # 0 before the first tool output, then +1 after each
    turn_ids: list[int]  # tokens already produced in this turn
    policy_turns: list[str]  # decoded text of finished turns
    tool_outputs: list[str]  # environment replies so far (one per finished turn)


# Test/benchmark hook: return a token id to use instead of sampling (its logprob under the sampling
# distribution is still recorded), or None to sample. Never used in training.
ForcedPolicy = Callable[[ForcedContext], "int | None"]


@runtime_checkable
class RolloutEngine(Protocol):
    def generate(self, requests: list[RolloutRequest], tools: ToolEnv) -> list[list[TokenTrajectory]]:
        """``n`` trajectories per request, in request order; never raises for model or tool misbehaviour."""
        ...

    def update_weights(self, state_dict: Mapping[str, torch.Tensor]) -> None:
        """Load new policy weights (e.g. after an optimizer step)."""
        ...

    def sync_from(self, model: torch.nn.Module) -> None:
        """Copy weights from the trainer's module (a no-op when the engine shares that module)."""
        ...


@runtime_checkable
class StreamingRolloutEngine(RolloutEngine, Protocol):
    """An engine that reports while ``generate`` runs (every engine here: transformers, vLLM, vLLM server):
    the RL rollout task sets these hooks for its progress log and the streaming judge."""

    on_progress: Callable[[int, int], None] | None  # (finished rows, all rows)
    on_group_done: Callable[[int, list[TokenTrajectory]], None] | None  # (request index, its trajectories)
