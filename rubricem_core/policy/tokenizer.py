"""A byte-level BPE tokenizer for the tiny policy, trained on the world corpus and the scaffold.

Byte-level means every UTF-8 string encodes (no unknown token) and decodes back byte-exact: there
is no normalizer, and the pre-tokenizer only splits, it never rewrites. Every scaffold tag is one
*added* token that is not special, so ``decode(skip_special_tokens=True)`` keeps it and the rollout
parser sees tags as whole tokens; the chat markers are special tokens with a Qwen-style template.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from rubricem_core.scaffold import TAG_NAMES

IM_START = "<|im_start|>"
IM_END = "<|im_end|>"  # end of a chat turn: the eos token
ENDOFTEXT = "<|endoftext|>"  # padding
SPECIAL_TOKENS: tuple[str, ...] = (ENDOFTEXT, IM_START, IM_END)

# Opening pieces that carry an attribute. Whole tool calls for the two built-in tools, a generic
# ``<call_tool name="`` prefix for other tools, and the id prefixes of snippets and citations (the id
# itself stays ordinary text so new ids need no new tokens). Added tokens match leftmost-longest,
# so ``<call_tool name="search">`` wins over the generic prefix.
ATTRIBUTE_PIECES: tuple[str, ...] = (
    '<call_tool name="search">',
    '<call_tool name="browse">',
    '<call_tool name="',
    '<snippet id="',
    '<cite id="',
)
TAG_TOKENS: tuple[str, ...] = (
    tuple(piece for name in TAG_NAMES for piece in (f"<{name}>", f"</{name}>")) + ATTRIBUTE_PIECES
)

# Qwen-style split: letters with one leading non-letter, single digits (numbers generalise better
# digit by digit), punctuation runs with trailing newlines, newline runs, other whitespace.
_SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# Qwen-style ChatML template: one block per message, an open assistant turn on request.
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- endif %}"
)

_PIECE_RE = re.compile("|".join(re.escape(p) for p in sorted(SPECIAL_TOKENS + TAG_TOKENS, key=len, reverse=True)))


def _without_added_pieces(texts: Iterable[str]) -> Iterator[str]:
    """Cut tags and chat markers out of the training text: they are whole tokens already, so BPE
    must not spend merges on their fragments."""
    for text in texts:
        if not isinstance(text, str):
            raise TypeError(f"train_bpe_tokenizer texts must be str, got {type(text).__name__}")
        for piece in _PIECE_RE.split(text):
            if piece:
                yield piece


def _build_backend(texts: Iterable[str], vocab_size: int, atomic_terms: Sequence[str] = ()) -> Tokenizer:
    n_reserved = len(SPECIAL_TOKENS) + len(TAG_TOKENS) + len(atomic_terms)
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    if vocab_size < n_reserved + len(alphabet):
        raise ValueError(
            f"vocab_size={vocab_size} is too small: the 256 byte symbols and {n_reserved} special/tag tokens "
            f"alone need {n_reserved + len(alphabet)}"
            + (f" (including {len(atomic_terms)} atomic terms)" if atomic_terms else "")
        )
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(_SPLIT_PATTERN), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    # Tags and atomic terms are added after training, so the BPE vocabulary gets what is left of the budget.
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - len(TAG_TOKENS) - len(atomic_terms),
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=sorted(alphabet),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_without_added_pieces(texts), trainer=trainer)
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in TAG_TOKENS])
    if atomic_terms:
        tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in atomic_terms])
    return tokenizer


def _checked_atomic_terms(terms: Sequence[str]) -> tuple[str, ...]:
    out = tuple(dict.fromkeys(terms))
    reserved = set(SPECIAL_TOKENS) | set(TAG_TOKENS)
    for term in out:
        if not isinstance(term, str) or not term or term != term.strip() or term in reserved:
            raise ValueError(f"atomic term {term!r} must be a non-empty str without surrounding whitespace, not a tag")
    return out


def train_bpe_tokenizer(
    texts: Iterable[str],
    vocab_size: int = 4096,
    out_dir: str | Path | None = None,
    atomic_terms: Sequence[str] = (),
) -> PreTrainedTokenizerFast:
    """Train the byte-level BPE on ``texts``; the result has at most ``vocab_size`` tokens.

    ``atomic_terms`` (e.g. the corpus's document ids) become one added token each, so citing a
    retrieved id is copying one token from the context rather than a digit sequence.

    Deterministic for the same texts in the same order. With ``out_dir`` the tokenizer is saved
    there as Hugging Face tokenizer files (tokenizer.json, tokenizer_config.json, chat template).
    """
    atomic_terms = _checked_atomic_terms(atomic_terms)
    backend = _build_backend(texts, vocab_size, atomic_terms)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        eos_token=IM_END,
        pad_token=ENDOFTEXT,
        additional_special_tokens=[IM_START],
        chat_template=CHAT_TEMPLATE,
        clean_up_tokenization_spaces=False,  # decode must return the exact text
        model_max_length=1 << 20,
    )
    if out_dir is not None:
        save_tokenizer(tokenizer, out_dir)
    return tokenizer


def save_tokenizer(tokenizer: PreTrainedTokenizerFast, out_dir: str | Path) -> Path:
    """Save as HF files readable by transformers 4.x and 5.x (and so by vLLM); works for any fast tokenizer."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(out)
    config_path = out / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    # transformers 5 names its fast class TokenizersBackend; 4.x only knows PreTrainedTokenizerFast,
    # which 5.x still resolves. The template also goes inline for readers that ignore the .jinja file.
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    # 5.x writes extra special tokens as a list, which 4.x rejects (it expects a dict there).
    extra = config.get("extra_special_tokens")
    if isinstance(extra, list):
        config.pop("extra_special_tokens")
        config["additional_special_tokens"] = extra
    config["chat_template"] = tokenizer.chat_template
    config_path.write_text(json.dumps(config, indent=2, ensure_ascii=False, sort_keys=True) + "\n")
    return out
