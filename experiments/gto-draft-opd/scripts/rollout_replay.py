"""Greedy rollouts decoded by the real decoder vs replayed from their continuations, side by side.

What `rollout_replay` buys Draft-OPD: the same drafter rolls out the same ShareGPT training
prompts three times in one process, alone on the cores: (1) decoded (`DecoderRolloutSource`,
a target forward per verification step), (2) replayed for the first time (one teacher-forced
target pass per text, then batched drafting; `ReplayingRolloutSource`), (3) replayed again with
the text passes cached (the drafter's work only, what a revisit under a later drafter costs).
With ``--decode-batch N`` a fourth run makes the rollouts of new prompts the way
``rollout_decode_batch`` does: the target's batched greedy answers (N at a time), then a first
replay. Every replayed step is checked against the decoded one (anchor, accepted nodes,
committed tokens); the script fails on any difference (a batched answer cut to its greedy
prefix, counted in ``cut_prompts``, must be a prefix of the decoded text).

    python experiments/gto-draft-opd/scripts/rollout_replay.py --drafter DIR --prompts 16 --tree dynamic:2,4,8 --prepack \\
        --output experiments/gto-draft-opd/results/smollm2_rollout_replay.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from lightning_spec.bench.report import write_json


def _steps(generations: list[Any]) -> list[list[tuple]]:
    return [
        [(r.anchor, r.accepted.tolist(), list(r.committed)) for r in g.records] for g in generations
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--drafter", required=True, help="drafter folder")
    parser.add_argument("--target", default="smollm2")
    parser.add_argument("--dataset", default="sharegpt")
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--skip", type=int, default=0, help="start after this many prompts")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--max-prompt-tokens", type=int, default=256)
    parser.add_argument("--tree", default="dynamic:2,4,8")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument(
        "--decode-batch", type=int, default=0, help="also time batched answers + replay (N > 0)"
    )
    parser.add_argument("--prepack", action="store_true", help="prepack target and drafter (CPU)")
    parser.add_argument("--output", type=Path)
    args = parser.parse_args(argv)

    import torch

    from lightning_spec import specs
    from lightning_spec.bench.machine import git_commit, machine_info
    from lightning_spec.data.chat import render_prompt
    from lightning_spec.data.sources import load_source
    from lightning_spec.decoding.source import DecoderRolloutSource, ReplayingRolloutSource
    from lightning_spec.metrics import tau_from_records

    torch.set_num_threads(args.threads)
    target = specs.resolve_target(args.target, "fp32")
    drafter = specs.resolve_drafter(args.drafter, target)
    if args.prepack:
        from lightning_spec.models.packed import prepack_where_possible

        prepack_where_possible({"target": target.model, "drafter": drafter}, who="rollout_replay")
    source = load_source(args.dataset, limit=args.skip + 4 * args.prompts)
    prompts = []
    for messages in source.prompts()[args.skip :]:
        ids = render_prompt(target.tokenizer, messages)
        if len(ids) <= args.max_prompt_tokens:
            prompts.append(ids)
        if len(prompts) == args.prompts:
            break
    options = {"tree": args.tree, "max_new_tokens": args.max_new_tokens}
    runs: dict[str, dict[str, float]] = {}
    decoded = DecoderRolloutSource(target, **options).generate(drafter, prompts)
    runs["decoded"] = {}
    tic = time.perf_counter()
    decoded = DecoderRolloutSource(target, **options).generate(drafter, prompts)
    runs["decoded"]["seconds"] = time.perf_counter() - tic
    replaying = ReplayingRolloutSource(target, **options)
    replaying.load_state_dict(
        {"continuations": [[p, g.tokens] for p, g in zip(prompts, decoded, strict=True)]}
    )
    for name in ("replayed", "replayed_cached"):
        tic = time.perf_counter()
        generations = replaying.generate(drafter, prompts)
        runs[name] = {"seconds": time.perf_counter() - tic}
        if _steps(generations) != _steps(decoded):
            print(f"rollout_replay: {name} differs from the decoded rollouts", file=sys.stderr)
            return 1
    cut = 0
    if args.decode_batch > 0:
        batched = ReplayingRolloutSource(target, decode_batch_size=args.decode_batch, **options)
        tic = time.perf_counter()
        generations = batched.generate(drafter, prompts)
        runs["batched_replayed"] = {"seconds": time.perf_counter() - tic}
        for mine, theirs in zip(generations, decoded, strict=True):
            whole = mine.tokens == theirs.tokens
            cut += not whole
            if (whole and _steps([mine]) != _steps([theirs])) or (
                not whole and theirs.tokens[: len(mine.tokens)] != mine.tokens
            ):
                print(
                    "rollout_replay: a batched rollout differs from the decoded one",
                    file=sys.stderr,
                )
                return 1
    tokens = sum(len(g.tokens) for g in decoded)
    steps = sum(len(g.records) for g in decoded)
    for run in runs.values():
        run["tokens_per_s"] = tokens / run["seconds"]
        run["speedup_vs_decoded"] = runs["decoded"]["seconds"] / run["seconds"]
    result = {
        "commit": git_commit(),
        "machine": machine_info(),
        "drafter": args.drafter,
        "tree": args.tree,
        "prompts": len(prompts),
        "prompt_tokens_mean": sum(map(len, prompts)) / len(prompts),
        "new_tokens": tokens,
        "verification_steps": steps,
        "tau": tau_from_records([r for g in decoded for r in g.records]),
        "records_equal": True,
        "cut_prompts": cut,
        "runs": runs,
        "command": "python experiments/gto-draft-opd/scripts/rollout_replay.py " + " ".join(argv or sys.argv[1:]),
    }
    print(json.dumps(result["runs"], indent=1))
    if args.output:
        write_json(args.output, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
