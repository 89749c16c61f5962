"""What a live speculative-decoding step costs at each thread count, measured interleaved.

Whether an online update can run beside serving on the same CPU turns on this: the update takes
cores from the server, so the server's step cost at fewer threads is the price. Clock drift on a
shared machine (~10% over an hour here) is larger than the differences that matter, so the
thread counts are interleaved in a palindrome (2, 1, 1, 2: each count's mean time sits at the
same point of the run) over the same requests, and the seconds and verification steps of each
count are summed (ratio of sums).

    python experiments/onlinespec/scripts/step_threads.py --drafter runs/online_domain_warm_ref/drafter/last \
        --stream runs/streams/py-doc2code.jsonl --skip 800 --requests 6 --threads 2,1 --prepack
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from lightning_spec import specs
from lightning_spec.bench.report import write_json
from lightning_spec.decoding.engine import SpeculativeDecoder


def interleaved_step_costs(
    decoder: SpeculativeDecoder,
    prompts: Sequence[Sequence[int]],
    threads: Sequence[int],
    *,
    max_new_tokens: int,
) -> dict[int, dict[str, float]]:
    """{threads: seconds, steps, ms_per_step} over the prompts decoded once in `threads` order
    and once in reverse (the palindrome cancels a linear drift); the thread count is restored."""
    before = torch.get_num_threads()
    totals = {int(t): {"seconds": 0.0, "steps": 0.0} for t in threads}
    try:
        for count in [*threads, *reversed(threads)]:
            torch.set_num_threads(int(count))
            for prompt in prompts:
                result = decoder.generate(list(prompt), max_new_tokens)
                totals[int(count)]["seconds"] += result.total_seconds
                totals[int(count)]["steps"] += result.num_verifications
    finally:
        torch.set_num_threads(before)
    for entry in totals.values():
        entry["ms_per_step"] = 1000 * entry["seconds"] / max(1.0, entry["steps"])
    return totals


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--target", default="smollm2")
    parser.add_argument("--drafter", required=True)
    parser.add_argument("--tree", default="dynamic:6,10,32")
    parser.add_argument("--stream", required=True, help="a JSONL stream (lightning-spec online)")
    parser.add_argument("--skip", type=int, default=0, help="stream items to skip first")
    parser.add_argument("--requests", type=int, default=6)
    parser.add_argument("--threads", default="2,1", help="comma-separated thread counts")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--prepack", action="store_true", help="prepack the target's linears")
    parser.add_argument("--output", type=Path, help="write the figures as JSON here too")
    args = parser.parse_args(argv)
    from lightning_spec.online.stream import Segment, build_stream

    target = specs.resolve_target(args.target, "fp32")
    if args.prepack:
        from lightning_spec.models.packed import prepack_where_possible

        prepack_where_possible({"target": target.model}, who="step_threads")
    drafter = specs.resolve_drafter(args.drafter, target)
    decoder = SpeculativeDecoder(target, drafter, specs.resolve_tree(args.tree))
    segment = Segment(args.stream, args.requests, "source", args.skip)
    requests = build_stream(target.tokenizer, [segment], seed=0)
    decoder.generate(list(requests[0].prompt), 16)  # warm-up, not counted
    threads = [int(t) for t in args.threads.split(",") if t]
    figures = interleaved_step_costs(
        decoder, [r.prompt for r in requests], threads, max_new_tokens=args.max_new_tokens
    )
    report: dict[str, Any] = {"threads": {str(k): v for k, v in figures.items()},
                              "command": " ".join(sys.argv)}  # fmt: skip
    for count, entry in figures.items():
        print(f"threads {count}: {entry['ms_per_step']:.1f} ms a step over "
              f"{int(entry['steps'])} steps")  # fmt: skip
    if args.output:
        write_json(args.output, report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
