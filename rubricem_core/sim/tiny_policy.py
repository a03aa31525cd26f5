"""The `tiny` profile's policy: a random-init Qwen3 causal LM with the project's own BPE tokenizer.

It is saved as an ordinary Hugging Face model directory, so every consumer (SFT trainer, the
transformers rollout engine, vLLM on a GPU node) loads it exactly like a hub checkpoint.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from transformers import GenerationConfig, Qwen3Config, Qwen3ForCausalLM

from rubricem_core.config import PolicyConfig
from rubricem_core.policy.loading import add_legacy_config_keys, staged_directory
from rubricem_core.policy.tokenizer import ENDOFTEXT, IM_END, save_tokenizer, train_bpe_tokenizer

SPEC_FILE = "tiny_policy_spec.json"  # the spec the directory was built from, for provenance


@dataclass
class TinyPolicySpec:
    """Shape of the tiny policy; the defaults give ≈1.3M parameters."""

    vocab_size: int = field(
        default=4096, metadata={"help": "Tokenizer and embedding size (BPE merges + tags + specials)."}
    )
    hidden_size: int = field(default=128, metadata={"help": "Width of the residual stream."})
    n_layers: int = field(default=4, metadata={"help": "Number of decoder layers."})
    n_heads: int = field(
        default=2, metadata={"help": "Query heads; head_dim = hidden_size / n_heads unless head_dim is set."}
    )
    n_kv_heads: int = field(
        default=1, metadata={"help": "Key/value heads (grouped-query attention); must divide n_heads."}
    )
    head_dim: int | None = field(
        default=None,
        metadata={
            "help": "Per-head width; None derives hidden_size / n_heads (64 by default, a size every vLLM attention backend supports)."
        },
    )
    intermediate_size: int = field(default=384, metadata={"help": "Width of the SwiGLU MLP."})
    max_position_embeddings: int = field(
        default=8192,
        metadata={"help": "Longest sequence (prompt + trajectory); at least 8192 so multi-round traces fit."},
    )
    tie_embeddings: bool = field(
        default=True, metadata={"help": "Share input embedding and LM head (saves vocab_size*hidden_size parameters)."}
    )
    seed: int = field(
        default=0, metadata={"help": "Seed of the weight initialisation; the same seed gives byte-identical weights."}
    )

    def __post_init__(self) -> None:
        positive = ("vocab_size", "hidden_size", "n_layers", "n_heads", "n_kv_heads", "intermediate_size")
        for name in positive:
            if getattr(self, name) <= 0:
                raise ValueError(f"TinyPolicySpec.{name} must be positive, got {getattr(self, name)}")
        if self.max_position_embeddings < 8192:
            raise ValueError(
                f"TinyPolicySpec.max_position_embeddings must be >= 8192 (multi-round traces), got {self.max_position_embeddings}"
            )
        if self.head_dim is None and self.hidden_size % self.n_heads:
            raise ValueError(
                f"TinyPolicySpec.hidden_size={self.hidden_size} is not divisible by n_heads={self.n_heads}; set head_dim"
            )
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"TinyPolicySpec.n_kv_heads={self.n_kv_heads} must divide n_heads={self.n_heads}")

    @property
    def resolved_head_dim(self) -> int:
        return self.head_dim if self.head_dim is not None else self.hidden_size // self.n_heads


def tiny_qwen3_config(spec: TinyPolicySpec, eos_token_id: int, pad_token_id: int) -> Qwen3Config:
    return Qwen3Config(
        vocab_size=spec.vocab_size,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.n_layers,
        num_attention_heads=spec.n_heads,
        num_key_value_heads=spec.n_kv_heads,
        head_dim=spec.resolved_head_dim,
        max_position_embeddings=spec.max_position_embeddings,
        tie_word_embeddings=spec.tie_embeddings,
        eos_token_id=eos_token_id,
        pad_token_id=pad_token_id,
        bos_token_id=None,  # ChatML has no BOS; the template starts every turn with <|im_start|>
        dtype="float32",
        architectures=["Qwen3ForCausalLM"],
    )


def init_tiny_model(config: Qwen3Config, seed: int) -> Qwen3ForCausalLM:
    """Random init from ``seed`` without disturbing the caller's global RNG state."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen3ForCausalLM(config)
    return model.to(torch.float32).eval()


def build_tiny_policy(
    texts: Iterable[str],
    out_dir: str | Path,
    spec: TinyPolicySpec | None = None,
    atomic_terms: Sequence[str] = (),
) -> Path:
    """Train the tokenizer on ``texts``, random-init the model, save both to ``out_dir``.

    ``atomic_terms`` (document ids) become single tokens; see ``train_bpe_tokenizer``.

    ``texts`` should cover what the policy will read and write: the world corpus, the scaffold's
    system prompt and example trace. ``out_dir`` must be absent or empty; it appears whole or not
    at all. Returns ``out_dir``, a directory that
    ``AutoModelForCausalLM.from_pretrained`` / ``AutoTokenizer.from_pretrained`` load.
    """
    spec = spec or TinyPolicySpec()
    out = Path(out_dir)
    tokenizer = train_bpe_tokenizer(texts, vocab_size=spec.vocab_size, atomic_terms=atomic_terms)
    if len(tokenizer) > spec.vocab_size:  # the trainer respects its budget; this guards the invariant
        raise ValueError(f"tokenizer has {len(tokenizer)} tokens but TinyPolicySpec.vocab_size={spec.vocab_size}")
    eos_id = tokenizer.convert_tokens_to_ids(IM_END)
    pad_id = tokenizer.convert_tokens_to_ids(ENDOFTEXT)
    model = init_tiny_model(tiny_qwen3_config(spec, eos_id, pad_id), spec.seed)
    model.generation_config = GenerationConfig(eos_token_id=eos_id, pad_token_id=pad_id, bos_token_id=None)
    with staged_directory(out) as staging:
        model.save_pretrained(staging, safe_serialization=True)
        add_legacy_config_keys(staging)
        save_tokenizer(tokenizer, staging)
        (staging / SPEC_FILE).write_text(json.dumps(asdict(spec), indent=2, sort_keys=True) + "\n")
    return out


def prepare_tiny_policy(
    policy: PolicyConfig, texts: Sequence[str], out_dir: str | Path, seed: int, atomic_terms: Sequence[str] = ()
) -> Path:
    """The tiny policy of a ``policy`` section (``name_or_path: tiny``), built in ``out_dir`` from ``texts``
    (rubricem_core.sft.prepare_policy's stand-in for a pretrained model)."""
    spec = TinyPolicySpec(
        vocab_size=policy.vocab_size,
        hidden_size=policy.hidden_size,
        n_layers=policy.n_layers,
        n_heads=policy.n_heads,
        n_kv_heads=policy.n_kv_heads,
        intermediate_size=policy.intermediate_size,
        max_position_embeddings=max(8192, policy.max_seq_len),
        seed=seed,
    )
    return build_tiny_policy(texts, out_dir, spec, atomic_terms=atomic_terms)
