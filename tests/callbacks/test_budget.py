"""RunBudget: the whole-run wall-clock budget and the schedule fitted to it, on a fake clock."""

from __future__ import annotations

import pytest
import torch
from lightning.pytorch import LightningModule, Trainer
from torch import nn
from torch.utils.data import DataLoader

from lightning_spec.callbacks.budget import RunBudget, fitted_total
from lightning_spec.objectives.base import WarmupCosine


class Clock:
    """Seconds that advance only when the test says so."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class OneSecondSteps(LightningModule):
    """Every training step takes exactly one second on `clock`."""

    def __init__(self, clock: Clock, warmup: int = 2, total: float = 1000.0) -> None:
        super().__init__()
        self.clock = clock
        self.layer = nn.Linear(2, 1)
        self.schedule = WarmupCosine(warmup=warmup, total=total)

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        self.clock.now += 1.0
        return self.layer(batch).pow(2).mean()

    def configure_optimizers(self) -> dict:
        optimizer = torch.optim.SGD(self.parameters(), lr=0.1)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, self.schedule)
        return {
            "optimizer": optimizer,
            "lr_scheduler": {"scheduler": scheduler, "interval": "step"},
        }


def _budget(clock: Clock, minutes: float, prep_seconds: float, **kwargs) -> RunBudget:
    callback = RunBudget(minutes=minutes, **kwargs)
    callback._clock = clock
    callback._created = clock.now - prep_seconds  # created before the data was prepared
    return callback


def _fit(module: LightningModule, callback: RunBudget, max_steps: int = 500) -> Trainer:
    trainer = Trainer(
        max_steps=max_steps,
        callbacks=[callback],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        accelerator="cpu",
    )
    trainer.fit(module, DataLoader(torch.ones(1000, 2), batch_size=1))
    return trainer


def test_fitted_total_arithmetic() -> None:
    # 20 steps in 10 s = 0.5 s a step; 30 s left at step 25 -> 60 more steps -> total 85.
    assert fitted_total(step=25, steps_done=20, train_seconds=10.0, remaining=30.0, cap=500) == 85.0
    # Never beyond the schedule's own total, never before the current step.
    assert fitted_total(step=25, steps_done=20, train_seconds=10.0, remaining=30.0, cap=70) == 70
    assert fitted_total(step=25, steps_done=20, train_seconds=10.0, remaining=-5.0, cap=500) == 25
    assert fitted_total(step=0, steps_done=0, train_seconds=0.0, remaining=30.0, cap=500) == 500


def test_budget_counts_preparation_and_stops_training() -> None:
    clock = Clock()
    # 60 s budget, 20 s already spent on "data preparation": 40 one-second steps remain.
    callback = _budget(clock, minutes=1.0, prep_seconds=20.0)
    module = OneSecondSteps(clock)
    trainer = _fit(module, callback)
    assert callback.prep_seconds == pytest.approx(20.0)
    assert trainer.global_step == 40
    # The schedule was re-sized to end at the deadline: 40 steps in all, so the last learning
    # rate is the cosine's floor (0.1 of the peak) up to one step of rounding.
    assert module.schedule.total == pytest.approx(40.0)
    assert module.schedule(39) == pytest.approx(0.1, abs=0.01)


def test_schedule_left_alone_when_asked() -> None:
    clock = Clock()
    module = OneSecondSteps(clock, total=1000.0)
    _fit(module, _budget(clock, minutes=0.5, prep_seconds=0.0, fit_schedule=False))
    assert module.schedule.total == 1000.0


def test_schedule_never_extended_past_max_steps() -> None:
    clock = Clock()
    module = OneSecondSteps(clock, total=25.0)  # max_steps-sized schedule shorter than budget
    trainer = _fit(module, _budget(clock, minutes=10.0, prep_seconds=0.0), max_steps=25)
    assert trainer.global_step == 25
    assert module.schedule.total == 25.0


def test_spent_budget_survives_a_resume() -> None:
    clock = Clock()
    first = _budget(clock, minutes=1.0, prep_seconds=5.0)
    clock.now += 30.0
    state = first.state_dict()
    assert state["spent"] == pytest.approx(35.0)
    second = _budget(clock, minutes=1.0, prep_seconds=0.0)
    second.load_state_dict(state)
    assert second.elapsed() == pytest.approx(35.0)


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="minutes"):
        RunBudget(minutes=0)
    with pytest.raises(ValueError, match="refit_every"):
        RunBudget(minutes=1, refit_every=0)
