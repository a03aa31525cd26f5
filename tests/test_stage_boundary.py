"""rl.stage_boundary: a stage's opening tag — the choice to leave the stage before it — takes the advantage
of the stage it leaves (`leaving`, the default) or of the stage it opens (`entering`)."""

from __future__ import annotations

import pytest
import yaml

from rubricem_core.config import ConfigError, config_to_yaml, load_config
from rubricem_core.rl.update import leaving_stage_ids, per_token_advantages, training_batch
from rubricem_core.scaffold import STAGES
from rubricem_core.trajectory import NO_STAGE, TokenTrajectory

# token pieces as SmolLM2's BPE splits the scaffold (one id per piece; the stage the rollout parser gives it)
PLAN, RESEARCH, REVIEW, ANSWER = range(4)
SEARCHED = [  # plan, a search, its state evaluation, a second search, review, answer
    ("<", PLAN),
    ("structured", PLAN),
    ("_plan", PLAN),
    (">", PLAN),
    ("plan", PLAN),
    ("</", PLAN),
    ("structured_plan>\n", PLAN),
    ("<", RESEARCH),
    ("call", RESEARCH),
    ("_tool", RESEARCH),
    (' name="search">', RESEARCH),
    ("q", RESEARCH),
    ("</call_tool>", RESEARCH),
    ("<tool_output>docs</tool_output>", None),
    ("<state_evaluation>", RESEARCH),
    ("Verdict: continue", RESEARCH),
    ("</state_evaluation>", RESEARCH),
    ("\n", RESEARCH),
    ("<", RESEARCH),
    ("call", RESEARCH),
    ("_tool", RESEARCH),
    (">", RESEARCH),
    ("<tool_output>docs</tool_output>", None),
    ("<", REVIEW),
    ("review", REVIEW),
    (">", REVIEW),
    ("facts", REVIEW),
    ("</review>", REVIEW),
    ("\n", REVIEW),
    ("<", ANSWER),
    ("answer", ANSWER),
    (">", ANSWER),
    ("Paris", ANSWER),
]
STOPPED = SEARCHED[:18] + SEARCHED[23:]  # the same, but `<review>` after the first state evaluation


def trajectory(pieces: list[tuple[str, int | None]]) -> tuple[TokenTrajectory, dict[int, str]]:
    vocab = {i: text for i, (text, _) in enumerate(pieces)}
    prompt = [("<|im_start|>user: where?", None)]
    traj = TokenTrajectory(
        token_ids=[100, *vocab],
        loss_mask=[0] + [0 if stage is None else 1 for _, stage in pieces],
        stage_ids=[NO_STAGE] + [RESEARCH if stage is None else stage for _, stage in pieces],
        logprobs=[-0.1] * (len(pieces) + 1),
    )
    vocab[100] = prompt[0][0]
    return traj, vocab


def decoder(vocab: dict[int, str]):
    return lambda ids: "".join(vocab[i] for i in ids)


def test_each_stages_opening_tag_takes_the_stage_it_leaves():
    traj, vocab = trajectory(STOPPED)
    ids = leaving_stage_ids(traj, decoder(vocab))
    text = [vocab[i] for i in traj.token_ids]
    moved = [(text[t], traj.stage_ids[t], ids[t]) for t in range(len(ids)) if ids[t] != traj.stage_ids[t]]
    assert moved == [
        ("<", RESEARCH, PLAN),
        ("call", RESEARCH, PLAN),
        ("_tool", RESEARCH, PLAN),
        (' name="search">', RESEARCH, PLAN),
        ("<", REVIEW, RESEARCH),
        ("review", REVIEW, RESEARCH),
        (">", REVIEW, RESEARCH),
        ("<", ANSWER, REVIEW),
        ("answer", ANSWER, REVIEW),
        (">", ANSWER, REVIEW),
    ]


@pytest.mark.parametrize("pieces", [SEARCHED, STOPPED], ids=["searched", "stopped"])
def test_entering_is_the_plain_rule_and_leaving_moves_only_the_tags(pieces):
    traj, vocab = trajectory(pieces)
    A = [1.0, 2.0, 3.0, 4.0]
    entering = per_token_advantages(traj, A)
    assert entering == [A[s] if m and s >= 0 else 0.0 for s, m in zip(traj.stage_ids, traj.loss_mask)]
    leaving = per_token_advantages(traj, A, decoder(vocab))
    ids = leaving_stage_ids(traj, decoder(vocab))
    assert leaving == [A[s] if m and s >= 0 else 0.0 for s, m in zip(ids, traj.loss_mask)]
    changed = [t for t in range(len(leaving)) if leaving[t] != entering[t]]
    assert leaving != entering and all(traj.loss_mask[t] for t in changed)


def test_a_tag_that_never_closes_moves_at_most_a_few_tokens():
    pieces = [("plan", PLAN)] + [("x", REVIEW)] * 20
    traj, vocab = trajectory(pieces)
    ids = leaving_stage_ids(traj, decoder(vocab))
    assert ids.count(PLAN) == 1 + 8 and ids[-1] == REVIEW


def test_a_stopped_research_is_scored_with_the_research():
    """Two rollouts that differ only in the decision after the first search: `<call_tool` (search again) or
    `<review>` (close the research). With the research of the one that stopped scored below average and its
    review above, `leaving` pushes its `review` token down; `entering` pushed it up."""
    rows, rewards, vocab = [], [], {}
    for rid, pieces, A in (
        ("searched", SEARCHED, {"plan": 0.0, "research": 1.0, "review": -1.0, "answer": 0.0}),
        ("stopped", STOPPED, {"plan": 0.0, "research": -1.0, "review": 1.0, "answer": 0.0}),
    ):
        traj, v = trajectory(pieces)
        ids = [1000 * len(rows) + i for i in traj.token_ids]  # each rollout its own ids for its own pieces
        vocab.update({1000 * len(rows) + i: text for i, text in v.items()})
        rows.append(
            {
                "rollout_id": rid,
                "judge_failed": False,
                "token_ids": ids,
                "loss_mask": traj.loss_mask,
                "stage_ids": traj.stage_ids,
                "logprobs": traj.logprobs,
            }
        )
        rewards += [{"rollout_id": rid, "stage": s, "R": None, "G": None, "A": A[s]} for s in STAGES]
    decision = 1 + 18 + 1  # the prompt, the pieces up to the first state evaluation's "\n<", then call | review
    assert [vocab[rows[0]["token_ids"][decision]], vocab[rows[1]["token_ids"][decision]]] == ["call", "review"]
    entering = training_batch(rows, rewards).token_advantages
    leaving = training_batch(rows, rewards, decoder(vocab)).token_advantages
    assert entering[1][decision] == 1.0 and leaving[1][decision] == -1.0
    assert entering[0][decision] == leaving[0][decision] == 1.0  # `call` is research either way


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
