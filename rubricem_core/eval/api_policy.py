"""A model behind an API (any litellm model) as the evaluated policy: the paper's Fig. 6c, a frontier model
prompted with and without the scaffold.

The checkpoint ``api:<model>`` samples with the scaffold's system prompt, ``api-plain:<model>`` with a prompt
that keeps the tools, evidence ids and final ``<answer>`` but asks for no plan, state evaluation or review
(``scaffold.plain_system_prompt``). ``eval.api_policy`` says how to reach the model (base URL, key variable,
concurrency, turn length, rounds). The loop is the teacher's (``teacher.rounds``): one chat request per
unfinished trajectory per round, generation stopped at ``</call_tool>``, the tool run, its output appended
as the next user turn, until ``</answer>``, the call budget or the round limit. Trajectories come back as
text segments (an API returns no token ids), so the evaluation's grading, validity and tables are the same
as a checkpoint's; ``completion_tokens`` is the provider's count.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from rubricem_core.config import RunConfig
from rubricem_core.eval.checkpoints import APIPolicySpec
from rubricem_core.llm.concurrent import run_concurrent
from rubricem_core.llm.endpoints import builtin_provider, endpoint_for
from rubricem_core.llm.types import EndpointSettings
from rubricem_core.rollout.types import ANSWERED, ERROR, TOOL_BUDGET, TRUNCATED, RolloutError, RolloutRequest
from rubricem_core.scaffold import ToolCall, plain_system_prompt, prompt_guidance, system_prompt
from rubricem_core.seeds import EVAL_API_TRAJECTORY, derive_seed
from rubricem_core.teacher.rounds import TrajectoryState, apply_result, build_requests
from rubricem_core.tools.base import ToolEnv
from rubricem_core.trajectory import TokenTrajectory

log = logging.getLogger(__name__)

# the loop's finish reasons as the rollout engine's (a round limit is a truncation)
_FINISH = {ANSWERED: ANSWERED, TOOL_BUDGET: TOOL_BUDGET, TRUNCATED: TRUNCATED, "max_rounds": TRUNCATED}


class APIPolicyEngine:
    """The rollout engine protocol over a chat API: ``generate`` reads each request's ``messages``."""

    def __init__(
        self, settings: EndpointSettings, *, scaffold: bool, max_rounds: int, max_tokens: int, seed: int = 0
    ) -> None:
        if max_rounds < 1 or max_tokens < 1:
            raise RolloutError(f"an API policy needs max_rounds and max_tokens >= 1, got {max_rounds}, {max_tokens}")
        self.settings = settings
        self.scaffold = scaffold
        self.max_rounds = max_rounds
        self.max_tokens = max_tokens
        self.seed = seed
        self.on_progress: Callable[[int, int], None] | None = None
        self.on_group_done: Callable[[int, list[TokenTrajectory]], None] | None = None

    def _messages(self, request: RolloutRequest, tools: ToolEnv) -> list[dict[str, str]]:
        if not request.messages:
            raise RolloutError(
                f"request {request.request_id!r}: an API policy needs the chat (RolloutRequest.messages)"
            )
        messages = [dict(m) for m in request.messages]
        if messages[0]["role"] == "system":  # the full instructions (or none), whatever the policy's prompt style
            guidance = prompt_guidance(messages[0]["content"])
            prompt = system_prompt if self.scaffold else plain_system_prompt
            messages[0]["content"] = prompt(tools.specs(), guidance)
        return messages

    def generate(self, requests: list[RolloutRequest], tools: ToolEnv) -> list[list[TokenTrajectory]]:
        """``n`` trajectories per request, in request order; a failed call ends its trajectory (``error``)."""
        states: list[TrajectoryState] = []
        owner: list[tuple[int, RolloutRequest, ToolEnv]] = []
        for index, request in enumerate(requests):
            messages = self._messages(request, tools)
            for sample in range(request.n):
                seed = derive_seed(
                    self.seed if request.sampling.seed is None else request.sampling.seed,
                    EVAL_API_TRAJECTORY,
                    index,
                    sample,
                )
                states.append(
                    TrajectoryState(f"{request.request_id}#{sample}", request.request_id, sample, seed, list(messages))
                )
                owner.append((index, request, tools.fork()))
        by_id = {s.trajectory_id: (s, o) for s, o in zip(states, owner)}
        temperature = requests[0].sampling.temperature if requests else 0.0
        for round_index in range(self.max_rounds):
            chats = build_requests(states, round_index, self.settings.model, self.max_tokens, temperature)
            if not chats:
                break
            results = {r.custom_id: r for r in run_concurrent(chats, self.settings)}
            for chat in chats:
                state, (_, request, env) = by_id[chat.metadata["trajectory_id"]]
                apply_result(
                    state,
                    results[chat.custom_id],
                    _runner(env),
                    round_index,
                    self.max_rounds,
                    request.max_tool_calls,
                )
            if self.on_progress is not None:
                self.on_progress(sum(s.finished for s in states), len(states))
        groups: list[list[TokenTrajectory]] = [[] for _ in requests]
        for state, (index, request, _) in zip(states, owner):
            groups[index].append(_trajectory(state, request))
        for index, group in enumerate(groups):
            if self.on_group_done is not None:
                self.on_group_done(index, group)
        return groups

    def update_weights(self, state_dict: Any) -> None:
        raise RolloutError("a model behind an API has no weights to update: it is evaluated, never trained")


def _runner(env: ToolEnv) -> Callable[[ToolCall], str]:
    """The trajectory's own tool environment (its own call budget) as the loop's tool runner."""
    return lambda call: env.execute(call).text


def _trajectory(state: TrajectoryState, request: RolloutRequest) -> TokenTrajectory:
    """The state as a trajectory of text segments: the prompt, then the model's turns and the tool outputs."""
    traj = TokenTrajectory.empty()
    prompt_turns = len(request.messages or [])
    traj.append("prompt", None, [], "\n\n".join(m["content"] for m in state.messages[:prompt_turns]))
    for message in state.messages[prompt_turns:]:
        traj.append("policy" if message["role"] == "assistant" else "tool_output", None, [], message["content"])
    traj.n_tool_calls = state.n_tool_calls
    traj.finish_reason = _FINISH.get(state.finish_reason or "", ERROR)
    traj.meta = {**request.meta, "completion_tokens": state.completion_tokens, "rounds": state.n_rounds}
    if state.error:
        traj.meta["error"] = state.error
    return traj


def api_engine(cfg: RunConfig, spec: APIPolicySpec, api_key: str | None = None) -> tuple[APIPolicyEngine, None]:
    """(engine, no tokenizer) for ``spec`` reached through ``cfg.eval.api_policy``; the built-in teacher
    (``rubricem-teacher/...``, offline) is configured from the run's teacher section, as in collection."""
    section = cfg.eval.api_policy
    if builtin_provider(spec.model) == "rubricem-teacher":
        settings = endpoint_for(
            cfg.teacher.model_copy(update={"model": spec.model}), max_tool_calls=cfg.tools.max_tool_calls
        )
    else:
        settings = endpoint_for(section.model_copy(update={"model": spec.model}), api_key=api_key)
    engine = APIPolicyEngine(
        settings, scaffold=spec.scaffold, max_rounds=section.max_rounds, max_tokens=section.max_tokens, seed=cfg.seed
    )
    return engine, None


def api_engine_settings(cfg: RunConfig, spec: APIPolicySpec) -> dict[str, Any]:
    """What an eval part's settings digest records of an API policy (a change evaluates it again)."""
    reach = cfg.eval.api_policy.model_dump(mode="json", include={"api_base", "max_tokens", "max_rounds"})
    return {"api": spec.model, "scaffold": spec.scaffold, **reach}
