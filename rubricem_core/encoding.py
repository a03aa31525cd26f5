"""Text → token ids for prompts, tool outputs and whole SFT trajectories.

Shared by SFT and the rollout engine, so both build the same token sequence:

    prompt (chat template + generation prompt)  mask 0, NO_STAGE
    policy run                                  mask 1, stage of each token
    <tool_output>…</tool_output>                mask 0, research   (via encode_tool_output)
    policy run …
    end-of-turn token (when finished)           mask 1, answer

A policy run is the maximal text between two tool outputs. It is tokenized once, as one piece,
because that is how the engine produces it: generation stops right after ``</call_tool>``, the
environment's ids are appended, and generation resumes. Tokenizing the whole text at once would
merge tokens across those boundaries and train on sequences the policy never sees.
"""

from __future__ import annotations

import bisect
import math
from typing import Any

from rubricem_core.scaffold import parse_segments
from rubricem_core.trajectory import NO_STAGE, TokenSegment, TokenTrajectory

TOOL_OUTPUT_STAGE = "research"
END_STAGE = "answer"


class EncodingError(ValueError):
    """A tokenizer or input cannot be encoded the way the trainer and engine need."""


class TrajectoryTooLong(EncodingError):
    """The encoded trajectory exceeds ``max_len`` tokens."""

    def __init__(self, length: int, max_len: int, prompt_len: int):
        self.length, self.max_len, self.prompt_len = length, max_len, prompt_len
        super().__init__(f"trajectory has {length} tokens (prompt {prompt_len}), over max_len {max_len}")


def _tokenizer_name(tokenizer: Any) -> str:
    return getattr(tokenizer, "name_or_path", "") or f"<in-memory {type(tokenizer).__name__}>"


def _render_prompt(tokenizer: Any, messages: list[dict], **template_kwargs: Any) -> str:
    if not getattr(tokenizer, "chat_template", None):
        raise EncodingError(
            f"tokenizer {_tokenizer_name(tokenizer)} has no chat_template; set one in its tokenizer_config"
        )
    if not messages:
        raise EncodingError("encode_prompt needs at least one message")
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **template_kwargs)


def encode_prompt(tokenizer: Any, messages: list[dict], **template_kwargs: Any) -> list[int]:
    """Chat-template ids for ``messages`` ending in the assistant generation prompt.

    ``template_kwargs`` reach the template (e.g. ``enable_thinking=False`` for Qwen3).
    """
    rendered = _render_prompt(tokenizer, messages, **template_kwargs)
    # The template already wrote every special token; a BOS added here would appear twice.
    return list(tokenizer.encode(rendered, add_special_tokens=False))


def encode_tool_output(tokenizer: Any, text: str) -> list[int]:
    """THE ids of one environment reply; the rollout engine appends exactly these."""
    return list(tokenizer.encode(text, add_special_tokens=False))


def end_of_turn_id(tokenizer: Any) -> int:
    """The id that ends the assistant turn (the generation stop token and the last SFT target)."""
    eos = getattr(tokenizer, "eos_token_id", None)
    if eos is None:
        raise EncodingError(f"tokenizer {_tokenizer_name(tokenizer)} has no eos_token; set it to the end-of-turn token")
    return int(eos)


def _token_char_ends(offsets: list[tuple[int, int]], n_chars: int) -> list[int]:
    """Partition ``[0, n_chars)`` by token: token i covers ``[ends[i-1], ends[i])``.

    Offsets may be trimmed (a leading space left out) or shared (bytes of one multi-byte char);
    taking a running max of the end offsets gives every char to exactly one token.
    """
    ends: list[int] = []
    last = 0
    for _, end in offsets:
        last = max(last, end)
        ends.append(last)
    if ends:
        ends[-1] = n_chars
    return ends


def _encode_policy_run(
    tokenizer: Any,
    traj: TokenTrajectory,
    text: str,
    base: int,
    seg_starts: list[int],
    seg_stages: list[str],
) -> None:
    """Tokenize one policy run once and append it as one segment per stage change."""
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids: list[int] = list(enc["input_ids"])
    if not ids:
        return
    ends = _token_char_ends([tuple(o) for o in enc["offset_mapping"]], len(text))
    # A token's stage is that of its first character (global offset base + its start).
    starts = [0] + ends[:-1]
    stages = [seg_stages[bisect.bisect_right(seg_starts, base + s) - 1] for s in starts]
    run_start = 0
    for i in range(1, len(ids) + 1):
        if i == len(ids) or stages[i] != stages[run_start]:
            char_from, char_to = starts[run_start], ends[i - 1]
            traj.append("policy", stages[run_start], ids[run_start:i], text[char_from:char_to])
            run_start = i


def encode_trajectory(
    tokenizer: Any,
    prompt_messages: list[dict],
    text: str,
    finished: bool,
    max_len: int | None = None,
    **template_kwargs: Any,
) -> TokenTrajectory:
    """The SFT view of one trace: prompt, policy runs and tool outputs, each tokenized once."""
    traj = TokenTrajectory.empty()
    prompt_text = _render_prompt(tokenizer, prompt_messages, **template_kwargs)
    prompt_ids = list(tokenizer.encode(prompt_text, add_special_tokens=False))  # = encode_prompt
    traj.append("prompt", None, prompt_ids, prompt_text)
    traj.prompt_len = len(prompt_ids)

    segments = parse_segments(text)
    seg_starts = [s.start for s in segments]
    seg_stages = [s.stage for s in segments]
    run_from = 0  # char offset where the current policy run began
    n_tool_outputs = 0
    for segment in segments:
        if not segment.is_tool_output:
            continue
        if segment.start > run_from:
            _encode_policy_run(tokenizer, traj, text[run_from : segment.start], run_from, seg_starts, seg_stages)
        traj.append("tool_output", TOOL_OUTPUT_STAGE, encode_tool_output(tokenizer, segment.text), segment.text)
        n_tool_outputs += 1
        run_from = segment.end
    if run_from < len(text):
        _encode_policy_run(tokenizer, traj, text[run_from:], run_from, seg_starts, seg_stages)
    if finished:
        eos = end_of_turn_id(tokenizer)
        traj.append("policy", END_STAGE, [eos], tokenizer.convert_ids_to_tokens(eos))

    traj.n_tool_calls = n_tool_outputs
    traj.finish_reason = "stop" if finished else None
    if max_len is not None and len(traj) > max_len:
        raise TrajectoryTooLong(len(traj), max_len, traj.prompt_len)
    return traj


def encode_completion(
    tokenizer: Any,
    prompt_messages: list[dict],
    completion: str,
    stage_id: int,
    max_len: int | None = None,
    **template_kwargs: Any,
) -> TokenTrajectory:
    """A one-turn SFT example (the reflection task): the prompt exactly as ``encode_prompt`` gives it
    to the sampler, then the completion and the end-of-turn token, trained under ``stage_id``."""
    prompt_text = _render_prompt(tokenizer, prompt_messages, **template_kwargs)
    prompt_ids = list(tokenizer.encode(prompt_text, add_special_tokens=False))
    ids = list(tokenizer.encode(completion, add_special_tokens=False)) + [end_of_turn_id(tokenizer)]
    n, m = len(prompt_ids), len(ids)
    traj = TokenTrajectory(
        token_ids=prompt_ids + ids,
        loss_mask=[0] * n + [1] * m,
        stage_ids=[NO_STAGE] * n + [stage_id] * m,
        logprobs=[math.nan] * (n + m),
        segments=[TokenSegment("prompt", None, 0, n, prompt_text), TokenSegment("policy", None, n, n + m, completion)],
        prompt_len=n,
        finish_reason="stop",
    )
    if max_len is not None and len(traj) > max_len:
        raise TrajectoryTooLong(len(traj), max_len, traj.prompt_len)
    return traj


def decode_segments(tokenizer: Any, traj: TokenTrajectory) -> list[str]:
    """Decode each segment's ids on their own (tests: equals each segment's ``text``)."""
    return [
        tokenizer.decode(traj.token_ids[s.start : s.end], skip_special_tokens=False, clean_up_tokenization_spaces=False)
        for s in traj.segments
    ]
