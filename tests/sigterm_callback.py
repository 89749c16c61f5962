"""A callback that sends this process SIGTERM at a given training step: the signal a scheduler
sends, delivered where the test wants it (tests/repo/test_configs.py)."""

from __future__ import annotations

import os
import signal
from typing import Any

from lightning.pytorch import Callback


class SigtermAtStep(Callback):
    def __init__(self, step: int = 1) -> None:
        self.step = step

    def on_train_batch_end(self, trainer: Any, *args: Any) -> None:
        if trainer.global_step == self.step:
            os.kill(os.getpid(), signal.SIGTERM)
