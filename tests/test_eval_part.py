"""One `eval_results` part without Prefect (rubricem_core.eval.benchmark): its settings digest, sampling
and grading with a real (random-init) policy and the real tools, the read-back of a part with the same
settings, re-evaluation when they change, and the valid-reflection rate."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest

from rubricem_core.config import RunConfig, load_config
from rubricem_core.environment import local_tool_env
from rubricem_core.eval.benchmark import (
    REFLECTIONS_TABLE,
    RESULTS_TABLE,
    evaluate_part,
    plan_part,
    reflection_valid_rate,
    reflection_validity_rows,
)
from rubricem_core.eval.grading import summarize
from rubricem_core.store import RunStore
from tests.untrained_run import UNTRAINED_TINY, write_untrained_run

SMALL = {
    **UNTRAINED_TINY,
    "data.world.eval_fraction": 0.25,
    "policy.prompt_style": "compact",
    "rollout.max_new_tokens": 16,
    "rollout.max_total_tokens": 700,
    "reflection.max_new_tokens": 16,
    "tools.max_tool_calls": 1,
    "eval.max_queries": 2,
    "eval.samples_per_query": 1,
}


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    run = tmp_path_factory.mktemp("eval-part") / "run"
    write_untrained_run(load_config("tiny", SMALL), run)
    return run


class Calls:
    """The engine, grader and tool factories of the task, counting how often sampling needed them."""

    def __init__(self, run: Path, cfg: RunConfig) -> None:
        self.run, self.cfg, self.engines = run, cfg, 0

    def engine(self) -> tuple[Any, Any]:
        from rubricem_core.policy.loading import load_policy
        from rubricem_core.rollout import HFRolloutEngine

        self.engines += 1
        model, tokenizer = load_policy(str(self.run / "checkpoints" / "sft" / "final"), device="cpu")
        return HFRolloutEngine(model, tokenizer, max_batch_rows=self.cfg.rollout.max_batch_rows), tokenizer

    def grader(self) -> Any:
        raise AssertionError("the synthetic benchmark is graded without an LLM grader")

    def env(self) -> Any:
        return local_tool_env(RunStore(self.run).read_table("corpus"), self.cfg.tools)


def _evaluate(run: Path, cfg: RunConfig, calls: Calls):
    checkpoint = str(run / "checkpoints" / "sft" / "final")
    return evaluate_part(
        RunStore(run), cfg, checkpoint, "synthetic", "none", calls.engine, calls.grader, calls.env, lambda *a: None
    )


@pytest.mark.parametrize(
    ("override", "changes"),
    [
        ({"eval.temperature": 0.3}, True),
        ({"eval.samples_per_query": 2}, True),
        ({"eval.max_queries": 1}, True),
        ({"rollout.max_new_tokens": 17}, True),
        ({"eval.reflection_validity": False}, False),  # not part of what produced the rows
        ({"rl.lr": 1e-3}, False),
    ],
)
def test_the_settings_digest_follows_what_produces_the_rows(run: Path, override: dict, changes: bool) -> None:
    checkpoint = str(run / "checkpoints" / "sft" / "final")
    base = plan_part(RunStore(run), load_config("tiny", SMALL), checkpoint, "synthetic", "none")
    assert (
        base.settings == plan_part(RunStore(run), load_config("tiny", SMALL), checkpoint, "synthetic", "none").settings
    )
    assert base.tag == "sft" and base.name == "sft--synthetic--none" and len(base.queries) == 2
    other = plan_part(RunStore(run), load_config("tiny", {**SMALL, **override}), checkpoint, "synthetic", "none")
    assert (other.settings != base.settings) == changes


def test_a_part_is_sampled_once_read_back_and_evaluated_again_when_settings_change(run: Path) -> None:
    cfg = load_config("tiny", SMALL)
    store, calls = RunStore(run), Calls(run, cfg)
    fresh = _evaluate(run, cfg, calls)
    assert not fresh.cached and calls.engines == 1
    assert len(fresh.rows) == 2 and {r["settings"] for r in fresh.rows} == {fresh.part.settings}
    assert {r["checkpoint"] for r in fresh.rows} == {"sft"} and fresh.summary["n_samples"] == 2
    store.write_table(RESULTS_TABLE, fresh.rows, {}, fresh.part.name)

    again = _evaluate(run, cfg, calls)
    assert again.cached and calls.engines == 1  # nothing sampled
    assert again.summary == fresh.summary == summarize(fresh.rows)
    assert [r["text"] for r in again.rows] == [r["text"] for r in fresh.rows]

    # the valid-reflection rate: one reflection per sampled trajectory, keyed like its result row
    reflections = reflection_validity_rows(cfg, again.part, again.rows, calls.engine, calls.env)
    assert [(r["query_id"], r["sample"]) for r in reflections] == [(r["query_id"], r["sample"]) for r in fresh.rows]
    assert all(isinstance(r["valid"], bool) and isinstance(r["codes"], list) for r in reflections)
    rate = reflection_valid_rate(reflections)["reflection_valid_rate"]
    assert rate == sum(r["valid"] for r in reflections) / 2
    assert math.isnan(reflection_valid_rate([])["reflection_valid_rate"])
    store.write_table(REFLECTIONS_TABLE, reflections, {}, again.part.name)

    hotter = load_config("tiny", {**SMALL, "eval.temperature": 1.3})
    redone = _evaluate(run, hotter, calls)
    assert not redone.cached and calls.engines == 3 and redone.part.settings != fresh.part.settings
    assert not store.has(REFLECTIONS_TABLE, {}, again.part.name)  # the old part's reflections went with it
