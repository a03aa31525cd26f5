"""The reflection meta-policy step without orchestration (the Prefect tasks call these).

Per new-query step: one rollout per query is drawn uniformly (no score or length bias) → the policy
writes ``n`` candidates from the question and the raw trajectory only → the reflection judge scores
them with the privileged view (the rubrics the trajectory was scored on, its scores and
justifications), rebuilt here from the step's ``judge_rubrics``/``judge_scores`` rows → the best valid
candidate per query enters the bank → all candidates give a GRPO signal on their reflection tokens
(group = the candidates of one trajectory), applied one step later.

The bank is a replay of the ``reflections`` table: inserting the accepted rows in step order with the
bank's replace policy gives the same bank an uninterrupted run had, so a resumed run rebuilds it
exactly instead of trusting a snapshot that may be newer than its checkpoint.
"""

from __future__ import annotations

import dataclasses
import json
import math
import random
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import numpy as np
import torch

from rubricem_core.encoding import encode_prompt
from rubricem_core.judge.types import Rubric, RubricScore, TrajectoryJudgment
from rubricem_core.reflection.bank import BankEntry, ReflectionBank
from rubricem_core.reflection.format import (
    REFLECTION_STOP,
    format_tag_tokens,
    guidance_text,
    parse_reflection,
    reflection_messages,
    validate_reflection,
)
from rubricem_core.rollout import RolloutRequest, SamplingParams
from rubricem_core.seeds import REFLECTION_SOURCE, derive_seed
from rubricem_core.ssgrpo import stage_advantages
from rubricem_core.trajectory import TokenTrajectory


def pick_source_rollouts(
    rollouts: Sequence[dict[str, Any]], query_ids: Sequence[str], seed: int, step: int
) -> dict[str, dict[str, Any]]:
    """query_id → one rollout drawn uniformly from its group. Rollouts whose judgment failed are left
    out: the reflection judge would have no scores to judge the candidates with."""
    rng = random.Random(derive_seed(seed, REFLECTION_SOURCE, step))
    chosen: dict[str, dict[str, Any]] = {}
    for qid in query_ids:
        group = sorted(
            (r for r in rollouts if r["query_id"] == qid and not r["judge_failed"]), key=lambda r: r["rollout_id"]
        )
        if group:
            chosen[qid] = group[rng.randrange(len(group))]
    return chosen


def candidate_requests(
    tokenizer: Any,
    sources: dict[str, dict[str, Any]],
    questions: dict[str, str],
    n: int,
    sampling: SamplingParams,
    max_trajectory_chars: int,
    max_trajectory_tokens: int | None = None,
) -> list[RolloutRequest]:
    """One request per source rollout, ``n`` samples each; no tool calls are allowed. The trajectory is
    middle-cut to ``max_trajectory_tokens`` tokens of ``tokenizer`` when set, else to ``max_trajectory_chars``."""
    return [
        RolloutRequest(
            request_id=src["rollout_id"],
            prompt_ids=encode_prompt(
                tokenizer,
                reflection_messages(
                    questions[qid],
                    src["text"],
                    max_trajectory_chars,
                    max_tokens=max_trajectory_tokens,
                    tokenizer=tokenizer,
                ),
            ),
            n=n,
            sampling=reflection_sampling(sampling),
            max_tool_calls=0,
            meta={"query_id": qid},
            scaffold=False,
        )
        for qid, src in sources.items()
    ]


def reflection_sampling(sampling: SamplingParams) -> SamplingParams:
    """A reflection ends at ``</reflection>`` (text after it would make it invalid); the research
    scaffold's ``</answer>`` inside it ends nothing (the requests have ``scaffold=False``)."""
    return dataclasses.replace(sampling, stop_texts=(*sampling.stop_texts, REFLECTION_STOP))


def engine_stop_texts(engine: Any, tokenizer: Any) -> list[str]:
    """The texts of the tokens that end a turn for ``engine`` (stripped from a candidate's text)."""
    if hasattr(engine, "stop_token_ids"):
        return [tokenizer.decode([i]) for i in sorted(engine.stop_token_ids)]
    return [t for t in (tokenizer.eos_token,) if t]


def sample_reflections(
    engine: Any,
    tokenizer: Any,
    sources: Sequence[dict[str, Any]],
    questions: dict[str, str],
    sampling: SamplingParams,
    max_trajectory_chars: int,
    tools: Any,
    max_trajectory_tokens: int | None = None,
    validity: str = "strict",
) -> list[dict[str, Any]]:
    """One reflection per source trajectory (dicts with ``query_id``, ``text`` and an id ``source``),
    unforced, each checked with the meta-policy's validator: the valid-reflection rate of a policy.
    ``tools`` is the engine's ToolEnv (no call is allowed: max_tool_calls 0); the trajectory bound is that of
    ``candidate_requests``."""
    sources = [s for s in sources if s["text"] and s["text"].strip()]
    requests = [
        RolloutRequest(
            request_id=s["source"],
            n=1,
            sampling=reflection_sampling(sampling),
            max_tool_calls=0,
            scaffold=False,
            prompt_ids=encode_prompt(
                tokenizer,
                reflection_messages(
                    questions[s["query_id"]],
                    s["text"],
                    max_trajectory_chars,
                    max_tokens=max_trajectory_tokens,
                    tokenizer=tokenizer,
                ),
            ),
        )
        for s in sources
    ]
    groups = engine.generate(requests, tools) if requests else []
    stops = engine_stop_texts(engine, tokenizer)
    rows = []
    for src, group in zip(sources, groups):
        text = candidate_text(group[0], stops)
        codes = validate_reflection(text, src["text"], questions[src["query_id"]], validity=validity)
        rows.append(
            {"source": src["source"], "query_id": src["query_id"], "text": text, "valid": not codes, "codes": codes}
        )
    return rows


def candidate_text(traj: TokenTrajectory, stop_texts: Sequence[str] = ()) -> str:
    """What the policy wrote (and any environment reply it provoked) after the prompt, without the
    end-of-turn token that stopped it."""
    text = "".join(seg.text for seg in traj.segments if seg.kind != "prompt").rstrip()
    for stop in stop_texts:
        if stop and text.endswith(stop):
            text = text[: -len(stop)].rstrip()
    return text.strip()


def judge_view(
    query_id: str, rollout_id: str, rubric_rows: Sequence[dict[str, Any]], score_rows: Sequence[dict[str, Any]]
) -> tuple[list[Rubric], TrajectoryJudgment]:
    """The rubrics one rollout was scored on and its judgment, read back from the step's tables."""
    scores = [r for r in score_rows if r["query_id"] == query_id and r["rollout_id"] == rollout_id]
    scored_ids = {r["rubric_id"] for r in scores}
    rubrics = []
    for row in rubric_rows:
        if row["query_id"] != query_id or row["rubric_id"] not in scored_ids:
            continue
        data = dict(row)
        check = data.get("check")
        data["check"] = json.loads(check) if isinstance(check, str) and check else None
        rubrics.append(Rubric.from_dict(data))
    judgment = TrajectoryJudgment(
        rollout_id,
        [
            RubricScore(
                r["rubric_id"], r["stage"], r["polarity"], float(r["weight"]), int(r["score"]), r["justification"] or ""
            )
            for r in scores
        ],
    )
    if not scores:
        judgment.failed, judgment.error = True, "no judge scores recorded for this rollout"
    return rubrics, judgment


def candidate_advantages(scores: Sequence[float | None], eps: float = 1e-6) -> list[float]:
    """GRPO advantages within one candidate group: (r − mean) / (std + eps), unbiased std; a candidate
    without a score (judge failed) gets 0 and stays out of the statistics; all-equal scores give 0."""
    rewards = torch.tensor([[math.nan if s is None else float(s)] for s in scores], dtype=torch.float64)
    return [float(a) for a in stage_advantages(rewards, eps)[:, 0]]


def trained_mask(traj: TokenTrajectory, decode: Callable[[list[int]], str]) -> list[int]:
    """The tokens a valid candidate's reflection update trains: what the policy wrote, less the format's
    tags. Every valid candidate writes the same tags, so they carry no preference between candidates;
    trained, GRPO's push on a below-average candidate's tags can unlearn one the policy is unsure of
    (on the learn profile one update made the policy close its rubric list with `</reflection>`, the
    stop string, and no candidate was valid after it; docs/learning.md)."""
    written = [i for i, m in enumerate(traj.loss_mask) if m]
    mask = list(traj.loss_mask)
    for i, is_tag in zip(written, format_tag_tokens([traj.token_ids[i] for i in written], decode)):
        if is_tag:
            mask[i] = 0
    return mask


def reflection_token_advantages(loss_mask: Sequence[int], advantage: float) -> list[float]:
    """Every generated reflection token carries its candidate's advantage; prompt tokens get 0."""
    return [advantage if m else 0.0 for m in loss_mask]


def bank_entries(rows: Iterable[dict[str, Any]], questions: dict[str, str]) -> list[BankEntry]:
    """Bank insertions of accepted ``reflections`` rows, in step then query order."""
    accepted = sorted((r for r in rows if r["accepted"]), key=lambda r: (r["step"], r["query_id"]))
    out = []
    for r in accepted:
        parsed = parse_reflection(r["text"])
        if parsed is None:  # accepted rows are valid by construction; a hand-edited table is not trusted
            raise ValueError(f"reflections row step={r['step']} query={r['query_id']!r} is accepted but unparsable")
        out.append(
            BankEntry(
                r["query_id"], questions.get(r["query_id"], ""), parsed.render(), float(r["score"]), int(r["step"])
            )
        )
    return out


def rebuild_bank(bank: ReflectionBank, rows: Iterable[dict[str, Any]], questions: dict[str, str]) -> int:
    """Insert accepted reflections in order; returns how many entries the bank holds."""
    bank.add_many(bank_entries(rows, questions))
    return len(bank)


def retrieve_guidance(
    bank: ReflectionBank,
    queries: Sequence[tuple[str, str]],
    mode: str,
    k: int,
    min_similarity: float | None,
    questions: dict[str, str],
    source_step: int | None = None,
) -> tuple[list[str | None], dict[str, float]]:
    """Guidance text per query (None when nothing was retrieved) and hit/miss counts for the step;
    ``source_step``: the new-query step a replay repeats (within retrieval of that window's reflection)."""
    results = bank.retrieve_many(queries, mode, k=k, min_similarity=min_similarity, source_step=source_step)
    texts: list[str | None] = []
    for (qid, _), found in zip(queries, results):
        parts = []
        for entry, _sim in found:
            parsed = parse_reflection(entry.reflection)
            if parsed is None:
                continue
            source = questions.get(entry.query_id) if entry.query_id != qid else None
            parts.append(guidance_text(parsed, source_question=source))
        texts.append("\n\n".join(parts) if parts else None)
    hits = sum(1 for t in texts if t is not None)
    metrics = {}
    if mode != "none":
        metrics = {f"retrieval/{mode}_hits": float(hits), f"retrieval/{mode}_misses": float(len(texts) - hits)}
    return texts, metrics


def reflection_metrics(rows: Sequence[dict[str, Any]]) -> dict[str, float]:
    """Acceptance rate (source trajectories whose best candidate entered the bank), validity, reward."""
    if not rows:
        return {}
    sources = {(r["query_id"], r["source_rollout_id"]) for r in rows}
    accepted = {(r["query_id"], r["source_rollout_id"]) for r in rows if r["accepted"]}
    scored = [r["score"] for r in rows if r["score"] is not None]
    out = {
        "reflection/candidates": float(len(rows)),
        "reflection/valid_fraction": float(np.mean([bool(r["valid"]) for r in rows])),
        "reflection/acceptance_rate": len(accepted) / max(1, len(sources)),
        "reflection/judge_failed": float(sum(bool(r["judge_failed"]) for r in rows)),
    }
    if scored:
        out["reflection/reward_mean"] = float(np.mean(scored))
        out["reflection/reward_max"] = float(np.max(scored))
    return out
