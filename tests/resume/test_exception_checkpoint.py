"""A crash mid-run (an exception in a step, hours in) loses at most that step: every config
with a ModelCheckpoint saves on exceptions, and `--ckpt_path last` continues from the crash."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import yaml
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = sorted([*(ROOT / "configs").rglob("*.yaml"), *ROOT.glob("experiments/*/configs/*.yaml")])
CHECKPOINTED = [p for p in CONFIGS if "lightning.pytorch.callbacks.ModelCheckpoint" in p.read_text()]


class Crashing(LightningModule):
    def __init__(self, crash_at: int | None = None) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(1))
        self.crash_at = crash_at

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        if self.crash_at is not None and self.global_step == self.crash_at:
            raise RuntimeError("a crash after hours of training")
        return (self.weight - 1.0).pow(2).sum()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD([self.weight], lr=0.1)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(torch.zeros(50, 1))


def _checkpoint_args(path: Path) -> dict:
    config = yaml.safe_load(path.read_text())
    (args,) = [
        c.get("init_args", {})
        for c in config["trainer"]["callbacks"]
        if c["class_path"] == "lightning.pytorch.callbacks.ModelCheckpoint"
    ]
    return args


@pytest.mark.parametrize("path", CHECKPOINTED, ids=lambda p: p.name)
def test_configs_save_on_exceptions(path: Path) -> None:
    args = _checkpoint_args(path)
    assert args.get("save_on_exception") is True and args.get("save_last") is True


def test_a_crash_resumes_from_the_crashed_step(tmp_path: Path) -> None:
    args = dict(_checkpoint_args(ROOT / "configs" / "train" / "eagle3_2h_cpu.yaml"), dirpath=str(tmp_path))

    def trainer() -> Trainer:
        return Trainer(max_steps=20, logger=False, enable_progress_bar=False,
                       enable_model_summary=False, default_root_dir=str(tmp_path),
                       callbacks=[ModelCheckpoint(**args)])  # fmt: skip

    with pytest.raises(RuntimeError, match="crash"):
        trainer().fit(Crashing(crash_at=7))
    state = torch.load(tmp_path / "last.ckpt", weights_only=False)
    assert state["global_step"] == 7  # saved at the crash, not at the last every-500 step
    resumed = trainer()
    resumed.fit(Crashing(), ckpt_path="last")
    assert resumed.global_step == 20
