"""Probes of docs/reflection_decay.md (issue #33): where the `full` recipe's invalid reflection candidates
come from, on a finished `rubricem rl` run directory (tiny profile).

    guidance  research rollouts of the run's queries with the guidance they were sampled with vs none
    fixed     reflections on fixed inputs (the SFT data's teacher trajectories; the run's source rollouts)
              under each checkpoint, so the policy's weights and its inputs are told apart
    imend     the run's source rollouts as recorded (ending in the eos text) vs with it removed (before the
              fix of reflection_messages; since it, both prompts are the same)
    escape    the run's source rollouts with their reflection tags shown raw vs escaped

    .venv/bin/python scripts/reflection_decay_probe.py --run-dir /tmp/refl-run --probe fixed \
        --checkpoints sft/final,rl/step-000007 --teacher-run-dir runs/tiny
"""

from __future__ import annotations

import argparse
import re
import sys
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rubricem_core.offline import apply_offline_defaults  # noqa: E402

apply_offline_defaults()

from rubricem_core.config import load_config  # noqa: E402
from rubricem_core.encoding import encode_prompt  # noqa: E402
from rubricem_core.environment import local_tool_env, prompt_messages  # noqa: E402
from rubricem_core.policy.loading import load_policy  # noqa: E402
from rubricem_core.reflection.meta import sample_reflections  # noqa: E402
from rubricem_core.rl.records import rollout_text  # noqa: E402
from rubricem_core.rollout import HFRolloutEngine, RolloutRequest, SamplingParams  # noqa: E402
from rubricem_core.scaffold import validate  # noqa: E402
from rubricem_core.store import RunStore  # noqa: E402

REFLECTION_TAG = re.compile(r"<(\s*/?\s*(?:reflection_rubrics|reflection|takeaways)\b[^<>]*)(>?)", re.I)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--run-dir", required=True)
    p.add_argument("--probe", required=True, choices=["guidance", "fixed", "imend", "escape"])
    p.add_argument("--checkpoints", default="sft/final", help="comma-separated, under <run-dir>/checkpoints")
    p.add_argument("--steps", default="0,1,4,5", help="the new-query steps whose source rollouts are used")
    p.add_argument("--n", type=int, default=2, help="samples per source (reflections) or per query (rollouts)")
    p.add_argument("--teacher-run-dir", default=None, help="run with `sft_trajectories` (fixed; default --run-dir)")
    args = p.parse_args()
    store = RunStore(args.run_dir)
    cfg = load_config(Path(args.run_dir) / "config.yaml")
    queries = {q["query_id"]: q for q in store.read_rows("queries")}
    questions = {k: q["question"] for k, q in queries.items()}
    env = local_tool_env(store.read_table("corpus"), cfg.tools)
    steps = [int(s) for s in args.steps.split(",")]
    rollouts = {r["rollout_id"]: r for s in steps for r in store.read_rows("rollouts", {"step": s})}
    # repeat steps write no reflections (the guidance probe reads their rollouts only)
    reflected = [s for s in steps if store.has("reflections", {"step": s})]
    source_ids = sorted(
        {r["source_rollout_id"] for s in reflected for r in store.read_rows("reflections", {"step": s})}
    )

    def reflect(engine, tok, sources, seed):
        rows = []
        for k in range(args.n):
            sampling = SamplingParams(
                temperature=cfg.reflection.temperature,
                top_p=cfg.rollout.top_p,
                max_new_tokens=cfg.reflection.max_new_tokens,
                max_total_tokens=cfg.rollout.max_total_tokens,
                seed=seed + k,
            )
            rows += sample_reflections(
                engine, tok, sources, questions, sampling, cfg.reflection.max_trajectory_chars, env
            )
        return rows

    def report(name, rows):
        codes = Counter(c for r in rows for c in r["codes"])
        step = {i: rollouts[i]["step"] for i in source_ids}
        per_step = {
            s: f"{sum(r['valid'] for r in rows if step.get(r['source']) == s)}/{sum(step.get(r['source']) == s for r in rows)}"
            for s in steps
        }
        mean = sum(len(r["text"]) for r in rows) / max(1, len(rows))
        print(
            f"  {name}: {sum(r['valid'] for r in rows)}/{len(rows)} valid, mean {mean:.0f} chars, per step {per_step}"
        )
        print(f"    codes {dict(codes.most_common(5))}", flush=True)

    for ckpt in args.checkpoints.split(","):
        model, tok = load_policy(str(Path(args.run_dir) / "checkpoints" / ckpt))
        engine = HFRolloutEngine(model, tok)
        eos = tok.eos_token
        print(f"== {ckpt}", flush=True)
        sources = [{"source": i, "query_id": rollouts[i]["query_id"], "text": rollouts[i]["text"]} for i in source_ids]
        if args.probe == "guidance":
            qids = sorted({r["query_id"] for r in rollouts.values()})
            guidance = {r["query_id"]: r["guidance"] for r in rollouts.values()}
            sampling = SamplingParams(
                temperature=cfg.rollout.temperature,
                top_p=cfg.rollout.top_p,
                max_new_tokens=cfg.rollout.max_new_tokens,
                max_total_tokens=cfg.rollout.max_total_tokens,
                seed=5,
            )
            for label, guided in (("no guidance", False), ("recorded guidance", True)):
                requests = [
                    RolloutRequest(
                        request_id=q,
                        n=args.n,
                        sampling=sampling,
                        max_tool_calls=cfg.tools.max_tool_calls,
                        prompt_ids=encode_prompt(
                            tok,
                            prompt_messages(
                                queries[q], guidance=guidance[q] if guided else None, style=cfg.policy.prompt_style
                            ),
                        ),
                    )
                    for q in qids
                ]
                trajs = [t for group in engine.generate(requests, env) for t in group]
                texts = [rollout_text(t) for t in trajs]
                print(
                    f"  {label}: {len(texts)} rollouts, "
                    f"valid scaffold {sum(not validate(t, max_tool_calls=cfg.tools.max_tool_calls) for t in texts)}, "
                    f"answered {sum(t.finish_reason == 'answered' for t in trajs)}, "
                    f"with reflection tags {sum(bool(REFLECTION_TAG.search(t)) for t in texts)}",
                    flush=True,
                )
        elif args.probe == "fixed":
            teacher_store = RunStore(args.teacher_run_dir or args.run_dir)
            teacher = [
                {"source": r["trajectory_id"], "query_id": r["query_id"], "text": r["text"]}
                for r in teacher_store.read_rows("sft_trajectories")
                if r["accepted"]
            ][:16]
            report("teacher trajectories", reflect(engine, tok, teacher, 21))
            report("the run's source rollouts", reflect(engine, tok, sources, 21))
        elif args.probe == "imend":
            print(
                f"  sources ending in {eos!r}: {sum(s['text'].rstrip().endswith(eos) for s in sources)}/{len(sources)}"
            )
            report("as recorded", reflect(engine, tok, sources, 11))
            report(
                f"{eos} removed", reflect(engine, tok, [{**s, "text": s["text"].replace(eos, "")} for s in sources], 11)
            )
        else:

            def escape(text: str) -> str:
                return REFLECTION_TAG.sub(lambda m: "&lt;" + m.group(1) + ("&gt;" if m.group(2) else ""), text)

            report("tags raw", reflect(engine, tok, sources, 31))
            report("tags escaped", reflect(engine, tok, [{**s, "text": escape(s["text"])} for s in sources], 31))
    return 0


if __name__ == "__main__":
    sys.exit(main())
