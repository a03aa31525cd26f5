"""Prefect tasks of the reflection meta-policy (recipes meta_policy and full).

`reflect` (step N, new-query phase): candidates from the policy → reflection judge → `reflections`
partition step=N, best valid candidate per query into the bank (`bank` table + the FAISS bank saved at
`bank_dir(run_dir)`, where evaluation reads it).
`reflection-update` (run in step N+1): one GRPO step on the reflection tokens of step N's candidates.
The flow overlaps them with the task work (see flows/rl.py); both skip what their Parquet or the
newest checkpoint already holds, so a retried run redoes only what is missing.
"""

from __future__ import annotations

import time
from typing import Any

from prefect import get_run_logger
from prefect.states import State

from rubricem_core.config import RunConfig
from rubricem_core.faults import fault_point
from rubricem_core.judge.types import JudgeQuery
from rubricem_core.llm.endpoints import endpoint_for
from rubricem_core.reflection.bank import ReflectionBank, bank_dir
from rubricem_core.reflection.judge import (
    ReflectionJudge,
    ReflectionJudgeInput,
    ReflectionJudgeOptions,
    reflection_rows,
)
from rubricem_core.reflection.meta import (
    candidate_requests,
    candidate_text,
    engine_stop_texts,
    judge_view,
    pick_source_rollouts,
    reflection_batch,
    reflection_metrics,
)
from rubricem_core.rl.curriculum import StepPlan
from rubricem_core.rollout import SamplingParams
from rubricem_core.schemas import BANK_SCHEMA, REFLECTIONS_SCHEMA, nan_to_none
from rubricem_core.seeds import REFLECTION_SAMPLING, derive_seed
from rubricem_core.store import RunStore
from rubricem_core.trajectory import TokenTrajectory
from tasks.inputs import search_env
from tasks.readback import parquet_task, read_back
from tasks.rl import (
    cached_task_metrics,
    completed_step,
    current_session,
    engine_asleep,
    ensure_engine_weights,
    get_session,
    load_bank_steps,
    reset_bank,
    sampling_session,
    save_task_metrics,
    update_settings,
)
from tasks.secrets import resolve_api_key


def _key(step: int) -> dict[str, int]:
    return {"step": step}


def _judge(cfg: RunConfig) -> ReflectionJudge:
    endpoint = cfg.reflection.judge
    settings = endpoint_for(endpoint, api_key=resolve_api_key(endpoint))
    options = ReflectionJudgeOptions.from_config(
        endpoint,
        seed=cfg.seed,
        max_trajectory_chars=endpoint.max_attempt_chars,
        validity=cfg.reflection.validity,
    )
    return ReflectionJudge(settings, options)


@parquet_task(name="reflect", task_run_name="reflect-step-{plan.step}")
def reflect_task(run_dir: str, cfg: RunConfig, plan: StepPlan) -> dict[str, Any] | State:
    """Write, judge and bank the reflections of a new-query step (weights: checkpoint step−1)."""
    log = get_run_logger()
    store = RunStore(run_dir)
    if store.has("reflections", _key(plan.step)):
        session = current_session(run_dir, cfg)
        load_bank_steps(session, store, [plan.step])
        metrics = cached_task_metrics(store, "reflect", plan.step)
        if session.bank is not None:
            metrics["bank/size"] = float(len(session.bank))
        return read_back(
            {"cached": True, "metrics": metrics}, store.partition_path("reflections", _key(plan.step)), run_dir
        )
    # the live session, unless a resumed run lost the weights of step−1 (no checkpoint kept them):
    # then one replayed to step−1 from the tables
    session = sampling_session(run_dir, cfg, plan.step - 1)
    queries = {q["query_id"]: q for q in store.read_rows("queries")}
    questions = {qid: q["question"] for qid, q in queries.items()}
    rollouts = store.read_rows("rollouts", _key(plan.step))
    sources = pick_source_rollouts(rollouts, plan.query_ids, cfg.seed, plan.step)
    sampling = SamplingParams(
        temperature=cfg.reflection.temperature,
        top_p=cfg.rollout.top_p,
        max_new_tokens=cfg.reflection.max_new_tokens,
        max_total_tokens=cfg.rollout.max_total_tokens,
        seed=derive_seed(cfg.seed, REFLECTION_SAMPLING, plan.step),
    )
    requests = candidate_requests(
        session.tokenizer,
        sources,
        questions,
        cfg.reflection.n_candidates,
        sampling,
        cfg.reflection.max_trajectory_chars,
        cfg.reflection.max_trajectory_tokens,
    )
    t0 = time.perf_counter()
    with session.lock:  # the engine is not re-entrant; the weights are those the step's rollouts used
        ensure_engine_weights(session, plan.step - 1, cfg)
        groups = session.engine.generate(requests, search_env(run_dir, cfg)) if requests else []
    gen_seconds = time.perf_counter() - t0

    rubric_rows = store.read_rows("judge_rubrics", _key(plan.step))
    score_rows = store.read_rows("judge_scores", _key(plan.step))
    inputs, trajs = [], {}
    tok = session.tokenizer
    stop_texts = engine_stop_texts(session.engine, tok)
    for (qid, src), group in zip(sources.items(), groups):
        rubrics, judgment = judge_view(qid, src["rollout_id"], rubric_rows, score_rows)
        q = queries[qid]
        inputs.append(
            ReflectionJudgeInput(
                query=JudgeQuery(
                    qid,
                    q["question"],  # the answer key only where the task judge may see it
                    reference_answer=q.get("reference_answer") if cfg.judge.show_reference else None,
                ),
                source_rollout_id=src["rollout_id"],
                trajectory_text=src["text"],
                candidates=[candidate_text(t, stop_texts) for t in group],
                rubrics=rubrics,
                judgment=judgment,
            )
        )
        for i, traj in enumerate(group):
            trajs[(src["rollout_id"], i)] = traj
    judge = _judge(cfg)
    t1 = time.perf_counter()
    scores = judge.score(inputs)
    judge_seconds = time.perf_counter() - t1

    rows = reflection_rows(plan.step, scores, cfg.reflection.min_score)
    for row in rows:
        traj: TokenTrajectory = trajs[(row["source_rollout_id"], row["candidate"])]
        row.update(
            token_ids=traj.token_ids,
            loss_mask=traj.loss_mask,
            n_tokens=len(traj),
            logprobs=[nan_to_none(x) for x in traj.logprobs],
            finish_reason=traj.finish_reason,
        )
    metrics = reflection_metrics(rows)
    metrics.update(judge.usage.metrics())
    metrics["reflection/generate_seconds"] = gen_seconds
    metrics["reflection/judge_seconds"] = judge_seconds
    # The bank first, then the metrics, then `reflections`, which marks the task done: a rerun after a
    # kill before it redoes the step's reflections and rebuilds the bank from the earlier partitions.
    if plan.step in session.bank_steps:  # an earlier attempt in this process banked other rows
        reset_bank(session, cfg, store, [s for s in store.partitions("reflections", "step") if s < plan.step])
    load_bank_steps(session, store, [plan.step], rows={plan.step: rows})
    if session.bank is not None:
        _write_bank(store, session.bank)
        metrics["bank/size"] = float(len(session.bank))
    save_task_metrics(store, "reflect", plan.step, metrics)
    store.write_table("reflections", rows, _key(plan.step), schema=REFLECTIONS_SCHEMA)
    fault_point("rl.reflections_written")
    log.info(
        "step %d: %d reflection candidates for %d trajectories, %d valid, %d accepted; bank size %d",
        plan.step,
        len(rows),
        len(inputs),
        sum(r["valid"] for r in rows),
        sum(r["accepted"] for r in rows),
        len(session.bank) if session.bank is not None else 0,
    )
    return {"cached": False, "metrics": metrics}


def _write_bank(store: RunStore, bank: ReflectionBank) -> None:
    """The `bank` table and the saved FAISS index, both from the session's bank (the replay of
    every `reflections` partition so far)."""
    store.write_table("bank", bank.rows(), schema=BANK_SCHEMA)
    fault_point("rl.bank_table_written")
    bank.save(bank_dir(store.run_dir))  # with its embedder's name: evaluation rebuilds the same one


@parquet_task(name="reflection-update", task_run_name="reflection-update-of-step-{source.step}")
def reflection_update_task(run_dir: str, cfg: RunConfig, source: StepPlan, at_step: int) -> dict[str, Any] | State:
    """GRPO on the reflection tokens of step ``source.step``'s candidates, applied during ``at_step``
    (before that step's task update; the engine keeps sampling with the weights it was synced to)."""
    log = get_run_logger()
    store = RunStore(run_dir)
    if completed_step(run_dir) >= at_step:
        metrics = cached_task_metrics(store, "reflection-update", at_step)
        return read_back({"cached": True, "metrics": metrics}, store.layout.rl_progress_file, run_dir)
    session = get_session(run_dir, cfg, at_step - 1)
    if at_step in session.reflection_updates:  # replayed from the tables when the session was rebuilt
        metrics = cached_task_metrics(store, "reflection-update", at_step)
        return read_back(
            {"cached": True, "metrics": metrics}, store.partition_path("reflections", _key(source.step)), run_dir
        )
    # The step's rollouts must see the weights from before this update.
    ensure_engine_weights(session, at_step - 1, cfg)
    batch = reflection_batch(store.read_rows("reflections", _key(source.step)))
    trajs, advs = batch.trajectories, batch.token_advantages
    t0 = time.perf_counter()
    session.policy.log_to(log.info)  # trainer ranks' output goes to this task's log
    with engine_asleep(session, cfg):
        metrics = session.policy.update(trajs, advs, update_settings(cfg, cfg.reflection.temperature))
    session.reflection_updates.add(at_step)
    out = {f"reflection_update/{k}": v for k, v in metrics.items()}
    out["reflection_update/source_step"] = float(source.step)
    out["reflection_update/candidates"] = float(len(trajs))
    out["reflection_update/nonzero_advantages"] = float(batch.nonzero)
    out["reflection_update/seconds"] = time.perf_counter() - t0
    # the weights keep this update only in memory until the step's checkpoint; a rerun redoes both
    save_task_metrics(store, "reflection-update", at_step, out)
    fault_point("rl.reflection_update_done")
    log.info(
        "step %d: reflection update on %d candidates of step %d (%d with signal)",
        at_step,
        len(trajs),
        source.step,
        batch.nonzero,
    )
    return {"cached": False, "metrics": out}
