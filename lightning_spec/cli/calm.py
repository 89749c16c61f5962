"""A calm console: our progress and results, not library noise a user cannot act on.

Each filter below names a message we checked and why it is harmless here; anything else still
reaches the user. Applied by `lightning-spec fit` (and the other Lightning subcommands) before
the trainer is built.
"""

from __future__ import annotations

import logging
import warnings

__all__ = ["calm_console"]

_FILTERED = (
    # Lightning advertises its cloud logger and checkpoint store at every fit; we log to MLflow
    # and write drafter folders on purpose.
    "💡 Tip: For seamless cloud",
)


class _DropAdvertising(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.getMessage()).startswith(_FILTERED)


def calm_console() -> None:
    """Install the filters (idempotent)."""
    logger = logging.getLogger("lightning.pytorch.utilities.rank_zero")
    if not any(isinstance(f, _DropAdvertising) for f in logger.filters):
        logger.addFilter(_DropAdvertising())
    # Lightning's own pytree helper calls a torch API torch deprecated; nothing for a user to do.
    warnings.filterwarnings("ignore", message=r".*isinstance\(treespec, LeafSpec\)` is deprecated")
    # The frozen target (and GTO's frozen reference drafter) are in eval mode by design.
    warnings.filterwarnings("ignore", message=r"Found \d+ module\(s\) in eval mode at the start")
