"""Seed derivation: every random stream of a run is derived from the run's one seed here.

A stream's seed is ``seed × multiplier + Σ weightᵢ × partᵢ`` (optionally ``mod modulus``), a text part
counting as its CRC-32. The multipliers are the (near-)primes the code has always used: changing one
changes every figure a run produces for the same seed, so they are fixed. Different multipliers keep
streams that are indexed by the same small numbers (steps, rounds) from drawing the same numbers.

    derive_seed(cfg.seed, ROLLOUT, plan.step)                  # = cfg.seed * 100_003 + plan.step
    derive_seed(cfg.seed, EVAL_SAMPLING, benchmark)            # = cfg.seed * 100_003 + crc32(benchmark)
    derive_seed(seed, TEACHER_TRAJECTORY, query_index, sample) # = (seed * 1_000_003 + qi * 101 + s) % (2**31 - 1)
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass


@dataclass(frozen=True)
class SeedStream:
    """One named use of randomness: how its seed is made from the run's seed and the stream's parts."""

    name: str
    multiplier: int
    weights: tuple[int, ...] = (1,)  # one per part
    modulus: int | None = None
    why: str = ""


def _part(value: int | str) -> int:
    # a name (benchmark, eval part) counts as its CRC-32: stable across processes, unlike hash()
    return zlib.crc32(value.encode()) if isinstance(value, str) else int(value)


def derive_seed(seed: int, stream: SeedStream, *parts: int | str) -> int:
    """The seed of ``stream`` for these parts (exactly as many as the stream has weights)."""
    if len(parts) != len(stream.weights):
        raise ValueError(f"seed stream {stream.name!r} takes {len(stream.weights)} part(s), got {len(parts)}")
    value = seed * stream.multiplier + sum(w * _part(p) for w, p in zip(stream.weights, parts))
    return value % stream.modulus if stream.modulus is not None else value


# ---- SFT data collection ----------------------------------------------------------------------------
TEACHER_TRAJECTORY = SeedStream(
    "teacher_trajectory",
    1_000_003,
    weights=(101, 1),
    modulus=2**31 - 1,
    why="one seed per (query index, sample) trajectory of the teacher; kept below 2**31 - 1 because "
    "providers take a 32-bit request seed",
)
TEACHER_REQUEST = SeedStream(
    "teacher_request",
    1,
    why="a teacher request's seed is its trajectory's seed + the round: the built-in teacher subtracts the "
    "round again to keep a trajectory's mistakes the same across its turns",
)
TEACHER_TURN = SeedStream(
    "teacher_turn", 7919, why="the built-in teacher's per-turn draws (part: the number of assistant turns so far)"
)
TEACHER_REFLECTION_CUTS = SeedStream(
    "teacher_reflection_cuts",
    1_000_033,
    why="where a trajectory (part: its index) is cut into the prefixes the teacher reflects on",
)
TEACHER_REFLECTION_REQUEST = SeedStream(
    "teacher_reflection_request",
    1_000_033,
    weights=(16, 1),
    why="the request seed of the teacher's reflection on (trajectory index, prefix variant < 16)",
)

# ---- SFT -------------------------------------------------------------------------------------------
SFT_EPOCH = SeedStream("sft_epoch", 1, why="the bucket shuffle of each SFT epoch (part: the epoch)")
SFT_REFLECTION_MIX = SeedStream(
    "sft_reflection_mix",
    7_919,
    why="the order of each pass over the reflection examples mixed into SFT (part: the pass)",
)
SFT_GUIDED = SeedStream(
    "sft_guided",
    7_927,
    why="which research traces SFT shows with their own reflection as guidance (part: always 0)",
)

# ---- RL --------------------------------------------------------------------------------------------
ROLLOUT = SeedStream("rollout", 100_003, why="the rollout sampling of an RL step (part: the step)")
REFLECTION_SOURCE = SeedStream(
    "reflection_source",
    1_000_003,
    why="which rollout of each group the meta-policy reflects on at an RL step (part: the step)",
)
REFLECTION_SAMPLING = SeedStream(
    "reflection_sampling", 100_019, why="the reflection candidates' sampling at an RL step (part: the step)"
)

# ---- evaluation ------------------------------------------------------------------------------------
EVAL_SAMPLING = SeedStream(
    "eval_sampling",
    100_003,
    why="evaluation sampling of one benchmark (part: its name), the same for every checkpoint compared",
)
EVAL_REFLECTION = SeedStream(
    "eval_reflection",
    100_019,
    why="the unforced reflections of an eval part's trajectories (part: the eval part's name)",
)
EVAL_API_TRAJECTORY = SeedStream(
    "eval_api_trajectory",
    1_000_003,
    weights=(101, 1),
    modulus=2**31 - 1,
    why="one seed per (request index, sample) of a model behind an API evaluated as the policy; below 2**31 - 1 "
    "for providers' 32-bit request seeds",
)

STREAMS: dict[str, SeedStream] = {
    s.name: s
    for s in (
        TEACHER_TRAJECTORY,
        TEACHER_REQUEST,
        TEACHER_TURN,
        TEACHER_REFLECTION_CUTS,
        TEACHER_REFLECTION_REQUEST,
        SFT_EPOCH,
        SFT_REFLECTION_MIX,
        SFT_GUIDED,
        ROLLOUT,
        REFLECTION_SOURCE,
        REFLECTION_SAMPLING,
        EVAL_SAMPLING,
        EVAL_REFLECTION,
        EVAL_API_TRAJECTORY,
    )
}
