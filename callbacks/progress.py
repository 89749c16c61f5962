"""`SpecProgressBar`: Lightning's rich progress bar without the "Epoch 5/-2" of unbounded runs,
and with plain progress lines when nobody is watching a terminal.

Our configs bound runs by steps or by `RunBudget` minutes, so Lightning's epoch limit is -1 and
its bar prints the meaningless total "-2"; this bar shows "Epoch N" then, and "Epoch N/M" when
an epoch limit exists. Rich draws its bar only on a terminal: under ``nohup``, a scheduler or
CI a two-hour run would log nothing until it ends, so there the bar also writes one line every
``plain_interval`` seconds (step, pace, time left, loss) and one per validation.
"""

from __future__ import annotations

import math
import sys
import time
from typing import Any

from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import RichProgressBar

from lightning_spec.progress import format_seconds

# the validation metrics a line shows, when logged (the rest are in MLflow)
VALIDATION_KEYS = ("val/tau", "val/loss", "val/acc_0", "val/reward", "val/reward_gap")


class SpecProgressBar(RichProgressBar):
    """`RichProgressBar` that leaves an unbounded epoch count out of the description and
    writes plain lines where its output is not a terminal.

    Args:
        plain_interval: Seconds between two plain training lines (off a terminal).
        plain: Force plain lines on (True) or off (False); None decides by the terminal.
    """

    def __init__(
        self, *args: Any, plain_interval: float = 60.0, plain: bool | None = None, **kwargs: Any
    ) -> None:
        super().__init__(*args, **kwargs)
        if plain_interval < 0:
            raise ValueError("SpecProgressBar: plain_interval must be >= 0")
        self.plain_interval = float(plain_interval)
        self.plain = plain
        self._started: float | None = None
        self._first_step = 0
        self._last_line = 0.0

    def _get_train_description(self, current_epoch: int) -> str:
        description = f"Epoch {current_epoch}"
        max_epochs = self.trainer.max_epochs
        if max_epochs is not None and max_epochs > 0:
            description += f"/{max_epochs - 1}"
        if len(self.validation_description) > len(description):
            description = f"{description:{len(self.validation_description)}}"
        return description

    # ------------------------------------------------------------------ plain lines
    def _plain_on(self) -> bool:
        if self.plain is not None:
            return self.plain
        from rich.console import Console

        return not Console().is_terminal

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        super().on_train_start(trainer, pl_module)
        self.plain = self._plain_on()
        self._started = self._last_line = time.monotonic()
        self._first_step = int(trainer.global_step)

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, idx: int
    ) -> None:
        super().on_train_batch_end(trainer, pl_module, outputs, batch, idx)
        if not self.plain or self._started is None or trainer.global_rank != 0:
            return
        now = time.monotonic()
        if now - self._last_line >= self.plain_interval:
            self._last_line = now
            self._write(self.training_line(trainer, now))

    def on_validation_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        super().on_validation_end(trainer, pl_module)
        if self.plain and not trainer.sanity_checking and trainer.global_rank == 0:
            self._write(self.validation_line(trainer))

    def training_line(self, trainer: Trainer, now: float) -> str:
        """``training step 500/3000 (17%) 1.26 s/step elapsed 10m30s left ~52m loss 10.2``:
        the time left is the sooner of the step limit and a `RunBudget` deadline."""
        step = int(trainer.global_step)
        elapsed = now - (self._started or now)
        done = step - self._first_step
        total = _total_steps(trainer)
        parts = [f"training step {step}" + (f"/{total} ({100 * step / total:.0f}%)" if total else "")]
        pace = elapsed / done if done > 0 else None
        if pace is not None:
            parts.append(f"{pace:.2f} s/step")
        parts.append(f"elapsed {format_seconds(elapsed)}")
        lefts = [pace * (total - step)] if pace is not None and total else []
        budget = _budget_left(trainer)
        if budget is not None:
            lefts.append(budget)
        if lefts:
            parts.append(f"left ~{format_seconds(max(0.0, min(lefts)))}")
        loss = trainer.callback_metrics.get("train/loss")
        if loss is not None:
            parts.append(f"loss {float(loss):.4g}")
        return " ".join(parts)

    def validation_line(self, trainer: Trainer) -> str:
        """``validation at step 500: val/tau 1.69 val/loss 10.2 ...`` (the keys logged)."""
        metrics = trainer.callback_metrics
        shown = [f"{key} {float(metrics[key]):.4g}" for key in VALIDATION_KEYS if key in metrics]
        return f"validation at step {int(trainer.global_step)}: " + (" ".join(shown) or "done")

    @staticmethod
    def _write(line: str) -> None:
        print(line, file=sys.stderr, flush=True)


def _total_steps(trainer: Trainer) -> int | None:
    if trainer.max_steps and trainer.max_steps > 0:
        return int(trainer.max_steps)
    estimated = trainer.estimated_stepping_batches
    return int(estimated) if math.isfinite(estimated) else None


def _budget_left(trainer: Trainer) -> float | None:
    from lightning_spec.callbacks.budget import RunBudget

    for callback in trainer.callbacks:
        if isinstance(callback, RunBudget):
            return callback.budget_s - callback.elapsed()
    return None
