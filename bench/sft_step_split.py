"""Where an EAGLE-3 SFT step with streamed target features spends its time on this CPU.

With no feature store the frozen target runs inside every training step, so a step is the
target's forward (the features and final hidden states of the batch) plus the drafter's TTT
forward, backward and AdamW update. Which half dominates decides what to make cheaper (issue 55,
deliver 2): this times both on real ShareGPT text at the batch of `configs/bstar_stream.yaml`,
for the target fp32 or prepacked and the drafter's step in fp32 or under bf16 autocast (the
trainer's `bf16-mixed`; the target stays fp32), at each TTT depth asked, in one process.

    python bench/sft_step_split.py --batch 4 --length 512 --ttt 2,3 --repeats 3 \
        --output experiments/drafter-data/results/smollm2_sft_step_split.json
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from lightning_spec.bench.machine import machine_info
from lightning_spec.bench.texts import sharegpt_rows
from lightning_spec.objectives.sft import EagleSFT


def _batch(tokenizer, batch: int, length: int) -> dict[str, torch.Tensor]:
    """[batch, length] real ShareGPT text, every token a label."""
    ids = sharegpt_rows(tokenizer, batch, length)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "loss_mask": torch.ones_like(ids)}


def _time_step(
    module: EagleSFT, optimizer: torch.optim.Optimizer, batch: dict, ttt: int, bf16: bool
) -> tuple[float, float]:
    """(target forward s, drafter step s) of one training step."""
    module.hparams.ttt_steps = ttt
    start = time.perf_counter()
    with torch.no_grad():
        features, last_hidden = module._target_outputs(batch)
    middle = time.perf_counter()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        result = module._common_step({**batch, "features": features, "last_hidden": last_hidden})
    result.loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return middle - start, time.perf_counter() - middle


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--length", type=int, default=512)
    parser.add_argument("--ttt", default="2,3")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--no-prepack", action="store_true", help="time the unpacked target")
    parser.add_argument("--output", type=Path, default=None)
    args = parser.parse_args(argv)
    machine = machine_info()
    torch.manual_seed(0)
    module = EagleSFT(
        target="smollm2", draft_vocab_size=4096, vocab_source="sharegpt",
        vocab_conversations=400, ttt_steps=3, prepack_target=not args.no_prepack,
    )
    batch = _batch(module.target.tokenizer, args.batch, args.length)
    optimizer = torch.optim.AdamW(module.drafter.parameters(), lr=1e-5)
    rows = []
    for ttt in (int(t) for t in args.ttt.split(",")):
        for bf16 in (False, True):
            _time_step(module, optimizer, batch, ttt, bf16)  # warm-up: kernels per shape
            times = [_time_step(module, optimizer, batch, ttt, bf16) for _ in range(args.repeats)]
            target_s = sorted(t[0] for t in times)[len(times) // 2]
            drafter_s = sorted(t[1] for t in times)[len(times) // 2]
            tokens = args.batch * args.length
            rows.append({
                "ttt": ttt, "drafter_bf16": bf16, "target_s": target_s, "drafter_s": drafter_s,
                "step_s": target_s + drafter_s, "tokens_per_s": tokens / (target_s + drafter_s),
            })
            print(f"TTT {ttt} drafter {'bf16' if bf16 else 'fp32'}: target {target_s:.2f} s + "
                  f"drafter {drafter_s:.2f} s = {tokens / (target_s + drafter_s):.0f} tokens/s",
                  flush=True)
    result = {"argv": argv, "batch": args.batch, "length": args.length,
              "target_prepacked": not args.no_prepack, "machine": machine, "rows": rows}
    if args.output:
        args.output.write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
