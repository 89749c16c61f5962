"""A callback that slows each training step down, so a test can kill `lightning-spec fit`
between two checkpoints (a tiny model otherwise finishes before the test can act)."""

from __future__ import annotations

import time
from typing import Any

from lightning.pytorch import Callback, LightningModule, Trainer


class SlowSteps(Callback):
    def __init__(self, seconds: float = 0.25) -> None:
        super().__init__()
        self.seconds = seconds

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, idx: int
    ) -> None:
        time.sleep(self.seconds)
