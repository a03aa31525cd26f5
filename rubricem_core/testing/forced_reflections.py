"""Question-specific reflections forced into the rollout engine (tests and the deferral benchmark).

The tiny SFT policy has never seen a reflection prompt, so left alone it writes no valid reflection and
the reflection judge is never called. ``forcing_engine`` wraps ``rubricem_core.rollout.factory``'s
``HFRolloutEngine`` so that, for reflection requests of the training queries in ``questions`` (request ids
are source rollout ids, ``<query>-sNNNN-rK``), even-numbered candidates spell ``reflection_for(question)``
token by token through the engine's ``forced_policy`` hook (sampling logprobs are still recorded); task
rollouts, odd candidates and every other request (an evaluation's samples) are sampled freely.
"""

from __future__ import annotations

import re
from collections.abc import Callable

_QUESTION_WORDS = {"What", "Which", "When", "Who", "How", "In", "Of", "The", "List", "Compare", "Give"}


def reflection_for(question: str) -> str:
    names = [
        n for n in dict.fromkeys(re.findall(r"\b[A-Z][a-z]+(?: [A-Z][a-z]+)*", question)) if n not in _QUESTION_WORDS
    ][:3] or ["the entities asked about"]
    listed = ", ".join(names)
    return (
        "<reflection>\n<reflection_rubrics>\n"
        f"- Gives the requested value for each of {listed}, each backed by its own retrieved passage\n"
        f"- Does not confuse {names[0]} with a look-alike name\n"
        "</reflection_rubrics>\n<takeaways>\n"
        f"- Search for {names[0]} alone first, then browse its passage to confirm the value\n"
        f"- Compare the values for {listed} only after every one is verified\n"
        "</takeaways>\n</reflection>"
    )


def forcing_engine(real_engine: Callable, questions: dict[str, str]) -> Callable:
    """A drop-in for the engine class whose instances force even reflection candidates."""

    def engine(model, tokenizer, *args, **kwargs):
        cache: dict[str, list[int]] = {}
        eos = tokenizer.convert_tokens_to_ids("<|im_end|>")

        def force(ctx):
            if "-s" not in ctx.request_id or ctx.sample_index % 2:
                return None
            question = questions.get(ctx.request_id.rsplit("-s", 1)[0])
            if question is None:  # not a reflection of a training query (an evaluation's sample): free
                return None
            ids = cache.setdefault(ctx.request_id, tokenizer.encode(reflection_for(question), add_special_tokens=False))
            return ids[len(ctx.turn_ids)] if len(ctx.turn_ids) < len(ids) else eos

        return real_engine(model, tokenizer, *args, forced_policy=force, **kwargs)

    return engine
