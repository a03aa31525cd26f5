"""Copy probe: can a policy copy from its context at all?

Most of a research trace that is not fixed scaffold text is copied: the question's entity names into
the plan and the search calls, snippet ids and values into the state evaluations and the cited answer.
Transformers copy with induction heads. The probe measures that mechanism directly and in seconds: a
row of random ordinary tokens in which a random span appears twice; the score is argmax accuracy on the
second copy (minus its first token, which nothing predicts). Random tokens cannot be memorised, so only
looking back scores. Span lengths and both positions vary per row, so attending a fixed number of
tokens back (a positional shortcut) does not pass either.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch


def ordinary_token_ids(tokenizer: Any) -> list[int]:
    """Every id except special and added (scaffold tag) tokens."""
    reserved = set(tokenizer.all_special_ids) | set(tokenizer.get_added_vocab().values())
    ids = [i for i in range(len(tokenizer)) if i not in reserved]
    if len(ids) < 2:
        raise ValueError(f"the tokenizer has {len(ids)} ordinary tokens; the copy probe needs at least 2")
    return ids


def copy_task_batch(
    token_ids: torch.Tensor, batch_size: int, span_tokens: int, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids, labels), both (batch_size, 4·span_tokens); labels are -100 except on the repeat."""
    if span_tokens < 4:
        raise ValueError(f"span_tokens must be >= 4, got {span_tokens}")
    width = 4 * span_tokens  # room for the distance between the copies to vary widely
    input_ids = token_ids[torch.randint(0, len(token_ids), (batch_size, width), generator=generator)]
    labels = torch.full_like(input_ids, -100)
    for row in range(batch_size):
        length = int(torch.randint(4, span_tokens + 1, (1,), generator=generator))
        first = int(torch.randint(0, width - 2 * length + 1, (1,), generator=generator))
        second = int(torch.randint(first + length, width - length + 1, (1,), generator=generator))
        input_ids[row, second : second + length] = input_ids[row, first : first + length]
        labels[row, second + 1 : second + length] = input_ids[row, second + 1 : second + length]
    return input_ids, labels


@torch.no_grad()
def copy_accuracy(model: torch.nn.Module, input_ids: torch.Tensor, labels: torch.Tensor) -> float:
    """Fraction of labelled positions where the argmax next token is the copied one."""
    logits = model(input_ids=input_ids).logits[:, :-1]
    target = labels[:, 1:]
    scored = target != -100
    return float((logits.argmax(-1)[scored] == target[scored]).float().mean())


def probe_copying(
    model: torch.nn.Module, tokenizer: Any, span_tokens: Sequence[int] = (16, 64), rows: int = 32, seed: int = 0
) -> dict[int, float]:
    """Copy accuracy per maximum span length; 0 means the model has no working induction mechanism."""
    ids = torch.as_tensor(ordinary_token_ids(tokenizer), dtype=torch.long)
    was_training = model.training
    model.eval()
    try:
        return {
            span: copy_accuracy(model, *copy_task_batch(ids, rows, span, torch.Generator().manual_seed(seed + span)))
            for span in span_tokens
        }
    finally:
        model.train(was_training)
