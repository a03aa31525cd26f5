"""Micro-batch budgets against the longest sequence a run can make (issue #32).

`bucket_batches` refuses a sequence longer than a trainer's `max_tokens_per_batch`, which the RL update
only meets mid-run. The config now refuses, when it loads, an `rl.max_tokens_per_batch` below
`rollout.max_total_tokens` (the sampler's cap on a rollout and on a reflection candidate) or, with a
reflection recipe, below the reflection attempt bound plus the reflection, and an `sft.max_tokens_per_batch`
below `policy.max_seq_len` (SFT skips longer sequences, batches the rest).
"""

from __future__ import annotations

import math
import random
import re
from pathlib import Path

import pytest

from rubricem_core.batching import bucket_batches, collate
from rubricem_core.config import ConfigError, load_config, token_budget_problems
from rubricem_core.trajectory import NO_STAGE, TokenTrajectory

PROFILES = ["tiny", "small", "learn", "gpu", "research"]


def _refused(profile: str, overrides: dict) -> str:
    with pytest.raises(ConfigError) as err:
        load_config(profile, overrides)
    return str(err.value)


# ---- every profile loads, and its numbers hold -----------------------------------------------------
@pytest.mark.parametrize("profile", PROFILES)
def test_every_profile_loads_with_budgets_that_hold_its_longest_sequences(profile):
    cfg = load_config(profile)
    assert token_budget_problems(cfg) == []
    assert cfg.rl.max_tokens_per_batch >= cfg.rollout.max_total_tokens
    assert cfg.sft.max_tokens_per_batch >= cfg.policy.max_seq_len
    bound = cfg.reflection.max_trajectory_tokens
    if bound is not None:  # gpu and research bound the reflection prompt in tokens
        assert cfg.rl.max_tokens_per_batch >= min(bound, cfg.rollout.max_total_tokens) + cfg.reflection.max_new_tokens


def test_the_research_profile_holds_a_whole_rollout_in_one_rl_micro_batch():
    cfg = load_config("research")
    assert cfg.rollout.max_total_tokens == 32768
    assert cfg.rl.max_tokens_per_batch == 32768  # was the default 16384: refused now
    assert cfg.rl.gradient_checkpointing  # what makes a 32768-token micro-batch fit (the profile's comment)


# ---- the RL rule: a rollout --------------------------------------------------------------------------
def test_an_rl_budget_below_the_longest_rollout_is_refused_naming_both_fields():
    # the case: research's rollouts with the old default
    message = _refused("research", {"rl.max_tokens_per_batch": 16384})
    assert (
        "rl.max_tokens_per_batch 16384 < rollout.max_total_tokens 32768: a rollout of 32768 tokens cannot fit "
        "one micro-batch; set rl.max_tokens_per_batch ≥ 32768"
    ) in message
    assert "research.yaml with overrides rl.max_tokens_per_batch=16384" in message
    assert "(got {" not in message  # a whole-config error does not print the whole config back
    # the same from the other side: a longer context than the budget
    message = _refused("tiny", {"rollout.max_total_tokens": 20000})
    assert "rl.max_tokens_per_batch 16384 < rollout.max_total_tokens 20000" in message
    assert "set rl.max_tokens_per_batch ≥ 20000" in message
    assert "sft." not in message and "reflection." not in message  # only the rule that fails


def test_an_rl_budget_equal_to_the_longest_rollout_loads():
    cfg = load_config("tiny", {"rollout.max_total_tokens": 20000, "rl.max_tokens_per_batch": 20000})
    assert cfg.rl.max_tokens_per_batch == cfg.rollout.max_total_tokens == 20000
    with pytest.raises(ConfigError, match="rl.max_tokens_per_batch 19999 < rollout.max_total_tokens 20000"):
        load_config("tiny", {"rollout.max_total_tokens": 20000, "rl.max_tokens_per_batch": 19999})


# ---- the reflection rule: attempt + reflection ---------------------------------------------------------
REFLECTING = {"rl.max_tokens_per_batch": 4096, "reflection.max_new_tokens": 384}  # tiny: rollouts of 4096


def test_a_reflection_attempt_and_reflection_above_the_rl_budget_are_refused():
    message = _refused("tiny", {**REFLECTING, "reflection.max_trajectory_tokens": 3900})
    assert (
        "rl.max_tokens_per_batch 4096 < reflection.max_trajectory_tokens 3900 + reflection.max_new_tokens 384 = "
        "4284: rl.recipe full also updates the policy on its reflection candidates"
    ) in message
    assert "set rl.max_tokens_per_batch ≥ 4284 or reflection.max_trajectory_tokens ≤ 3712" in message
    assert "rollout.max_total_tokens" not in message  # the rollouts themselves fit
    # the boundary loads
    cfg = load_config("tiny", {**REFLECTING, "reflection.max_trajectory_tokens": 3712})
    assert cfg.reflection.max_trajectory_tokens + cfg.reflection.max_new_tokens == cfg.rl.max_tokens_per_batch


def test_the_reflection_rule_binds_only_recipes_that_update_on_reflections():
    too_long = {**REFLECTING, "reflection.max_trajectory_tokens": 3900}
    assert "rl.recipe meta_policy" in _refused("tiny", {**too_long, "rl.recipe": "meta_policy"})
    for recipe in ("baseline", "ss_grpo"):  # no reflection update: nothing of that length is trained
        assert load_config("tiny", {**too_long, "rl.recipe": recipe}).rl.recipe == recipe


def test_an_attempt_bound_above_the_context_counts_as_the_context():
    # an attempt is a rollout's text, under rollout.max_total_tokens, whatever the bound (the research
    # profile's test on a CPU keeps research's 30720 under a 2048-token context)
    overrides = {
        "rollout.max_total_tokens": 1024,
        "reflection.max_trajectory_tokens": 8192,
        "reflection.max_new_tokens": 384,
    }
    message = _refused("tiny", {**overrides, "rl.max_tokens_per_batch": 1024})
    assert (
        "rl.max_tokens_per_batch 1024 < rollout.max_total_tokens 1024 (the longest attempt: "
        "reflection.max_trajectory_tokens 8192 is above it) + reflection.max_new_tokens 384 = 1408"
    ) in message
    assert "set rl.max_tokens_per_batch ≥ 1408" in message
    assert load_config("tiny", {**overrides, "rl.max_tokens_per_batch": 1408}).rl.max_tokens_per_batch == 1408


def test_a_character_bound_sets_no_token_rule():
    # max_trajectory_chars (tiny: 2000) bounds no token count: only the rollout rule applies
    cfg = load_config("tiny", {"rl.max_tokens_per_batch": 4096, "reflection.max_new_tokens": 2048})
    assert cfg.reflection.max_trajectory_tokens is None and token_budget_problems(cfg) == []


# ---- the SFT rule -----------------------------------------------------------------------------------------
def test_an_sft_budget_below_the_longest_sft_sequence_is_refused_naming_both_fields():
    message = _refused("tiny", {"policy.max_seq_len": 8192})  # tiny's SFT budget: 4096
    assert (
        "sft.max_tokens_per_batch 4096 < policy.max_seq_len 8192: SFT trains sequences of up to 8192 tokens "
        "(it skips only longer ones), and one of 8192 tokens cannot fit one micro-batch; set "
        "sft.max_tokens_per_batch ≥ 8192 or policy.max_seq_len ≤ 4096"
    ) in message
    assert "rl.max_tokens_per_batch" not in message
    assert load_config("tiny", {"policy.max_seq_len": 8192, "sft.max_tokens_per_batch": 8192})
    message = _refused("research", {"sft.max_tokens_per_batch": 16384})
    assert "sft.max_tokens_per_batch 16384 < policy.max_seq_len 32768" in message


def test_every_failing_rule_is_listed_at_once():
    message = _refused("research", {"rl.max_tokens_per_batch": 16384, "sft.max_tokens_per_batch": 16384})
    assert "rl.max_tokens_per_batch 16384 < rollout.max_total_tokens 32768" in message
    reflection = "rl.max_tokens_per_batch 16384 < reflection.max_trajectory_tokens 30720 + reflection.max_new_tokens"
    assert reflection + " 1024 = 31744" in message
    assert "sft.max_tokens_per_batch 16384 < policy.max_seq_len 32768" in message


# ---- show: research's longest sequences go through the batching they used to crash ------------------
def _trajectory(prompt: int, policy: int, rng: random.Random, stage: int = 3) -> TokenTrajectory:
    n = prompt + policy
    return TokenTrajectory(
        token_ids=[rng.randrange(3, 1000) for _ in range(n)],
        loss_mask=[0] * prompt + [1] * policy,
        stage_ids=[NO_STAGE] * prompt + [stage] * policy,
        logprobs=[math.nan] * prompt + [-1.0] * policy,
    )


def _reflection_row(rid: str, candidate: int, prompt: int, reflection: int, score: float, rng) -> dict:
    """A `reflections` row as the reflect task writes it: the candidate's prompt and reflection tokens."""
    traj = _trajectory(prompt, reflection, rng)
    return {
        "source_rollout_id": rid,
        "candidate": candidate,
        "score": score,
        "judge_failed": False,
        "token_ids": traj.token_ids,
        "loss_mask": traj.loss_mask,
        "logprobs": [None if math.isnan(x) else x for x in traj.logprobs],
    }


def test_show_research_sized_rollouts_and_reflections_batch_under_the_research_budgets():
    from rubricem_core.rl.update import UpdateConfig, _micro_batch, reflection_training_batch, update_plan
    from rubricem_core.sft import step_schedule

    cfg = load_config("research")
    budget, total = cfg.rl.max_tokens_per_batch, cfg.rollout.max_total_tokens
    rng = random.Random(0)
    # rollouts: one cut at the context limit (the longest the sampler makes), a ~30k one, short ones
    rollouts = [_trajectory(1100, total - 1100, rng), _trajectory(1100, 29000, rng)]
    rollouts += [_trajectory(1100, rng.randint(200, 3000), rng) for _ in range(4)]
    # reflection candidates of one source: a prompt of research's attempt bound + its fixed part (1024, the
    # profile's comment) with a full reflection (~31.7k + 1k), and a prompt-only candidate that was refused
    # at sampling (no reflection tokens: it is kept whole in the update)
    prompt = cfg.reflection.max_trajectory_tokens + 1024
    new = cfg.reflection.max_new_tokens
    rows = [
        _reflection_row("r0", 0, prompt, new, 1.0, rng),
        _reflection_row("r0", 1, prompt - 1500, new, 0.5, rng),
        _reflection_row("r0", 2, prompt, 0, 0.0, rng),
        _reflection_row("r0", 3, 900, 300, 0.2, rng),
    ]
    reflections = reflection_training_batch(rows)
    lengths = sorted((len(t) for t in rollouts + reflections.trajectories), reverse=True)
    assert lengths[:5] == [32768, 32768, 31744, 31268, 30100]  # ~30k rollout, ~31k prompt + reflection

    # the budget the profile had before (the default) refuses them mid-run: the crash the config now prevents
    with pytest.raises(ValueError, match="has 32768 tokens, more than max_tokens_per_batch 16384"):
        bucket_batches(rollouts, 16384)

    for trajs, advs in (
        (rollouts, [[0.5 * m for m in t.loss_mask] for t in rollouts]),
        (reflections.trajectories, reflections.token_advantages),
    ):
        batches = bucket_batches(trajs, budget)
        assert sorted(i for b in batches for i in b) == list(range(len(trajs)))
        assert all(len(b) * max(len(trajs[i]) for i in b) <= budget for b in batches)
        # what the RL update (and the reflection update) runs: bucket, then collate with the extras
        config = UpdateConfig(max_tokens_per_batch=budget)
        plan = update_plan(trajs, config)
        micro = [
            _micro_batch(dict(enumerate(trajs)), dict(enumerate(advs)), picked, 0, config) for picked in plan.parts[0]
        ]
        assert plan.weights[0] == [float(b.loss_mask.sum()) for b in micro]  # the plan's weights: the trained tokens
        assert sum(b.batch_size for b in micro) == len(trajs)
        assert all(b.n_padded_tokens <= budget for b in micro)
        assert max(int(b.input_ids.shape[1]) for b in micro) == max(len(t) for t in trajs)
        assert sum(int(b.loss_mask.sum()) for b in micro) == sum(t.n_policy_tokens for t in trajs)
    longest = collate([rollouts[0]], pad_id=0)
    assert tuple(longest.input_ids.shape) == (1, total) and longest.n_padded_tokens == budget

    # SFT: research trains sequences up to policy.max_seq_len in sft.max_tokens_per_batch
    sft_lengths = [cfg.policy.max_seq_len, 30000, 31744, 1200, 5000]
    steps = step_schedule(sft_lengths, cfg.sft, cfg.seed)
    scheduled = [i for step in steps for micro in step for i in micro]
    assert sorted(scheduled) == sorted(list(range(len(sft_lengths))) * math.ceil(cfg.sft.epochs))


def test_the_rules_are_documented_where_the_fields_are():
    from rubricem_core.config import RLConfig, SFTConfig

    assert "rollout.max_total_tokens" in (RLConfig.model_fields["max_tokens_per_batch"].description or "")
    assert "policy.max_seq_len" in (SFTConfig.model_fields["max_tokens_per_batch"].description or "")
    page = (Path(__file__).resolve().parents[1] / "docs" / "configuration.md").read_text(encoding="utf-8")
    assert re.search(r"rl\.max_tokens_per_batch` ≥ `rollout\.max_total_tokens", page)
