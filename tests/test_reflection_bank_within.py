"""Within-episode retrieval's source (reflection.within_source): the reflection written in the replay's
own window (the paper, "window") or the query's best-ever one ("best")."""

from __future__ import annotations

import pytest

from rubricem_core.config import load_config
from rubricem_core.embedders import HashingEmbedder
from rubricem_core.reflection.bank import BankEntry, BankError, ReflectionBank
from rubricem_core.reflection.format import Reflection
from rubricem_core.reflection.meta import rebuild_bank, retrieve_guidance
from rubricem_core.rl.curriculum import replay_source_step, windowed_schedule
from rubricem_core.rl.session import new_bank

QUESTIONS = {
    "q1": "Which was founded earlier, Voralis Labs or Keto Works?",
    "q2": "What is the population of the city of Marrow Bay?",
}
# two windows of one new-query step and its replay: steps 0 new, 1 replay, 2 new, 3 replay
TWO_WINDOWS = {"rl.window": 1, "rl.n_windows": 2}


def _row(query_id: str, step: int, score: float, tag: str) -> dict:
    """An accepted `reflections` row, as reflect_task writes it."""
    text = Reflection((f"criterion {tag}",), (f"lesson {tag}",)).render()
    return {"query_id": query_id, "step": step, "score": score, "accepted": True, "text": text}


def _bank(source: str) -> ReflectionBank:
    cfg = load_config("tiny", {**TWO_WINDOWS, "reflection.within_source": source})
    bank = new_bank(cfg)
    # window 0 wrote a strong reflection for both queries; window 1 a weaker one for q1 and none for q2
    rebuild_bank(
        bank, [_row("q1", 0, 0.9, "w0-q1"), _row("q2", 0, 0.8, "w0-q2"), _row("q1", 2, 0.4, "w1-q1")], QUESTIONS
    )
    return bank


def _guidance(bank: ReflectionBank, step: int) -> dict[str, str | None]:
    """Within guidance for sampling ``step`` (window 1: replays are the odd steps), as rollout_task asks."""
    texts, _ = retrieve_guidance(
        bank, list(QUESTIONS.items()), "within", 1, None, QUESTIONS, source_step=replay_source_step(step, 1)
    )
    return dict(zip(QUESTIONS, texts))


def test_window_returns_this_windows_reflection_even_when_an_earlier_one_scored_higher():
    bank = _bank("window")
    assert bank.get("q1").step == 0  # the bank's entry is still the best one
    guidance = _guidance(bank, 3)  # step 3: window 1's replay
    assert "w1-q1" in guidance["q1"] and "w0-q1" not in guidance["q1"]
    assert guidance["q2"] is None  # window 1 accepted nothing for q2: a miss, not window 0's
    assert bank.stats()["within"] == {"requests": 2, "hits": 1, "misses": 1}

    guidance = _guidance(bank, 1)  # step 1, window 0's replay: window 0's reflections
    assert "w0-q1" in guidance["q1"] and "w0-q2" in guidance["q2"]


def test_best_returns_the_best_reflection_of_any_window():
    guidance = _guidance(_bank("best"), 3)
    assert "w0-q1" in guidance["q1"] and "w0-q2" in guidance["q2"]


def test_window_on_a_new_query_step_finds_nothing():
    bank = _bank("window")
    assert _guidance(bank, 2) == {"q1": None, "q2": None}  # step 2 is a new-query step: no source step
    assert bank.retrieve_many([("q1", QUESTIONS["q1"])], "within", source_step=None) == [[]]


def test_an_unknown_within_source_is_refused():
    with pytest.raises(BankError, match="within_source"):
        ReflectionBank(HashingEmbedder(dim=64), within_source="latest")


def test_the_code_default_is_best_and_the_gpu_profile_follows_the_paper():
    assert load_config("tiny", {}).reflection.within_source == "best"
    assert load_config("gpu", {}).reflection.within_source == "window"


def test_written_keeps_every_steps_entry_under_the_replace_policy():
    bank = ReflectionBank(HashingEmbedder(dim=64))
    text = Reflection(("c",), ("l",)).render()
    bank.add_many(
        [
            BankEntry("q1", "a question", text, 0.9, 0),
            BankEntry("q1", "a question", text, 0.2, 2),
            BankEntry("q1", "a question", text, 0.1, 2),
        ]
    )
    assert bank.get("q1").score == 0.9
    assert bank.written("q1", 0).score == 0.9 and bank.written("q1", 2).score == 0.2  # if_better within step 2
    assert bank.written("q1", 1) is None
    assert bank.retrieve("q1", "a question", "within")[0].score == 0.9  # within_source best: the entry


@pytest.mark.parametrize("window,n_windows", [(1, 2), (2, 3), (3, 2)])
def test_replay_source_step_matches_the_schedule(window, n_windows):
    plans = windowed_schedule([f"q{i}" for i in range(20)], window, n_windows, 2, seed=0)
    steps = {p.step: p for p in plans}
    for plan in plans:
        source = replay_source_step(plan.step, window)
        if plan.phase == "new":
            assert source is None
        else:
            assert steps[source].phase == "new" and steps[source].window == plan.window
            assert steps[source].query_ids == plan.query_ids
