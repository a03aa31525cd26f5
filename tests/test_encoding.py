"""Token-level encoding of prompts, tool outputs and SFT trajectories."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from rubricem_core.encoding import (
    EncodingError,
    TrajectoryTooLong,
    decode_segments,
    encode_prompt,
    encode_tool_output,
    encode_trajectory,
)
from rubricem_core.scaffold import EXAMPLE_TRACE, STAGE_IDS, TAG_NAMES, parse_segments, system_prompt, validate
from rubricem_core.trajectory import NO_STAGE

QWEN_STYLE_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

PLAN = """<structured_plan>
<deep_analysis>Who founded Halden Observatory and what did it discover?</deep_analysis>
<rubric>
<knowledge_checklist>
- Founder of Halden Observatory
</knowledge_checklist>
<analytical_criteria>
- Explains why the discovery mattered
</analytical_criteria>
<negative_constraints>
- No unsupported dates
</negative_constraints>
</rubric>
<research_plan>
1. Search the founder.
2. Browse the comet document.
</research_plan>
</structured_plan>
"""
CALL_1 = '<call_tool name="search">Halden Observatory founder</call_tool>'
OUTPUT_1 = (
    '<tool_output><snippet id="D4">Halden Observatory was founded by Ilse Marr in 1902 — in Växjö.</snippet>'
    '<snippet id="D9">Marr catalogued the Halden comet.</snippet></tool_output>'
)
EVAL_1 = "\n<state_evaluation>Founder found (D4); comet partly (D9). Verdict: continue</state_evaluation>\n"
CALL_2 = '<call_tool name="browse">D9</call_tool>'
OUTPUT_2 = '<tool_output><snippet id="D9">The Halden comet (彗星) was catalogued in 1911.</snippet></tool_output>'
EVAL_2 = "\n<state_evaluation>Every checklist item has evidence. Verdict: ready</state_evaluation>\n"
REVIEW = """<review>
<rubric_review>Founder -> D4. Comet -> D9.</rubric_review>
<writing_plan><thesis>Marr's observatory found the Halden comet.</thesis><outline>1. Founding 2. Comet</outline></writing_plan>
</review>
"""
ANSWER = (
    '<answer>Halden Observatory <cite id="D4">was founded by Ilse Marr in 1902</cite>; '
    '<cite id="D9">the comet (彗星) was catalogued in 1911</cite>.</answer>'
)
TRACE = PLAN + CALL_1 + OUTPUT_1 + EVAL_1 + CALL_2 + OUTPUT_2 + EVAL_2 + REVIEW + ANSWER
MESSAGES = [
    {"role": "system", "content": system_prompt(guidance="Search the founder before the discovery.")},
    {"role": "user", "content": "Who founded Halden Observatory, and what did it discover?"},
]


def build_tokenizer(out_dir: Path, tags_as_tokens: bool, trim_offsets: bool) -> PreTrainedTokenizerFast:
    """A small byte-level BPE trained on scaffold text, saved and reloaded from ``out_dir``."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=trim_offsets)
    trainer = trainers.BpeTrainer(
        vocab_size=700,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([EXAMPLE_TRACE, TRACE, system_prompt()] * 2, trainer)
    if tags_as_tokens:
        tok.add_tokens([f"<{name}>" for name in TAG_NAMES] + [f"</{name}>" for name in TAG_NAMES])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    fast.chat_template = QWEN_STYLE_TEMPLATE
    fast.save_pretrained(out_dir)
    return AutoTokenizer.from_pretrained(out_dir)


def project_tokenizer(out_dir: Path) -> PreTrainedTokenizerFast:
    """The tiny policy's own tokenizer (Qwen-style split, tags and attribute pieces as tokens)."""
    from rubricem_core.policy.tokenizer import train_bpe_tokenizer

    train_bpe_tokenizer([EXAMPLE_TRACE, TRACE, system_prompt()] * 2, vocab_size=800, out_dir=out_dir)
    return AutoTokenizer.from_pretrained(out_dir)


TOKENIZER_KINDS = {
    "tags": dict(tags_as_tokens=True, trim_offsets=False),
    "plain": dict(tags_as_tokens=False, trim_offsets=False),  # tags split into "<", "answer", ">"
    "trimmed": dict(tags_as_tokens=False, trim_offsets=True),  # offsets leave out leading spaces
}


@pytest.fixture(scope="module", params=[*TOKENIZER_KINDS, "project"])
def tokenizer(request, tmp_path_factory) -> PreTrainedTokenizerFast:
    out_dir = tmp_path_factory.mktemp(request.param)
    if request.param == "project":
        return project_tokenizer(out_dir)
    return build_tokenizer(out_dir, **TOKENIZER_KINDS[request.param])


def char_stages(text: str) -> list[str]:
    out: list[str] = []
    for segment in parse_segments(text):
        out += [segment.stage] * len(segment.text)
    return out


def test_trace_is_valid_with_two_tool_calls():
    assert validate(TRACE) == []
    assert sum(s.is_tool_output for s in parse_segments(TRACE)) == 2


def test_prompt_is_chat_template_with_generation_prompt(tokenizer):
    ids = encode_prompt(tokenizer, MESSAGES)
    text = tokenizer.decode(ids, skip_special_tokens=False)
    assert text.startswith("<|im_start|>system\n") and text.endswith("<|im_start|>assistant\n")
    assert "Search the founder before the discovery." in text  # guidance sits inside the system prompt
    assert ids.count(tokenizer.convert_tokens_to_ids("<|im_start|>")) == 3


def test_masks_and_stages_at_every_token(tokenizer):
    traj = encode_trajectory(tokenizer, MESSAGES, TRACE, finished=True)
    prompt_ids = encode_prompt(tokenizer, MESSAGES)
    assert traj.token_ids[: traj.prompt_len] == prompt_ids
    assert traj.loss_mask[: traj.prompt_len] == [0] * len(prompt_ids)
    assert traj.stage_ids[: traj.prompt_len] == [NO_STAGE] * len(prompt_ids)

    stages = char_stages(TRACE)
    offset = 0  # char offset in TRACE of the current segment
    kinds = []
    for seg in traj.segments[1:]:
        kinds.append(seg.kind)
        mask = traj.loss_mask[seg.start : seg.end]
        stage_ids = traj.stage_ids[seg.start : seg.end]
        if seg.kind == "tool_output":
            assert mask == [0] * len(mask)
            assert stage_ids == [STAGE_IDS["research"]] * len(mask)
            assert traj.token_ids[seg.start : seg.end] == encode_tool_output(tokenizer, seg.text)
            assert seg.text in (OUTPUT_1, OUTPUT_2)
        elif seg is traj.segments[-1]:
            assert traj.token_ids[seg.start : seg.end] == [tokenizer.eos_token_id]
            assert (mask, stage_ids) == ([1], [STAGE_IDS["answer"]])
            continue
        else:
            assert mask == [1] * len(mask)
            # A token's stage is its first character's; with tags single tokens or tags split at
            # "<", a stage begins exactly where its tag does, so every char of the segment agrees.
            assert {stages[c] for c in range(offset, offset + len(seg.text))} == {seg.stage}
            assert stage_ids == [STAGE_IDS[seg.stage]] * len(mask)
        assert TRACE[offset : offset + len(seg.text)] == seg.text
        offset += len(seg.text)
    assert offset == len(TRACE)
    assert kinds.count("tool_output") == 2 and traj.n_tool_calls == 2
    # Exact boundaries: the trajectory's segments are parse_segments' view, one policy run per stage.
    view = [(s.kind == "tool_output", s.stage, s.text) for s in traj.segments[1:-1]]
    assert view == [(s.is_tool_output, s.stage, s.text) for s in parse_segments(TRACE)]
    assert [s.stage for s in traj.segments[1:-1] if s.kind == "policy"] == [
        "plan",
        "research",
        "research",
        "research",
        "review",
        "answer",
    ]


def test_each_segment_decodes_to_its_text(tokenizer):
    traj = encode_trajectory(tokenizer, MESSAGES, TRACE, finished=True)
    decoded = decode_segments(tokenizer, traj)
    assert decoded == [s.text for s in traj.segments]
    assert "".join(decoded[1:-1]) == TRACE
    assert decoded[-1] == "<|im_end|>"


def test_policy_runs_are_tokenized_once_never_the_whole_text(tokenizer):
    """Spy on every string the tokenizer encodes: runs between tool outputs, never the full trace."""
    seen: list[str] = []

    class Spy:
        def __getattr__(self, name: str) -> Any:
            return getattr(tokenizer, name)

        def __call__(self, text: str, **kwargs: Any) -> Any:
            seen.append(text)
            return tokenizer(text, **kwargs)

        def encode(self, text: str, **kwargs: Any) -> list[int]:
            seen.append(text)
            return tokenizer.encode(text, **kwargs)

    traj = encode_trajectory(Spy(), MESSAGES, TRACE, finished=False)
    runs = [PLAN + CALL_1, EVAL_1 + CALL_2, EVAL_2 + REVIEW + ANSWER]
    assert [t for t in seen if t in runs] == runs
    assert TRACE not in seen
    # The engine's view: prompt, then each run's ids and each tool output's ids, appended.
    expected = encode_prompt(tokenizer, MESSAGES)
    for run, output in zip(runs, [OUTPUT_1, OUTPUT_2, None]):
        expected += tokenizer.encode(run, add_special_tokens=False)
        if output is not None:
            expected += encode_tool_output(tokenizer, output)
    assert traj.token_ids == expected


def test_finished_adds_end_of_turn(tokenizer):
    open_traj = encode_trajectory(tokenizer, MESSAGES, TRACE, finished=False)
    done = encode_trajectory(tokenizer, MESSAGES, TRACE, finished=True)
    assert len(done) == len(open_traj) + 1
    assert done.token_ids[:-1] == open_traj.token_ids
    assert done.token_ids[-1] == tokenizer.eos_token_id
    assert open_traj.token_ids[-1] != tokenizer.eos_token_id
    assert (done.loss_mask[-1], done.stage_ids[-1]) == (1, STAGE_IDS["answer"])
    assert done.n_policy_tokens == open_traj.n_policy_tokens + 1


def test_too_long_raises_with_lengths(tokenizer):
    n = len(encode_trajectory(tokenizer, MESSAGES, TRACE, finished=True))
    assert len(encode_trajectory(tokenizer, MESSAGES, TRACE, finished=True, max_len=n)) == n
    with pytest.raises(TrajectoryTooLong, match=f"{n} tokens.*max_len {n - 1}") as info:
        encode_trajectory(tokenizer, MESSAGES, TRACE, finished=True, max_len=n - 1)
    assert (info.value.length, info.value.max_len) == (n, n - 1)


def test_truncated_trace_ending_inside_tool_output(tokenizer):
    """A trace cut inside a tool output keeps that output masked and adds no eos."""
    text = PLAN + CALL_1 + OUTPUT_1[:60]
    traj = encode_trajectory(tokenizer, MESSAGES, text, finished=False)
    assert [(s.kind, s.stage) for s in traj.segments] == [
        ("prompt", None),
        ("policy", "plan"),
        ("policy", "research"),
        ("tool_output", "research"),
    ]
    last = traj.segments[-1]
    assert traj.loss_mask[last.start :] == [0] * (last.end - last.start)
    assert decode_segments(tokenizer, traj)[-1] == OUTPUT_1[:60]


def test_no_chat_template_names_the_tokenizer(tmp_path):
    tok = build_tokenizer(tmp_path / "tok", tags_as_tokens=True, trim_offsets=False)
    tok.chat_template = None
    with pytest.raises(EncodingError, match=str(tmp_path / "tok")):
        encode_prompt(tok, MESSAGES)
    with pytest.raises(EncodingError, match="chat_template"):
        encode_trajectory(tok, MESSAGES, TRACE, finished=True)
