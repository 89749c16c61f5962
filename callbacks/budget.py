"""A wall-clock budget for the whole run, data preparation included, with a schedule that fits it.

Lightning's ``max_time`` starts counting when the training loop starts, so a run whose data
preparation (regeneration, feature caching) is expensive cannot be given "ten minutes in all",
and two data modes cannot be compared at equal wall time. ``RunBudget`` counts from its own
creation (LightningCLI builds callbacks before the data module prepares anything) and stops
training when the budget is spent.

A cosine schedule sized by ``max_steps`` never decays when the budget stops the run first, so by
default the callback also re-sizes the objective's :class:`WarmupCosine` schedule from the pace
measured so far (validation included): the learning rate reaches its floor at the deadline. A
resumed run continues the budget: the time already spent is saved in the checkpoint.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from lightning.pytorch import Callback, LightningModule, Trainer
from typing_extensions import override

log = logging.getLogger(__name__)

__all__ = ["RunBudget", "fitted_total"]


def fitted_total(
    *, step: int, steps_done: int, train_seconds: float, remaining: float, cap: float
) -> float:
    """Total steps a schedule should span so it ends at the deadline.

    ``steps_done`` updates took ``train_seconds`` (the pace); ``remaining`` seconds are left at
    ``step``. Never more than ``cap`` (the schedule's own total, from ``max_steps``).
    """
    if steps_done <= 0 or train_seconds <= 0:
        return cap
    pace = train_seconds / steps_done
    return min(cap, step + max(0.0, remaining) / pace)


class RunBudget(Callback):
    """Stop the run ``minutes`` after this callback was created, data preparation included.

    Args:
        minutes: The wall-clock budget of the whole run.
        fit_schedule: Re-size the learning-rate schedule (objects with ``warmup`` and ``total``,
            e.g. ``WarmupCosine``) so it decays to its floor by the deadline.
        refit_every: Steps between two re-sizings (after warm-up).
    """

    def __init__(self, minutes: float, fit_schedule: bool = True, refit_every: int = 10) -> None:
        if minutes <= 0:
            raise ValueError("RunBudget: minutes must be positive")
        if refit_every <= 0:
            raise ValueError("RunBudget: refit_every must be positive")
        self.budget_s = float(minutes) * 60.0
        self.fit_schedule = fit_schedule
        self.refit_every = refit_every
        self._clock = time.monotonic  # replaced by tests with a deterministic clock
        self._created = self._clock()
        self._spent_before = 0.0  # seconds spent by earlier processes of a resumed run
        self._train_start: float | None = None
        self._first_step = 0
        self._caps: dict[int, float] = {}
        self.prep_seconds: float | None = None

    def elapsed(self) -> float:
        """Seconds of the budget spent so far (earlier processes of a resumed run included)."""
        return self._spent_before + self._clock() - self._created

    @override
    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._train_start = self._clock()
        self._first_step = int(trainer.global_step)
        self.prep_seconds = self._train_start - self._created
        log.info(
            "RunBudget: %.0f s spent before training (data preparation, model set-up); "
            "%.0f s of %.0f s left",
            self.prep_seconds,
            self.budget_s - self.elapsed(),
            self.budget_s,
        )
        if trainer.logger is not None:
            trainer.logger.log_metrics({"budget/prep_seconds": self.prep_seconds}, step=0)
        if self.elapsed() >= self.budget_s:
            log.warning("RunBudget: the budget was spent before training started")
            trainer.should_stop = True

    @override
    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, idx: int
    ) -> None:
        elapsed = self.elapsed()
        if elapsed >= self.budget_s:
            if not trainer.should_stop:
                log.info(
                    "RunBudget: %.0f s spent, stopping at step %d", elapsed, trainer.global_step
                )
            trainer.should_stop = True
            return
        if self.fit_schedule and self._train_start is not None:
            self._refit(trainer, remaining=self.budget_s - elapsed)

    def _refit(self, trainer: Trainer, *, remaining: float) -> None:
        step = int(trainer.global_step)
        steps_done = step - self._first_step
        if steps_done <= 0 or steps_done % self.refit_every:
            return
        train_seconds = self._clock() - float(self._train_start or 0.0)
        for config in trainer.lr_scheduler_configs:
            for factor in getattr(config.scheduler, "lr_lambdas", []):
                if not (hasattr(factor, "total") and hasattr(factor, "warmup")):
                    continue
                if step < factor.warmup:
                    continue
                key = id(factor)
                cap = self._caps.setdefault(key, float(factor.total))
                factor.total = max(
                    float(factor.warmup) + 1.0,
                    fitted_total(
                        step=step,
                        steps_done=steps_done,
                        train_seconds=train_seconds,
                        remaining=remaining,
                        cap=cap,
                    ),
                )

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"spent": self.elapsed(), "budget_s": self.budget_s}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        # Time before this process started counts; the part of it that went to this process's
        # own set-up is already in `_created`.
        self._spent_before = float(state_dict.get("spent", 0.0))
