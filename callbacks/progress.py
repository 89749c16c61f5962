"""`SpecProgressBar`: Lightning's rich progress bar without the "Epoch 5/-2" of unbounded runs.

Our configs bound runs by steps or by `RunBudget` minutes, so Lightning's epoch limit is -1 and
its bar prints the meaningless total "-2"; this bar shows "Epoch N" then, and "Epoch N/M" when
an epoch limit exists.
"""

from __future__ import annotations

from lightning.pytorch.callbacks import RichProgressBar


class SpecProgressBar(RichProgressBar):
    """`RichProgressBar` that leaves an unbounded epoch count out of the description."""

    def _get_train_description(self, current_epoch: int) -> str:
        description = f"Epoch {current_epoch}"
        max_epochs = self.trainer.max_epochs
        if max_epochs is not None and max_epochs > 0:
            description += f"/{max_epochs - 1}"
        if len(self.validation_description) > len(description):
            description = f"{description:{len(self.validation_description)}}"
        return description
