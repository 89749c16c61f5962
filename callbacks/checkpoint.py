"""Drafter checkpoints as Hugging Face-style folders: `best/` and `last/`.

Lightning checkpoints hold optimizer state and exist to resume training; what users deploy,
export, benchmark and serve (SGLang/vLLM read EAGLE-3 folders) is the drafter folder written by
`Drafter.save_pretrained`. This callback keeps two of them under `dirpath`:

* `last/`: after every validation pass and at the end of training;
* `best/`: whenever the monitored metric (default `val/tau`, written by `AcceptanceEval`)
  improves, or equals the best so far while the tie-breaker (default `val/loss`) improves:
  tau over a few held-out prompts is coarse and ties happen (the two-hour CPU run had 1.918 at
  steps 2,500 and 3,000 with a lower loss at 3,000), and a tie kept the older drafter.

Each folder also holds `training_state.json` (step, epoch, the monitored value, the best value);
a run that finds a `best/` from before (a fresh run in an old folder, or a resume without
Lightning's checkpoint) reads its value back, so `best/` never regresses to a worse drafter.
A folder is written under a temporary name and renamed into place (`lightning_spec.io.
atomic_folder`), so a job killed mid-write leaves the previous folder intact; a kill between the
swap's two renames is undone at the next setup or write, and stale `.tmp-*` folders removed.
Only global rank 0 writes.
"""

from __future__ import annotations

import json
import logging
import math
import time
from pathlib import Path
from typing import Any

from lightning.pytorch import Callback, LightningModule, Trainer
from typing_extensions import override

from lightning_spec.io import atomic_folder, recover_folder

log = logging.getLogger(__name__)

__all__ = ["DrafterCheckpoint", "STATE_FILE"]

STATE_FILE = "training_state.json"


class DrafterCheckpoint(Callback):
    """Keep `best/` and `last/` drafter folders (see the module docstring)."""

    def __init__(
        self,
        dirpath: str | None = None,
        monitor: str = "val/tau",
        mode: str = "max",
        tie_breaker: str | None = "val/loss",
        tie_mode: str = "min",
    ) -> None:
        """
        Args:
            dirpath: Folder for `best/` and `last/`; default `<trainer.default_root_dir>/drafter`.
            monitor: Logged metric that decides `best/`.
            mode: "max" (tau, accuracy) or "min" (a loss).
            tie_breaker: Logged metric that decides between equal `monitor` values (None: the
                earlier drafter stays best).
            tie_mode: "min" or "max", as `mode`, for the tie-breaker.
        """
        super().__init__()
        for name, value in (("mode", mode), ("tie_mode", tie_mode)):
            if value not in ("max", "min"):
                raise ValueError(f"{name} must be 'max' or 'min', got {value!r}")
        self.dirpath = dirpath
        self.monitor = monitor
        self.mode = mode
        self.tie_breaker = tie_breaker
        self.tie_mode = tie_mode
        self.best_value: float | None = None
        self.best_tie: float | None = None
        self.best_step: int | None = None
        self._last_step_written: int | None = None
        self._warned_missing = False

    # ---------------------------------------------------------------------------- paths
    def root(self, trainer: Trainer) -> Path:
        return Path(self.dirpath or Path(trainer.default_root_dir) / "drafter").expanduser()

    def best_path(self, trainer: Trainer) -> Path:
        return self.root(trainer) / "best"

    def last_path(self, trainer: Trainer) -> Path:
        return self.root(trainer) / "last"

    # ---------------------------------------------------------------------------- hooks
    @override
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if trainer.is_global_zero and self.root(trainer).is_dir():
            for name in ("best", "last"):
                recover_folder(self.root(trainer) / name)
        if self.best_value is None:
            self._adopt_existing_best(trainer)

    def _adopt_existing_best(self, trainer: Trainer) -> None:
        """A `best/` already in the folder (a fresh run in an old folder, a resume without
        Lightning's checkpoint) keeps its place until a drafter beats its recorded value:
        `best/` never regresses. A folder recorded for another metric or mode is left to be
        replaced (its value says nothing about this run's)."""
        path = self.best_path(trainer) / STATE_FILE
        try:
            state = json.loads(path.read_text())
        except (OSError, ValueError):
            return
        if state.get("monitor") != self.monitor or _finite(state.get("value")) is None:
            return
        self.best_value = _finite(state.get("value"))
        self.best_step = state.get("global_step")
        self.best_tie = _finite(state.get("best_tie"))
        log.info(
            "DrafterCheckpoint: keeping the existing best/ (%s = %.4f at step %s) until a "
            "drafter beats it",
            self.monitor,
            self.best_value,
            self.best_step,
        )

    @override
    def on_validation_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if trainer.sanity_checking:
            return
        value = self._monitored(trainer)
        tie = _finite(trainer.callback_metrics.get(self.tie_breaker or ""))
        improved = value is not None and self._improves(value, tie)
        if improved:
            self.best_value, self.best_step = value, int(trainer.global_step)
            self.best_tie = tie
        if trainer.is_global_zero:
            self._write(trainer, pl_module, "last", value)
            if improved:
                self._write(trainer, pl_module, "best", value)
                log.info(
                    "new best drafter: %s = %.4f at step %d",
                    self.monitor,
                    value,
                    trainer.global_step,
                )
        trainer.strategy.barrier("drafter_checkpoint")

    @override
    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if trainer.is_global_zero and self._last_step_written != int(trainer.global_step):
            self._write(trainer, pl_module, "last", self._monitored(trainer))

    # ---------------------------------------------------------------------------- internals
    def _monitored(self, trainer: Trainer) -> float | None:
        value = trainer.callback_metrics.get(self.monitor)
        if value is None:
            if not self._warned_missing:
                log.warning(
                    "DrafterCheckpoint: %r was not logged; only last/ is written "
                    "(add AcceptanceEval, or monitor another metric)",
                    self.monitor,
                )
                self._warned_missing = True
            return None
        return _finite(value)

    def _improves(self, value: float, tie: float | None = None) -> bool:
        if self.best_value is None:
            return True
        if value == self.best_value:
            if self.tie_breaker is None or tie is None or self.best_tie is None:
                return False
            return tie > self.best_tie if self.tie_mode == "max" else tie < self.best_tie
        return value > self.best_value if self.mode == "max" else value < self.best_value

    def _write(
        self, trainer: Trainer, pl_module: LightningModule, name: str, value: float | None
    ) -> None:
        state = {
            "global_step": int(trainer.global_step),
            "epoch": int(trainer.current_epoch),
            "monitor": self.monitor,
            "value": value,
            "best_value": self.best_value,
            "best_step": self.best_step,
            "tie_breaker": self.tie_breaker,
            "best_tie": self.best_tie,
            "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "training_data": training_data(trainer, pl_module),
        }
        with atomic_folder(self.root(trainer) / name) as tmp:
            pl_module.drafter.save_pretrained(tmp)
            (tmp / STATE_FILE).write_text(json.dumps(state, indent=2) + "\n")
        if name == "last":
            self._last_step_written = int(trainer.global_step)

    # ---------------------------------------------------------------------------- resume
    @override
    def state_dict(self) -> dict[str, Any]:
        return {
            "best_value": self.best_value,
            "best_step": self.best_step,
            "best_tie": self.best_tie,
        }

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.best_value = state_dict.get("best_value")
        self.best_step = state_dict.get("best_step")
        self.best_tie = state_dict.get("best_tie")


def training_data(trainer: Trainer, pl_module: LightningModule) -> list[dict[str, Any]]:
    """What this drafter trained on: the data module's selection (source, first N conversations,
    mode) after that of the `drafter_init` folder it started from, so `lightning-spec online`
    can check that a stream's prompts are new to it (`online.overlap`). An entry with source
    None says a step of the chain did not record its data."""
    hparams = getattr(pl_module, "hparams", {}) or {}
    init = hparams.get("drafter_init") if hasattr(hparams, "get") else None
    record: list[dict[str, Any]] = []
    if init:
        try:
            state = json.loads((Path(init) / STATE_FILE).read_text())
            inherited = state.get("training_data")
        except (OSError, ValueError):
            inherited = None
        if isinstance(inherited, list):
            record += inherited
        else:
            record.append({"source": None, "drafter_init": str(init)})
    data = getattr(trainer, "datamodule", None)
    if getattr(data, "dataset", None) is not None:
        record.append({
            "source": str(data.dataset),
            "count": getattr(data, "max_conversations", None),
            "mode": getattr(data, "mode", None),
        })  # fmt: skip
    return record


def _finite(value: Any) -> float | None:
    """A logged metric as a float, or None when absent or not finite."""
    if value is None:
        return None
    value = float(value)
    return value if math.isfinite(value) else None


def drafter_from_checkpoint(ckpt: str | Path, like: str | Path, out: str | Path) -> Path:
    """The drafter inside a Lightning checkpoint (`last.ckpt`, or the one a killed run saved on
    its way down) written as a drafter folder at `out`, with the config of `like` (a drafter
    folder of the same run: its architecture and vocabulary). The folder that `DrafterCheckpoint`
    writes holds the drafter of the last validation; this gives the drafter of any step a
    checkpoint holds."""
    import torch

    from lightning_spec.models.drafters.base import DRAFTER_TYPES, drafter_type_of

    config = json.loads((Path(like) / "config.json").read_text())
    drafter = DRAFTER_TYPES[drafter_type_of(config)].from_config_dict(config)
    state = torch.load(ckpt, map_location="cpu", weights_only=False)
    weights = {k.removeprefix("drafter."): v for k, v in state["state_dict"].items() if k.startswith("drafter.")}
    if not weights:
        raise ValueError(f"{ckpt} holds no drafter weights (no 'drafter.' keys)")
    drafter.load_state_dict(weights)
    with atomic_folder(out) as staging:
        drafter.save_pretrained(staging)
        step = {"global_step": int(state.get("global_step", -1)), "checkpoint": str(ckpt)}
        (staging / "training_state.json").write_text(json.dumps(step, indent=2))
    return Path(out)
