"""Flow `evaluate`: run a policy checkpoint on held-out and benchmark queries with the real tools and grade
it independently of training rewards → `eval_results` (one Parquet part per checkpoint × benchmark ×
retrieval mode) and per-benchmark means in MLflow (child run "evaluate", step = policy updates in the
checkpoint: SFT 0, RL step N → N + 1). A rerun skips benchmarks whose part exists.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Any

from prefect import flow, get_run_logger

from flows.common import (
    RUN_HOOKS,
    Profile,
    mlflow_links,
    prefect_links,
    publish_markdown,
    resolve_config,
    writes_run_dir,
)
from rubricem_core.config import RunConfig, flatten
from rubricem_core.eval.benchmark import default_checkpoint
from rubricem_core.eval.checkpoints import api_policy_spec, checkpoint_tag, checkpoint_updates
from rubricem_core.eval.run import EVAL_RETRIEVAL_MODES
from rubricem_core.eval.types import EvalError
from rubricem_core.registry import model_name, tag_scores
from rubricem_core.report.markdown import eval_markdown
from rubricem_core.store import RunStore
from rubricem_core.tracking import Tracker
from tasks.evaluate import drop_engines, evaluate_benchmark
from tasks.secrets import check_endpoint_keys


@contextmanager
def _fleet_ends_with_flow(cfg: RunConfig) -> Iterator[None]:
    """A vLLM server fleet (processes and GPUs of its own) lives for one evaluate flow run; in-process
    engines stay loaded for the next one on the same checkpoint."""
    try:
        yield
    finally:
        if cfg.rollout.engine == "vllm_server":
            drop_engines()


def evaluate_run_name() -> str:
    """``evaluate · runs/x``, and the checkpoint when one is named (``… · rl-step-000003``): a learning
    curve evaluates several checkpoints of one run directory in a row."""
    from prefect.runtime import flow_run

    params = flow_run.parameters
    name = f"evaluate · {params.get('run_dir')}"
    checkpoint = params.get("checkpoint")
    return f"{name} · {checkpoint_tag(params['run_dir'], checkpoint)}" if checkpoint else name


@flow(name="evaluate", flow_run_name=evaluate_run_name, **RUN_HOOKS)
@writes_run_dir
def evaluate(
    run_dir: str = "runs/tiny",
    profile: Profile = None,
    overrides: dict[str, Any] | None = None,
    checkpoint: str | None = None,
    benchmarks: list[str] | None = None,
    retrieval: str | None = None,
) -> dict[str, Any]:
    """Evaluate one checkpoint on several benchmarks.

    Args:
        run_dir: a run directory with `queries`, `corpus` and a policy checkpoint.
        profile: profile name under data/profiles or a YAML path; None: the run directory's own config.yaml
            (the tiny profile for a new run directory).
        overrides: dotted-key overrides, e.g. {"eval.max_queries": 4}.
        checkpoint: a policy directory (default: the newest RL checkpoint, else the SFT policy), or a model behind
            an API as the policy: api:<model> (prompted with the scaffold) or api-plain:<model> (without it),
            reached through eval.api_policy.
        benchmarks: names to run (default: eval.benchmarks): synthetic, healthbench, deep_research_bench,
            scholarqa_cs, simpleqa, 2wiki, researchqa, researchrubrics, webwalkerqa, deepsearchqa.
        retrieval: test-time reflection guidance none | cross | within | sequential (default: eval.retrieval);
            sequential: a trial with cross retrieval, the policy's reflection on it, a second trial guided by it.
    """
    log = get_run_logger()
    cfg = resolve_config(run_dir, profile, overrides, command="evaluate")
    if benchmarks is not None:
        cfg = cfg.model_copy(
            update={"eval": cfg.eval.model_validate({**cfg.eval.model_dump(), "benchmarks": benchmarks})}
        )
    # each benchmark's grader (eval.graders, else eval.grader)
    check_endpoint_keys(*(cfg.eval.grader_for(b) for b in cfg.eval.benchmarks if b != "synthetic"))
    mode = retrieval or cfg.eval.retrieval
    if mode not in EVAL_RETRIEVAL_MODES:
        raise EvalError(f"retrieval must be one of {EVAL_RETRIEVAL_MODES}, got {mode!r}")
    api = api_policy_spec(checkpoint) if checkpoint else None
    if api is not None:  # a model behind an API as the policy: nothing on disk to find
        if mode == "sequential":
            raise EvalError(
                f"retrieval sequential needs a policy checkpoint (its reflection between trials); {checkpoint!r} "
                "is a model behind an API: use none, cross or within"
            )
        check_endpoint_keys(cfg.eval.api_policy.model_copy(update={"model": api.model}))
    path = (
        checkpoint
        if api is not None
        else str(Path(checkpoint) if checkpoint else default_checkpoint(RunStore(run_dir)))
    )
    tag = checkpoint_tag(run_dir, path)
    tracker = Tracker.from_config(run_dir, cfg.tracking)
    params = flatten({"eval": cfg.eval.model_dump(mode="json", exclude={"retrieval", "benchmarks"})})
    results: dict[str, dict[str, Any]] = {}
    with (
        tracker.child_run("evaluate", params=params, tags=prefect_links(), label=tag)
        if tracker
        else nullcontext() as child,
        _fleet_ends_with_flow(cfg),
    ):
        for benchmark in cfg.eval.benchmarks:
            summary = evaluate_benchmark(run_dir, cfg, path, benchmark, mode)
            results[benchmark] = summary
            if child is not None:
                numbers = {
                    f"eval/{benchmark}/{mode}/{k}": v for k, v in summary.items() if k != "cached" and v == v
                }  # NaN (nothing scored) is not logged
                child.log_metrics(numbers, step=checkpoint_updates(tag))
                tracker.log_parent_metrics(numbers, step=checkpoint_updates(tag))  # the run's headline scores
            log.info("%s: %s score %.3f", tag, benchmark, summary["score_mean"])
        if child is not None:
            child.log_dict(
                {"checkpoint": path, "tag": tag, "retrieval": mode, "benchmarks": results}, f"eval/{tag}--{mode}.json"
            )
        if tracker is not None and cfg.tracking.register_model:
            # the held-out scores on the registered version of these weights (when SFT or RL registered it)
            scores = {
                f"eval.{b}.{mode}.{k}": float(v)
                for b, s in results.items()
                for k, v in s.items()
                if k in ("score_mean", "answer_match_mean", "valid_scaffold_rate") and v == v
            }
            version = tag_scores(tracker, model_name(run_dir, cfg.tracking.model_name), path, scores)
            if version is not None:
                log.info("scores tagged on %s version %s", version.name, version.version)
        publish_markdown(
            "evaluate",
            run_dir,
            eval_markdown(tag, path, mode, results, run_dir, **mlflow_links(tracker, child)),
            f"evaluation of {tag} in {run_dir}",
        )
    return {"checkpoint": path, "tag": tag, "retrieval": mode, "benchmarks": results}
