"""An engine's replies against a stream's cached greedy answers, request by request.

    lightning-spec bench vllm --drafter DIR --dataset STREAM_SUBSET.jsonl --limit N --k "" \
        --ngram-k "" --output runs/plain.json                       # vLLM plain only
    python experiments/onlinespec/scripts/engine_vs_greedy.py --bench runs/plain.json \
        --stream STREAM_SUBSET.jsonl --answers runs/online_domain/continuations.jsonl

`online --engine vllm` checks every served reply against the target's greedy answer (the
stream's replay cache, `serving.continuations`); this says whether the engine's own plain
decoding gives that same answer, so "equal to the greedy answer" and "equal to vLLM plain"
are one statement on the requests checked. The bench's prompts are the stream file's in order
(`specs.load_prompts` keeps a one-category JSONL's order), so reply i is request i's.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from lightning_spec.io import atomic_write_json
from lightning_spec.online.loop import matches_greedy


def cached_answers(path: Path) -> dict[str, list[int]]:
    """Request id -> greedy answer tokens from a continuations file (its header skipped)."""
    answers: dict[str, list[int]] = {}
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        row = json.loads(line)
        if not row.get("header"):
            answers[str(row["id"])] = [int(t) for t in row["tokens"]]
    return answers


def compare(replies: dict[str, list[list[int]]], ids: list[str], answers: dict[str, list[int]]) -> dict[str, Any]:
    """Per mode: requests checked, replies that differ from the cached answer, the first few ids."""
    out: dict[str, Any] = {}
    for mode, tokens in replies.items():
        if len(tokens) != len(ids):
            raise ValueError(f"mode {mode}: {len(tokens)} replies for {len(ids)} stream requests")
        known = [(i, t) for i, t in zip(ids, tokens, strict=True) if i in answers]
        differ = [i for i, t in known if not matches_greedy(t, answers[i])]
        out[mode] = {"checked": len(known), "mismatches": len(differ), "first": differ[:5]}
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--bench", type=Path, required=True, help="a `lightning-spec bench vllm` output")
    parser.add_argument("--stream", type=Path, required=True, help="the JSONL the bench served")
    parser.add_argument("--answers", type=Path, required=True, help="the stream's replay cache")
    parser.add_argument("--output", type=Path, default=None)
    args = parser.parse_args(argv)
    for path in (args.bench, args.stream, args.answers):
        if not path.is_file():
            parser.error(f"{path} does not exist")
    ids = [str(json.loads(line)["id"]) for line in args.stream.read_text().splitlines() if line.strip()]
    bench = json.loads(args.bench.read_text())
    if "tokens" not in bench:
        parser.error(f"{args.bench} has no per-prompt tokens: not a `lightning-spec bench vllm` output")
    ids = ids[: bench.get("prompts", len(ids))]
    result = {"command": " ".join([sys.executable, *sys.argv]), "bench": str(args.bench),
              "modes": compare(bench["tokens"], ids, cached_answers(args.answers))}  # fmt: skip
    for mode, row in result["modes"].items():
        print(f"{mode}: {row['mismatches']} of {row['checked']} replies differ from the cached greedy answer")
    if args.output:
        atomic_write_json(args.output, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
