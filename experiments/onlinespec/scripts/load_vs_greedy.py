"""A load run's replies against the target's own greedy answers, and vLLM's per-request acceptance
against our replay of the same drafter, on a sample of requests.

    python experiments/onlinespec/scripts/load_vs_greedy.py --load OUT/frozen/load.jsonl \
        --stream S.jsonl --drafter D --every 10 --output OUT/frozen/vs_greedy.json

Greedy: the target's answers generated in batches (`online.continuations`, cut to their batch-1
greedy prefix, cached in ``--answers``); a reply is lossless when it starts with that answer.
Acceptance: each sampled reply replayed with the drafter that served it (`decoding.replay`,
vLLM's chain of ``--k``; only meaningful for a frozen arm, whose drafter is ``--drafter``) and
its tau compared with the one vLLM reported for it (near-ties in fp32 may move a few steps).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from lightning_spec import specs
from lightning_spec.bench.serve_load import load_stream, read_rows
from lightning_spec.decoding.replay import ReplayMismatch, replay_greedy
from lightning_spec.io import atomic_write_json
from lightning_spec.online.continuations import stream_continuations
from lightning_spec.online.loop import matches_greedy
from lightning_spec.online.stream import Request


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--load", required=True)
    parser.add_argument("--stream", required=True)
    parser.add_argument("--drafter", default=None, help="replay this drafter (a frozen arm)")
    parser.add_argument("--k", type=int, default=3)
    parser.add_argument("--every", type=int, default=10, help="check every Nth request")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--answers", default=None, help="greedy answers cache (JSONL)")
    parser.add_argument("--output", required=True)
    args = parser.parse_args()
    torch.set_num_threads(2)
    stream = load_stream(args.stream)
    rows = {r["index"]: r for r in read_rows(args.load) if r.get("ok")}
    sample = [i for i in sorted(rows) if i % args.every == 0]
    target = specs.resolve_target("smollm2", "fp32")
    requests = [Request(i, "stream", str(stream[i].get("id", i)), stream[i]["prompt_ids"])
                for i in sample]  # fmt: skip
    answers = stream_continuations(
        target, requests, max_new_tokens=args.max_new_tokens,
        cache=args.answers or Path(args.output).with_suffix(".answers.jsonl"),
    )  # fmt: skip
    differ = [i for i, a in zip(sample, answers, strict=True)
              if not matches_greedy(rows[i]["token_ids"], a)]  # fmt: skip
    report = {"load": args.load, "checked": len(sample), "not_greedy": differ}
    if args.drafter:
        drafter = specs.resolve_drafter(args.drafter, target)
        policy = specs.resolve_tree(f"chain:{args.k}")
        ours, theirs, skipped = [], [], 0
        for i in sample:
            tokens = rows[i]["token_ids"]
            try:
                generation = replay_greedy(target, drafter, policy, stream[i]["prompt_ids"], tokens)
            except (ValueError, ReplayMismatch):
                skipped += 1
                continue
            steps = len(generation.records)
            ours.append((sum(len(r.committed) for r in generation.records), steps))
            theirs.append((rows[i]["accepted"] + rows[i]["steps"], rows[i]["steps"]))
        report.update(
            replayed=len(ours), replay_skipped=skipped,
            tau_ours=sum(c for c, _ in ours) / max(1, sum(s for _, s in ours)),
            tau_vllm=sum(c for c, _ in theirs) / max(1, sum(s for _, s in theirs)),
            requests_with_equal_steps=sum(a == b for a, b in zip(ours, theirs, strict=True)),
        )  # fmt: skip
    atomic_write_json(args.output, report)
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
