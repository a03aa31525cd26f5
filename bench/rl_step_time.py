"""Time one RL step's two halves for a policy on this machine: rollouts, then the SS-GRPO update.

Rollouts: HFRolloutEngine samples ``--queries`` × ``--group`` trajectories on a synthetic world with
the real local tools (as the `rollout` task does). Update: ``rl.update.ss_grpo_update`` on those
trajectories as `rubricem rl` runs it by default (one optimizer step, the old policy the current one:
no extra forward), the frozen reference's logprobs included (advantages are random: the cost does not
depend on them). ``--compare-recompute`` times, on the same trajectories, the update that first
recomputes the old logprobs (what every update did before, and what PPO reuse needs) and prints the
ratio, and each one's MFU (6·N·tokens of the training pass over the update's seconds, against
``--peak-tflops``). Prints seconds, tokens/s and, on a GPU, peak memory: what one step of `rubricem rl`
costs with this model here.

    .venv/bin/python bench/rl_step_time.py --run-dir runs/small          # its SFT policy
    python bench/rl_step_time.py --policy DIR --random-init --device cuda   # speed only: weights from config.json

``--random-init`` builds the model from the directory's config.json (no weight files needed, so a
config and tokenizer are enough to size a GPU node); a random model never calls tools and writes
every turn to ``--max-new-tokens``, so its rollouts are the long, tool-free case.
"""

from __future__ import annotations

import argparse
import copy
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import has_sft_checkpoint  # noqa: E402
from bench.run_all import figure_line  # noqa: E402
from rubricem_core.offline import apply_offline_defaults  # noqa: E402

apply_offline_defaults()

import torch  # noqa: E402
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer  # noqa: E402

from rubricem_core.config import ToolsConfig  # noqa: E402
from rubricem_core.encoding import encode_prompt  # noqa: E402
from rubricem_core.environment import local_tool_env, prompt_messages  # noqa: E402
from rubricem_core.layout import RunLayout  # noqa: E402
from rubricem_core.policy.loading import DTYPES, _ensure_pad_token, auto_device, load_policy  # noqa: E402
from rubricem_core.rl.update import UpdateConfig, ss_grpo_update  # noqa: E402
from rubricem_core.rollout import HFRolloutEngine, RolloutRequest, SamplingParams  # noqa: E402
from rubricem_core.sim.world import WorldConfig, generate_world  # noqa: E402
from rubricem_core.training import make_trainer  # noqa: E402
from rubricem_core.training.config import TrainerConfig  # noqa: E402


def load(policy: str, random_init: bool, dtype: str, device: torch.device):
    if not random_init:
        return load_policy(policy, dtype=dtype, device=device)
    tokenizer = AutoTokenizer.from_pretrained(policy)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(policy), dtype=DTYPES[dtype])
    _ensure_pad_token(model, tokenizer, policy)
    return model.to(device).eval(), tokenizer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--run-dir", default="runs/tiny", help="its checkpoints/sft/final is the policy (unless --policy)"
    )
    parser.add_argument("--policy", default=None, help="a Hugging Face causal-LM directory (with its tokenizer)")
    parser.add_argument("--random-init", action="store_true", help="random weights from config.json (speed only)")
    parser.add_argument("--device", default="auto", help="auto (cuda if available), cpu, cuda, cuda:1, ...")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="weights' dtype")
    parser.add_argument("--precision", default="fp32", choices=["fp32", "bf16"], help="trainer: fp32 or bf16 autocast")
    parser.add_argument("--queries", type=int, default=4)
    parser.add_argument("--group", type=int, default=4, help="samples per query")
    parser.add_argument("--max-new-tokens", type=int, default=512, help="per turn")
    parser.add_argument("--max-total-tokens", type=int, default=4096)
    parser.add_argument("--max-tokens-per-batch", type=int, default=16384, help="update micro-batch token budget")
    parser.add_argument("--backend", default="torch", choices=["torch", "deepspeed"], help="trainer backend")
    parser.add_argument("--zero-stage", type=int, default=3, help="deepspeed: ZeRO stage")
    parser.add_argument("--gradient-checkpointing", action="store_true", help="recompute activations in backward")
    parser.add_argument(
        "--steps",
        type=int,
        default=1,
        help="RL steps (rollouts, update, weight sync to the engine's own copy after each)",
    )
    parser.add_argument("--sft-steps", type=int, default=0, help="SFT steps on the first rollouts before RL")
    parser.add_argument("--quick", action="store_true", help="2 queries x 2 samples, 64 tokens per turn")
    parser.add_argument(
        "--compare-recompute",
        action="store_true",
        help="also time each step's update with the old-logprob recompute (an extra forward) and print the ratio",
    )
    parser.add_argument(
        "--peak-tflops", type=float, default=None, help="the device's dense peak, for MFU (H200 bf16: 989)"
    )
    args = parser.parse_args()
    if args.quick:
        args.queries, args.group, args.max_new_tokens = 2, 2, 64
    if args.policy is None:
        if not has_sft_checkpoint(Path(args.run_dir), figure_line("rl_step", float("nan"), "s", "report", None)):
            return
        args.policy = str(RunLayout(args.run_dir).sft_final)

    device = auto_device() if args.device == "auto" else torch.device(args.device)
    model, tokenizer = load(args.policy, args.random_init, args.dtype, device)
    n_params = sum(p.numel() for p in model.parameters())
    print(
        f"policy: {args.policy}{' (random init)' if args.random_init else ''}, {n_params / 1e6:.1f}M params, "
        f"{args.dtype} on {device}" + (f" ({torch.cuda.get_device_name(device)})" if device.type == "cuda" else "")
    )

    world = generate_world(WorldConfig(seed=0, n_documents=400, n_queries=max(args.queries, 4)))
    env = local_tool_env(world.corpus_table(), ToolsConfig())
    sampling = SamplingParams(
        temperature=1.0, max_new_tokens=args.max_new_tokens, max_total_tokens=args.max_total_tokens, seed=0
    )
    requests = []
    for q in world.queries[: args.queries]:
        messages = prompt_messages({"question": q.question}, style="compact")
        requests.append(
            RolloutRequest(
                q.query_id, encode_prompt(tokenizer, messages), n=args.group, sampling=sampling, max_tool_calls=4
            )
        )

    # the reference and (with --steps > 1 or ZeRO-3) the engine's own copy, before ZeRO-3 partitions the model
    ref_model = copy.deepcopy(model).eval().requires_grad_(False)
    separate = args.steps > 1 or (args.backend == "deepspeed" and args.zero_stage == 3)
    engine_model = copy.deepcopy(model).eval().requires_grad_(False) if separate else None
    trainer = make_trainer(
        model,
        TrainerConfig(
            lr=1e-6,
            weight_decay=0.0,
            total_steps=args.steps + args.sft_steps + 1,
            precision=args.precision,
            device=str(device),
            backend=args.backend,
            zero_stage=args.zero_stage,
            gradient_checkpointing=args.gradient_checkpointing,
        ),
    )
    engine = HFRolloutEngine(engine_model if separate else trainer.model, tokenizer)
    print(
        f"trainer: {args.backend}"
        + (f" ZeRO-{args.zero_stage}" if args.backend == "deepspeed" else "")
        + (", gradient checkpointing" if args.gradient_checkpointing else "")
        + (", engine with its own copy of the weights" if separate else ", engine shares the trainer's module")
    )
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    rollout_s = update_s = recompute_s = sft_s = sync_s = 0.0
    generated = trained = sft_tokens = 0
    for step in range(args.steps):
        t0 = time.perf_counter()
        trajs = [t for group in engine.generate(requests, env) for t in group]
        rollout_s += time.perf_counter() - t0
        generated += sum(t.n_policy_tokens for t in trajs)
        total = sum(len(t) for t in trajs)
        print(
            f"step {step} rollouts: {len(trajs)} trajectories, {sum(t.n_policy_tokens for t in trajs)} generated of "
            f"{total} tokens; finish: {sorted({t.finish_reason for t in trajs})}"
        )
        if device.type == "cuda" and step == 0:
            free, total_mem = torch.cuda.mem_get_info(device)
            print(
                f"after rollouts: torch allocated {torch.cuda.memory_allocated(device) / 2**30:.2f} GiB, reserved "
                f"{torch.cuda.memory_reserved(device) / 2**30:.2f} GiB; device free {free / 2**30:.1f} of "
                f"{total_mem / 2**30:.1f} GiB"
            )
        if step == 0 and args.sft_steps:
            from rubricem_core.batching import bucket_batches, collate
            from rubricem_core.logprobs import sft_loss

            micro = [
                collate([trajs[i] for i in idx], tokenizer.pad_token_id)
                for idx in bucket_batches([len(t) for t in trajs], args.max_tokens_per_batch)
            ]
            sync()
            t0 = time.perf_counter()
            for _ in range(args.sft_steps):
                trainer.step(micro, sft_loss, weights=[float(b.loss_mask.sum()) for b in micro])
            sync()
            sft_s += time.perf_counter() - t0
            sft_tokens += args.sft_steps * total
        rng = random.Random(step)
        advs = [[rng.gauss(0.0, 1.0) * m for m in t.loss_mask] for t in trajs]
        sync()
        t0 = time.perf_counter()
        metrics = ss_grpo_update(
            trainer,
            ref_model,
            trajs,
            advs,
            tokenizer.pad_token_id,
            UpdateConfig(max_tokens_per_batch=args.max_tokens_per_batch),
        )
        sync()
        update_s += time.perf_counter() - t0
        trained += total
        print(f"step {step} update: loss {metrics['loss']:.4f}, logprob gap mean {metrics['logprob_gap_mean']:.2e}")
        if args.compare_recompute:  # the same trajectories once more, old logprobs recomputed first
            sync()
            t0 = time.perf_counter()
            ss_grpo_update(
                trainer,
                ref_model,
                trajs,
                advs,
                tokenizer.pad_token_id,
                UpdateConfig(max_tokens_per_batch=args.max_tokens_per_batch, recompute_old=True),
            )
            sync()
            recompute_s += time.perf_counter() - t0
        if separate:
            t0 = time.perf_counter()
            engine.update_weights(trainer.state_dict_for_sync())  # gathered under ZeRO-3
            sync()
            sync_s += time.perf_counter() - t0

    print(f"rollout_tokens_per_s: {generated / max(rollout_s, 1e-9):.0f} generated tok/s ({rollout_s:.1f} s)")
    print(f"update_tokens_per_s: {trained / max(update_s, 1e-9):.0f} tok/s ({update_s:.1f} s)")
    if args.compare_recompute:
        print(f"update_recompute_tokens_per_s: {trained / max(recompute_s, 1e-9):.0f} tok/s ({recompute_s:.1f} s)")
        print(f"update_time_ratio: {update_s / max(recompute_s, 1e-9):.3f} (no extra forward / with the recompute)")
    if args.peak_tflops:
        flops = 6.0 * n_params * trained  # forward + backward of the training pass
        print(f"update_mfu: {flops / max(update_s, 1e-9) / (args.peak_tflops * 1e12):.3f}")
        if args.compare_recompute:
            print(f"update_recompute_mfu: {flops / max(recompute_s, 1e-9) / (args.peak_tflops * 1e12):.3f}")
    if args.sft_steps:
        print(f"sft_tokens_per_s: {sft_tokens / max(sft_s, 1e-9):.0f} tok/s ({sft_s:.1f} s)")
    if separate:
        print(f"weight_sync_s: {sync_s / args.steps:.3f} s per sync")
    if device.type == "cuda":
        print(f"peak_gpu_memory: {torch.cuda.max_memory_allocated(device) / 2**30:.2f} GiB")
    print(f"{args.steps} RL step(s) of {len(trajs)} trajectories: rollouts {rollout_s:.1f} s + update {update_s:.1f} s")
    print(figure_line("rl_step", (rollout_s + update_s) / args.steps, "s", "report", None))


if __name__ == "__main__":
    main()
