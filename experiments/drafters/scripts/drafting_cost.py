"""Drafting milliseconds per verification step against draft depth: DFlash blocks vs EAGLE-3.

An EAGLE head drafts depth by depth, one drafter forward per tree level, so its drafting cost
grows with the depth; a DFlash block drafter drafts the whole block in one forward. This script
times the decoder's own drafting phase (`StepRecord.timings["draft"]`) on the real target, for
fresh DFlash drafters over a grid of block sizes and layer counts (the cost does not depend on
the weights) drafting their full block as a chain, and for an EAGLE-3 drafter drafting chains
of the same depths. Weights are random where no folder is given, so nearly nothing is accepted
and every step drafts a full chain: the figure is the cost of one full draft.

    python experiments/drafters/scripts/drafting_cost.py --eagle DIR --blocks 4,8,16 --layers 1,2,5 \\
        --output experiments/drafters/results/smollm2_drafting_cost.json

Run it alone on the cores (a timing benchmark).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

import torch

from lightning_spec.bench.machine import git_commit, machine_info
from lightning_spec.decoding.build import parse_tree_spec
from lightning_spec.decoding.engine import SpeculativeDecoder
from lightning_spec.models.drafters.base import load_drafter
from lightning_spec.models.drafters.dflash import DFlashDrafter
from lightning_spec.models.drafters.eagle3 import Eagle3Drafter
from lightning_spec.models.target import load_target

PROMPT = "Explain, step by step, how a hash map handles collisions, with a short example."


def draft_ms(target: Any, drafter: Any, depth: int, prompt: list[int], tokens: int) -> dict:
    """Median and mean drafting ms per step of a chain of `depth` drafts (after one warm-up)."""
    decoder = SpeculativeDecoder(target, drafter, parse_tree_spec(f"chain:{depth}"))
    decoder.generate(prompt, 8, stop_on_eos=False)  # warm-up
    result = decoder.generate(prompt, tokens, stop_on_eos=False)
    draft = [1000 * r.timings["draft"] for r in result.records]
    verify = [1000 * r.timings["verify"] for r in result.records]
    return {
        "depth": depth,
        "steps": len(draft),
        "draft_ms_median": round(statistics.median(draft), 3),
        "draft_ms_mean": round(statistics.fmean(draft), 3),
        "verify_ms_median": round(statistics.median(verify), 3),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="smollm2")
    parser.add_argument("--eagle", help="an EAGLE-3 drafter folder (default: a fresh head)")
    parser.add_argument("--blocks", default="4,8,16", help="DFlash block sizes")
    parser.add_argument("--layers", default="1,2,5", help="DFlash layer counts")
    parser.add_argument("--draft-vocab", type=int, default=4096)
    parser.add_argument("--tokens", type=int, default=40, help="new tokens per measurement")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--output", type=Path)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    target = load_target(args.target)
    prompt = target.tokenizer(PROMPT)["input_ids"] if target.tokenizer is not None else []
    prompt = prompt or list(range(3, 30))
    blocks = [int(b) for b in args.blocks.split(",")]
    layers = [int(n) for n in args.layers.split(",")]
    rows: list[dict[str, Any]] = []
    with torch.inference_mode():
        eagle = (
            load_drafter(args.eagle, target=target)
            if args.eagle
            else Eagle3Drafter.from_target(target, draft_vocab_size=args.draft_vocab)
        )
        for block in blocks:
            row = {"drafter": "eagle3", "layers": 1, "block_size": None}
            row |= draft_ms(target, eagle.eval(), block - 1, prompt, args.tokens)
            rows.append(row)
            print(json.dumps(row), flush=True)
        for count in layers:
            for block in blocks:
                drafter = DFlashDrafter.from_target(
                    target, block_size=block, num_layers=count, draft_vocab_size=args.draft_vocab
                ).eval()
                row = {"drafter": "dflash", "layers": count, "block_size": block}
                row |= draft_ms(target, drafter, block - 1, prompt, args.tokens)
                rows.append(row)
                print(json.dumps(row), flush=True)
    if args.output:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        payload = {
            "command": sys.argv,
            "commit": git_commit(),
            "machine": machine_info("float32"),
            "eagle": args.eagle,
            "rows": rows,
        }
        args.output.write_text(json.dumps(payload, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
