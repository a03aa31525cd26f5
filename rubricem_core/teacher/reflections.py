"""Teacher-written reflections: SFT examples of the reflection meta-policy's task.

For every accepted trajectory the teacher is asked exactly what the policy is asked during RL
(``reflection.format.reflection_messages``: the question and the raw trajectory, nothing privileged)
and its reply is checked with the meta-policy's own validator. Valid replies are stored in their
canonical rendering, so SFT teaches one format; each row keeps the prompt it answered, which SFT
encodes as the meta-policy's prompt.
"""

from __future__ import annotations

import json
import random
from collections.abc import Sequence
from typing import Any

from rubricem_core.llm.types import ChatRequest, ChatResult
from rubricem_core.reflection.format import REFLECTION_STOP, parse_reflection, reflection_messages, validate_reflection
from rubricem_core.seeds import TEACHER_REFLECTION_CUTS, TEACHER_REFLECTION_REQUEST, derive_seed

REQUEST_FAILED = "request_failed"  # the call itself failed (retried by a rerun); not a format problem


def reflection_request_id(trajectory_id: str, variant: int = 0) -> str:
    return f"{trajectory_id}-reflection" + (f"-p{variant}" if variant else "")


def reflection_sources(trajectories: Sequence[dict[str, Any]], prefixes: int, seed: int) -> list[dict[str, Any]]:
    """What the teacher reflects on: each trajectory whole, and ``prefixes`` cuts of it at seeded points
    (an attempt that stopped early: what RL rollouts often are), so the policy learns the format for
    attempts of every length and state, not only for finished teacher traces."""
    out = []
    for i, row in enumerate(trajectories):
        text = row["text"]
        out.append({**row, "variant": 0, "text": text, "seed": derive_seed(seed, TEACHER_REFLECTION_REQUEST, i, 0)})
        rng = random.Random(derive_seed(seed, TEACHER_REFLECTION_CUTS, i))
        for k in range(1, prefixes + 1):
            cut = rng.randint(len(text) // 5, max(len(text) // 5, 4 * len(text) // 5))
            out.append(
                {**row, "variant": k, "text": text[:cut], "seed": derive_seed(seed, TEACHER_REFLECTION_REQUEST, i, k)}
            )
    return out


def reflection_requests(
    sources: Sequence[dict[str, Any]],
    questions: dict[str, str],
    model: str,
    max_tokens: int,
    temperature: float,
    max_trajectory_chars: int,
    max_trajectory_tokens: int | None = None,
    tokenizer: Any = None,
) -> list[ChatRequest]:
    """One request per source (``reflection_sources``), with its own seed. The prompt is the policy's
    (``reflection.meta.candidate_requests``): with ``max_trajectory_tokens`` the trajectory is cut in
    tokens of ``tokenizer``, the policy's, not the teacher's."""
    return [
        ChatRequest(
            custom_id=reflection_request_id(src["trajectory_id"], src["variant"]),
            model=model,
            messages=reflection_messages(
                questions[src["query_id"]],
                src["text"],
                max_trajectory_chars,
                max_tokens=max_trajectory_tokens,
                tokenizer=tokenizer,
            ),
            stop=[REFLECTION_STOP],
            max_tokens=max_tokens,
            temperature=temperature,
            seed=src["seed"],
            metadata={"trajectory_id": src["trajectory_id"], "query_id": src["query_id"], "source_text": src["text"]},
        )
        for src in sources
    ]


def reflection_row(request: ChatRequest, result: ChatResult, question: str, validity: str = "strict") -> dict[str, Any]:
    """A `teacher_reflections` row: the reply, its validity codes, and the canonical text when valid."""
    trajectory_text = request.metadata["source_text"]
    response = result.text if result.status == "ok" else None
    if response is not None and REFLECTION_STOP not in response and "<reflection" in response:
        response = response.rstrip() + "\n" + REFLECTION_STOP  # the provider stripped the stop string
    codes = (
        [REQUEST_FAILED]
        if response is None
        else validate_reflection(response, trajectory_text, question, validity=validity)
    )
    parsed = parse_reflection(response) if not codes else None
    return {
        "request_id": request.custom_id,
        "trajectory_id": request.metadata["trajectory_id"],
        "query_id": request.metadata["query_id"],
        "model": request.model,
        "status": result.status,
        "error": result.error,
        "response": response,
        "text": parsed.render() if parsed is not None else None,
        "valid": parsed is not None,
        "reject_codes": codes,
        "messages": json.dumps(request.messages, ensure_ascii=False),
        "prompt_tokens": result.prompt_tokens,
        "completion_tokens": result.completion_tokens,
        "cost_usd": result.cost_usd,
        "attempts": result.attempts,
    }


def reflection_stats(rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    codes: dict[str, int] = {}
    for row in rows:
        for code in row["reject_codes"]:
            codes[code] = codes.get(code, 0) + 1
    return {
        "reflections": len(rows),
        "reflections_valid": sum(bool(r["valid"]) for r in rows),
        "reflections_failed": sum(r["status"] != "ok" for r in rows),
        "reflection_reject_codes": codes,
        "reflections_cost_usd": sum(r["cost_usd"] or 0.0 for r in rows),
    }
