"""Checkpoints: exact stop-and-resume, atomic saves, latest_checkpoint, clear errors."""

from __future__ import annotations

import json
import random
import shutil

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from rubricem_core.testing.tiny_models import VOCAB, tiny_model
from rubricem_core.training import CheckpointError, TrainerConfig, latest_checkpoint, load_checkpoint, make_trainer
from rubricem_core.training import checkpoint as ckpt_mod
from rubricem_core.training.checkpoint import (
    META_FILE,
    STATE_FILE,
    capture_rng_state,
    restore_rng_state,
    save_checkpoint,
)
from tiny_models import one_thread  # noqa: F401 (an autouse fixture)


def data_for_step(step: int) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(100 + step)
    return [{"input_ids": torch.randint(0, VOCAB, (2, 12), generator=g)} for _ in range(2)]


def noisy_loss(model, micro_batch):
    """Token NLL over a random subset of positions drawn from the global torch RNG, so a resume
    that does not restore RNG state gives different losses."""
    ids = micro_batch["input_ids"]
    logits = model(input_ids=ids).logits[:, :-1].float()
    nll = F.cross_entropy(logits.reshape(-1, VOCAB), ids[:, 1:].reshape(-1), reduction="none")
    keep = (torch.rand(nll.shape) > 0.3).float()
    return (nll * keep).sum() / keep.sum(), {"n_tokens": int(keep.sum())}


def cfg(**kw) -> TrainerConfig:
    return TrainerConfig(**{**dict(lr=5e-3, weight_decay=0.1, warmup_steps=1, total_steps=4, max_grad_norm=1.0), **kw})


def train(trainer, steps: range) -> list[float]:
    return [trainer.step(data_for_step(s), noisy_loss)["loss"] for s in steps]


def same_params(a, b) -> bool:
    pa, pb = dict(a.named_parameters()), dict(b.named_parameters())
    return pa.keys() == pb.keys() and all(torch.equal(pa[k], pb[k]) for k in pa)


# ------------------------------------------------------------------------------- exact resume
N, K = 4, 2


@pytest.fixture(scope="module")
def uninterrupted():
    trainer = make_trainer(tiny_model(), cfg())
    losses = train(trainer, range(N))
    return trainer, losses


@pytest.mark.parametrize("tie", [False, True])
def test_torch_stop_and_resume_is_exact(tmp_path, uninterrupted, tie):
    if tie:  # tied embeddings are saved once by save_pretrained: the resume must still be exact
        ref = make_trainer(tiny_model(tie=True), cfg())
        ref_losses = train(ref, range(N))
    else:
        ref, ref_losses = uninterrupted
    first = make_trainer(tiny_model(tie=tie), cfg())
    losses = train(first, range(K))
    first.save(tmp_path / "ck", extra={"next_batch": K, "epoch": 0})
    # A fresh process would build the model from another seed and draw other random numbers.
    torch.manual_seed(12345), random.seed(1), np.random.seed(1)
    resumed = make_trainer(tiny_model(seed=7, tie=tie), cfg(seed=99))
    extra = resumed.load(tmp_path / "ck")
    assert extra == {"next_batch": K, "epoch": 0} and resumed.global_step == K
    losses += train(resumed, range(extra["next_batch"], N))
    assert losses == ref_losses  # exactly, not approximately
    assert same_params(resumed.model, ref.model)


def test_resume_with_another_schedule_warns_and_keeps_the_checkpoints(tmp_path, caplog):
    # another warm-up or peak lr is ignored (the checkpoint's curve wins); another total_steps is
    # followed instead (tests/test_schedule_resume.py)
    first = make_trainer(tiny_model(), cfg())
    train(first, range(2))
    first.save(tmp_path / "ck")
    resumed = make_trainer(tiny_model(), cfg(warmup_steps=3, lr=1e-3))
    with caplog.at_level("WARNING"):
        resumed.load(tmp_path / "ck")
    assert "warmup_steps" in caplog.text and "'lr'" in caplog.text
    assert resumed.scheduler.get_last_lr() == first.scheduler.get_last_lr()


def test_resume_comparison_is_sensitive(tmp_path, uninterrupted):
    # Control: loading only the weights (fresh optimizer and schedule) must not pass as a resume.
    ref, ref_losses = uninterrupted
    first = make_trainer(tiny_model(), cfg())
    train(first, range(K))
    first.save(tmp_path / "ck")
    weights_only = make_trainer(load_checkpoint(tmp_path / "ck").model, cfg())
    weights_only.global_step = K
    train(weights_only, range(K, N))
    assert not same_params(weights_only.model, ref.model)


@pytest.mark.parametrize("stage", [1, 3])
def test_deepspeed_stop_and_resume_is_exact(tmp_path, deepspeed_ok, stage):
    ds_cfg = cfg(backend="deepspeed", zero_stage=stage)
    ref = make_trainer(tiny_model(), ds_cfg)
    ref_losses = train(ref, range(4))
    first = make_trainer(tiny_model(), ds_cfg)
    losses = train(first, range(2))
    saved = first.state_dict_for_sync()
    first.save(tmp_path / "ds", extra={"next_batch": 2})
    torch.manual_seed(12345)
    resumed = make_trainer(tiny_model(seed=7), ds_cfg)
    extra = resumed.load(tmp_path / "ds")
    losses += train(resumed, range(extra["next_batch"], 4))
    assert losses == ref_losses
    expected, got = ref.state_dict_for_sync(), resumed.state_dict_for_sync()  # gathered under ZeRO-3
    assert expected.keys() == got.keys() and all(torch.equal(expected[k], got[k]) for k in expected)
    # The HF weights beside DeepSpeed's shards are the trained model (ZeRO-3: gathered before
    # saving), loadable without DeepSpeed.
    hf = load_checkpoint(tmp_path / "ds").model
    assert all(torch.equal(p, saved[k]) for k, p in hf.named_parameters())
    assert (tmp_path / "ds" / "deepspeed").is_dir() and (tmp_path / "ds" / "rng_rank0.pt").is_file()


class _Payload:
    """A pickle that runs code when it is loaded without weights_only (what a hostile file on a shared volume does)."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_deepspeed_files_load_without_running_pickled_code(tmp_path, deepspeed_ok):
    trainer = make_trainer(tiny_model(), cfg(backend="deepspeed", zero_stage=1))
    hostile, marker = tmp_path / "optim_states.pt", tmp_path / "pwned"
    torch.save({"optimizer_state_dict": _Payload(marker)}, hostile)
    with pytest.raises(Exception, match="Weights only load failed"):
        trainer.engine.checkpoint_engine.load(str(hostile), map_location="cpu")
    assert not marker.exists()
    # DeepSpeed's own files still load: the resume test above runs through the same load


def test_backend_mismatch_is_a_checkpoint_error(tmp_path, deepspeed_ok):
    torch_trainer = make_trainer(tiny_model(), cfg())
    torch_trainer.save(tmp_path / "t")
    ds = make_trainer(tiny_model(), cfg(backend="deepspeed", zero_stage=1))
    with pytest.raises(CheckpointError, match="torch.*backend"):
        ds.load(tmp_path / "t")


# ------------------------------------------------------------------------ atomicity and listing
def test_crash_mid_save_leaves_no_checkpoint_under_the_final_name(tmp_path, monkeypatch):
    trainer = make_trainer(tiny_model(), cfg())
    train(trainer, range(1))
    trainer.save(tmp_path / "step-1")

    def crash(*args, **kwargs):
        raise KeyboardInterrupt("killed while writing trainer_state.pt")

    monkeypatch.setattr(ckpt_mod.torch, "save", crash)
    train(trainer, range(1, 2))
    with pytest.raises(KeyboardInterrupt):
        trainer.save(tmp_path / "step-2")
    assert not (tmp_path / "step-2").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-1"]  # the staging dir is removed too
    assert latest_checkpoint(tmp_path) == tmp_path / "step-1"


def test_latest_checkpoint_orders_by_step_and_skips_incomplete(tmp_path):
    assert latest_checkpoint(tmp_path / "missing") is None
    assert latest_checkpoint(tmp_path) is None
    model = tiny_model()
    for name, step in [("step-000002", 2), ("step-000010", 10), ("final", 4)]:
        save_checkpoint(tmp_path / name, model, trainer_state={"global_step": step})
    (tmp_path / ".step-000020.tmp").mkdir()  # a save killed by SIGKILL: staging left behind
    (tmp_path / "step-000030").mkdir()  # not a checkpoint (no checkpoint.json)
    assert latest_checkpoint(tmp_path) == tmp_path / "step-000010"
    assert json.loads((tmp_path / "final" / META_FILE).read_text())["step"] == 4


def test_saving_over_an_existing_checkpoint_replaces_it(tmp_path):
    model = tiny_model()
    save_checkpoint(tmp_path / "final", model, trainer_state={"global_step": 1})
    with torch.no_grad():
        model.lm_head.weight.add_(1.0)
    save_checkpoint(tmp_path / "final", model, trainer_state={"global_step": 2})
    loaded = load_checkpoint(tmp_path / "final")
    assert loaded.trainer_state["global_step"] == 2
    assert torch.equal(loaded.model.lm_head.weight, model.lm_head.weight)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["final"]


def test_checkpoint_weights_are_readable_like_the_rest_of_the_run_dir(tmp_path):
    save_checkpoint(tmp_path / "final", tiny_model(), trainer_state={"global_step": 1})
    modes = {p.name: p.stat().st_mode & 0o777 for p in (tmp_path / "final").iterdir() if p.is_file()}
    assert modes["model.safetensors"] == modes["config.json"], modes  # transformers writes it 0600
    assert len(set(modes.values())) == 1, modes


def test_tokenizer_is_saved_beside_the_weights(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    vocab = {"[UNK]": 0, "hello": 1, "world": 2}
    raw = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    raw.pre_tokenizer = pre_tokenizers.Whitespace()
    tok = PreTrainedTokenizerFast(tokenizer_object=raw, unk_token="[UNK]")
    save_checkpoint(tmp_path / "ck", tiny_model(), tok, {"global_step": 0})
    loaded = AutoTokenizer.from_pretrained(str(tmp_path / "ck"))
    assert loaded("hello world")["input_ids"] == [1, 2]


def test_rng_state_round_trip():
    state = capture_rng_state()
    first = (random.random(), float(np.random.rand()), float(torch.rand(1)))
    restore_rng_state(state)
    assert (random.random(), float(np.random.rand()), float(torch.rand(1))) == first


# ---------------------------------------------------------------------------------- bad input
def _truncate(path):
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def _garble_same_size(path):
    path.write_bytes(b"\x00garbage" * (path.stat().st_size // 8) + b"x" * (path.stat().st_size % 8))


@pytest.mark.parametrize(
    "damage, message",
    [
        (lambda d: shutil.rmtree(d), "no checkpoint directory"),
        (lambda d: (d / META_FILE).unlink(), "checkpoint.json is missing"),
        (lambda d: (d / META_FILE).write_text("{not json"), "checkpoint.json is corrupt"),
        (lambda d: (d / "model.safetensors").unlink(), "model.safetensors is missing"),
        (lambda d: _truncate(d / "model.safetensors"), "model.safetensors has .* bytes"),
        (lambda d: _truncate(d / STATE_FILE), "trainer_state.pt has .* bytes"),
        (lambda d: _garble_same_size(d / STATE_FILE), "trainer_state.pt is corrupt"),
        (lambda d: _garble_same_size(d / "model.safetensors"), "model.safetensors is corrupt"),
    ],
)
def test_missing_or_corrupt_checkpoint_raises_a_clear_error(tmp_path, damage, message):
    trainer = make_trainer(tiny_model(), cfg())
    trainer.save(tmp_path / "ck")
    damage(tmp_path / "ck")
    with pytest.raises(CheckpointError, match=message):
        trainer.load(tmp_path / "ck")
    with pytest.raises(CheckpointError, match=message):
        load_checkpoint(tmp_path / "ck")


def test_a_flipped_bit_in_the_weights_is_refused_naming_the_file(tmp_path):
    save_checkpoint(tmp_path / "ck", tiny_model(), None, {"global_step": 1})
    victim = tmp_path / "ck" / "model.safetensors"
    data = bytearray(victim.read_bytes())
    data[-5] ^= 0x10  # inside the last tensor: safetensors itself would load it without a word
    victim.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"model\.safetensors is corrupt: its SHA-256"):
        load_checkpoint(tmp_path / "ck")
    assert json.loads((tmp_path / "ck" / META_FILE).read_text())["sha256"]["model.safetensors"]


@pytest.mark.parametrize("damage", [_truncate, _garble_same_size], ids=["truncated", "garbled"])
def test_load_weights_into_names_a_corrupt_weight_file(tmp_path, damage):
    # load_weights_into does not read checkpoint.json: safetensors' own error must name the file
    save_checkpoint(tmp_path / "ck", tiny_model(), None, {"global_step": 1})
    victim = tmp_path / "ck" / "model.safetensors"
    damage(victim)
    model = tiny_model(seed=3)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(CheckpointError, match=f"{victim} is corrupt"):
        ckpt_mod.load_weights_into(model, tmp_path / "ck")
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())  # left as it was


def _mount_tmpfs(path, size: str) -> bool:
    import subprocess

    path.mkdir()
    return (
        subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True
        ).returncode
        == 0
    )


def test_a_full_disk_is_named_and_leaves_no_partial_checkpoint(tmp_path):
    """On a 256 KiB tmpfs the save fails (torch and safetensors say only "unexpected pos" / I/O error):
    the error says the disk is full, and neither the staging directory nor a final one is left."""
    import subprocess

    disk = tmp_path / "disk"
    if not _mount_tmpfs(disk, "256k"):
        pytest.skip("cannot mount a tmpfs here (needs root / CAP_SYS_ADMIN)")
    try:
        model = tiny_model()
        with pytest.raises(CheckpointError, match=r"the disk is full \(\d+\.\d MiB free\)"):
            save_checkpoint(disk / "step-000001", model, trainer_state={"global_step": 1})
        assert list(disk.iterdir()) == []
    finally:
        subprocess.run(["umount", "-l", str(disk)], capture_output=True)


def test_other_write_failures_name_the_directory(tmp_path, monkeypatch):
    def broken_save(*args, **kwargs):
        raise RuntimeError("basic_ios::clear: iostream error")

    monkeypatch.setattr(ckpt_mod.torch, "save", broken_save)
    with pytest.raises(
        CheckpointError, match=r"cannot write checkpoint files into .*step-000002.tmp: RuntimeError: basic_ios"
    ):
        save_checkpoint(tmp_path / "step-000002", tiny_model(), trainer_state={"global_step": 2})
    monkeypatch.setattr(ckpt_mod.shutil, "disk_usage", lambda _p: shutil._ntuple_diskusage(10**9, 10**9 - 2**20, 2**20))
    with pytest.raises(CheckpointError, match="the disk is full"):
        save_checkpoint(tmp_path / "step-000003", tiny_model(), trainer_state={"global_step": 3})
