"""The calm console: advertising and checked-harmless warnings dropped, nothing else, and an
unbounded run's progress bar says "Epoch N", not "Epoch N/-2"."""

from __future__ import annotations

import logging
import warnings
from types import SimpleNamespace

import pytest

from lightning_spec.callbacks.progress import SpecProgressBar
from lightning_spec.cli.calm import calm_console


def test_only_the_checked_messages_are_dropped(caplog) -> None:  # noqa: ANN001
    calm_console()
    logger = logging.getLogger("lightning.pytorch.utilities.rank_zero")
    with caplog.at_level(logging.INFO, logger=logger.name):
        logger.info("💡 Tip: For seamless cloud logging and experiment tracking, try X")
        logger.info("💡 Tip: For seamless cloud uploads and versioning, try Y")
        logger.info("GPU available: False, used: False")
    assert [r.getMessage() for r in caplog.records] == ["GPU available: False, used: False"]
    with warnings.catch_warnings(record=True) as caught:
        calm_console()  # inside catch_warnings the filters must be installed again
        warnings.warn(
            "Found 398 module(s) in eval mode at the start of training.", UserWarning, stacklevel=1
        )
        warnings.warn("something a user must see", UserWarning, stacklevel=1)
    assert [str(w.message) for w in caught] == ["something a user must see"]


def test_unbounded_epochs_are_not_shown_as_minus_two() -> None:
    bar = SpecProgressBar()
    bar._trainer = SimpleNamespace(max_epochs=-1)  # what Lightning sets for step-bounded runs
    assert bar._get_train_description(5).strip() == "Epoch 5"
    bar._trainer = SimpleNamespace(max_epochs=10)
    assert bar._get_train_description(5).strip() == "Epoch 5/9"


def test_off_a_terminal_training_reports_plain_lines(capsys, tmp_path) -> None:  # noqa: ANN001
    """Under nohup or CI (stderr a file) a long run still says where it is: one line per
    interval with the step, pace, time left (RunBudget's deadline counts) and loss, and one
    per validation."""
    import torch
    from lightning.pytorch import Trainer
    from lightning.pytorch.demos.boring_classes import BoringModel

    from lightning_spec.callbacks.budget import RunBudget

    class Logged(BoringModel):
        def training_step(self, batch, batch_idx):  # noqa: ANN001, ANN201
            out = super().training_step(batch, batch_idx)
            self.log("train/loss", out["loss"])
            return out

        def validation_step(self, batch, batch_idx):  # noqa: ANN001, ANN201
            self.log("val/tau", torch.tensor(1.5))
            return super().validation_step(batch, batch_idx)

    trainer = Trainer(
        max_steps=4, val_check_interval=2, limit_val_batches=1, num_sanity_val_steps=0,
        logger=False, enable_checkpointing=False, default_root_dir=tmp_path,
        callbacks=[SpecProgressBar(plain_interval=0.0, plain=True), RunBudget(minutes=30)],
    )  # fmt: skip
    trainer.fit(Logged())
    lines = [line for line in capsys.readouterr().err.splitlines()
             if line.startswith(("training step", "validation at"))]  # fmt: skip
    assert lines[0].startswith("training step 1/4 (25%)")
    assert "s/step" in lines[0] and "left ~" in lines[0] and "loss " in lines[0]
    assert "training step 4/4 (100%)" in "\n".join(lines)
    assert [line for line in lines if line.startswith("validation")] == [
        "validation at step 2: val/tau 1.5",
        "validation at step 4: val/tau 1.5",
    ]
    with pytest.raises(ValueError, match="plain_interval"):
        SpecProgressBar(plain_interval=-1)
