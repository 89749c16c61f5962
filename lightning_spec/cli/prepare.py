"""`lightning-spec prepare`: build a fit config's data (rendering, regeneration, feature cache), then stop.

A `regenerated` store of thousands of prompts takes the better part of an hour on a CPU, and a
`RunBudget` counts data preparation in its budget (that is what makes data modes comparable).
Two objectives compared at equal training time on one store therefore prepare it first, here,
so no arm pays for it: afterwards every `fit` with the same data arguments finds the store
complete and only reads it. Takes exactly the arguments of `lightning-spec fit` (a config and
command-line overrides); the model is built too, as `fit` builds it, so a mismatch between the
drafter's target and the data's shows here rather than hours later. Interrupted, it resumes from
the shards already written.

``--regenerate-with URL[,URL...]`` has the regeneration sent to servers that serve the target
(vLLM, llama.cpp's llama-server, ...) instead of the target's batched ``generate`` here,
``--concurrency N`` requests at a time on each (`data.regenerate_served`). They set the data
module's ``regenerate_with`` and ``regenerate_concurrency``, which do not change the store, so a
later `fit` without them finds it complete.

``--features-from-spool DIR`` takes the regenerated records' target features from the captures
that `lightning-spec serve --engine vllm --spool DIR` kept while answering them, instead of a
second target pass (`data.spool_features`; the config must give ``feature_cache_bytes``);
records no capture covers are cached by the target pass as before.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from collections.abc import Sequence
from pathlib import Path

__all__ = ["engine_overrides", "main"]

log = logging.getLogger(__name__)

USAGE = """usage: lightning-spec prepare --config FILE.yaml [--data.init_args.X=... ...]
                              [--regenerate-with URL[,URL...] [--concurrency N]]
                              [--features-from-spool DIR]

Build the data a `lightning-spec fit` with the same arguments would train on (render the
dataset, regenerate answers, cache features), print what it holds, and stop without training.

  --regenerate-with URL[,URL...]  regenerate through these OpenAI-compatible servers (vllm
                                  serve, llama-server, lightning-spec serve --engine vllm)
                                  instead of the target's batched generate here
  --concurrency N                 requests in flight on each server (default 8)
  --features-from-spool DIR       the regenerated records' features from the captures of
                                  lightning-spec serve --engine vllm --spool DIR (no second
                                  target pass; needs feature_cache_bytes > 0)"""


def engine_overrides(args: Sequence[str]) -> list[str]:
    """`args` with ``--regenerate-with``, ``--concurrency`` and ``--features-from-spool`` turned
    into the data module's overrides (``--data.init_args.regenerate_with=...``, appended last so
    they win over the configs); a malformed URL or a missing spool folder raises ValueError
    here, before anything is built."""
    from lightning_spec.data.served_protocol import parse_server_urls

    parser = argparse.ArgumentParser(prog="lightning-spec prepare", add_help=False,
                                     allow_abbrev=False)  # fmt: skip
    parser.add_argument("--regenerate-with", default=None)
    parser.add_argument("--concurrency", type=int, default=None)
    parser.add_argument("--features-from-spool", default=None)
    known, rest = parser.parse_known_args(list(args))
    overrides: list[str] = []
    if known.regenerate_with is None:
        if known.concurrency is not None:
            raise ValueError("--concurrency applies to --regenerate-with URL[,URL...]")
    else:
        urls = parse_server_urls(known.regenerate_with)
        if not urls:
            raise ValueError("--regenerate-with needs at least one URL (http://HOST:PORT)")
        overrides.append(f"--data.init_args.regenerate_with={','.join(urls)}")
        if known.concurrency is not None:
            if known.concurrency < 1:
                raise ValueError("--concurrency must be >= 1")
            overrides.append(f"--data.init_args.regenerate_concurrency={known.concurrency}")
    if known.features_from_spool is not None:
        spool = Path(known.features_from_spool).expanduser()
        if not spool.is_dir():
            raise ValueError(
                f"--features-from-spool: no folder {spool} (give the --spool DIR of the "
                "lightning-spec serve --engine vllm server that answered the regeneration)"
            )
        overrides.append(f"--data.init_args.features_from_spool={spool.resolve()}")
    return [*rest, *overrides]


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in {"-h", "--help"}:
        print(USAGE)
        return 0 if args else 2
    try:
        args = engine_overrides(args)
    except ValueError as error:
        print(f"lightning-spec prepare: error: {error}", file=sys.stderr)
        return 2
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
