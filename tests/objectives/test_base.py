"""Objective (objectives/base.py) through the smallest subclass: two training steps on a tiny
target, checkpoints without the target, the batch-key check, the non-finite guard, and target
and drafter loaded from folders."""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar

import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch import LightningDataModule, Trainer
from torch import Tensor
from torch.utils.data import DataLoader

from lightning_spec.models.drafters.base import Drafter
from lightning_spec.models.drafters.eagle3 import Eagle3Drafter
from lightning_spec.models.target import TargetModel
from lightning_spec.models.tiny import tiny_config
from lightning_spec.objectives.base import BatchKeyError, Objective
from tests.conftest import quiet_trainer

VOCAB = 128


class NextToken(Objective):
    """Teacher-forced next-token cross-entropy on cached target features: a whole objective."""

    required_batch_keys: ClassVar[frozenset[str]] = frozenset({"input_ids", "features"})
    checkpoint_key: ClassVar[str] = "next_token"

    def __init__(
        self,
        target: str = "smollm2",
        drafter_init: str | None = None,
        lr: float = 1e-2,
        warmup_steps: int = 1,
        max_steps_for_schedule: int | None = 10,
        max_consecutive_nonfinite: int = 10,
        width: int = 64,
    ) -> None:
        super().__init__(
            target=target,
            drafter_init=drafter_init,
            lr=lr,
            warmup_steps=warmup_steps,
            max_steps_for_schedule=max_steps_for_schedule,
            max_consecutive_nonfinite=max_consecutive_nonfinite,
        )
        self.losses: list[float] = []

    def build_drafter(self, target: TargetModel) -> Drafter:
        return Eagle3Drafter.from_target(target, intermediate_size=int(self.hparams.width))

    def training_step(self, batch: dict[str, Any], batch_idx: int) -> Tensor:
        logits = self.drafter(batch["input_ids"], batch["features"]).logits  # [B, T, V]
        loss = F.cross_entropy(logits[:, :-1].flatten(0, 1), batch["input_ids"][:, 1:].flatten())
        skipped = self.skip_nonfinite(loss)
        if skipped is not None:
            return skipped
        self.losses.append(loss.item())
        self.log("train/loss", loss.detach())
        return loss


class Batches(LightningDataModule):
    def __init__(self, batch: dict[str, Tensor], steps: int = 2) -> None:
        super().__init__()
        self.batch, self.steps = batch, steps

    def train_dataloader(self) -> DataLoader:
        return DataLoader([self.batch] * self.steps, batch_size=None)


@pytest.fixture(scope="module")
def target() -> TargetModel:
    return TargetModel.from_config(tiny_config("llama", num_layers=4), seed=1)


def _batch(target: TargetModel) -> dict[str, Tensor]:
    input_ids = torch.randint(3, VOCAB, (2, 12), generator=torch.Generator().manual_seed(0))
    features = target(input_ids, use_cache=False).features
    return {"input_ids": input_ids, "features": features}


def _trainer(**kwargs: Any) -> Trainer:
    return quiet_trainer(**kwargs)


def _module(target: TargetModel, **hparams: Any) -> NextToken:
    drafter = Eagle3Drafter.from_target(target, intermediate_size=64)
    return NextToken.from_objects(target, drafter, **hparams)


def test_two_training_steps_train_the_drafter_only(target: TargetModel, tmp_path: Path) -> None:
    module = _module(target)
    frozen = {k: v.clone() for k, v in target.state_dict().items()}
    assert not any(p.requires_grad for p in module.target.parameters())
    trainer = _trainer(default_root_dir=str(tmp_path))
    trainer.fit(module, datamodule=Batches(_batch(target)))
    assert trainer.global_step == 2
    assert len(module.losses) == 2 and module.losses[1] < module.losses[0], module.losses
    assert not module.target.training
    for key, value in target.state_dict().items():
        torch.testing.assert_close(value, frozen[key], msg=f"target weight {key} changed")
    optimizer = trainer.optimizers[0]
    optimized = {id(p) for group in optimizer.param_groups for p in group["params"]}
    assert optimized == {id(p) for p in module.drafter.parameters() if p.requires_grad}

    # The Lightning checkpoint holds the drafter and the counters, never the target.
    trainer.save_checkpoint(tmp_path / "objective.ckpt")
    checkpoint = torch.load(tmp_path / "objective.ckpt", weights_only=False)
    assert not [k for k in checkpoint["state_dict"] if k.startswith("target.")]
    assert "drafter.fc.weight" in checkpoint["state_dict"]
    assert checkpoint["next_token"] == {"nonfinite_total": 0}
    fresh = _module(target)
    fresh.on_load_checkpoint(checkpoint)
    fresh.load_state_dict(checkpoint["state_dict"], strict=True)
    torch.testing.assert_close(fresh.drafter.fc.weight, module.drafter.fc.weight)


def test_a_missing_batch_key_is_named(target: TargetModel) -> None:
    module = _module(target)
    batch = _batch(target)
    del batch["features"]
    with pytest.raises(BatchKeyError, match=r"NextToken needs batch keys \['features'\]") as error:
        _trainer().fit(module, datamodule=Batches(batch))
    assert "'input_ids'" in str(error.value)  # what the batch did have
    assert isinstance(error.value, KeyError)
    with pytest.raises(TypeError, match="dict batches"):
        module.check_batch(torch.zeros(2, 3))


def test_nonfinite_steps_are_skipped_then_fatal(target: TargetModel) -> None:
    poisoned = _batch(target)
    poisoned["features"] = torch.full_like(poisoned["features"], float("nan"))

    def fit(limit: int) -> NextToken:
        module = _module(target, max_consecutive_nonfinite=limit)
        before = {k: v.clone() for k, v in module.drafter.state_dict().items()}
        trainer = _trainer()
        try:
            trainer.fit(module, datamodule=Batches(poisoned))
        finally:
            for key, value in module.drafter.state_dict().items():
                torch.testing.assert_close(value, before[key], msg=f"{key} changed when skipped")
        assert float(trainer.callback_metrics["train/skipped_nonfinite"]) == 2.0
        return module

    module = fit(limit=3)  # two NaN steps in a row: skipped, the run goes on
    assert module._nonfinite_total == 2 and module.losses == []
    assert module.checkpoint_state() == {"nonfinite_total": 2}
    with pytest.raises(FloatingPointError, match="2 consecutive"):
        fit(limit=2)


def test_target_and_drafter_from_folders(
    target: TargetModel, tiny_cli_assets: dict[str, str], tmp_path: Path
) -> None:
    """`target` as a model folder, `drafter_init` as a drafter folder; without it the subclass
    builds one; a subclass that cannot build says so."""
    built = NextToken(target=tiny_cli_assets["model"], width=32)
    assert isinstance(built.drafter, Eagle3Drafter) and built.drafter.training
    assert not any(p.requires_grad for p in built.target.parameters())
    built.drafter.save_pretrained(tmp_path / "drafter")
    loaded = NextToken(target=tiny_cli_assets["model"], drafter_init=str(tmp_path / "drafter"))
    torch.testing.assert_close(loaded.drafter.fc.weight, built.drafter.fc.weight)
    assert loaded.drafter.training  # trainable again after load_drafter's eval()

    class NoBuilder(Objective):
        def training_step(self, batch: Any, batch_idx: int) -> Tensor:  # pragma: no cover
            raise AssertionError

    with pytest.raises(NotImplementedError, match="NoBuilder cannot build a drafter"):
        NoBuilder(target=tiny_cli_assets["model"])
    with pytest.raises(ValueError, match="another tokenizer"):
        NextToken.from_objects(
            TargetModel.from_config(tiny_config("llama", vocab_size=96, num_layers=4)),
            Eagle3Drafter.from_target(target),
        )
