"""Seed `bench --replay`'s greedy-answer cache from an earlier replay result's per-prompt text.

At T = 0 the target's greedy answers do not depend on the drafter, so a replay result already
holds every answer a later replay of the same prompts needs (`per_prompt[*].methods[*].tokens`).
Regenerating them one prompt at a time costs ~20 minutes for MT-Bench + HumanEval at 128 tokens
on 2 cores; this writes them into the cache `bench --replay` reads, after checking each one
against the target here (one teacher-forced pass: an answer is cut at the first token that is not
this target's argmax, and the cut is counted; a new machine's arithmetic can break a near-tie
differently).

    python experiments/drafter-data/scripts/seed_replay_cache.py experiments/drafter-data/results/smollm2_bstar2_replay_T0_chain_6.json \\
        --dataset mtbench,humaneval --max-new-tokens 128

The cache path and the prompts are those `bench --replay` uses for the same `--dataset`,
`--limit`, `--selection` and `--max-new-tokens` (or `--replay-cache`).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any


def answers_by_prompt(result: dict[str, Any]) -> dict[tuple[str, int], list[int]]:
    """(dataset, index) -> greedy answer, refusing a result whose methods disagree on a text."""
    answers: dict[tuple[str, int], list[int]] = {}
    for entry in result["per_prompt"]:
        texts = {tuple(m["tokens"]) for m in entry["methods"].values() if "tokens" in m}
        if len(texts) != 1:
            raise ValueError(
                f"{entry['dataset']}:{entry['index']}: the methods of this result made "
                f"{len(texts)} different texts (not a T = 0 run?)"
            )
        answers[(entry["dataset"], int(entry["index"]))] = list(texts.pop())
    return answers


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("result", help="a `bench --replay` (or live T = 0) result JSON")
    parser.add_argument("--target", default="smollm2")
    parser.add_argument("--dataset", default="mtbench")
    parser.add_argument("--limit", type=int, default=None)
    parser.add_argument("--selection", default="stratified")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--replay-cache", default=None)
    args = parser.parse_args(argv)

    from lightning_spec import specs
    from lightning_spec.bench.replay import _requests, default_cache
    from lightning_spec.online.continuations import seed_continuations

    result = json.loads(Path(args.result).read_text())
    flags = result.get("config", {}).get("flags", {})
    if flags.get("temperature", 0.0) != 0 or flags.get("max_new_tokens") != args.max_new_tokens:
        print("seed_replay_cache: the result must be a T = 0 run with the same --max-new-tokens",
              file=sys.stderr)  # fmt: skip
        return 2
    answers = answers_by_prompt(result)
    target = specs.resolve_target(args.target, "fp32")
    datasets = {}
    for spec in [s for s in args.dataset.split(",") if s]:
        name, items = specs.load_prompts(spec, target.tokenizer, args.limit, args.selection)
        datasets[name] = items
    cache = args.replay_cache
    if cache is None:  # the path `bench --replay` uses for these flags
        cache = default_cache(target, datasets, args.limit, args.selection, args.max_new_tokens)
    requests = _requests(datasets)
    known = [answers.get((r.domain, r.index)) for r in requests]
    try:
        written, cut = seed_continuations(
            target, requests, known, max_new_tokens=args.max_new_tokens, cache=cache
        )
    except FileExistsError as error:
        print(f"seed_replay_cache: {error}", file=sys.stderr)
        return 2
    print(f"seeded {written} answers into {cache}: {cut} cut at a token that is not this "
          f"target's argmax, {len(requests) - written} prompts not in the result (the bench "
          "generates those)")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
