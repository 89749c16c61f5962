"""How much of the target's held-out greedy text a draft vocabulary can draft at all.

    lightning-spec bench vocab --sizes 2048,4096,8192,16384,32768 \
        --counts sharegpt:4000 --counts store:$CACHE/rollouts/regenerated-... \
        --output runs/bench/smollm2_vocab_coverage.json

A reduced draft vocabulary (EAGLE-3's ``d2t``) can never propose a token outside it, so every
such token in the text a drafter is verified on is a rejection whatever the drafter learned:
coverage caps alpha_1, and the chance that the next j tokens are all drafteable caps depth j.
This reads the cached greedy texts of the replay bench (`bench --replay`'s cache: the target's
own answers to MT-Bench and HumanEval, prompts never trained on) and, per vocabulary source
(``sharegpt:N``: the assistant turns of N ShareGPT conversations, the default of our configs;
``store:DIR``: the loss tokens of a rollout store, e.g. the target's regenerated answers) and
size (the most frequent tokens, EOS kept, as `build_draft_vocab` picks them), reports the share
of answer tokens in the vocabulary and the share of positions whose next 1 .. 6 tokens all are.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import torch

from lightning_spec.io import atomic_write_json
from lightning_spec.models.vocab import build_draft_vocab

DEPTHS = 6


def replay_texts(path: Path) -> dict[str, list[list[int]]]:
    """{dataset: [answer token ids]} of a replay cache file (header line, then one text each)."""
    texts: dict[str, list[list[int]]] = {}
    with path.open() as handle:
        for line in handle:
            row = json.loads(line)
            if row.get("header"):
                continue
            texts.setdefault(row["id"].split(":")[0], []).append([int(t) for t in row["tokens"]])
    return texts


def store_counts(directory: Path, vocab_size: int) -> torch.Tensor:
    """Token counts of the loss tokens of a rollout store's records."""
    from lightning_spec.data.rollouts import RolloutStore

    manifest = json.loads((directory / "manifest.json").read_text())
    store = RolloutStore(directory, manifest["config"], prefix=directory.name.split("-")[0])
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for shard in store.shards():
        for record in store.read_shard(shard):
            ids = torch.tensor(record.input_ids)[torch.tensor(record.loss_mask, dtype=torch.bool)]
            counts += torch.bincount(ids, minlength=vocab_size)
    return counts


def coverage(texts: list[list[int]], in_vocab: torch.Tensor) -> dict[str, Any]:
    """Token coverage and, per depth j, the share of positions whose next j tokens are in."""
    hits = [in_vocab[torch.tensor(t)] for t in texts if t]
    tokens = torch.cat(hits)
    runs = []
    for depth in range(1, DEPTHS + 1):
        ok = total = 0
        for row in hits:
            if row.numel() < depth:
                continue
            window = row.unfold(0, depth, 1).all(dim=1)
            ok += int(window.sum())
            total += int(window.numel())
        runs.append(ok / total if total else None)
    return {"tokens": int(tokens.numel()), "coverage": float(tokens.float().mean()), "next_j_all_in": runs}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="lightning-spec bench vocab", description=__doc__.split("\n\n")[0])
    parser.add_argument("--texts", type=Path, default=None, help="a replay cache file (default: SmolLM2's 244-prompt one)")
    parser.add_argument("--counts", action="append", required=True, help="sharegpt:N or store:DIR (repeatable)")
    parser.add_argument("--sizes", default="2048,4096,8192,16384,32768")
    parser.add_argument("--target", default="smollm2")
    parser.add_argument("--output", type=Path, required=True)
    args = parser.parse_args(argv)

    from lightning_spec.data.assets import cache_root
    from lightning_spec.models.target import load_target
    from lightning_spec.objectives.sft import draft_token_counts

    target = load_target(args.target)
    texts_path = args.texts or next(
        iter(sorted((cache_root() / "bench-replay").glob("*/humaneval+mtbench-limitNone-*new128.jsonl")))
    )
    texts = replay_texts(texts_path)
    report: dict[str, Any] = {"command": " ".join([sys.executable, *sys.argv]), "texts": str(texts_path),
                              "datasets": {k: len(v) for k, v in texts.items()}, "rows": []}  # fmt: skip
    for spec in args.counts:
        kind, _, value = spec.partition(":")
        if kind == "sharegpt":
            counts = draft_token_counts(target, source="sharegpt", conversations=int(value))
        elif kind == "store":
            counts = store_counts(Path(value).expanduser(), target.vocab_size)
        else:
            parser.error(f"--counts {spec}: sharegpt:N or store:DIR")
        for size in [int(s) for s in args.sizes.split(",")]:
            _, t2d = build_draft_vocab(counts, min(size, target.vocab_size), target.eos_token_ids)
            row = {"counts": spec, "size": size}
            for dataset, items in texts.items():
                row[dataset] = coverage(items, t2d)
            report["rows"].append(row)
            cells = "  ".join(
                f"{d} {row[d]['coverage']:.3f} (6 in a row {row[d]['next_j_all_in'][-1]:.3f})" for d in texts
            )
            print(f"{spec:>24} {size:>6}: {cells}", flush=True)
    atomic_write_json(args.output, report)
    return 0

