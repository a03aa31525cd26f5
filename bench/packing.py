"""Sample packing against length buckets on a run's own sequences: padding, micro-batches, update tokens/s.

For each run directory, the sequences its trainers see: SFT's accepted `sft_trajectories` (encoded as SFT
encodes them) under `sft.max_tokens_per_batch`, and, when the run has RL steps, each step's `rollouts` under
`rl.max_tokens_per_batch` as the SS-GRPO update plans them. Both ways of batching them are laid out
(``bucket_batches`` + ``collate``; ``pack_batches`` + ``collate_packed``, one row a micro-batch unless
``--pack-length``), and their padding fraction and micro-batch count printed. Then the same sequences
(the first ``--tokens`` of them) are trained both ways for ``--steps`` timed optimizer steps after one
warm-up (SFT's loss, the run's trainer settings, its SFT policy or base policy) and real tokens per second
printed, with the ratio packed/bucketed.

    .venv/bin/python bench/packing.py --run-dir runs/tiny                         # after `make run`
    .venv/bin/python bench/packing.py --run-dir runs/tiny --run-dir runs/learn/ablation/full --tokens 4096
    .venv/bin/python bench/packing.py --run-dir runs/learn/ablation/full --budget 16384 --tokens 0   # a GPU budget

Prints ``padding_fraction_bucketed=`` and ``padding_fraction_packed=`` per run and sequence set; the figure is
the largest packed padding fraction (goal ≤ 5%). Nothing in the run directory is written.

``--policy DIR`` (a device with no run directory, e.g. scripts/gpu_check.sh): ``--n-seqs`` random sequences of
mixed lengths (uniform in ``--lengths``, a 64-token untrained prompt each) at ``--budget``, on ``--device`` in
``--dtype``, with the model's attention (``--attn``: sdpa, or flash_attention_2 where installed); first the
largest difference between packed and padded logprobs of one micro-batch (``packing_logprob_max_diff=``),
then padding and tokens/s both ways.

    python bench/packing.py --policy /tmp/gpu-check-policy --device cuda --dtype bfloat16 --budget 16384
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rubricem_core.offline import apply_offline_defaults  # noqa: E402

apply_offline_defaults()

import torch  # noqa: E402

from bench.run_all import figure_line  # noqa: E402
from rubricem_core.batching import (  # noqa: E402
    collate,
    collate_micro_batch,
    collate_packed,
    padding_fraction,
    plan_micro_batches,
)
from rubricem_core.config import RunConfig  # noqa: E402
from rubricem_core.layout import RunLayout  # noqa: E402
from rubricem_core.logprobs import batch_logprobs, sft_loss  # noqa: E402
from rubricem_core.policy.loading import load_for_training, load_policy  # noqa: E402
from rubricem_core.rl.records import rollout_trajectory  # noqa: E402
from rubricem_core.run_config import stored_config  # noqa: E402
from rubricem_core.sft import encode_sft_rows, prepare_policy, trainer_config  # noqa: E402
from rubricem_core.store import RunStore  # noqa: E402
from rubricem_core.training import make_trainer  # noqa: E402
from rubricem_core.trajectory import TokenTrajectory  # noqa: E402


def policy_dir(run_dir: Path, cfg: RunConfig, scratch: Path) -> Path:
    """The run's SFT policy, else its base policy, else one built as the SFT flow builds it."""
    layout = RunLayout(run_dir)
    if layout.has_sft_policy():
        return layout.sft_final
    if (layout.policy_base_dir / "config.json").exists():
        return layout.policy_base_dir
    corpus = RunStore(run_dir).read_table("corpus")
    return prepare_policy(cfg.policy, scratch / "base", corpus["text"].to_pylist(), cfg.seed)


def sequence_sets(run_dir: Path, cfg: RunConfig, tokenizer: Any) -> list[tuple[str, list[list[TokenTrajectory]], int]]:
    """(name, the sequences of each step, the micro-batch budget): SFT's as one step, RL's per step."""
    store = RunStore(run_dir)
    sets = []
    if store.files("sft_trajectories"):
        data = encode_sft_rows(tokenizer, store.read_rows("sft_trajectories"), cfg.policy.max_seq_len)
        sets.append(("sft", [data.trajectories], cfg.sft.max_tokens_per_batch))
    if store.files("rollouts"):
        steps: dict[int, list[TokenTrajectory]] = {}
        for row in store.read_rows("rollouts"):
            steps.setdefault(int(row["step"]), []).append(rollout_trajectory(row))
        sets.append(("rl", [steps[s] for s in sorted(steps)], cfg.rl.max_tokens_per_batch))
    return sets


def layouts(steps: list[list[TokenTrajectory]], budget: int, pack_length: int | None, pad_id: int) -> dict[str, list]:
    """Each step's micro-batches, bucketed and packed."""
    out: dict[str, list] = {"bucketed": [], "packed": []}
    for trajs in steps:
        for way, packing in (("bucketed", False), ("packed", True)):
            out[way] += [
                collate_micro_batch([trajs[i] for i in b], pad_id, budget, packing, pack_length)
                for b in plan_micro_batches([len(t) for t in trajs], budget, packing, pack_length)
            ]
    return out


def tokens_per_s(model_path: Path, cfg: RunConfig, micro: list, steps: int) -> float:
    """Real tokens per second of SFT optimizer steps over ``micro`` (one warm-up step first)."""
    model, _ = load_for_training(model_path, cfg.policy.dtype, trainer_config(cfg.sft, steps + 1, cfg.seed))
    trainer = make_trainer(model, trainer_config(cfg.sft, steps + 1, cfg.seed))
    weights = [float(b.loss_mask.sum()) for b in micro]
    trainer.step(micro, sft_loss, weights=weights)
    t0 = time.perf_counter()
    for _ in range(steps):
        trainer.step(micro, sft_loss, weights=weights)
    return steps * sum(b.n_real_tokens for b in micro) / (time.perf_counter() - t0)


def first_tokens(steps: list[list[TokenTrajectory]], tokens: int) -> list[TokenTrajectory]:
    picked: list[TokenTrajectory] = []
    for t in (t for step in steps for t in step):
        if picked and sum(len(p) for p in picked) + len(t) > tokens:
            break
        picked.append(t)
    return picked


def random_sequences(n: int, lengths: tuple[int, int], vocab: int, seed: int) -> list[TokenTrajectory]:
    """Random token ids, a 64-token prompt untrained and the rest trained (one stage)."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        length = int(torch.randint(lengths[0], lengths[1] + 1, (1,), generator=gen))
        ids = torch.randint(1, vocab, (length,), generator=gen).tolist()
        mask = [0] * min(64, length - 1) + [1] * (length - min(64, length - 1))
        out.append(TokenTrajectory(ids, mask, [0] * length, [float("nan")] * length))
    return out


def device_check(args: argparse.Namespace) -> int:
    """Packing on a device from a bare policy directory: logprob equivalence, padding, tokens/s."""
    from transformers import AutoModelForCausalLM

    from rubricem_core.training import TrainerConfig

    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype)
    model = AutoModelForCausalLM.from_pretrained(args.policy, dtype=dtype, attn_implementation=args.attn).to(device)
    budget = args.budget or 16384
    seqs = random_sequences(args.n_seqs, args.lengths, model.config.vocab_size, seed=0)
    got = layouts([seqs], budget, args.pack_length, pad_id=0)
    with torch.no_grad():
        packed = got["packed"][0]
        picked = [s for s, _ in zip(seqs, range(4))]
        padded_lp = batch_logprobs(model.eval(), collate(picked, 0).to(device))
        packed_lp = batch_logprobs(model, collate_packed(picked, 0, budget).to(device))
        diff, offset = 0.0, 0
        for i, t in enumerate(picked):  # a row holds them end to end when they fit one row
            if offset + len(t) > packed_lp.shape[1]:
                break
            diff = max(diff, float((packed_lp[0, offset : offset + len(t)] - padded_lp[i, : len(t)]).abs().max()))
            offset += len(t)
    print(f"{args.policy} on {device} ({args.dtype}, {args.attn}): {len(seqs)} sequences of "
          f"{args.lengths[0]}–{args.lengths[1]} tokens, budget {budget}; first micro-batch packed {packed.n_real_tokens} tokens")  # fmt: skip
    print(f"packing_logprob_max_diff={diff:.2e}")
    fractions = {way: padding_fraction(micro) for way, micro in got.items()}
    print(f"padding_fraction_bucketed={fractions['bucketed']:.4f} padding_fraction_packed={fractions['packed']:.4f}")
    speed = {}
    for way, micro in got.items():
        model.train()
        precision = "bf16" if dtype == torch.bfloat16 else "fp32"
        trainer = make_trainer(model, TrainerConfig(lr=1e-6, total_steps=args.steps + 1, precision=precision, device=str(device)))  # fmt: skip
        weights = [float(b.loss_mask.sum()) for b in micro]
        trainer.step(micro[:1], sft_loss, weights=weights[:1])  # warm-up
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        for _ in range(args.steps):
            trainer.step(micro, sft_loss, weights=weights)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        speed[way] = args.steps * sum(b.n_real_tokens for b in micro) / (time.perf_counter() - t0)
    print(f"update_tokens_per_s_bucketed={speed['bucketed']:.1f} update_tokens_per_s_packed={speed['packed']:.1f} "
          f"packed_over_bucketed={speed['packed'] / speed['bucketed']:.2f}")  # fmt: skip
    print(figure_line("padding_fraction_packed", fractions["packed"], "", "<= 0.05", fractions["packed"] <= 0.05))
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--run-dir", action="append", type=Path, help="a run directory (repeatable); default runs/tiny")
    ap.add_argument("--budget", type=int, default=None, help="tokens a micro-batch (default: the run's own)")
    ap.add_argument("--pack-length", type=int, default=None, help="tokens per packed row (default: the budget)")
    ap.add_argument("--tokens", type=int, default=2048, help="tokens of each timed step (0: no timing)")
    ap.add_argument("--steps", type=int, default=2, help="timed optimizer steps per batching")
    ap.add_argument("--quick", action="store_true", help="one timed step of at most 1024 tokens")
    ap.add_argument("--policy", default=None, help="a policy directory: random sequences on --device, no run dir")
    ap.add_argument("--device", default="cpu", help="with --policy: cpu, cuda, ...")
    ap.add_argument("--dtype", default="float32", help="with --policy: float32 or bfloat16")
    ap.add_argument("--attn", default="sdpa", help="with --policy: sdpa, eager or flash_attention_2")
    ap.add_argument("--n-seqs", type=int, default=32, help="with --policy: random sequences")
    ap.add_argument("--lengths", type=int, nargs=2, default=(256, 4096), help="with --policy: their length range")
    args = ap.parse_args()
    if args.policy:
        return device_check(args)
    if args.quick:
        args.steps, args.tokens = 1, min(args.tokens, 1024)
    torch.manual_seed(0)
    worst = 0.0
    for run_dir in args.run_dir or [Path("runs/tiny")]:
        cfg = stored_config(run_dir)
        if cfg is None:
            print(f"{run_dir}: no config.yaml (run `make run`, or pass --run-dir)")
            print(figure_line("padding_fraction_packed", float("nan"), "", "<= 0.05", None))
            return 1
        with tempfile.TemporaryDirectory() as scratch:
            model_path = policy_dir(run_dir, cfg, Path(scratch))
            _, tokenizer = load_policy(str(model_path), dtype="float32")
            for name, steps, budget in sequence_sets(run_dir, cfg, tokenizer):
                budget = args.budget or budget
                got = layouts(steps, budget, args.pack_length, tokenizer.pad_token_id)
                n = sum(len(s) for s in steps)
                lengths = sorted(len(t) for s in steps for t in s)
                print(f"\n{run_dir} {name}: {n} sequences in {len(steps)} step(s), lengths {lengths[0]}–{lengths[-1]} "
                      f"(median {lengths[len(lengths) // 2]}), budget {budget} tokens a micro-batch")  # fmt: skip
                fractions = {way: padding_fraction(micro) for way, micro in got.items()}
                for way, micro in got.items():
                    print(f"  {way:9} micro-batches {len(micro):4d}  padding {fractions[way]:.3f}")
                print(f"padding_fraction_bucketed={fractions['bucketed']:.4f} padding_fraction_packed="
                      f"{fractions['packed']:.4f} run={run_dir.name} set={name}")  # fmt: skip
                worst = max(worst, fractions["packed"])
                if args.tokens <= 0:
                    continue
                sample = first_tokens(steps, args.tokens)
                timed = layouts([sample], budget, args.pack_length, tokenizer.pad_token_id)
                speed = {way: tokens_per_s(model_path, cfg, micro, args.steps) for way, micro in timed.items()}
                print(f"update_tokens_per_s_bucketed={speed['bucketed']:.1f} update_tokens_per_s_packed="
                      f"{speed['packed']:.1f} packed_over_bucketed={speed['packed'] / speed['bucketed']:.2f} "
                      f"({sum(len(t) for t in sample)} tokens a step, {args.steps} timed steps)")  # fmt: skip
    print(figure_line("padding_fraction_packed", worst, "", "<= 0.05", worst <= 0.05))
    return 0


if __name__ == "__main__":
    sys.exit(main())
