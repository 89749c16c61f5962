"""Measure the data side of the three training-data modes, and regeneration throughput.

``RolloutDataModule(mode=...)`` is the only thing that changes between ``dataset``,
``regenerated`` and ``mixture``, so an equal-wall-time comparison of the modes trains the same
objective with the same Trainer and swaps that one argument. This script reports what the
data side costs in each mode: preparation time (rendering, regeneration), loader throughput,
padding waste and the share of loss tokens, as JSON. With ``--throughput`` it measures
batched regeneration tokens/s of the target at several batch sizes instead.

    python experiments/drafters/scripts/bench_data_modes.py --modes dataset regenerated mixture \\
        --max-conversations 200 --output data_modes.json
    python experiments/drafters/scripts/bench_data_modes.py --throughput --prompts 16 --batch-sizes 1 4 8 \\
        --max-new-tokens 64 --threads 2

Timings on a shared machine are unstable: pin ``--threads``, check the load average (printed),
and compare ratios measured in one run (docs/benchmarking.md).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import tempfile
import time
from pathlib import Path
from typing import Any

import torch


def _machine(threads: int) -> dict[str, Any]:
    load = os.getloadavg() if hasattr(os, "getloadavg") else (float("nan"),) * 3
    return {
        "cpu_count": os.cpu_count(),
        "threads": threads,
        "load_average_1m": round(load[0], 2),
        "torch": torch.__version__,
        "python": platform.python_version(),
    }


def bench_modes(args: argparse.Namespace) -> dict[str, Any]:
    """Prepare each mode's data module and iterate one epoch of training batches."""
    from lightning_spec.data.datamodule import RolloutDataModule

    results: dict[str, Any] = {}
    for mode in args.modes:
        tic = time.perf_counter()
        module = RolloutDataModule(
            target=args.target,
            dataset=args.dataset,
            mode=mode,
            cache_dir=args.cache_dir,
            max_length=args.max_length,
            max_conversations=args.max_conversations,
            batch_size=args.batch_size,
            regenerate_max_new_tokens=args.max_new_tokens,
            regenerate_batch_size=args.regenerate_batch_size,
            seed=args.seed,
        )
        module.prepare_data()
        module.setup("fit")
        prepared = time.perf_counter() - tic
        loader = module.train_dataloader()
        tic = time.perf_counter()
        batches = tokens = padded = loss = 0
        sources: dict[str, int] = {}
        for batch in loader:
            batches += 1
            tokens += int(batch["attention_mask"].sum())
            padded += batch["input_ids"].numel()
            loss += int(batch["loss_mask"].sum())
            for source in batch["source"]:
                sources[source] = sources.get(source, 0) + 1
        seconds = time.perf_counter() - tic
        results[mode] = {
            "prepare_seconds": round(prepared, 2),
            "train_items": len(module._train),
            "val_items": len(module._val),
            "batches": batches,
            "loader_batches_per_s": round(batches / max(seconds, 1e-9), 1),
            "tokens": tokens,
            "loss_tokens": loss,
            "loss_token_share": round(loss / max(tokens, 1), 3),
            "padding_share": round(1 - tokens / max(padded, 1), 3),
            "sources": sources,
        }
        print(mode, json.dumps(results[mode]))
    return results


def bench_throughput(args: argparse.Namespace) -> dict[str, Any]:
    """Regeneration tokens/s of the target over the same prompts at several batch sizes."""
    from lightning_spec.data.regenerate import GenerationSettings, PromptItem, regenerate
    from lightning_spec.data.rollouts import RolloutStore
    from lightning_spec.data.sources import load_source
    from lightning_spec.models.target import load_target

    target = load_target(args.target, dtype=args.dtype)
    source = load_source(args.dataset, limit=args.prompts)
    prompts = [PromptItem(c.id, messages=c.prompt()) for c in source]
    settings = GenerationSettings(max_new_tokens=args.max_new_tokens)
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as scratch:
        for batch_size in args.batch_sizes:
            store = RolloutStore(Path(scratch) / f"b{batch_size}", {"batch_size": batch_size})
            report = regenerate(
                target,
                target.tokenizer,
                prompts,
                store,
                settings=settings,
                batch_size=batch_size,
                max_length=args.max_length,
                progress=False,
            )
            results[str(batch_size)] = {
                "prompts": report.generated,
                "new_tokens": report.new_tokens,
                "seconds": round(report.seconds, 2),
                "tokens_per_s": round(report.tokens_per_second, 1),
            }
            print(f"batch {batch_size}", json.dumps(results[str(batch_size)]))
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default="smollm2")
    parser.add_argument("--dataset", default="sharegpt")
    parser.add_argument("--modes", nargs="+", default=["dataset", "regenerated", "mixture"])
    parser.add_argument("--cache-dir", default=None)
    parser.add_argument("--max-length", type=int, default=512)
    parser.add_argument("--max-conversations", type=int, default=200)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--regenerate-batch-size", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--throughput", action="store_true", help="measure regeneration tok/s")
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 4, 8])
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--output", default=None, help="write the results as JSON here")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    torch.set_num_threads(args.threads)
    machine = _machine(args.threads)
    print("machine", json.dumps(machine))
    kind = "throughput" if args.throughput else "modes"
    results = bench_throughput(args) if args.throughput else bench_modes(args)
    if args.output:
        payload = {"kind": kind, "args": vars(args), "machine": machine, "results": results}
        Path(args.output).write_text(json.dumps(payload, indent=2) + "\n")


if __name__ == "__main__":
    main()
