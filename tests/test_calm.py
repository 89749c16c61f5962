"""The calm console: advertising and checked-harmless warnings dropped, nothing else, and an
unbounded run's progress bar says "Epoch N", not "Epoch N/-2"."""

from __future__ import annotations

import logging
import warnings
from types import SimpleNamespace

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
