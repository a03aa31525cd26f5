"""Resuming with another total_steps re-plans the learning-rate curve (issue #21): from the checkpoint's
step on, the lr is the one a fresh schedule planned for the new total gives; a resume with the same
config is unchanged; other schedule changes keep the checkpoint's curve with a warning."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F

from rubricem_core.testing.tiny_models import VOCAB, tiny_model
from rubricem_core.training import TrainerConfig, make_trainer
from rubricem_core.training.schedule import make_scheduler, resume_schedule
from tiny_models import one_thread  # noqa: F401 (an autouse fixture)

WARMUP, MIN_RATIO, LR = 2, 0.1, 1e-3


SCHEDULE_LOG = "rubricem_core.training.schedule"


def schedule_logs(caplog, level: int = logging.INFO) -> str:
    """What the schedule helper logged (other libraries' records, e.g. DeepSpeed's, left out)."""
    return "\n".join(r.getMessage() for r in caplog.records if r.name == SCHEDULE_LOG and r.levelno >= level)


def config(total_steps: int, **kw) -> TrainerConfig:
    return TrainerConfig(**{**dict(lr=LR, warmup_steps=WARMUP, total_steps=total_steps, min_lr_ratio=MIN_RATIO), **kw})


def scheduler(total_steps: int, warmup_steps: int = WARMUP, lr: float = LR):
    p = torch.nn.Parameter(torch.zeros(1))
    return make_scheduler(torch.optim.AdamW([p], lr=lr), warmup_steps, total_steps, MIN_RATIO)


def advance(sched, n: int) -> list[float]:
    """The lr each of the next ``n`` optimizer steps runs at."""
    seen = []
    for _ in range(n):
        seen.append(sched.optimizer.param_groups[0]["lr"])
        sched.optimizer.step()
        sched.step()
    return seen


def resumed(planned: int, at: int, cfg: TrainerConfig):
    """A scheduler planned for ``planned`` steps, checkpointed after ``at`` steps and resumed under ``cfg``
    (built from cfg's numbers, then loaded, as a trainer does)."""
    first = scheduler(planned)
    advance(first, at)
    again = scheduler(cfg.total_steps, cfg.warmup_steps, cfg.lr)
    again.optimizer.load_state_dict(first.optimizer.state_dict())  # the optimizer carries the next step's lr
    again.load_state_dict(first.state_dict())
    resume_schedule(again, cfg, "ck")
    return again


def test_extended_schedule_equals_a_fresh_one_from_the_resume_step(caplog):
    fresh = advance(scheduler(20), 20)
    with caplog.at_level(logging.INFO, logger=SCHEDULE_LOG):
        extended = resumed(10, 4, config(20))
    assert extended.last_epoch == 4
    assert advance(extended, 16) == fresh[4:]  # exactly: the same curve as if planned for 20 steps
    assert "10 total steps" in schedule_logs(caplog) and "runs to 20" in schedule_logs(caplog)
    assert schedule_logs(caplog, logging.WARNING) == ""
    assert extended.state_dict()["lr_lambdas"][0]["total_steps"] == 20  # a later checkpoint keeps it


def test_same_total_resume_is_unchanged(caplog):
    uninterrupted = advance(scheduler(10), 10)
    with caplog.at_level(logging.INFO, logger=SCHEDULE_LOG):
        same = resumed(10, 4, config(10))
    assert advance(same, 6) == uninterrupted[4:]
    assert schedule_logs(caplog) == ""


def test_shortening_follows_the_new_total_too():
    fresh = advance(scheduler(6), 12)
    shorter = resumed(10, 4, config(6))
    assert advance(shorter, 8) == fresh[4:]


def test_a_total_behind_the_checkpoint_step_is_ignored_with_a_warning(caplog):
    kept = advance(scheduler(10), 10)
    with caplog.at_level(logging.WARNING, logger=SCHEDULE_LOG):
        behind = resumed(10, 5, config(3))
    assert "total_steps" in schedule_logs(caplog, logging.WARNING)
    assert advance(behind, 5) == kept[5:]


def test_other_changes_keep_the_checkpoint_curve_but_the_total_is_followed(caplog):
    fresh = advance(scheduler(20), 20)  # the checkpoint's lr and warm-up, planned for 20 steps
    with caplog.at_level(logging.WARNING, logger=SCHEDULE_LOG):
        mixed = resumed(10, 4, config(20, lr=5e-3, warmup_steps=3))
    warned = schedule_logs(caplog, logging.WARNING)
    assert "'lr'" in warned and "warmup_steps" in warned and "total_steps" not in warned
    assert advance(mixed, 16) == fresh[4:]


# ---- both trainer backends -----------------------------------------------------------------------------


def data_for_step(step: int) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(100 + step)
    return [{"input_ids": torch.randint(0, VOCAB, (2, 12), generator=g)} for _ in range(2)]


def lm_loss(model, micro_batch):
    ids = micro_batch["input_ids"]
    logits = model(input_ids=ids).logits[:, :-1].float()
    return F.cross_entropy(logits.reshape(-1, VOCAB), ids[:, 1:].reshape(-1)), {}


def lrs(trainer, steps: range) -> list[float]:
    return [trainer.step(data_for_step(s), lm_loss)["lr"] for s in steps]


@pytest.mark.parametrize("backend", ["torch", "deepspeed"])
def test_trainer_resume_extends_the_schedule(tmp_path, caplog, backend, request):
    extra = {}
    if backend == "deepspeed":
        request.getfixturevalue("deepspeed_ok")
        extra = dict(backend="deepspeed", zero_stage=1)
    fresh = lrs(make_trainer(tiny_model(), config(8, **extra)), range(8))
    first = make_trainer(tiny_model(), config(4, **extra))
    lrs(first, range(2))
    first.save(tmp_path / "ck")
    longer = make_trainer(tiny_model(), config(8, **extra))
    with caplog.at_level(logging.INFO, logger=SCHEDULE_LOG):
        longer.load(tmp_path / "ck")
    assert "4 total steps" in schedule_logs(caplog) and "runs to 8" in schedule_logs(caplog)
    assert lrs(longer, range(2, 5)) == fresh[2:5]
    longer.save(tmp_path / "ck2")
    # the extended schedule is what the next checkpoint carries: resuming it with the same config is silent
    caplog.clear()
    again = make_trainer(tiny_model(), config(8, **extra))
    with caplog.at_level(logging.INFO, logger=SCHEDULE_LOG):
        again.load(tmp_path / "ck2")
    assert schedule_logs(caplog) == ""
    assert lrs(again, range(5, 8)) == fresh[5:8]
