"""Evaluation finds the bank RL saved: one location (bank_dir) and the embedder recorded with the bank.

The bank is written by the real RL save path (tasks.reflection._write_bank on a bank from the session's
new_bank) with a non-default embedder, then read by the evaluation's loader (rubricem_core.eval.benchmark.load_bank).
The evaluate flow on top of it is covered in tests/test_evaluate_flow.py (retrieval modes).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from rubricem_core.config import load_config
from rubricem_core.embedders import HashingEmbedder
from rubricem_core.reflection.bank import BankEntry, BankError, ReflectionBank, bank_dir, saved_bank_info
from rubricem_core.reflection.format import Reflection
from rubricem_core.rl.session import new_bank
from rubricem_core.store import RunStore

QUESTIONS = {
    "q-found": "Which was founded earlier, Voralis Labs or Keto Works?",
    "q-found2": "Which was founded earlier, Voralis Labs or Ambrel Optics?",
    "q-city": "What is the population of the city of Marrow Bay?",
}


def _cfg(**overrides):
    return load_config("tiny", {"reflection.embedder": "hashing:64", **overrides})


@pytest.fixture
def rl_run(tmp_path) -> str:
    """A run directory whose bank was saved as RL's reflect task saves it."""
    from tasks.reflection import _write_bank

    bank = new_bank(_cfg())
    for qid, question in QUESTIONS.items():
        bank.add(BankEntry(qid, question, Reflection((f"criterion {qid}",), (f"lesson {qid}",)).render(), 0.7, 0))
    run_dir = tmp_path / "run"
    _write_bank(RunStore(run_dir), bank)
    return str(run_dir)


def test_evaluation_loads_the_bank_rl_saved_with_the_recorded_embedder(rl_run):
    from rubricem_core.eval.benchmark import load_bank

    assert bank_dir(rl_run) == Path(rl_run).resolve() / "state" / "bank"
    info = saved_bank_info(bank_dir(rl_run))
    assert (info.embedder, info.dim) == ("hashing:64", 64)
    cfg = _cfg()
    assert cfg.eval.bank_embedder is None and cfg.eval.bank_dir is None  # the defaults: recorded, bank_dir
    bank = load_bank(rl_run, cfg, "cross")
    assert bank.embedder.dim == 64 and bank.path == bank_dir(rl_run)
    assert bank.rows() == RunStore(rl_run).read_rows("bank")  # the table RL wrote beside it
    [hit] = bank.retrieve("q-found", QUESTIONS["q-found"], "cross")
    assert hit.query_id == "q-found2"
    assert load_bank(rl_run, cfg, "none") is None


def test_the_bank_table_directory_is_not_a_saved_bank(rl_run):
    with pytest.raises(BankError, match="not a saved ReflectionBank"):
        ReflectionBank.load(Path(rl_run) / "tables" / "bank")


def test_an_override_of_another_dimension_is_refused_naming_both(rl_run):
    from rubricem_core.eval.benchmark import load_bank

    with pytest.raises(BankError, match=r"64-dim embeddings \('hashing:64'\).*\('hashing'\) gives 256-dim"):
        load_bank(rl_run, _cfg(**{"eval.bank_embedder": "hashing"}), "within")
    assert load_bank(rl_run, _cfg(**{"eval.bank_embedder": "hashing:64"}), "within").embedder.dim == 64
    with pytest.raises(BankError, match="cannot search a bank"):
        load_bank(rl_run, _cfg(**{"eval.bank_embedder": "none"}), "cross")


def test_bank_dir_overrides_the_location(rl_run, tmp_path):
    from rubricem_core.eval.benchmark import load_bank

    moved = tmp_path / "elsewhere"
    ReflectionBank.load(bank_dir(rl_run)).save(moved)
    bank = load_bank(str(tmp_path / "no-run"), _cfg(**{"eval.bank_dir": str(moved)}), "cross")
    assert len(bank) == len(QUESTIONS) and bank.embedder.dim == 64


class _Unnamed:
    """An embedder make_embedder cannot name: nothing is recorded with its bank."""

    dim = 64

    def encode(self, texts):
        return HashingEmbedder(dim=64).encode(texts)


def test_a_bank_without_a_recorded_embedder_needs_one(tmp_path):
    bank = ReflectionBank(_Unnamed())
    bank.add(BankEntry("q-city", QUESTIONS["q-city"], Reflection(("c",), ("l",)).render(), 0.5, 0))
    directory = bank.save(tmp_path / "bank")
    assert saved_bank_info(directory).embedder is None
    with pytest.raises(BankError, match="does not record the embedder"):
        ReflectionBank.load(directory)
    assert len(ReflectionBank.load(directory, "hashing:64")) == 1
    assert len(ReflectionBank.load(directory, _Unnamed())) == 1


def test_eval_settings_name_the_embedder_searched_with(rl_run):
    from rubricem_core.eval.benchmark import bank_settings

    cfg = _cfg()
    assert bank_settings(rl_run, cfg, "none") == [None, "hashing"]  # the digest of parts without retrieval stays
    assert bank_settings(rl_run, cfg, "cross") == [None, "hashing:64"]
    assert bank_settings(rl_run, _cfg(**{"eval.bank_embedder": "hashing:64"}), "within") == [None, "hashing:64"]


def test_the_recorded_embedder_rebuilds_the_stored_vectors(rl_run):
    bank = ReflectionBank.load(bank_dir(rl_run))
    stored = bank._index.reconstruct(bank.faiss_id("q-city"))
    assert np.allclose(stored, HashingEmbedder(dim=64).encode([QUESTIONS["q-city"]])[0], atol=1e-6)
