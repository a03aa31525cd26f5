"""One SS-GRPO step, assembled in one place from the ``ssgrpo`` functions:

    R = gate_broken_stages(R, broken, rule, failed)        # optional: no reward where the scaffold broke
    ga = group_advantages(R, lam, failed)                  # per query: G = R Λᵀ, A = per-stage normalization
    rows = reward_rows(step, query_id, rollout_ids, ga)    # the step's `stage_rewards` (R, G, A), final
    batch = training_batch(rollouts, rows, decode)         # judged trajectories, a[i, t] = A[i, stage(t)]
    batch = reflection_training_batch(reflections)         # or: a step's reflection candidates (GRPO per group)
    metrics = learner.update(batch.trajectories, batch.token_advantages, config)  # SSGRPOLearner: trainer + reference

The judge task writes ``reward_rows`` once; the update task trains on exactly those A values, so what
SQL shows is what was trained on. By default the update is one optimizer step over length-bucketed
micro-batches weighted by their policy tokens: the old policy is then the current one, so the loss
takes its own logprobs detached as the old ones (ratio 1) and no extra forward runs; each rank computes
the reference logprobs of its own micro-batches. ``rl.minibatches``/``rl.epochs`` reuse the samples
for several steps (PPO): the old logprobs are then recomputed for every micro-batch before the first
step. ``rl.importance_correction: tis`` weights each token by min(π_old/π_sampler, cap), with the
engine's sampling logprobs as the behaviour policy (samples drawn before the deferred reflection
update moved the weights, or by an engine whose numerics differ).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from rubricem_core.batching import TokenBatch, collate_micro_batch, plan_micro_batches
from rubricem_core.config import RLConfig
from rubricem_core.judge.aggregate import stage_reward_rows
from rubricem_core.logprobs import batch_logprobs
from rubricem_core.reflection.meta import candidate_advantages, reflection_token_advantages
from rubricem_core.rl.records import rollout_trajectory
from rubricem_core.scaffold import STAGES
from rubricem_core.ssgrpo import policy_loss, stage_advantages, stage_returns, token_advantages
from rubricem_core.training.step import MetricsAccumulator
from rubricem_core.trajectory import NO_STAGE, TokenTrajectory


@dataclass(frozen=True)
class UpdateConfig:
    """The numbers of one clipped policy-gradient step besides its trajectories."""

    temperature: float = 1.0  # the sampling temperature the logprobs are taken at
    clip_low: float = 0.2  # ratios below 1 − clip_low (for a < 0) get no gradient
    clip_high: float = 0.2  # ratios above 1 + clip_high (for a > 0) get no gradient
    kl_coef: float = 0.001  # β of the k3 KL to the reference
    max_tokens_per_batch: int = 16384  # padded tokens per micro-batch
    packing: bool = False  # micro-batches of packed rows instead of length buckets
    pack_length: int | None = None  # tokens per packed row (None: max_tokens_per_batch)
    minibatches: int = 1  # optimizer steps per pass, each on its share of the trajectories
    epochs: int = 1  # passes over the trajectories (more than one step in all: PPO reuse)
    importance_correction: str = "none"  # "tis": truncated importance weights π_old/π_sampler
    tis_cap: float = 2.0  # the truncation of those weights
    recompute_old: bool = False  # recompute old logprobs even for one step (equivalence tests, benches)

    @classmethod
    def from_rl(cls, rl: RLConfig, temperature: float) -> UpdateConfig:
        """The `rl` section's settings at the temperature the trained tokens were sampled with."""
        return cls(
            temperature=temperature,
            clip_low=rl.clip_low,
            clip_high=rl.clip_high,
            kl_coef=rl.kl_coef,
            max_tokens_per_batch=rl.max_tokens_per_batch,
            packing=rl.packing,
            pack_length=rl.pack_length,
            minibatches=rl.minibatches,
            epochs=rl.epochs,
            importance_correction=rl.importance_correction,
            tis_cap=rl.tis_cap,
        )


# ---- R → G → A ----------------------------------------------------------------------------------
@dataclass
class GroupAdvantages:
    R: np.ndarray  # n×K stage rewards (NaN: no rubric / failed judgment)
    G: np.ndarray  # n×K returns (NaN: no return)
    A: np.ndarray  # n×K advantages (NaN only on failed judgments: they get none, never 0)


def group_advantages(
    R: np.ndarray, lam: torch.Tensor, failed: Sequence[bool] | None = None, unscored: str = "none"
) -> GroupAdvantages:
    """G = R Λᵀ and per-stage group-normalized A for one query's group; a failed judgment's row has
    no return and no advantage. ``unscored``: rl.unscored_stage_return (ssgrpo.stage_returns)."""
    R_t = torch.as_tensor(np.asarray(R, dtype=np.float64))
    G = stage_returns(R_t, lam.to(R_t.dtype), unscored).numpy()
    A = stage_advantages(torch.as_tensor(G)).numpy()
    if failed is not None and any(failed):
        rows = np.asarray(failed, dtype=bool)
        G, A = G.copy(), A.copy()
        G[rows], A[rows] = np.nan, np.nan
    return GroupAdvantages(R=np.asarray(R, dtype=np.float64), G=G, A=A)


def gate_broken_stages(
    R: np.ndarray, broken: Sequence[set[str]], rule: str = "zero", failed: Sequence[bool] | None = None
) -> np.ndarray:
    """R with 0 in each stage a rollout broke the scaffold in (``broken[i]``: its stages with a violation;
    ``rl.scaffold_violations``). ``zero``: a stage with no reward (NaN: no rubric) stays NaN, there is
    nothing to withhold. ``format``: where some rollouts of a group broke a stage that has no rubric and
    some kept it, the scaffold is that stage's one rubric, as the judge adds an adaptive rubric only where it
    separates a group: those that kept it score 1, those that broke it 0. A failed judgment's row is left
    as it is."""
    if rule not in ("zero", "format"):
        raise ValueError(f"unknown scaffold_violations rule {rule!r}; expected zero or format")
    R = np.array(R, dtype=np.float64)
    if len(broken) != R.shape[0]:
        raise ValueError(f"{len(broken)} rollouts' broken stages for an R of {R.shape[0]} rows")
    rows = [i for i in range(len(broken)) if not (failed is not None and failed[i])]
    for k, stage in enumerate(STAGES):
        broke = [stage in broken[i] for i in rows]
        # a rubric-less stage gets the scaffold as its rubric only where it separates the group
        separates = rule == "format" and any(broke) and not all(broke)
        for i, b in zip(rows, broke):
            if np.isnan(R[i, k]):
                if separates:
                    R[i, k] = 0.0 if b else 1.0
            elif b:
                R[i, k] = 0.0
    return R


def reward_rows(step: int, query_id: str, rollout_ids: Sequence[str], ga: GroupAdvantages) -> list[dict[str, Any]]:
    """The group's final `stage_rewards` rows: R, G and A, NULL where NaN."""
    return stage_reward_rows(step, query_id, rollout_ids, ga.R, G=ga.G, A=ga.A)


# ---- A → token advantages -----------------------------------------------------------------------
# a stage's opening tag is at most this many tokens (`<review>`: 3 in SmolLM2's BPE); past it, a tag that
# never closes is not an opening tag
OPENING_TAG_MAX_TOKENS = 8


def leaving_stage_ids(traj: TokenTrajectory, decode: Callable[[list[int]], str]) -> list[int]:
    """The trajectory's stage ids with each stage's opening tag given to the trained stage before it.

    The opening tag is where the policy chooses to leave that earlier stage: after a search's state
    evaluation, ``<call_tool`` searches again (research) while ``<review>`` closes the research. Scored
    with the stage it opens, closing the research early was credited with how good the review was, not
    with how good the research was (session 25's ``ss_grpo`` drifted to one search that way;
    docs/learning.md). The tag runs from the stage's first trained token through the first token whose
    text closes it (``>``); the trajectory's first stage has no stage before it and keeps its own.
    """
    ids, stages, mask = traj.token_ids, traj.stage_ids, traj.loss_mask
    out = list(stages)
    previous = None  # the stage of the last trained token
    t = 0
    while t < len(ids):
        stage = stages[t]
        if not mask[t] or stage < 0:
            t += 1
            continue
        if previous is not None and previous < stage:
            end = t
            while end < len(ids) and end - t < OPENING_TAG_MAX_TOKENS and mask[end] and stages[end] == stage:
                out[end] = previous
                end += 1
                if ">" in decode(ids[t:end]):
                    break
            t = end
        else:
            t += 1
        previous = stage
    return out


def per_token_advantages(
    traj: TokenTrajectory, A_row: Sequence[float], decode: Callable[[list[int]], str] | None = None
) -> list[float]:
    """Stage advantage on every trained token; 0 on prompt, tool output and stage-less tokens. With
    ``decode`` (`rl.stage_boundary: leaving`), a stage's opening tag takes the stage it leaves
    (``leaving_stage_ids``)."""
    A = torch.as_tensor(np.asarray(A_row, dtype=np.float64)).view(1, -1)
    stage_ids = torch.tensor([traj.stage_ids if decode is None else leaving_stage_ids(traj, decode)], dtype=torch.long)
    mask = torch.tensor([traj.loss_mask])
    return token_advantages(A, stage_ids, mask)[0].tolist()


@dataclass
class TrainingBatch:
    """The judged trajectories of one step with their token advantages, and the reward statistics."""

    trajectories: list[TokenTrajectory] = field(default_factory=list)
    token_advantages: list[list[float]] = field(default_factory=list)
    stage_means: dict[str, float] = field(default_factory=dict)  # reward/{R,G,A}/{stage}_mean
    nonzero: int = 0  # trajectories whose advantage is not 0 (reflection_training_batch; the rest carry no signal)

    def advantaged_tokens_by_stage(self) -> dict[int, tuple[int, int]]:
        """Per stage id (-1: no stage): (trained tokens whose advantage is not 0, trained tokens)."""
        counts: dict[int, list[int]] = {}
        for traj, advs in zip(self.trajectories, self.token_advantages):
            for stage_id, kept, adv in zip(traj.stage_ids, traj.loss_mask, advs):
                if kept:
                    cell = counts.setdefault(stage_id, [0, 0])
                    cell[0] += adv != 0.0
                    cell[1] += 1
        return {k: (v[0], v[1]) for k, v in counts.items()}

    def advantaged_token_share(self) -> float:
        """The share of the trained tokens whose advantage is not 0: how much of the step carries signal
        (NaN for a batch with no trained token)."""
        counts = self.advantaged_tokens_by_stage().values()
        trained = sum(c[1] for c in counts)
        return sum(c[0] for c in counts) / trained if trained else math.nan


def training_batch(
    rollouts: list[dict[str, Any]],
    rewards: list[dict[str, Any]],
    decode: Callable[[list[int]], str] | None = None,
) -> TrainingBatch:
    """Every rollout whose judgment did not fail, in table order, with a[t] = A[stage(t)] from the
    step's `stage_rewards` (with ``decode``, each stage's opening tag takes the stage it leaves:
    per_token_advantages); failed judgments are left out of the update (never scored 0)."""
    by_key = {(r["rollout_id"], r["stage"]): r for r in rewards}
    batch = TrainingBatch()
    stats: dict[str, list[float]] = {f"{m}/{s}": [] for m in ("R", "G", "A") for s in STAGES}
    for row in rollouts:
        if row["judge_failed"]:
            continue
        stage_rows = [by_key[(row["rollout_id"], s)] for s in STAGES]
        for s, reward in zip(STAGES, stage_rows):
            for name in ("R", "G", "A"):
                if reward[name] is not None:
                    stats[f"{name}/{s}"].append(float(reward[name]))
        traj = rollout_trajectory(row)
        batch.trajectories.append(traj)
        batch.token_advantages.append(per_token_advantages(traj, [r["A"] for r in stage_rows], decode))
    batch.stage_means = {f"reward/{k}_mean": float(np.mean(v)) for k, v in stats.items() if v}
    return batch


def reflection_training_batch(rows: Iterable[dict[str, Any]]) -> TrainingBatch:
    """The reflection update's batch from a step's `reflections` rows: GRPO advantages per source
    rollout's candidate group, on the reflection tokens only (the reflection-update task and a resume's
    replay both train on exactly this); candidates whose judgment failed are left out."""
    groups: dict[str, list[dict[str, Any]]] = {}
    for row in rows:
        groups.setdefault(row["source_rollout_id"], []).append(row)
    batch = TrainingBatch()
    for rid in sorted(groups):
        group = sorted(groups[rid], key=lambda r: r["candidate"])
        for row, adv in zip(group, candidate_advantages([r["score"] for r in group])):
            if row["judge_failed"] or not row["token_ids"]:
                continue  # no reward: left out of the update, never treated as a zero
            # a reflection belongs to no research stage
            stageless = {
                "token_ids": row["token_ids"],
                "loss_mask": row["loss_mask"],
                "logprobs": row["logprobs"],
                "stage_ids": [NO_STAGE] * len(row["token_ids"]),
            }
            batch.trajectories.append(TokenTrajectory.from_row(stageless))
            batch.token_advantages.append(reflection_token_advantages(row["loss_mask"], adv))
            batch.nonzero += adv != 0.0
    return batch


# ---- the loss and the optimizer steps --------------------------------------------------------------
def importance_weights(old_logp: torch.Tensor, sampled_logp: torch.Tensor, cap: float) -> torch.Tensor:
    """Truncated importance weights min(π_old/π_sampler, cap) per token, from log-probabilities; 1 where
    the sampler's logprob is unknown (NaN). No gradient flows through them."""
    known = torch.isfinite(sampled_logp)
    diff = torch.where(known, old_logp.detach() - sampled_logp, torch.zeros_like(old_logp))
    return torch.exp(diff.clamp(max=math.log(cap)))


def sampler_metrics(old: torch.Tensor, batch: TokenBatch, weights: torch.Tensor | None, cap: float) -> dict[str, float]:
    """Engine vs trainer on the sampling weights (how far the sampler's logprobs are from ours) and, with
    truncated importance sampling, the weights' mean and capped share, over the trained tokens."""
    out: dict[str, float] = {}
    if batch.sampled_logprobs is None:
        return out
    mask = batch.loss_mask.bool()
    known = mask & torch.isfinite(batch.sampled_logprobs)
    gap = (old - batch.sampled_logprobs).abs()[known]
    out["logprob_gap_mean"] = float(gap.mean()) if gap.numel() else 0.0
    out["logprob_gap_max"] = float(gap.max()) if gap.numel() else 0.0
    if weights is not None:
        w = weights[mask]
        out["tis_weight_mean"] = float(w.mean()) if w.numel() else 1.0
        out["tis_capped_fraction"] = float((w >= cap).float().mean()) if w.numel() else 0.0
    return out


def _logprobs_on_model_device(model: torch.nn.Module, batch: TokenBatch, temperature: float) -> torch.Tensor:
    # The reference model may sit on another device than the trainer's batch.
    device = next(model.parameters()).device
    return batch_logprobs(model, batch.to(device), temperature=temperature)


def old_logprobs(model: torch.nn.Module, batch: TokenBatch, temperature: float) -> torch.Tensor:
    """The trainer's logprobs of ``batch`` in eval mode (no dropout), as the old policy of a PPO step."""
    was_training = model.training
    model.eval()
    try:
        return batch_logprobs(model, batch, temperature=temperature).float()
    finally:
        model.train(was_training)


def make_prepare_fn(ref_model: torch.nn.Module | None, temperature: float, recompute_old: bool):
    """Reference logprobs by the frozen reference (and, when asked, old logprobs recomputed by the
    trainer's model) for the micro-batches of this rank, with the weights of before the step."""

    def prepare(model: torch.nn.Module, batch: TokenBatch) -> TokenBatch:
        if recompute_old:
            batch.old_logprobs = old_logprobs(model, batch, temperature)
        if ref_model is not None:
            batch.ref_logprobs = _logprobs_on_model_device(ref_model, batch, temperature).to(batch.input_ids.device)
            batch.ref_logprobs = batch.ref_logprobs.float()
        return batch

    return prepare


def _uid(batch: TokenBatch) -> int:
    if batch.uid is None:
        raise RuntimeError("a micro-batch without a uid: the logprob pre-pass numbers every micro-batch")
    return batch.uid


def _cached_prepare(cache: dict[int, tuple[torch.Tensor, torch.Tensor | None]]):
    """A prepare that attaches the logprobs the pre-pass computed for a micro-batch (keyed by its uid)."""

    def prepare(model: torch.nn.Module, batch: TokenBatch) -> TokenBatch:
        old, ref = cache[_uid(batch)]
        batch.old_logprobs = old.to(batch.input_ids.device)
        batch.ref_logprobs = ref.to(batch.input_ids.device) if ref is not None else None
        return batch

    return prepare


def minibatch_split(n: int, minibatches: int) -> list[list[int]]:
    """Indices 0..n−1 in table order cut into ``minibatches`` contiguous parts of sizes differing by at
    most one (fewer parts when there are fewer trajectories)."""
    parts = min(minibatches, n)
    bounds = [round(i * n / parts) for i in range(parts + 1)]
    return [list(range(bounds[i], bounds[i + 1])) for i in range(parts)]


@dataclass(frozen=True)
class UpdatePlan:
    """Which trajectories make each micro-batch of each optimizer step, and each micro-batch's trained
    tokens (its weight in the step's token mean): a function of the trajectories' lengths and loss masks
    only, so the driver of several ranks computes it once and sends each rank just the trajectories of
    its own micro-batches (``rank_indices``)."""

    n_trajectories: int
    parts: list[list[list[int]]]  # per minibatch, per micro-batch: trajectory indices
    weights: list[list[float]]  # per minibatch, per micro-batch: trained tokens

    def rank_indices(self, rank: int, world_size: int) -> list[int]:
        """The trajectories rank ``rank`` of ``world_size`` trains on (its shard of every step, padding
        copies included)."""
        from rubricem_core.distributed.shard import shard_micro_batches

        needed: set[int] = set()
        for micro, w in zip(self.parts, self.weights):
            for item in shard_micro_batches(len(micro), w, rank, world_size):
                needed.update(micro[item.index])
        return sorted(needed)


def update_plan(trajectories: Sequence[TokenTrajectory], config: UpdateConfig) -> UpdatePlan:
    lengths = [len(t) for t in trajectories]
    trained = [float(sum(t.loss_mask)) for t in trajectories]
    parts, weights = [], []
    for idx in minibatch_split(len(trajectories), config.minibatches):
        groups = plan_micro_batches(
            [lengths[i] for i in idx], config.max_tokens_per_batch, config.packing, config.pack_length
        )
        micro = [[idx[j] for j in group] for group in groups]
        parts.append(micro)
        weights.append([sum(trained[i] for i in picked) for picked in micro])
    return UpdatePlan(len(trajectories), parts, weights)


def _micro_batch(
    trajectories: Mapping[int, TokenTrajectory],
    token_advs: Mapping[int, list[float]],
    picked: list[int],
    pad_id: int,
    config: UpdateConfig,
) -> TokenBatch | None:
    """One micro-batch, or None when this rank was not given its trajectories (another rank trains it)."""
    if not all(i in trajectories for i in picked):
        return None
    trajs = [trajectories[i] for i in picked]
    # the sampler's logprob on every trained token (NaN where it gave none: no importance weight)
    extras = {"advantages": [token_advs[i] for i in picked], "sampled_logprobs": [list(t.logprobs) for t in trajs]}
    return collate_micro_batch(
        trajs, pad_id, config.max_tokens_per_batch, config.packing, config.pack_length, extras=extras
    )


def logprobs_before_steps(
    trainer: Any,
    ref_model: torch.nn.Module | None,
    parts: list[list[Any]],
    weights: list[list[float]],
    temperature: float,
) -> Callable[[torch.nn.Module, TokenBatch], TokenBatch]:
    """For samples that train several optimizer steps (PPO reuse): the old logprobs (and the reference's)
    of every micro-batch of this rank, computed before any step changes the weights, under the loss's
    autocast; the prepare that attaches them to each micro-batch in the steps."""
    cache: dict[int, tuple[torch.Tensor, torch.Tensor | None]] = {}
    uid = 0
    for micro in parts:
        for b in micro:  # by position, so every rank numbers a micro-batch alike
            if b is not None:
                b.uid = uid
            uid += 1
    first_pass = make_prepare_fn(ref_model, temperature, recompute_old=True)

    def remember(model: torch.nn.Module, batch: TokenBatch) -> TokenBatch:
        done = first_pass(model, batch)
        ref = done.ref_logprobs.cpu() if done.ref_logprobs is not None else None
        cache[_uid(batch)] = (done.old_logprobs.cpu(), ref)
        return done

    for micro, w in zip(parts, weights):
        trainer.forward_only(micro, w, remember)
    return _cached_prepare(cache)


class SSGRPOLearner:
    """A trainer and the frozen KL reference (None: β = 0), and the SS-GRPO update on them: what the
    policy in this process and every Ray trainer rank is (rubricem_core.rl.policy.LocalPolicy)."""

    def __init__(self, trainer: Any, ref_model: torch.nn.Module | None, pad_id: int) -> None:
        self.trainer = trainer
        self.ref_model = ref_model
        self.pad_id = pad_id

    def update(
        self,
        trajectories: Sequence[TokenTrajectory] | Mapping[int, TokenTrajectory],
        token_advs: Sequence[list[float]] | Mapping[int, list[float]],
        config: UpdateConfig,
        plan: UpdatePlan | None = None,
    ) -> dict[str, float]:
        """``config.epochs`` passes over the given (judged, non-failed) trajectories, one optimizer step per
        minibatch of each pass. On several ranks each rank is given ``plan`` and only the trajectories of its
        own micro-batches (index → trajectory); each computes the logprobs and gradients of its shard.

        Each optimizer step reads top to bottom: this rank's micro-batches, per micro-batch logprobs → old
        logprobs → importance weights → ``policy_loss`` (ratio → clip → aggregate) → backward, then the step.
        One step in all (the default): the old policy is the current one (no extra forward). Several steps
        reuse the samples, so the old logprobs (and the reference's) are computed first
        (``logprobs_before_steps``)."""
        if plan is None:
            if isinstance(trajectories, Mapping):
                raise ValueError("a partial set of trajectories needs the step's UpdatePlan")
            plan = update_plan(trajectories, config)
        if plan.n_trajectories == 0:
            return {"skipped": 1.0}
        trajs = trajectories if isinstance(trajectories, Mapping) else dict(enumerate(trajectories))
        advs = token_advs if isinstance(token_advs, Mapping) else dict(enumerate(token_advs))
        parts: list[list[Any]] = [
            [_micro_batch(trajs, advs, picked, self.pad_id, config) for picked in micro] for micro in plan.parts
        ]
        weights = plan.weights
        if len(parts) * config.epochs > 1:  # the samples train several steps: logprobs from before the first
            prepare = logprobs_before_steps(self.trainer, self.ref_model, parts, weights, config.temperature)
        else:
            prepare = make_prepare_fn(self.ref_model, config.temperature, recompute_old=config.recompute_old)
        trainer = self.trainer
        steps: list[dict[str, Any]] = []
        for _ in range(config.epochs):
            for micro, w in zip(parts, weights):
                acc = MetricsAccumulator()
                shard = trainer.micro_batches(micro, w, prepare)  # this rank's share, with its reference logprobs
                for i, (item, batch) in enumerate(shard):
                    with trainer.forward(sync=i == len(shard) - 1):
                        logp = batch_logprobs(trainer.module, batch, temperature=config.temperature)
                        # One optimizer pass over fresh samples: the old policy is the current one, so its
                        # logprobs are ours detached (ratio 1, the plain policy gradient), no extra forward.
                        old = batch.old_logprobs if batch.old_logprobs is not None else logp.detach().float()
                        tis = config.importance_correction == "tis" and batch.sampled_logprobs is not None
                        is_weights = importance_weights(old, batch.sampled_logprobs, config.tis_cap) if tis else None
                        loss, metrics = policy_loss(
                            logp,
                            old,
                            batch.ref_logprobs,
                            batch.advantages,
                            batch.loss_mask.to(logp.dtype),
                            clip_low=config.clip_low,
                            clip_high=config.clip_high,
                            kl_coef=config.kl_coef,
                            is_weights=is_weights,
                        )
                        metrics |= sampler_metrics(old, batch, is_weights, config.tis_cap)
                    trainer.backward(loss, item.scale)
                    acc.add(loss, metrics, item.scale, pad=item.pad)
                steps.append(trainer.optimizer_step(acc))
        out = _mean_over_steps(steps)
        out["policy_tokens"] = float(sum(sum(w) for w in weights))
        out["optimizer_steps"] = float(len(steps))
        return out


def ss_grpo_update(
    trainer: Any,
    ref_model: torch.nn.Module | None,
    trajectories: Sequence[TokenTrajectory] | Mapping[int, TokenTrajectory],
    token_advs: Sequence[list[float]] | Mapping[int, list[float]],
    pad_id: int,
    config: UpdateConfig,
    plan: UpdatePlan | None = None,
) -> dict[str, float]:
    """``SSGRPOLearner.update`` on a trainer and reference that no policy holds (tests, benches)."""
    return SSGRPOLearner(trainer, ref_model, pad_id).update(trajectories, token_advs, config, plan)


def _mean_over_steps(steps: list[dict[str, Any]]) -> dict[str, float]:
    """One step's metrics as they are; several: their mean, with the counters of the last one."""
    numeric = [{k: float(v) for k, v in m.items() if isinstance(v, (int, float))} for m in steps]
    if len(numeric) == 1:
        return numeric[0]
    out = {k: float(np.mean([m[k] for m in numeric if k in m])) for k in numeric[-1]}
    out["step"] = numeric[-1].get("step", out.get("step", 0.0))
    out["lr"] = numeric[0].get("lr", out.get("lr", 0.0))  # the rate the first of them used
    return out
