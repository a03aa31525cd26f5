"""A valid reflection candidate's format tags are left out of its reflection update (reflection.train_format_tags)."""

from __future__ import annotations

import pytest

from rubricem_core.config import load_config
from rubricem_core.reflection.format import FORMAT_TAGS, format_tag_tokens, parse_reflection
from rubricem_core.reflection.meta import trained_mask
from rubricem_core.rl.update import reflection_training_batch
from rubricem_core.sim.world import WorldConfig, generate_world
from rubricem_core.testing.tiny_models import world_tokenizer
from rubricem_core.trajectory import NO_STAGE, TokenTrajectory

REFLECTION = (
    "<reflection>\n<reflection_rubrics>\n- States the founding year of Åsa Holdings\n</reflection_rubrics>\n"
    "<takeaways>\n- Search 'Åsa Holdings founding year' first\n</takeaways>\n</reflection>"
)


@pytest.fixture(scope="module")
def tok():
    return world_tokenizer(generate_world(WorldConfig(seed=0, n_documents=60, n_queries=4)))


def _pieces_decode(pieces: list[str]):
    return lambda ids: "".join(pieces[i] for i in ids)


def test_tokens_that_spell_a_tag_are_flagged_by_hand():
    pieces = ["<", "take", "aways", ">\n- go", " on", "\n</", "takeaways>", "\n", "</reflection", ">"]
    flags = format_tag_tokens(range(len(pieces)), _pieces_decode(pieces))
    # ">\n- go" closes <takeaways> and starts the item: it spells part of a tag, so it is flagged
    assert flags == [True, True, True, True, False, True, True, False, True, True]


def test_text_that_only_looks_like_a_tag_is_not_flagged():
    pieces = ["- use ", "<", "reflect", "ions>", " and <takeaway> items"]
    assert format_tag_tokens(range(len(pieces)), _pieces_decode(pieces)) == [False] * len(pieces)


def test_with_a_real_tokenizer_the_flagged_tokens_spell_the_tags_and_nothing_else(tok):
    ids = tok.encode(REFLECTION, add_special_tokens=False)
    assert tok.decode(ids) == REFLECTION
    flags = format_tag_tokens(ids, tok.decode)
    tagged = "".join(tok.decode([i]) for i, f in zip(ids, flags) if f)
    untagged = tok.decode([i for i, f in zip(ids, flags) if not f])
    assert "<" not in untagged and ">" not in untagged
    assert "".join(tagged.split()) == "".join(FORMAT_TAGS)  # every tag, in order, whitespace aside
    assert "Åsa Holdings" in untagged  # multi-byte characters stay with the content


def _candidate(tok, text: str) -> TokenTrajectory:
    prompt = tok.encode("Write your reflection now.", add_special_tokens=False)
    written = tok.encode(text, add_special_tokens=False)
    ids = prompt + written
    mask = [0] * len(prompt) + [1] * len(written)
    return TokenTrajectory(ids, mask, [NO_STAGE] * len(ids), [0.0] * len(ids))


def test_trained_mask_drops_the_tags_and_keeps_the_prompt_out(tok):
    traj = _candidate(tok, REFLECTION)
    mask = trained_mask(traj, tok.decode)
    assert len(mask) == len(traj.loss_mask)
    assert all(m == 0 for m, was in zip(mask, traj.loss_mask) if not was)  # the prompt stays untrained
    trained = tok.decode([t for t, m in zip(traj.token_ids, mask) if m])
    assert parse_reflection(REFLECTION) is not None
    assert "States the founding year" in trained and "<" not in trained
    assert 0 < sum(mask) < sum(traj.loss_mask)


def _row(traj: TokenTrajectory, mask: list[int], candidate: int, score: float) -> dict:
    return {
        "source_rollout_id": "q-r0",
        "candidate": candidate,
        "score": score,
        "judge_failed": False,
        "token_ids": traj.token_ids,
        "loss_mask": mask,
        "logprobs": traj.logprobs,
    }


def test_the_update_gives_a_valid_candidates_tags_no_advantage(tok):
    good = _candidate(tok, REFLECTION)
    worse = _candidate(tok, REFLECTION.replace("first", "later"))
    rows = [
        _row(good, trained_mask(good, tok.decode), 0, 0.9),
        _row(worse, trained_mask(worse, tok.decode), 1, 0.5),
    ]
    batch = reflection_training_batch(rows)
    untrained = reflection_training_batch([_row(good, good.loss_mask, 0, 0.9), _row(worse, worse.loss_mask, 1, 0.5)])
    for traj, advs, all_advs in zip([good, worse], batch.token_advantages, untrained.token_advantages):
        flags = format_tag_tokens([t for t, m in zip(traj.token_ids, traj.loss_mask) if m], tok.decode)
        written = [i for i, m in enumerate(traj.loss_mask) if m]
        assert all(advs[i] == 0.0 for i, f in zip(written, flags) if f)
        assert all(advs[i] == all_advs[i] != 0.0 for i, f in zip(written, flags) if not f)
        assert any(all_advs[i] != 0.0 for i, f in zip(written, flags) if f)  # trained, the tags would move


def test_the_switch_is_a_documented_config_field():
    assert load_config("tiny").reflection.train_format_tags is False
    assert load_config("tiny", ["reflection.train_format_tags=true"]).reflection.train_format_tags is True
