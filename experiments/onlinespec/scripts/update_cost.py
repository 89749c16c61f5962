"""Where a learner update's seconds go, and what cuts them: one round of a stream's requests,
its feedback built once, then the OGD update timed under each setting, alone on the cores.

    python experiments/onlinespec/scripts/update_cost.py --drafter D \
        --stream runs/streams/py-doc2code-live.jsonl --round 40 \
        --output experiments/onlinespec/results/update_cost.json

The round's answers are the target's greedy answers (batched, cached beside the output); the
feedback (features and soft labels) comes from one teacher-forced pass, which is what the rows a
server captures hold. Each setting starts from the same drafter with a fresh strategy (its
vocabulary swap included), so every row pays the same first-round costs.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from lightning_spec import specs
from lightning_spec.bench.serve_load import load_stream
from lightning_spec.decoding.replay import committed_feedback
from lightning_spec.io import atomic_write_json
from lightning_spec.online.continuations import stream_continuations
from lightning_spec.online.strategies import make_strategy
from lightning_spec.online.stream import Request

SETTINGS = {  # name: strategy options over the base recipe
    "fp32, 2 epochs of 2 (the reference)": {},
    "bf16, 2 epochs of 2": {"autocast": True},
    "bf16, 1 epoch of 2": {"autocast": True, "epochs": 1},
    "bf16, 1 epoch of 4": {"autocast": True, "epochs": 1, "minibatch": 4},
    "fp32, 1 epoch of 4": {"epochs": 1, "minibatch": 4},
    "vocabulary swap alone": {"epochs": 1, "lr": 1e-12, "minibatch": 64},
}
BASE = {"lr": 2e-4, "epochs": 2, "minibatch": 2, "ttt_steps": 2, "vocab_swap": 64}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--drafter", required=True)
    parser.add_argument("--stream", required=True)
    parser.add_argument("--round", type=int, default=40)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--output", required=True)
    args = parser.parse_args()
    torch.set_num_threads(2)
    target = specs.resolve_target("smollm2", "fp32")
    from lightning_spec.models.packed import prepack_where_possible

    prepack_where_possible({"target": target.model}, who="update_cost")
    stream = load_stream(args.stream, args.round)
    requests = [Request(i, "stream", str(item.get("id", i)), item["prompt_ids"])
                for i, item in enumerate(stream)]  # fmt: skip
    answers = stream_continuations(target, requests, max_new_tokens=args.max_new_tokens,
                                   cache=Path(args.output).with_suffix(".answers.jsonl"))  # fmt: skip
    drafter = specs.resolve_drafter(args.drafter, target)
    probe = make_strategy("ogd", drafter, **BASE)
    tic = time.perf_counter()
    feedback = [committed_feedback(target, r.prompt, a, keep_labels=probe.label_top_k)
                for r, a in zip(requests, answers, strict=True) if a]  # fmt: skip
    feedback_seconds = time.perf_counter() - tic
    rows = []
    for name, options in SETTINGS.items():
        strategy = make_strategy("ogd", drafter, **{**BASE, **options},
                                 protected_ids=list(target.eos_token_ids))  # fmt: skip
        tic = time.perf_counter()
        report = strategy.update(feedback)
        wall = time.perf_counter() - tic
        row = {"setting": name, "wall_seconds": wall,
               "update_seconds": report["update_seconds"],
               "served_loss_seconds": report.get("diagnostic_seconds", 0.0),
               "optimizer_steps": report.get("optimizer_steps"),
               "train_loss": report.get("train_loss"), "online_loss": report["online_loss"]}  # fmt: skip
        rows.append(row)
        print(json.dumps(row), flush=True)
    result = {"requests": len(feedback), "feedback_seconds_target_pass": feedback_seconds,
              "tokens": sum(len(g.tokens) for g in feedback), "rows": rows}  # fmt: skip
    atomic_write_json(args.output, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
