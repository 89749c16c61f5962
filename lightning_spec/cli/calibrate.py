"""`lightning-spec calibrate`: measure verification cost and suggest the fastest tree policy.

The command line of `lightning_spec.bench.calibrate` (the model behind the suggestion and its
stated approximations are described there): without ``--drafter`` only the target's cost curve
is measured; with one, its per-depth acceptance too, and the candidate tree policies are ranked
by modelled speedup. ``--output`` writes the JSON (reusable by ``bench --tree auto
--calibration``) and the markdown beside it.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import torch

from lightning_spec import specs
from lightning_spec.bench.calibrate import (
    CLI_SIZES,
    calibrate,
    format_report,
    measure_autoregressive_step,
    measure_verify_cost,
)
from lightning_spec.bench.machine import git_commit, load_average, machine_info, warn_if_busy

__all__ = ["build_parser", "main"]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="lightning-spec calibrate",
        description="Measure the target's verification cost curve and a drafter's per-depth "
        "acceptance, and suggest the tree policy with the best modelled speedup.",
    )
    parser.add_argument("--target", default="smollm2", help="smollm2, a model folder or hub id")
    parser.add_argument(
        "--drafter",
        default=None,
        help="drafter folder, random, self or bigram:<folder|dataset>; omit for the cost curve only",
    )
    parser.add_argument("--dataset", default="mtbench", help="prompts for the acceptance probe")
    parser.add_argument("--limit", type=int, default=5, help="prompts for the acceptance probe")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--depth", type=int, default=8, help="probe chain depth")
    parser.add_argument("--ranks", type=int, default=8, help="draft ranks recorded per depth")
    parser.add_argument(
        "--sizes",
        default=",".join(str(n) for n in CLI_SIZES),
        help="comma-separated numbers of verified tokens",
    )
    parser.add_argument("--context", type=int, default=256, help="cached tokens before the block")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument(
        "--candidate",
        action="append",
        default=None,
        help="a tree spec to consider (repeatable); default: chains, static trees, dynamic grid",
    )
    parser.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    parser.add_argument("--threads", type=int, default=2, help="torch.set_num_threads")
    parser.add_argument(
        "--prepack",
        action="store_true",
        help="CPU fp32: measure with the target's and drafter's linear weights prepacked for "
        "oneDNN (what bench --prepack runs)",
    )
    parser.add_argument("--draft-vocab-size", type=int, default=None, help="for --drafter random")
    parser.add_argument("--bigram-limit", type=int, default=2000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output", default=None, help="JSON path (markdown written next to it)")
    return parser


def main(argv: list[str] | None = None) -> int:
    """`lightning-spec calibrate`: print the cost curve, the acceptance profile, a suggestion."""
    args = build_parser().parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    machine = machine_info(args.dtype)
    warn_if_busy(machine)
    target = specs.resolve_target(args.target, args.dtype)
    sizes = [int(n) for n in args.sizes.split(",") if n.strip()]
    config = {k: v for k, v in vars(args).items()}
    config["commit"] = git_commit()
    config["machine"] = machine
    if args.prepack:
        from lightning_spec.models.packed import prepack_where_possible

        config["prepacked_linears"] = prepack_where_possible(
            {"target": target.model}, who="calibrate"
        )
    if args.drafter is None:
        curve = measure_verify_cost(target, sizes, args.context, args.repeats, seed=args.seed)
        result: dict[str, Any] = {
            "config": config,
            "cost_curve": {str(n): s for n, s in curve.items()},
            "autoregressive_step_seconds": measure_autoregressive_step(
                target, args.context, seed=args.seed
            ),
            "context": args.context,
            "repeats": args.repeats,
        }
        print(format_report(result))
    else:
        drafter = specs.resolve_drafter(
            args.drafter,
            target,
            draft_vocab_size=args.draft_vocab_size,
            bigram_limit=args.bigram_limit,
            seed=args.seed,
        )
        if args.prepack:
            from lightning_spec.models.packed import prepack_where_possible

            prepack_where_possible({"drafter": drafter}, who="calibrate")
        _, prompts = specs.load_prompts(args.dataset, target.tokenizer, args.limit)
        result = calibrate(
            target,
            drafter,
            [ids for ids, _ in prompts],
            sizes=sizes,
            context=args.context,
            repeats=args.repeats,
            depth=args.depth,
            ranks=args.ranks,
            max_new_tokens=args.max_new_tokens,
            candidates=args.candidate,
            seed=args.seed,
        )
        result = {"config": config, **result}
        print(format_report(result))
    config["machine"]["load_average_end"] = list(load_average())
    if args.output:
        path = Path(args.output)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(result, indent=2) + "\n")
        path.with_suffix(".md").write_text(format_report(result) + "\n")
        print(f"wrote {path}", file=sys.stderr)
    return 0
