"""rl.stage_boundary: a stage's first trained token — the choice to leave the stage before it — takes the
advantage of the stage it leaves (`leaving`, the default) or of the stage it opens (`entering`)."""

from __future__ import annotations

import pytest
import torch
import yaml

from rubricem_core.config import ConfigError, config_to_yaml, load_config
from rubricem_core.rl.update import training_batch
from rubricem_core.scaffold import STAGES
from rubricem_core.ssgrpo import leaving_stage_ids, token_advantages

K = len(STAGES)


def loop_advantages(A: list[list[float]], stage_ids: list[list[int]], mask: list[list[bool]], boundary: str):
    """Worked token by token: remember the stage of the last trained token; a trained token of a later stage
    is that stage's first, and with `leaving` it takes the remembered stage."""
    out = []
    for a, sids, ms in zip(A, stage_ids, mask):
        row, last = [], None
        for s, m in zip(sids, ms):
            if not m or s < 0:
                row.append(0.0)
                continue
            takes = last if boundary == "leaving" and last is not None and last < s else s
            row.append(a[takes])
            last = s
        out.append(row)
    return out


@pytest.mark.parametrize("boundary", ["leaving", "entering"])
@pytest.mark.parametrize("seed", range(4))
def test_vectorized_matches_the_loop(boundary, seed):
    g = torch.Generator().manual_seed(seed)
    n, T = 6, 40
    A = torch.randn(n, K, generator=g)
    # stages in order with runs of tokens, -1 and untrained tokens in between (prompt, tool output)
    stage_ids = torch.randint(0, K, (n, T), generator=g).sort(dim=1).values
    stage_ids[torch.rand(n, T, generator=g) < 0.15] = -1
    mask = torch.rand(n, T, generator=g) < 0.7
    out = token_advantages(A, stage_ids, mask, boundary)
    want = torch.tensor(loop_advantages(A.tolist(), stage_ids.tolist(), mask.tolist(), boundary), dtype=out.dtype)
    torch.testing.assert_close(out, want, rtol=0, atol=0)


def test_only_each_stages_first_trained_token_moves():
    # plan plan | tool output (untrained, research) | research research | -1 | review review | answer
    stage_ids = torch.tensor([[0, 0, 1, 1, 1, -1, 2, 2, 3]])
    mask = torch.tensor([[1, 1, 0, 1, 1, 1, 1, 1, 1]])
    assert leaving_stage_ids(stage_ids, mask).tolist() == [[0, 0, 1, 0, 1, -1, 1, 2, 2]]
    A = torch.tensor([[1.0, 2.0, 3.0, 4.0]])
    leaving = token_advantages(A, stage_ids, mask, "leaving")[0].tolist()
    entering = token_advantages(A, stage_ids, mask, "entering")[0].tolist()
    assert entering == [1.0, 1.0, 0.0, 2.0, 2.0, 0.0, 3.0, 3.0, 4.0]
    assert leaving == [1.0, 1.0, 0.0, 1.0, 2.0, 0.0, 2.0, 3.0, 3.0]
    # the rollout's first trained token has no stage before it: it keeps its own (review, 3.0)
    assert token_advantages(A, torch.tensor([[2, 2, 3]]), torch.ones(1, 3), "leaving")[0].tolist() == [3.0, 3.0, 3.0]


def test_a_stopped_research_is_scored_with_the_research():
    """Two rollouts that differ only in the decision after the first search: `call` (search again) or
    `review` (close the research). With the research scored below average for the one that stopped and its
    review above, `leaving` pushes its stop token down; `entering` pushed it up."""
    rollouts, rewards = [], []
    for rid, stages, A in (
        ("searched", [0, 1, 1, 1, 1, 2, 3], {"plan": 0.0, "research": 1.0, "review": -1.0, "answer": 0.0}),
        ("stopped", [0, 1, 1, 2, 2, 2, 3], {"plan": 0.0, "research": -1.0, "review": 1.0, "answer": 0.0}),
    ):
        rollouts.append(
            {
                "rollout_id": rid,
                "judge_failed": False,
                "token_ids": list(range(7)),
                "loss_mask": [1] * 7,
                "stage_ids": stages,
                "logprobs": [-0.1] * 7,
            }
        )
        rewards += [{"rollout_id": rid, "stage": s, "R": None, "G": None, "A": A[s]} for s in STAGES]
    decision = 3  # the token after the first state evaluation: `call` in one, `review` in the other
    entering = training_batch(rollouts, rewards, "entering").token_advantages
    leaving = training_batch(rollouts, rewards, "leaving").token_advantages
    assert entering[1][decision] == 1.0 and leaving[1][decision] == -1.0
    assert entering[0][decision] == leaving[0][decision] == 1.0  # `call` is research either way
    assert training_batch(rollouts, rewards).token_advantages == entering  # the function's default: a[t] = A[stage(t)]


def test_the_config_default_and_a_run_recorded_before_the_field(tmp_path):
    """New runs take `leaving`; a run directory recorded before the field existed keeps `entering` when
    resumed, and a profile's `leaving` is refused there once RL has written rollouts."""
    from rubricem_core.run_config import base_config, record_config, stored_config
    from rubricem_core.store import RunStore

    assert load_config("tiny").rl.stage_boundary == "leaving"
    with pytest.raises(ConfigError, match="stage_boundary"):
        load_config("tiny", {"rl.stage_boundary": "closing"})
    run = tmp_path / "run"
    run.mkdir()
    old = yaml.safe_load(config_to_yaml(load_config("tiny")))
    del old["rl"]["stage_boundary"]
    del old["reflection"]["train_format_tags"]
    (run / "config.yaml").write_text(yaml.safe_dump(old))
    recorded = stored_config(run)
    assert recorded.rl.stage_boundary == "entering" and recorded.reflection.train_format_tags is True
    resumed = base_config(run, None, [])  # a command without --profile: the run's own settings
    assert resumed.rl.stage_boundary == "entering" and resumed.reflection.train_format_tags is True
    assert base_config(run, None, ["rl.stage_boundary=leaving"]).rl.stage_boundary == "leaving"
    record_config(run, resumed, "rl")  # nothing changed: accepted
    import pyarrow as pa

    RunStore(run).write_table("rollouts", pa.table({"step": [0]}), {"step": 0})
    with pytest.raises(ConfigError, match=r"rl\.stage_boundary: 'entering' → 'leaving'  \(already used by rl\)"):
        record_config(run, load_config("tiny"), "rl")
