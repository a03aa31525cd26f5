"""One-step asynchronous RL against the on-policy step, through the real `rl` flow, in one run.

    rl.async_steps: 0   rollouts(t) → judge(t) → update(t)                               (on-policy)
    rl.async_steps: 1   judge(t) → update(t)  beside  rollouts(t+1), each group judged as it ends  (lag one)

Both runs are the `rl` flow (flows/rl.py, every task and the session as a user runs them) from one tiny
run directory collected and SFT-trained here, with the real trainer: a policy sized by ``--hidden`` and
``--layers`` so that an update takes about two thirds of a step's sampling time, as on a GPU trainer.
Three latencies are injected on loopback, as a cluster meets them:
- sampling: the rollout engine is the vLLM engine's turn loop (async schedule) over a stand-in for a
  GPU fleet that answers each call after ``--call-s`` + ``--token-s`` per token with text drawn from the
  call's seed, on no CPU of this machine (the fleet's work is on its own GPUs); weight pushes reach it
  and are counted, not timed;
- tools: the run's own corpus search, answering after a delay drawn from ``--tool-s``;
- judge: a fake OpenAI-compatible server on 127.0.0.1 answering with the built-in judge's logic after a
  delay drawn from ``--judge-s`` (streamed: each group judged as it ends, in both runs).
Prints each run's mean step time in the steady state (the `rl_step` subflows of steps 1..n−2: the first
fills the pipeline, the last has nothing to sample beside its update), the whole flow's wall time and the
engine's idle share (no sampling call in flight), and, last, ``async_over_sync``: the async step's time over
the on-policy step's (goal ≤ 0.7). The
async run's numbers differ from the on-policy run's by design (its samples lag one update); both must
finish every step. See docs/rl.md "One-step asynchronous RL".

    .venv/bin/python bench/async_rl.py --quick    # 4 steps of 4 queries × 4 rows (~3 min)
    .venv/bin/python bench/async_rl.py            # 6 steps of 6 queries × 4 rows
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

from rubricem_core.offline import apply_offline_defaults  # noqa: E402

apply_offline_defaults()

from rollout_schedule import FRAGMENTS, WORDS  # noqa: E402
from run_all import figure_line  # noqa: E402
from step_timeline import BusyClock  # noqa: E402

from rubricem_core.rollout.vllm_engine import TurnCall, TurnSample, VLLMRolloutEngine  # noqa: E402
from rubricem_core.sim.judge import respond as builtin_judge_reply  # noqa: E402
from rubricem_core.testing.openai_server import FakeOpenAIServer  # noqa: E402
from rubricem_core.tools.base import Tool, ToolEnv  # noqa: E402

JUDGE_KEY_ENV = "RUBRICEM_BENCH_JUDGE_KEY"


class FleetStandIn(VLLMRolloutEngine):
    """The vLLM engine's turn loop over a sampler that waits as a GPU fleet would and uses no CPU here."""

    def __init__(self, tokenizer: Any, clock: BusyClock, call_s: float, token_s: float, rows: int) -> None:
        self.clock, self.call_s, self.token_s = clock, call_s, token_s
        self.pushes = 0
        super().__init__(
            None,
            tokenizer,
            sampler=self._sample_one_each,
            schedule="async",
            max_in_flight=rows,
            max_tool_concurrency=rows,
        )

    def _sample_one(self, call: TurnCall) -> TurnSample:
        rng = random.Random(call.seed)
        weights = [w for _, w in FRAGMENTS]
        text = rng.choices([f for f, _ in FRAGMENTS], weights)[0].format(w=rng.choice(WORDS))
        ids = self.tokenizer.encode(text, add_special_tokens=False)[: call.max_tokens]
        self.clock.start()
        try:
            time.sleep(self.call_s + self.token_s * len(ids))
        finally:
            self.clock.stop()
        return TurnSample(ids, [-rng.random() for _ in ids])

    def _sample_one_each(self, calls: list[TurnCall]) -> list[TurnSample]:
        return [self._sample_one(c) for c in calls]  # the async schedule sends one call at a time

    def update_weights(self, state_dict: Any) -> None:
        self.pushes += 1  # a fleet takes them over NCCL (bench/weight_sync.py times that)


class DelayedTool(Tool):
    """A tool of the run's corpus search that answers after a delay (a web search's round trip)."""

    def __init__(self, tool: Tool, low_s: float, high_s: float, rng: random.Random, lock: threading.Lock) -> None:
        self.tool, self.spec = tool, tool.spec
        self.low_s, self.high_s, self.rng, self.lock = low_s, high_s, rng, lock

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        with self.lock:
            seconds = self.rng.uniform(self.low_s, self.high_s)
        time.sleep(seconds)
        return self.tool(*args, **kwargs)


def prepare_run(root: Path, overrides: dict[str, Any]) -> Path:
    """A tiny run directory collected and SFT-trained with ``overrides`` (the policy's size among them)."""
    from flows.collect_sft_data import collect_sft_data
    from flows.sft import sft

    run_dir = root / "base"
    collect_sft_data(run_dir=str(run_dir), profile="tiny", overrides=overrides)
    sft(run_dir=str(run_dir), profile="tiny", overrides=overrides)
    return run_dir


def run_rl(base: Path, name: str, overrides: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    """The `rl` flow on a copy of ``base`` with the stand-in fleet and delayed tools; wall time and idle share."""
    import flows.rl as rl_flow
    import rubricem_core.rl.session as rl_session
    import tasks.rl as rl_tasks

    run_dir = base.parent / name
    shutil.copytree(base, run_dir)
    clock = BusyClock()
    engines: list[FleetStandIn] = []
    real_make_engine, real_search_env, real_rl_step = rl_session.make_engine, rl_tasks.search_env, rl_flow.rl_step
    step_seconds: dict[int, float] = {}
    rng, lock = random.Random(0), threading.Lock()
    rows = overrides["rl.queries_per_step"] * overrides["rollout.group_size"]

    def make_engine(cfg: Any, model_dir: Any, tokenizer: Any, **_: Any) -> FleetStandIn:
        engines.append(FleetStandIn(tokenizer, clock, args.call_s, args.token_s, rows))
        return engines[-1]

    def search_env(run: str, cfg: Any) -> ToolEnv:
        env = real_search_env(run, cfg)
        tools = {k: DelayedTool(t, *args.tool_s, rng, lock) for k, t in env.tools.items()}
        return ToolEnv(tools, env.budget.max_calls)

    def rl_step(run: str, cfg: Any, plan: Any, *rest: Any) -> None:  # the rl flow's own subflow, timed
        started = time.perf_counter()
        real_rl_step(run, cfg, plan, *rest)
        step_seconds[plan.step] = time.perf_counter() - started

    rl_session.make_engine, rl_tasks.search_env, rl_flow.rl_step = make_engine, search_env, rl_step
    try:
        started = time.perf_counter()
        rl_flow.rl(run_dir=str(run_dir), profile="tiny", overrides=overrides)
        wall = time.perf_counter() - started
    finally:
        rl_session.make_engine, rl_tasks.search_env, rl_flow.rl_step = real_make_engine, real_search_env, real_rl_step
    from rubricem_core.store import RunStore
    from tasks.rl import step_metrics

    steps = [step_metrics(RunStore(run_dir), s) for s in range(2 * args.window)]

    def total(name: str) -> float:
        return sum(m.get(name, 0.0) for m in steps)

    # the steady state: the first step fills the pipeline (its own rollouts first), the last has no next
    # step to sample beside its update
    middle = [step_seconds[s] for s in sorted(step_seconds)[1:-1]]
    return {
        "wall": wall,
        "step": sum(middle) / len(middle),
        "idle": 1.0 - clock.busy / wall,
        "update_s": total("rl/update_seconds"),
        "rollout_s": total("rollout/seconds"),
        "pushes": sum(e.pushes for e in engines),
        "lags": sorted({m["rollout/policy_lag"] for m in steps}),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--window", type=int, default=3, help="rl.window: 2 × window steps")
    parser.add_argument("--queries", type=int, default=6, help="rl.queries_per_step")
    parser.add_argument("--n", type=int, default=4, help="rollout.group_size")
    parser.add_argument(
        "--hidden", type=int, default=512, help="policy.hidden_size: sizes the update (~2/3 of the rollouts' seconds)"
    )
    parser.add_argument("--layers", type=int, default=6, help="policy.n_layers")
    parser.add_argument("--call-s", type=float, default=0.05, help="fixed seconds per sampling call")
    parser.add_argument("--token-s", type=float, default=0.02, help="seconds per sampled token")
    parser.add_argument("--tool-s", type=float, nargs=2, default=(0.5, 3.0), help="tool latency range (s)")
    parser.add_argument("--judge-s", type=float, nargs=2, default=(1.0, 3.0), help="judge call latency range (s)")
    parser.add_argument("--work-dir", default=None, help="where the run directories go (default: a temp dir)")
    parser.add_argument("--quick", action="store_true", help="4 steps of 4 queries × 4 rows")
    args = parser.parse_args()
    if args.quick:
        args.window, args.queries = 2, 4
    delays, delay_lock = random.Random(0), threading.Lock()

    def reply(body: dict) -> str:
        with delay_lock:
            delay = delays.uniform(*args.judge_s)
        time.sleep(delay)
        return builtin_judge_reply(body["messages"], body)

    os.environ[JUDGE_KEY_ENV] = "sk-bench-judge"
    root = Path(args.work_dir or tempfile.mkdtemp(prefix="async-rl-"))
    root.mkdir(parents=True, exist_ok=True)
    from prefect.testing.utilities import prefect_test_harness

    with FakeOpenAIServer(reply, api_key="sk-bench-judge") as server, prefect_test_harness():
        overrides = {
            "data.world.n_queries": max(12, 2 * args.window * args.queries),
            "policy.hidden_size": args.hidden,
            "policy.intermediate_size": 2 * args.hidden,
            "policy.n_layers": args.layers,
            "sft.max_steps": 4,
            "sft.warmup_steps": 1,
            "rl.recipe": "ss_grpo",
            "rl.window": args.window,
            "rl.n_windows": 1,
            "rl.queries_per_step": args.queries,
            "rollout.group_size": args.n,
            "rollout.max_new_tokens": 64,
            "judge.model": "openai/judge",
            "judge.api_base": server.base_url,
            "judge.api_key_env": JUDGE_KEY_ENV,
            "judge.max_concurrency": 64,
            "tracking.enabled": False,
            # the same update in both runs: tis weights the on-policy run's tokens by ~1
            "rl.importance_correction": "tis",
        }
        base = prepare_run(root, overrides)
        out = {}
        for name, lag in (("sync", 0), ("async", 1)):
            r = out[name] = run_rl(base, name, {**overrides, "rl.async_steps": lag}, args)
            print(
                f"{name:>5} (rl.async_steps: {lag}): {r['step']:5.1f} s a step (steps 1..{2 * args.window - 2}), "
                f"{r['wall']:6.1f} s for the flow's {2 * args.window} steps; rollouts "
                f"{r['rollout_s']:.1f} s, updates {r['update_s']:.1f} s in all; engine idle {r['idle']:.0%}; "
                f"{r['pushes']} weight pushes; policy lag {r['lags']}"
            )
    print(
        f"injected on loopback: sampling {args.call_s} s + {args.token_s} s/token per call, tools "
        f"{args.tool_s[0]}–{args.tool_s[1]} s, judge calls {args.judge_s[0]}–{args.judge_s[1]} s; "
        f"{args.queries} queries × {args.n} rows a step; policy {args.layers} layers × {args.hidden}"
    )
    if out["sync"]["lags"] != [0.0] or out["async"]["lags"] != [0.0, 1.0]:
        raise SystemExit(f"policy lags {out['sync']['lags']} / {out['async']['lags']}: not the schedules asked for")
    ratio = out["async"]["step"] / out["sync"]["step"]
    whole = out["async"]["wall"] / out["sync"]["wall"]
    print(f"engine idle: on-policy {out['sync']['idle']:.0%} → one-step async {out['async']['idle']:.0%}")
    print(f"the whole flow (session start, the first and last steps included): {whole:.2f}x")
    print(figure_line("async_over_sync", ratio, "x wall time", "<= 0.7", ratio <= 0.7))


if __name__ == "__main__":
    main()
