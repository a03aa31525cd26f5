"""Seconds to get a trainer's new weights into a `vllm serve` process, both roads of rollout.weight_transfer:

- checkpoint: the trainer writes an HF checkpoint, the server reloads it in place (/collective_rpc
  reload_weights) — what rank 0's step checkpoint plus `checkpoint` costs when the checkpoint is written anyway
  only for the engine;
- gloo push: vLLM's weight-transfer API, the tensors broadcast from this process into the server's worker
  (the CPU twin of `nccl`: same protocol, same layerwise reload on the server side);
- adapter (``--lora-rank``, a LoRA run's `rollout.weight_transfer: adapter`): the trainer writes its LoRA
  adapter (peft's files) and the server loads it at run time in place of the last one.

After each transfer the server's greedy next-token logprob on a fixed prompt is checked against the new
weights (transformers), so a road that loses weights fails here rather than looking fast. The server runs
from `.venv-vllm` (bash scripts/vllm_cpu_env.sh); a random-init Qwen3 of the chosen width and depth stands
in for a policy. Last line: the push's seconds.

    .venv/bin/python bench/weight_sync.py --quick           # 2-layer, width-128 model (~1 min)
    .venv/bin/python bench/weight_sync.py                   # ~0.1B parameters (a few minutes on 2 cores)
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

from run_all import figure_line  # noqa: E402

from rubricem_core.rollout.vllm_server import VLLMServer, lora_server_args  # noqa: E402
from rubricem_core.rollout.weight_transfer import WeightPusher  # noqa: E402
from rubricem_core.sim.tiny_policy import TinyPolicySpec, build_tiny_policy, init_tiny_model  # noqa: E402
from rubricem_core.sim.world import WorldConfig, generate_world  # noqa: E402

VLLM_PYTHON = REPO / ".venv-vllm" / "bin" / "python"


def greedy_logprob(server: VLLMServer, prompt: list[int]) -> float:
    body = {"model": server.model_name, "prompt": prompt, "max_tokens": 1, "temperature": 0, "logprobs": 0}
    return float(server._post("/v1/completions", body)["choices"][0]["logprobs"]["token_logprobs"][0])


def expected_logprob(model: torch.nn.Module, prompt: list[int]) -> float:
    with torch.no_grad():
        return float(model(torch.tensor([prompt])).logits[0, -1].log_softmax(-1).max())


def adapter_road(server, trainer, base, prompt, args, tmp: Path) -> tuple[list[float], float]:
    """Seconds of each adapter write + load (new B each time: the server must change) and the adapter's MiB;
    each checked against the merged weights' logprob."""
    import copy

    from rubricem_core.config import LoraSettings
    from rubricem_core.training.adapters import add_adapter, merged_state_dict, write_adapter

    peft_model = add_adapter(copy.deepcopy(trainer), LoraSettings(rank=args.lora_rank, alpha=2 * args.lora_rank), base)
    merged = copy.deepcopy(trainer)
    times, size = [], 0.0
    for i in range(args.repeats):
        g = torch.Generator().manual_seed(100 + i)
        with torch.no_grad():
            for name, p in peft_model.named_parameters():
                if "lora_B" in name:
                    p.copy_(torch.randn(p.shape, generator=g) * 0.02)
        started = time.perf_counter()
        directory = write_adapter(peft_model, tmp / f"adapter-{i}")
        server.load_adapter(directory)
        times.append(time.perf_counter() - started)
        size = sum(f.stat().st_size for f in directory.iterdir()) / 2**20
        with torch.no_grad():
            merged.load_state_dict(merged_state_dict(peft_model))
        got, want = greedy_logprob(server, prompt), expected_logprob(merged, prompt)
        if abs(got - want) > 1e-3:
            raise SystemExit(f"adapter: the server's logprob {got:.5f} is not the merged weights' {want:.5f}")
    return times, size


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="a 2-layer, width-128 model")
    ap.add_argument("--hidden-size", type=int, default=768, help="model width (default: ~0.1B parameters)")
    ap.add_argument("--layers", type=int, default=12, help="decoder layers")
    ap.add_argument("--repeats", type=int, default=3, help="transfers per road (the median is reported)")
    ap.add_argument("--lora-rank", type=int, default=16, help="the adapter road's LoRA rank (0: no adapter road)")
    args = ap.parse_args()
    if not VLLM_PYTHON.exists():
        print(f"no {VLLM_PYTHON}: run `bash scripts/vllm_cpu_env.sh` first")
        print(figure_line("weight_push_s", float("nan"), "s", "report", None))
        return
    hidden, layers = (128, 2) if args.quick else (args.hidden_size, args.layers)
    spec = TinyPolicySpec(
        vocab_size=8192, hidden_size=hidden, n_layers=layers, n_heads=max(2, hidden // 64), n_kv_heads=2,
        intermediate_size=3 * hidden,
    )  # fmt: skip
    world = generate_world(WorldConfig(seed=0, n_documents=200, n_queries=4))
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        base = build_tiny_policy([d.text for d in world.documents], Path(tmp) / "base", spec)
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(base)
        trainer = init_tiny_model(config, seed=1)
        n_params = sum(p.numel() for p in trainer.parameters())
        megabytes = sum(p.numel() * p.element_size() for p in trainer.parameters()) / 2**20
        print(f"model: {n_params / 1e6:.1f}M parameters, {megabytes:.0f} MiB in float32 ({layers} layers of {hidden})")
        lora_args, lora_env = lora_server_args(args.lora_rank) if args.lora_rank else ([], {})
        server = VLLMServer(
            base,
            python=str(VLLM_PYTHON),
            dtype="float32",
            max_model_len=512,
            weight_transfer="gloo",
            env={"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_HOST_IP": "127.0.0.1", **lora_env},
            extra_args=lora_args,
            log_path=Path(tmp) / "server.log",
        )
        prompt = list(range(5, 37))
        pusher = WeightPusher(trainer, "gloo", timeout_s=600)
        times: dict[str, list[float]] = {"checkpoint": [], "push": []}
        sizes = {"checkpoint": megabytes, "push": megabytes}
        try:
            for i in range(args.repeats):
                for road in ("checkpoint", "push"):
                    with torch.no_grad():  # new weights each time: the server must really change
                        trainer.load_state_dict(
                            init_tiny_model(config, seed=10 + 2 * i + (road == "push")).state_dict()
                        )
                    started = time.perf_counter()
                    if road == "checkpoint":
                        ckpt = Path(tmp) / f"step-{i}"
                        trainer.save_pretrained(ckpt)
                        server.load_weights_from_dir(ckpt)  # reload + prefix-cache reset
                    else:
                        pusher.push(server.base_url, server.n_workers, is_sender=True)
                        server.reset_prefix_cache()
                    times[road].append(time.perf_counter() - started)
                    got, want = greedy_logprob(server, prompt), expected_logprob(trainer, prompt)
                    if abs(got - want) > 1e-3:
                        raise SystemExit(f"{road}: the server's logprob {got:.5f} is not the new weights' {want:.5f}")
            if args.lora_rank:  # over the last pushed weights: the server's base is the trainer's now
                times["adapter"], sizes["adapter"] = adapter_road(server, trainer, base, prompt, args, Path(tmp))
        finally:
            pusher.close()
            server.close()
    for road, values in times.items():
        med = statistics.median(values)
        print(f"{road}: median {med:.3f} s over {len(values)}, {sizes[road]:.2f} MiB a transfer; all {values}")
    push = statistics.median(times["push"])
    print(f"push / checkpoint: {push / statistics.median(times['checkpoint']):.2f}")
    print(figure_line("weight_push_s", push, "s", "report", None))


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
