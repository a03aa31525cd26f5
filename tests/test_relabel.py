"""Document-id relabelling: one consistent bijection per trajectory, nothing else touched."""

from __future__ import annotations

import random

import pytest

from rubricem_core import scaffold
from rubricem_core.encoding import encode_trajectory
from rubricem_core.policy import train_bpe_tokenizer
from rubricem_core.relabel import relabel_rng, relabel_trajectory, single_token_doc_ids
from rubricem_core.sim.world import WorldConfig, generate_world

DOC_IDS = [f"D{i:06d}" for i in range(60)]
TRACE = (
    "<structured_plan><deep_analysis>a</deep_analysis><rubric><knowledge_checklist>- x</knowledge_checklist>"
    "<analytical_criteria>- y</analytical_criteria><negative_constraints>- z</negative_constraints></rubric>"
    "<research_plan>- search</research_plan></structured_plan>"
    '<call_tool name="search">Oxo Works founder</call_tool>'
    '<tool_output><snippet id="D000003">Oxo Works was founded by Ana.</snippet>'
    '<snippet id="D000041">Ula Group was founded by Bo.</snippet></tool_output>'
    "<state_evaluation>Founder: Ana [D000003]. Verdict: ready</state_evaluation>"
    "<review><rubric_review>- founder → D000003</rubric_review><writing_plan><thesis>t</thesis>"
    "<outline>o</outline></writing_plan></review>"
    '<answer><cite id="D000003">Oxo Works was founded by Ana</cite>.</answer>'
)


@pytest.fixture(scope="module")
def tokenizers():
    world = generate_world(WorldConfig(seed=0, n_documents=60, n_queries=4))
    texts = [d.text for d in world.documents] + [scaffold.system_prompt(), scaffold.EXAMPLE_TRACE]
    return train_bpe_tokenizer(texts, 1024, atomic_terms=DOC_IDS), train_bpe_tokenizer(texts, 1024)


def encoded(tokenizer):
    prompt = [{"role": "system", "content": "s"}, {"role": "user", "content": "Who founded Oxo Works?"}]
    return encode_trajectory(tokenizer, prompt, TRACE, finished=True)


def test_single_token_doc_ids(tokenizers):
    atomic, plain = tokenizers
    ids = single_token_doc_ids(atomic, DOC_IDS + ["D999999"])  # an id outside the vocabulary is not one token
    assert len(ids) == len(DOC_IDS) and [atomic.decode([i]) for i in ids] == DOC_IDS
    assert single_token_doc_ids(plain, DOC_IDS) == []


@pytest.mark.parametrize("seed", range(4))
def test_relabel_is_one_consistent_bijection(tokenizers, seed):
    tokenizer = tokenizers[0]
    traj = encoded(tokenizer)
    id_tokens = single_token_doc_ids(tokenizer, DOC_IDS)
    renamed = relabel_trajectory(traj, id_tokens, random.Random(seed))
    assert len(renamed) == len(traj)
    assert renamed.loss_mask == traj.loss_mask and renamed.stage_ids == traj.stage_ids
    rename: dict[int, int] = {}
    for old, new in zip(traj.token_ids, renamed.token_ids):
        if old in id_tokens:
            assert new in id_tokens and rename.setdefault(old, new) == new  # same id → same new id
        else:
            assert new == old
    assert len(set(rename.values())) == len(rename) == 2  # two distinct ids stay distinct
    text = tokenizer.decode(renamed.token_ids)
    assert "D000003" not in text or rename[id_tokens[3]] == id_tokens[3]
    # The renamed trace is still a valid scaffold: citations point at the renamed snippets.
    body = text[text.index("<structured_plan>") :].removesuffix("<|im_end|>").strip()
    assert scaffold.validate(body) == []


def test_relabel_is_reproducible_and_varies(tokenizers):
    tokenizer = tokenizers[0]
    traj = encoded(tokenizer)
    id_tokens = single_token_doc_ids(tokenizer, DOC_IDS)
    first = relabel_trajectory(traj, id_tokens, relabel_rng(0, 5, 2)).token_ids
    assert relabel_trajectory(traj, id_tokens, relabel_rng(0, 5, 2)).token_ids == first
    others = {tuple(relabel_trajectory(traj, id_tokens, relabel_rng(0, step, 2)).token_ids) for step in range(6, 12)}
    assert len(others | {tuple(first)}) > 3
    assert relabel_trajectory(traj, [], relabel_rng(0, 5, 2)) is traj
