"""Held-out comparison of policy checkpoints with several samples per query, paired by query.

One evaluation of 60 queries with one sample each is noisy: two evaluations of the *same* SFT policy with
different sampling seeds differed by 0.079 ± 0.045 in answer match (docs/learning.md). This evaluates every
checkpoint in one evaluation directory (a copy of a run's inputs; the run itself is not modified) with
``--samples`` trajectories per query, all under the same seed, and prints each checkpoint's mean on both
graders and its gain over the first checkpoint, paired by query, ± its standard error; then the same split by
query kind (the synthetic world's comparison and multi-hop questions), with where the answers go wrong: the
share of trajectories that state every fact the question needs, and how often their final answer is then
right. The per-query scores go to ``<work-dir>/comparison.json`` (and ``--json``). Rerunning reads finished
evaluations back.

    .venv/bin/python bench/compare_checkpoints.py --run-dir runs/learn/base --work-dir runs/learn/compare \\
        --samples 4 sft runs/learn/ablation/full/checkpoints/rl/step-000023
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import add_set_argument, parse_overrides  # noqa: E402
from bench.pooled_gain import pooled_gain  # noqa: E402
from bench.rl_improvement import breakdown, copy_inputs, graded_rows  # noqa: E402
from bench.run_all import figure_line  # noqa: E402
from rubricem_core.layout import RunLayout  # noqa: E402
from rubricem_core.offline import apply_offline_defaults  # noqa: E402
from rubricem_core.store import RunStore  # noqa: E402

apply_offline_defaults()
GRADERS = {"independent": "per_query_independent", "builtin": "per_query"}


def evaluate_checkpoints(src: Path, work: Path, checkpoints: list[str], overrides: dict[str, Any]) -> list[dict]:
    """Each checkpoint's synthetic evaluation in ``work`` (``sft``: the source run's SFT policy): its tag,
    path and breakdown (per-query scores of both graders, the parts of the score)."""
    from flows.evaluate import evaluate

    copy_inputs(src, work)
    config = RunLayout(src).config_file
    if not (work / "config.yaml").exists():
        shutil.copy(config, work / "config.yaml")
    out = []
    for name in checkpoints:
        path = RunLayout(work).sft_final if name == "sft" else Path(name).resolve()
        if not path.is_dir():
            raise SystemExit(f"no checkpoint directory {path}")
        result = evaluate(
            run_dir=str(work),
            overrides=overrides,
            checkpoint=str(path),
            benchmarks=["synthetic"],
            retrieval="none",
        )
        tag = result["tag"]
        out.append({"name": name, "tag": tag, **breakdown(str(work), tag), "by_kind": kind_breakdown(work, tag)})
    return out


def kind_breakdown(run_dir: Path, tag: str) -> dict[str, dict[str, float]]:
    """Per query kind, over one checkpoint's graded synthetic trajectories (the independent grader's
    details): how many there are, the share that state every fact the question needs, and the share of
    those whose final answer is right."""
    kinds = query_kinds(run_dir)
    counts: dict[str, list[int]] = {}  # kind → [trajectories, all facts stated, final right given them]
    for row in graded_rows(run_dir, tag):
        match = json.loads(row["details"]).get("answer_match")
        if not isinstance(match, dict):
            continue
        c = counts.setdefault(kinds.get(row["query_id"], "unknown"), [0, 0, 0])
        stated = match["facts_stated"] >= match["facts_required"]
        c[0], c[1], c[2] = c[0] + 1, c[1] + stated, c[2] + (stated and bool(match["final_correct"]))
    return {
        kind: {"trajectories": n, "all_facts": facts / n, "final_given_facts": right / facts if facts else math.nan}
        for kind, (n, facts, right) in sorted(counts.items())
    }


def query_kinds(run_dir: Path) -> dict[str, str]:
    """Each query's kind (comparison, multi_hop, …) from the run's `queries` table."""
    return {q["query_id"]: q["kind"] for q in RunStore(run_dir).read_rows("queries")}


def print_kind_table(comparison: dict[str, Any]) -> None:
    """Per query kind (``comparison["kinds"]``; nothing for a comparison.json without them): each
    checkpoint's answer match and its gain over the first (paired over that kind's queries), with the share
    of trajectories stating every fact and the final's accuracy given them."""
    kinds: dict[str, str] = comparison.get("kinds", {})
    if not kinds:
        return
    first, *_ = checkpoints = comparison["checkpoints"]
    print(f"\nby query kind (independent grader; gains over {first['name']} paired by query)")
    head = f"{'kind':<12} {'checkpoint':<48} {'queries':>7} {'match':>6} {'gain ± se':>16}"
    print(f"{head} {'all facts':>9} {'final|facts':>11}")
    for kind in sorted(set(kinds.values())):
        for c in checkpoints:
            mine = {q: v for q, v in c["independent"].items() if kinds.get(q) == kind}
            if not mine:
                continue
            cell = f"{'':>16}"
            if c is not first:
                gain, se, _ = pooled_gain([(mine, first["independent"])])
                cell = f"{gain:>+8.3f} ± {se:.3f}"
            parts = c.get("by_kind", {}).get(kind, {})
            facts, final = parts.get("all_facts", math.nan), parts.get("final_given_facts", math.nan)
            mean = sum(mine.values()) / len(mine)
            print(f"{kind:<12} {c['name'][-48:]:<48} {len(mine):>7} {mean:>6.3f} {cell} {facts:>9.2f} {final:>11.2f}")


def print_table(comparison: dict[str, Any]) -> None:
    """Each checkpoint's mean on both graders (a comparison.json: ``payload``) and its gain over the first,
    paired by query, ± se."""
    first, *_ = checkpoints = comparison["checkpoints"]
    print(f"\n{comparison['samples_per_query']} samples a query; gains over {first['name']} paired by query")
    print(f"{'checkpoint':<60} {'queries':>7} {'independent':>11} {'gain ± se':>16} {'built-in':>9} {'gain ± se':>16}")
    for c in checkpoints:
        cells = []
        for grader in GRADERS:
            mean = sum(c[grader].values()) / max(1, len(c[grader]))
            if c is first:
                cells.append(f"{mean:>11.3f} {'':>16}" if grader == "independent" else f"{mean:>9.3f}")
                continue
            gain, se, _ = pooled_gain([(c[grader], first[grader])])
            width = 11 if grader == "independent" else 9
            cells.append(f"{mean:>{width}.3f} {gain:>+8.3f} ± {se:.3f}")
        print(f"{c['name'][-60:]:<60} {len(c['independent']):>7} " + " ".join(cells))


def payload(results: list[dict], samples: int, kinds: dict[str, str]) -> dict[str, Any]:
    """The per-query scores of every checkpoint on both graders, and each query's kind (comparison.json)."""
    return {
        "samples_per_query": samples,
        "kinds": kinds,
        "checkpoints": [
            {"name": r["name"], "tag": r["tag"], **{g: r[key] for g, key in GRADERS.items()}, "by_kind": r["by_kind"]}
            for r in results
        ],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("checkpoints", nargs="+", help="sft (the run's SFT policy) or checkpoint directories")
    parser.add_argument("--run-dir", required=True, help="a run with queries, corpus, config.yaml and an SFT policy")
    parser.add_argument("--work-dir", required=True, help="the evaluation directory (created; reused on a rerun)")
    parser.add_argument("--samples", type=int, default=4, help="trajectories per held-out query")
    parser.add_argument("--json", default=None, help="also copy the per-query scores here")
    add_set_argument(parser)
    args = parser.parse_args()
    src, work = Path(args.run_dir), Path(args.work_dir)
    if not RunLayout(src).has_sft_policy() or not RunLayout(src).config_file.exists():
        raise SystemExit(f"{src} has no SFT policy or config.yaml")
    overrides = {"tracking.enabled": False, "eval.samples_per_query": args.samples, **parse_overrides(args.overrides)}
    results = evaluate_checkpoints(src, work, args.checkpoints, overrides)
    comparison = payload(results, args.samples, query_kinds(work))
    print_table(comparison)
    print_kind_table(comparison)
    first, later, figure = results[0], results[1:], None
    if later:  # the later checkpoints as seeds of one recipe: their mean's gain over the first
        pairs = {g: [(r[key], first[key]) for r in later] for g, key in GRADERS.items()}
        pooled = {g: pooled_gain(p) for g, p in pairs.items()}
        print(
            f"mean of the {len(later)} later checkpoint(s) − {first['name']}: "
            + ", ".join(f"{g} {gain:+.3f} ± {se:.3f} ({gain / se:.1f} se)" for g, (gain, se, _) in pooled.items())
        )
        gain, se, _ = pooled["independent"]
        goal = "> 0 by more than 2 standard errors"
        figure = figure_line("checkpoint_gain.independent", round(gain, 5), "score", goal, bool(gain > 2 * se))
    text = json.dumps(comparison, indent=1)
    (work / "comparison.json").write_text(text)
    if args.json:
        Path(args.json).write_text(text)
    print(f"json: {work / 'comparison.json'}")
    if figure is not None:
        print(figure)
    return 0


if __name__ == "__main__":
    from flows.prefect_server import owned_ephemeral_server

    with owned_ephemeral_server():  # dies with this script, also when it is killed (flows/prefect_server.py)
        raise SystemExit(main())
