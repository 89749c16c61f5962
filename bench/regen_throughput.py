"""Regeneration throughput: the target's greedy answers to training prompts, tokens/s and fidelity.

Training on the target's own answers (mode `regenerated`) aligns a drafter with the text it will
be verified on, but a greedy answer costs a whole decode, so its price per token decides how much
of it a CPU-hour buys (issue 55, deliver 3). This answers the same ShareGPT prompts with our
batched loop (`data.regenerate.greedy_answers`, HF `generate` with left padding) at each batch
size and target setting asked (fp32 as loaded, or its linears prepacked for oneDNN), in one
process, and checks every answer against the target's own greedy output, decoded one prompt at a
time by the unpacked fp32 target: the share of answers that are identical, and the share of
tokens before the first difference (batched arithmetic breaks near-ties differently: such
differences are fine for training data but are counted).

    python bench/regen_throughput.py --prompts 64 --max-new-tokens 128 --batch 16,32,64 \
        --settings fp32,fp32-prepack --output experiments/drafter-data/results/smollm2_regen_throughput.json
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from lightning_spec.bench.machine import git_commit, machine_info
from lightning_spec.data.assets import default_target_path
from lightning_spec.data.chat import render_prompt
from lightning_spec.data.regenerate import greedy_answers
from lightning_spec.data.sources import load_source
from lightning_spec.models.target import TargetModel


def _prompts(tokenizer, count: int, max_prompt_tokens: int) -> list[list[int]]:
    """The first `count` ShareGPT prompts (system + first user turn, chat template) that fit."""
    prompts: list[list[int]] = []
    for conversation in load_source("sharegpt", limit=20 * count):
        ids = render_prompt(tokenizer, conversation.prompt())
        if 0 < len(ids) <= max_prompt_tokens:
            prompts.append(list(ids))
        if len(prompts) == count:
            return prompts
    raise RuntimeError(f"only {len(prompts)} ShareGPT prompts fit in {max_prompt_tokens} tokens")


def fidelity(answers: list[list[int]], reference: list[list[int]]) -> dict[str, float]:
    """Identical answers, and tokens before the first difference, as shares of the reference."""
    same = sum(a == r for a, r in zip(answers, reference, strict=True))
    agreed = 0
    for a, r in zip(answers, reference, strict=True):
        k = 0
        while k < min(len(a), len(r)) and a[k] == r[k]:
            k += 1
        agreed += k
    total = sum(len(r) for r in reference)
    return {"identical": same / len(reference), "token_prefix_agreement": agreed / max(total, 1)}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--max-prompt-tokens", type=int, default=320)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--batch", default="16,32,64")
    parser.add_argument("--settings", default="fp32,fp32-prepack")
    parser.add_argument("--output", type=Path, default=None)
    args = parser.parse_args(argv)
    machine = machine_info()
    path = default_target_path()
    plain = TargetModel.from_pretrained(path, dtype="float32")
    prompts = _prompts(plain.tokenizer, args.prompts, args.max_prompt_tokens)

    start = time.perf_counter()
    reference = greedy_answers(plain, prompts, max_new_tokens=args.max_new_tokens, batch_size=1)
    reference_s = time.perf_counter() - start
    reference_tokens = sum(len(a) for a in reference)
    rows = [{"setting": "fp32", "batch": 1, "seconds": reference_s, "new_tokens": reference_tokens,
             "tokens_per_s": reference_tokens / reference_s, "identical": 1.0,
             "token_prefix_agreement": 1.0}]
    print(f"reference (fp32, one at a time): {reference_tokens / reference_s:.1f} tokens/s", flush=True)
    for setting in args.settings.split(","):
        target = plain
        if setting == "fp32-prepack":
            from lightning_spec.models.packed import prepack_linears

            target = TargetModel.from_pretrained(path, dtype="float32")
            prepack_linears(target.model)
        elif setting != "fp32":
            raise ValueError(f"unknown setting {setting!r}: fp32 or fp32-prepack")
        for batch in (int(b) for b in args.batch.split(",")):
            start = time.perf_counter()
            answers = greedy_answers(
                target, prompts, max_new_tokens=args.max_new_tokens, batch_size=batch
            )
            seconds = time.perf_counter() - start
            new_tokens = sum(len(a) for a in answers)
            row = {"setting": setting, "batch": batch, "seconds": seconds,
                   "new_tokens": new_tokens, "tokens_per_s": new_tokens / seconds,
                   **fidelity(answers, reference)}
            rows.append(row)
            print(f"{setting} batch {batch}: {row['tokens_per_s']:.1f} tokens/s, identical "
                  f"{row['identical']:.3f}, prefix agreement {row['token_prefix_agreement']:.3f}",
                  flush=True)
    result = {"argv": argv, "prompts": len(prompts), "max_new_tokens": args.max_new_tokens,
              "commit": git_commit(), "machine": machine, "rows": rows}
    if args.output:
        args.output.write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
