"""Deferred vs synchronous reflection schedule: RL step time with a slow reflection judge.

Runs the same RL steps (recipe `full`) twice from one SFT checkpoint: `reflection.schedule=deferred`
(the reflection update of step N−1 overlaps step N's rollouts; reflection generation overlaps the
task judge, reflection judging the task update) and `sync` (the same tasks one after another). The
reflection judge is an OpenAI-compatible HTTP server on 127.0.0.1 that answers like the built-in
reflection judge after `--latency` seconds per call, reached through litellm like a real provider;
with `--judge-latency` the task judge is one too (the built-in judge's answers after that many
seconds per call), so the task judge's wait is real and reflection generation can fill it.

The tiny SFT policy has never seen a reflection prompt and writes no valid reflection, and invalid
candidates are scored without a judge call; so that the judge is really called, even-numbered
candidates are forced (the engine's `forced_policy` hook) to a question-specific reflection. This
measures the schedule, not reflection quality.

    .venv/bin/python bench/reflection_deferral.py --run-dir runs/tiny [--latency 6] [--judge-latency 3] [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import has_sft_checkpoint  # noqa: E402
from rubricem_core.offline import apply_offline_defaults  # noqa: E402

apply_offline_defaults()

from rubricem_core.layout import RunLayout  # noqa: E402
from rubricem_core.sim.judge import respond as builtin_judge_reply  # noqa: E402
from rubricem_core.sim.reflection_judge import respond as builtin_reflection_reply  # noqa: E402
from rubricem_core.sql import run_sql  # noqa: E402
from rubricem_core.store import RunStore  # noqa: E402
from rubricem_core.testing.forced_reflections import forcing_engine  # noqa: E402
from rubricem_core.testing.openai_server import FakeOpenAIServer  # noqa: E402

KEY_ENV = "RUBRICEM_BENCH_REFLECTION_JUDGE_KEY"
JUDGE_KEY_ENV = "RUBRICEM_BENCH_JUDGE_KEY"


def copy_base(src: Path, dst: Path) -> str:
    dst.mkdir(parents=True)
    a, b = RunLayout(src), RunLayout(dst)
    for source, target in ((a.tables_dir, b.tables_dir), (a.policy_dir, b.policy_dir), (a.config_file, b.config_file)):
        if source.is_dir():
            shutil.copytree(
                source,
                target,
                ignore=shutil.ignore_patterns(
                    "rollouts", "judge_*", "stage_rewards", "reflections", "bank", "metrics", "eval_results"
                ),
            )
        elif source.exists():
            shutil.copy2(source, target)
    shutil.copytree(a.sft_final, b.sft_final)
    return str(dst)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run-dir", default="runs/tiny", help="a run with checkpoints/sft/final (not modified)")
    parser.add_argument("--latency", type=float, default=6.0, help="seconds per reflection-judge call")
    parser.add_argument(
        "--judge-latency",
        type=float,
        default=0.0,
        help="seconds per task-judge call (an HTTP judge answering like the built-in one); 0: the built-in judge",
    )
    parser.add_argument("--window", type=int, default=1, help="K: steps = 2K (K new-query steps, K replays)")
    parser.add_argument("--queries", type=int, default=4, help="queries per step")
    parser.add_argument("--candidates", type=int, default=4, help="reflection candidates per trajectory")
    parser.add_argument("--quick", action="store_true", help="2 queries, 128 tokens per turn")
    parser.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="runs per schedule, alternating sync/deferred; the fastest of each is compared "
        "(on a shared machine other jobs inflate single runs)",
    )
    args = parser.parse_args()
    src = Path(args.run_dir)
    if not has_sft_checkpoint(src, "figure: deferred_over_sync=nan x  goal: <= 0.75  met: n/a"):
        return
    os.environ[KEY_ENV] = os.environ[JUDGE_KEY_ENV] = "bench-key"
    overrides = {
        "rl.recipe": "full",
        "rl.window": args.window,
        "rl.n_windows": 1,
        "rl.queries_per_step": 2 if args.quick else args.queries,
        "rollout.group_size": 2,
        "rollout.max_new_tokens": 128 if args.quick else 256,
        "reflection.n_candidates": args.candidates,
        "reflection.max_new_tokens": 400,
        "reflection.max_trajectory_chars": 2000,
        "tracking.enabled": True,
        "reflection.judge.model": "openai/reflection-judge",
        "reflection.judge.api_key_env": KEY_ENV,
        "reflection.judge.input_cost_per_token": 0.0,
        "reflection.judge.output_cost_per_token": 0.0,
    }
    questions = {q["query_id"]: q["question"] for q in RunStore(src).read_rows("queries")}
    import rubricem_core.rollout.factory as engine_factory

    engine_factory.HFRolloutEngine = forcing_engine(engine_factory.HFRolloutEngine, questions)

    from flows.rl import rl

    seconds: dict[str, float] = {"sync": float("inf"), "deferred": float("inf")}
    steps = 2 * args.window
    with (
        FakeOpenAIServer(respond=lambda body: builtin_reflection_reply(body["messages"], body)) as server,
        FakeOpenAIServer(respond=lambda body: builtin_judge_reply(body["messages"], body)) as judge_server,
        tempfile.TemporaryDirectory() as tmp,
    ):
        server.delay_s = args.latency
        overrides["reflection.judge.api_base"] = server.base_url
        if args.judge_latency > 0:
            judge_server.delay_s = args.judge_latency
            overrides.update(
                {
                    "judge.model": "openai/judge",
                    "judge.api_base": judge_server.base_url,
                    "judge.api_key_env": JUDGE_KEY_ENV,
                    "judge.input_cost_per_token": 0.0,
                    "judge.output_cost_per_token": 0.0,
                }
            )
        for attempt, schedule in enumerate(("sync", "deferred") * args.repeats):
            run_dir = copy_base(src, Path(tmp) / f"{schedule}-{attempt}")
            t0 = time.perf_counter()
            rl(
                run_dir=run_dir,
                profile=str(RunLayout(src).config_file),
                overrides={**overrides, "reflection.schedule": schedule},
            )
            elapsed = time.perf_counter() - t0
            seconds[schedule] = min(seconds[schedule], elapsed)
            rows = json.loads(
                run_sql(
                    run_dir,
                    "SELECT step, name, round(value, 2) AS v FROM metrics WHERE name IN "
                    "('rollout/seconds', 'judge/wait_seconds', 'rl/update_seconds', 'reflection/generate_seconds', "
                    "'reflection/judge_seconds', 'reflection_update/seconds') ORDER BY ALL",
                    fmt="json",
                )
            )
            print(
                f"{schedule}: {elapsed:.1f}s for {steps} steps ({elapsed / steps:.1f}s/step); "
                + ", ".join(f"s{r['step']} {r['name']}={r['v']}" for r in rows)
            )
        calls = len(server.chat_calls)
    ratio = seconds["deferred"] / seconds["sync"]
    print(
        f"reflection-judge calls: {calls} at {args.latency:.1f}s each; task-judge calls: "
        f"{len(judge_server.chat_calls) if args.judge_latency > 0 else 'built-in'} at {args.judge_latency:.1f}s each; "
        f"steps per schedule: {steps}"
    )
    print(f"figure: deferred_over_sync={ratio:.2f} x  goal: <= 0.75  met: {'yes' if ratio <= 0.75 else 'no'}")


if __name__ == "__main__":
    main()
