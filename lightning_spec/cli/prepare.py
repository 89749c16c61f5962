"""`lightning-spec prepare`: build a fit config's data (rendering, regeneration, feature cache), then stop.

A `regenerated` store of thousands of prompts takes the better part of an hour on a CPU, and a
`RunBudget` counts data preparation in its budget (that is what makes data modes comparable).
Two objectives compared at equal training time on one store therefore prepare it first, here,
so no arm pays for it: afterwards every `fit` with the same data arguments finds the store
complete and only reads it. Takes exactly the arguments of `lightning-spec fit` (a config and
command-line overrides); the model is built too, as `fit` builds it, so a mismatch between the
drafter's target and the data's shows here rather than hours later. Interrupted, it resumes from
the shards already written.
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Sequence

__all__ = ["main"]

log = logging.getLogger(__name__)

USAGE = """usage: lightning-spec prepare --config FILE.yaml [--data.init_args.X=... ...]

Build the data a `lightning-spec fit` with the same arguments would train on (render the
dataset, regenerate answers, cache features), print what it holds, and stop without training."""


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in {"-h", "--help"}:
        print(USAGE)
        return 0 if args else 2
    from lightning_spec.cli import lightning_cli

    # LightningCLI reads the command line itself when not given `args` (and warns when it has
    # both); what it sees is this command's own arguments
    saved, sys.argv = sys.argv, [sys.argv[0], *args]
    try:
        cli = lightning_cli(None, run=False)
    finally:
        sys.argv = saved
    data = cli.datamodule  # type: ignore[attr-defined]
    if not hasattr(data, "prepare_data"):
        raise ValueError(f"{type(data).__name__} has no data to prepare")
    start = time.perf_counter()
    data.prepare_data()
    data.setup("fit")
    seconds = time.perf_counter() - start
    train, val = getattr(data, "_train", None), getattr(data, "_val", None)
    sizes = "" if train is None else f"{len(train)} train / {len(val or [])} val items, "
    print(f"prepared: {sizes}{seconds:.0f} s")
    return 0
