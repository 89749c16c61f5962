"""`RefreshRollouts`: keep on-policy data on-policy, every N optimizer steps.

With ``RolloutDataModule(mode="on_policy")`` the batches come from a buffer of rollouts made by
the drafter being trained. This callback fills the buffer before the first batch and replaces
it every ``every_n_steps`` optimizer steps with rollouts of the *current* drafter (through the
data module's `RolloutSource`), outside the training precision context and without gradients.
A resumed run restores the buffer from the checkpoint and refreshes on the same steps as an
uninterrupted one. Rollout throughput (seconds, tokens/s, tau) is logged per refresh.
"""

from __future__ import annotations

from typing import Any

from lightning.pytorch import Callback, LightningModule, Trainer
from typing_extensions import override


class RefreshRollouts(Callback):
    """Refresh the on-policy buffer every `every_n_steps` optimizer steps (see module doc)."""

    def __init__(self, every_n_steps: int = 100) -> None:
        """`every_n_steps`: optimizer steps between two refreshes (>= 1)."""
        if every_n_steps < 1:
            raise ValueError(f"every_n_steps must be >= 1, got {every_n_steps}")
        self.every_n_steps = int(every_n_steps)

    @staticmethod
    def _data(trainer: Trainer) -> Any:
        data = trainer.datamodule
        if data is None or not hasattr(data, "refresh_rollouts"):
            raise RuntimeError("RefreshRollouts needs a RolloutDataModule(mode='on_policy')")
        return data

    def _refresh(self, trainer: Trainer, pl_module: LightningModule) -> None:
        data = self._data(trainer)
        step = int(trainer.global_step)
        data.refresh_rollouts(pl_module.drafter, step=step, version=f"step-{step}")
        source = getattr(data, "rollout_source", None)
        metrics = dict(getattr(source, "last_throughput", {}) or {})
        metrics["rollout_refreshes"] = float(data.buffer.refreshes)
        if trainer.logger is not None:
            trainer.logger.log_metrics({f"rollout/{k}": v for k, v in metrics.items()}, step)

    @override
    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        data = self._data(trainer)
        if len(data.buffer) < data.buffer.size:  # nothing restored from a checkpoint
            self._refresh(trainer, pl_module)

    @override
    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        step = int(trainer.global_step)
        data = self._data(trainer)
        if step > 0 and step % self.every_n_steps == 0 and data.buffer.refreshed_at_step != step:
            self._refresh(trainer, pl_module)
