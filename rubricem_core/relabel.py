"""Document-id relabelling for SFT: ids are arbitrary names, so training may rename them.

A teacher trace cites the ids it retrieved. A small policy trained on a few hundred traces learns
which ids tend to be cited (a unigram prior over the corpus) instead of copying the ids that its
tool outputs actually returned. Renaming every document id in a trajectory with a fresh random
bijection keeps the trace consistent (a snippet and the citations of it share the new id) while
making the id's name carry no information, so the only way to predict a cited id is to copy it from
the context. It works on token ids when each document id is one token (`policy.atomic_doc_ids`), so
lengths, the loss mask and stage ids are untouched.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from rubricem_core.trajectory import TokenTrajectory


def single_token_doc_ids(tokenizer: Any, doc_ids: Sequence[str]) -> list[int]:
    """Token ids of the document ids that the tokenizer encodes as exactly one token (all of them
    for the tiny tokenizer with ``policy.atomic_doc_ids``; usually none for a pretrained tokenizer,
    which then trains on the ids as they are)."""
    out: set[int] = set()
    for doc_id in doc_ids:
        ids = tokenizer.encode(doc_id, add_special_tokens=False)
        if len(ids) == 1:
            out.add(ids[0])
    return sorted(out)


def relabel_trajectory(trajectory: TokenTrajectory, id_tokens: Sequence[int], rng: random.Random) -> TokenTrajectory:
    """``trajectory`` with every token of ``id_tokens`` renamed by one random bijection of that set;
    everything else (other tokens, mask, stages, logprobs) is kept; segment texts keep the old names."""
    if not id_tokens:
        return trajectory
    shuffled = list(id_tokens)
    rng.shuffle(shuffled)
    rename = dict(zip(id_tokens, shuffled))
    return replace(trajectory, token_ids=[rename.get(t, t) for t in trajectory.token_ids])


def relabel_rng(seed: int, step: int, index: int) -> random.Random:
    """The renaming of trajectory ``index`` at optimizer ``step``: a pure function of the three, so a
    resumed run renames exactly as an uninterrupted one."""
    return random.Random(f"relabel:{seed}:{step}:{index}")
