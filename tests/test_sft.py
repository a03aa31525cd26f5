"""SFT: the flow end to end on tiny, exact resume, and clear errors for unusable data."""

from __future__ import annotations

import json

import pytest
import torch

from rubricem_core.config import load_config
from rubricem_core.sft import (
    SFTDataError,
    SFTRun,
    atomic_doc_id_terms,
    drive_sft,
    encode_sft_rows,
    prepare_policy,
    run_sft,
)
from rubricem_core.sql import run_sql
from rubricem_core.store import RunStore
from tests.sft_runs import SFT_RUN, collected_run  # noqa: F401  (module fixture)


@pytest.mark.slow
def test_sft_flow_trains_and_logs(collected_run):
    from flows.sft import sft

    result = sft(run_dir=collected_run, profile="tiny", overrides=SFT_RUN)
    assert result["steps"] == 8 and result["trajectories"] > 0
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(result["final_dir"])
    tok = AutoTokenizer.from_pretrained(result["final_dir"])
    assert tok.chat_template and model.num_parameters() > 0
    doc_id = RunStore(collected_run).read_table("corpus")["doc_id"][7].as_py()
    assert len(tok.encode(doc_id, add_special_tokens=False)) == 1, (
        "corpus ids are single tokens (policy.atomic_doc_ids)"
    )
    losses = json.loads(
        run_sql(collected_run, "SELECT step, value FROM metrics WHERE name = 'sft/loss' ORDER BY step", fmt="json")
    )
    assert len(losses) >= 3
    assert losses[-1]["value"] < losses[0]["value"], "loss must fall during SFT"
    # a second call finds the final checkpoint and does not train again
    assert sft(run_dir=collected_run, profile="tiny", overrides=SFT_RUN)["cached"] is True


@pytest.mark.slow
def test_sft_mixes_reflection_examples_with_their_own_loss(collected_run):
    """The teacher's reflections are SFT examples of the meta-policy's task: its exact prompt untrained,
    the reflection and end-of-turn token trained under their own stage; the task losses are logged apart."""
    from flows.sft import sft
    from rubricem_core.encoding import encode_prompt
    from rubricem_core.sft import encode_reflection_rows, sft_inputs
    from rubricem_core.trajectory import NO_STAGE, REFLECTION_STAGE

    sft(run_dir=collected_run, profile="tiny", overrides=SFT_RUN)  # trains once per module (cached after)
    rows, reflections = sft_inputs(collected_run)
    assert reflections and all(r["valid"] for r in reflections)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(f"{collected_run}/policy/base")
    trajs, ids, too_long = encode_reflection_rows(tok, reflections, max_len=4096)
    assert len(trajs) == len(reflections) and not too_long
    for traj, row in zip(trajs, reflections):
        prompt = encode_prompt(tok, json.loads(row["messages"]))  # what the sampler is given during RL
        assert traj.token_ids[: len(prompt)] == prompt and traj.prompt_len == len(prompt)
        assert set(traj.loss_mask[: len(prompt)]) == {0} and set(traj.loss_mask[len(prompt) :]) == {1}
        assert set(traj.stage_ids[: len(prompt)]) == {NO_STAGE} and set(traj.stage_ids[len(prompt) :]) == {
            REFLECTION_STAGE
        }
        assert tok.decode(traj.token_ids[len(prompt) : -1]) == row["text"] and traj.token_ids[-1] == tok.eos_token_id
    names = {r["name"] for r in json.loads(run_sql(collected_run, "SELECT DISTINCT name FROM metrics", fmt="json"))}
    assert {"sft/task_nll/research", "sft/task_nll/reflection", "sft/n_task_tokens/reflection"} <= names, sorted(names)


@pytest.mark.parametrize(
    "n_research,n_reflections,ratio,expected",
    [
        (10, 4, 1.0, 10),
        (10, 4, 0.5, 5),
        (10, 20, 0.5, 5),
        (10, 0, 1.0, 0),
        (10, 4, 0.0, 0),
        (3, 4, 2.0, 6),
    ],
)
def test_reflection_mix_sizes_and_covers(n_research, n_reflections, ratio, expected):
    from rubricem_core.sft import reflection_mix

    picks = reflection_mix(n_research, n_reflections, ratio, seed=3)
    assert len(picks) == expected
    if expected >= n_reflections > 0:  # every example used before any repeats
        assert set(picks[:n_reflections]) == set(range(n_reflections))
    assert picks == reflection_mix(n_research, n_reflections, ratio, seed=3)  # a pure function of the seed


class CountingRun:
    """SFTRun's driving surface (position, step, finish) over a counter: what ``drive_sft`` asks of a run."""

    def __init__(self, done: int, total: int) -> None:
        self.done, self.total, self.finished = done, total, False

    def position(self) -> tuple[int, int]:
        return self.done, self.total

    def step(self) -> dict[str, float]:
        self.done += 1
        return {"sft/loss": 1.0 / self.done}

    def finish(self) -> dict:
        self.finished = True
        return {"steps": self.total}


@pytest.mark.parametrize(
    "done, log_every, stop_after, logged, result",
    [
        (0, 2, None, [2, 4, 5], {"steps": 5}),  # every log_every steps, and the last
        (3, 2, None, [4, 5], {"steps": 5}),  # resumed at step 3
        (0, 1, 2, [1, 2], {"stopped_at": 2, "total_steps": 5}),  # stopped early: no final checkpoint
        (5, 1, None, [], {"steps": 5}),  # every step done: only the final save
    ],
)
def test_drive_sft_logs_the_returned_metrics_of_each_step(done, log_every, stop_after, logged, result):
    run = CountingRun(done, 5)
    seen: list = []
    out = drive_sft(lambda name: getattr(run, name)(), log_every, lambda m, step: seen.append((step, m)), stop_after)
    assert out == result
    assert [step for step, _ in seen] == logged
    assert all(m == {"sft/loss": 1.0 / step} for step, m in seen)  # each step's own return value
    assert run.finished == ("steps" in result)


@pytest.mark.slow
def test_resume_reproduces_uninterrupted_training(collected_run, tmp_path):
    cfg = load_config("tiny", {**SFT_RUN, "sft.max_steps": 6, "sft.checkpoint_every": 3, "sft.relabel_doc_ids": True})
    rows = RunStore(collected_run).read_rows("sft_trajectories")
    corpus = RunStore(collected_run).read_table("corpus")
    doc_ids = corpus["doc_id"].to_pylist()
    base = prepare_policy(cfg.policy, tmp_path / "base", corpus["text"].to_pylist(), seed=0, doc_ids=doc_ids)

    # document ids are renamed per trajectory and step (sft.relabel_doc_ids): resume must rename alike
    straight = run_sft(SFTRun(base, rows, tmp_path / "a", cfg.policy, cfg.sft, seed=0, doc_ids=doc_ids))
    stopped = run_sft(SFTRun(base, rows, tmp_path / "b", cfg.policy, cfg.sft, seed=0, doc_ids=doc_ids), stop_after=3)
    assert stopped["stopped_at"] == 3
    resumed = run_sft(SFTRun(base, rows, tmp_path / "b", cfg.policy, cfg.sft, seed=0, doc_ids=doc_ids))
    assert resumed["final_loss"] == pytest.approx(straight["final_loss"], rel=1e-6)
    a, b = final_weights(tmp_path / "a"), final_weights(tmp_path / "b")
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=0)
    # without relabelling the same run trains on other tokens, so the weights differ
    plain = cfg.sft.model_copy(update={"relabel_doc_ids": False})
    run_sft(SFTRun(base, rows, tmp_path / "c", cfg.policy, plain, seed=0, doc_ids=doc_ids))
    c = final_weights(tmp_path / "c")
    assert any(not torch.equal(a[k], c[k]) for k in a)


@pytest.mark.slow
def test_packed_sft_pads_less_and_resumes_exactly(collected_run, tmp_path):
    cfg = load_config("tiny", {**SFT_RUN, "sft.max_steps": 4})
    rows = RunStore(collected_run).read_rows("sft_trajectories")
    corpus = RunStore(collected_run).read_table("corpus")
    base = prepare_policy(cfg.policy, tmp_path / "base", corpus["text"].to_pylist(), seed=0)
    packed = cfg.sft.model_copy(update={"packing": True})
    bucketed = run_sft(SFTRun(base, rows, tmp_path / "bucketed", cfg.policy, cfg.sft, seed=0))
    straight = run_sft(SFTRun(base, rows, tmp_path / "a", cfg.policy, packed, seed=0))
    assert straight["padding_fraction"] < bucketed["padding_fraction"]
    assert straight["padding_fraction"] < 0.05
    assert run_sft(SFTRun(base, rows, tmp_path / "b", cfg.policy, packed, seed=0), stop_after=2)["stopped_at"] == 2
    resumed = run_sft(SFTRun(base, rows, tmp_path / "b", cfg.policy, packed, seed=0))
    assert resumed["final_loss"] == pytest.approx(straight["final_loss"], rel=1e-6)
    a, b = final_weights(tmp_path / "a"), final_weights(tmp_path / "b")
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=0)


@pytest.mark.slow
def test_sft_guides_a_share_of_traces_with_their_own_reflection(collected_run, tmp_path):
    """sft.guided_fraction: the chosen traces' system prompt carries their own teacher reflection as RL's
    retrieval renders it; the trace is the same tokens, the rest of the rows are untouched."""
    from rubricem_core.reflection.format import guidance_text, parse_reflection
    from rubricem_core.scaffold import prompt_guidance
    from rubricem_core.sft import guide_rows, sft_inputs

    cfg = load_config("tiny", {**SFT_RUN, "sft.max_steps": 1})
    style = cfg.policy.prompt_style
    rows, reflections = sft_inputs(collected_run)
    own: dict[str, str] = {}  # each trace's first valid reflection by request id
    for r in sorted(reflections, key=lambda r: r["request_id"], reverse=True):
        if r["valid"]:
            own[r["trajectory_id"]] = guidance_text(parse_reflection(r["text"]))
    candidates = [r for r in rows if r["accepted"] and r["trajectory_id"] in own]
    assert len(candidates) >= 4
    assert guide_rows(rows, reflections, 0.0, style, seed=0) == (rows, 0)
    for fraction in (0.5, 1.0):
        guided, n = guide_rows(rows, reflections, fraction, style, seed=0)
        assert n == round(fraction * len(candidates)) and guided == guide_rows(rows, reflections, fraction, style, 0)[0]
        changed = [(a, b) for a, b in zip(rows, guided) if a != b]
        assert len(changed) == n
        for before, after in changed:
            system, *rest = json.loads(after["messages"])
            assert prompt_guidance(system["content"]) == own[before["trajectory_id"]]
            assert rest == json.loads(before["messages"])[1:] and after["text"] == before["text"]
    assert guide_rows(rows, reflections, 0.5, style, seed=1)[0] != guide_rows(rows, reflections, 0.5, style, 0)[0]
    foreign = [dict(r, messages=json.dumps([{"role": "system", "content": "other"}])) for r in rows]
    with pytest.raises(SFTDataError, match="is not the policy's"):
        guide_rows(foreign, reflections, 1.0, style, seed=0)

    corpus = RunStore(collected_run).read_table("corpus")
    base = prepare_policy(cfg.policy, tmp_path / "base", corpus["text"].to_pylist(), seed=0)
    plain = SFTRun(base, rows, tmp_path / "a", cfg.policy, cfg.sft, seed=0, reflection_rows=reflections)
    sft = cfg.sft.model_copy(update={"guided_fraction": 0.5})
    run = SFTRun(base, rows, tmp_path / "b", cfg.policy, sft, seed=0, reflection_rows=reflections)
    assert plain.n_guided == 0 and run.n_guided == round(0.5 * len(candidates))
    longer = 0
    for a, b in zip(plain.data.trajectories, run.data.trajectories):
        assert a.token_ids[a.prompt_len :] == b.token_ids[b.prompt_len :]  # the same trace, trained alike
        longer += b.prompt_len > a.prompt_len
    assert longer == run.n_guided


def final_weights(root):
    from safetensors.torch import load_file

    return load_file(str(root / "final" / "model.safetensors"))


@pytest.mark.slow
def test_no_accepted_rows_is_a_clear_error(collected_run, tmp_path):
    cfg = load_config("tiny", SFT_RUN)
    corpus = RunStore(collected_run).read_table("corpus")
    base = prepare_policy(cfg.policy, tmp_path / "base", corpus["text"].to_pylist()[:50], seed=0)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(base))
    rows = [dict(r, accepted=False) for r in RunStore(collected_run).read_rows("sft_trajectories")]
    with pytest.raises(SFTDataError, match="no accepted rows"):
        encode_sft_rows(tok, rows, 4096)
    rows = RunStore(collected_run).read_rows("sft_trajectories")
    with pytest.raises(SFTDataError, match="longer than policy.max_seq_len=64"):
        encode_sft_rows(tok, rows, 64)
    lengths = sorted(len(t) for t in encode_sft_rows(tok, rows, 10**6).trajectories)
    data = encode_sft_rows(tok, rows, lengths[len(lengths) // 2])  # about half fit, the rest are counted
    assert data.trajectories and data.skipped_too_long
    assert len(data.trajectories) + len(data.skipped_too_long) == sum(r["accepted"] for r in rows)


@pytest.mark.parametrize(
    ("overrides", "n_ids", "expected"),
    [
        ({}, 300, 300),
        ({}, 1025, 0),
        ({"policy.atomic_doc_ids": False}, 300, 0),
        ({"policy.vocab_size": 8192}, 1025, 1025),
    ],
)
def test_atomic_doc_id_terms(overrides, n_ids, expected, caplog):
    cfg = load_config("tiny", overrides)  # vocab_size 4096 unless overridden: at most 1024 ids
    ids = [f"D{i:06d}" for i in range(n_ids)] + ["D000000"]  # a repeat is counted once
    terms = atomic_doc_id_terms(cfg.policy, ids)
    assert len(terms) == expected and len(set(terms)) == len(terms)
    if n_ids > cfg.policy.vocab_size // 4 and cfg.policy.atomic_doc_ids:
        assert "ids stay ordinary text" in caplog.text
