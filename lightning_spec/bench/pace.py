"""Machine pace: what one CPU-hour buys on this machine, in three measurements.

Each answers "how much unique training data does an hour of this CPU make?" from one side, in
one process, against the default target (SmolLM2):

``--what features``: target-feature tokens per second, and what a cheaper dtype costs in
accuracy. An EAGLE-3 step on a CPU is dominated by the frozen target's forward over the batch
(the features and the final hidden state the labels come from), so a feature token's price sets
how much unique data a CPU-hour buys. This runs that forward exactly as
`SFT._target_outputs` does (`output_features=True, logits_to_keep=1`), on real ShareGPT
text, for each setting named, rotating the settings so drift in the machine's speed hits all of
them alike, and reports:

* tokens/s (padded tokens of [batch, length] inputs; the step trains on these),
* the setting's feature error against fp32: relative L2 error of the fused features and of the
  final hidden state, and the agreement of the target's argmax (the hard label) with fp32's.

``--what regen``: regeneration throughput, the target's greedy answers to training prompts,
tokens/s and fidelity. Training on the target's own answers (mode `regenerated`) aligns a
drafter with the text it will be verified on, but a greedy answer costs a whole decode, so its
price per token decides how much of it a CPU-hour buys. This answers the same ShareGPT prompts
with our batched loop (`data.regenerate.greedy_answers`, HF `generate` with left padding) at
each batch size and target setting asked (fp32 as loaded, or its linears prepacked for oneDNN)
and checks every answer against the target's own greedy output, decoded one prompt at a time by
the unpacked fp32 target: the share of answers that are identical, and the share of tokens
before the first difference (batched arithmetic breaks near-ties differently: such differences
are fine for training data but are counted).

``--what sft-step``: where an EAGLE-3 SFT step with streamed target features spends its time.
With no feature store the frozen target runs inside every training step, so a step is the
target's forward (the features and final hidden states of the batch) plus the drafter's TTT
forward, backward and AdamW update. Which half dominates decides what to make cheaper: this
times both on real ShareGPT text at the streamed baseline's batch, for the target fp32 or
prepacked and the drafter's step in fp32 or under bf16 autocast (the trainer's `bf16-mixed`;
the target stays fp32), at each TTT depth asked.

    lightning-spec bench pace --what features --settings fp32,fp32-prepack,bf16 --batch 4,8 \
        --length 256 --repeats 3 --output runs/bench/smollm2_feature_throughput.json
    lightning-spec bench pace --what regen --prompts 64 --max-new-tokens 128 --batch 16,32,64 \
        --settings fp32,fp32-prepack --output runs/bench/smollm2_regen_throughput.json
    lightning-spec bench pace --what sft-step --batch 4 --length 512 --ttt 2,3 --repeats 3 \
        --output runs/bench/smollm2_sft_step_split.json

``lightning-spec bench pace --what WHAT --help`` lists one measurement's options.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

from lightning_spec.bench.machine import cpu_flags, git_commit, machine_info
from lightning_spec.bench.texts import sharegpt_rows
from lightning_spec.data.assets import default_target_path
from lightning_spec.data.chat import render_prompt
from lightning_spec.data.regenerate import greedy_answers
from lightning_spec.data.sources import load_source
from lightning_spec.models.target import TargetModel
from lightning_spec.objectives.sft import SFT

__all__ = ["WHAT", "features", "fidelity", "main", "regen", "sft_step"]


# ------------------------------------------------------------------------------ --what features
def _load(setting: str, path: Path) -> TargetModel:
    dtype = "bfloat16" if setting.startswith("bf16") else "float32"
    target = TargetModel.from_pretrained(path, dtype=dtype)
    target.model.eval()
    if setting.endswith("prepack"):
        from lightning_spec.models.packed import prepack_linears

        prepack_linears(target.model)
    return target


@torch.no_grad()
def _forward(target: TargetModel, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    out = target(
        ids,
        attention_mask=torch.ones_like(ids),
        use_cache=False,
        output_features=True,
        logits_to_keep=1,
    )
    return out.features.float(), out.last_hidden.float()


def features(argv: list[str] | None = None) -> dict:
    """`--what features`: see the module docstring."""
    parser = argparse.ArgumentParser(
        prog="lightning-spec bench pace --what features", description=WHAT["features"][1]
    )
    parser.add_argument("--settings", default="fp32,fp32-prepack,bf16")
    parser.add_argument("--batch", default="4,8")
    parser.add_argument("--length", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--output", default=None)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    settings = args.settings.split(",")
    batches = [int(b) for b in args.batch.split(",")]
    path = default_target_path()
    targets = {s: _load(s, path) for s in settings}
    tokenizer = targets[settings[0]].tokenizer
    ids = sharegpt_rows(tokenizer, max(batches), args.length)

    reference = None
    if "fp32" in settings:
        reference = _forward(targets["fp32"], ids[: batches[0]])
    errors = {}
    head = targets[settings[0]].model.get_output_embeddings()
    for s in settings:
        if reference is None:
            break
        feats, last = _forward(targets[s], ids[: batches[0]])
        ref_f, ref_h = reference
        argmax = head(last).argmax(-1)
        ref_argmax = head(ref_h).argmax(-1)
        errors[s] = {
            "features_rel_l2": float((feats - ref_f).norm() / ref_f.norm()),
            "last_hidden_rel_l2": float((last - ref_h).norm() / ref_h.norm()),
            "argmax_agreement": float((argmax == ref_argmax).float().mean()),
        }

    times: dict[tuple[str, int], list[float]] = {(s, b): [] for s in settings for b in batches}
    for s in settings:  # warm-up: oneDNN picks and caches its kernels per shape
        for b in batches:
            _forward(targets[s], ids[:b])
    for r in range(args.repeats):
        order = settings[r % len(settings) :] + settings[: r % len(settings)]
        for s in order:
            for b in batches:
                start = time.perf_counter()
                _forward(targets[s], ids[:b])
                times[(s, b)].append(time.perf_counter() - start)

    rows = []
    for (s, b), ts in times.items():
        best = sorted(ts)[len(ts) // 2]
        rows.append({"setting": s, "batch": b, "length": args.length,
                     "median_s": best, "tokens_per_s": b * args.length / best})
    result = {
        "argv": argv, "threads": args.threads, "torch": torch.__version__,
        "cpu_flags": cpu_flags(), "rows": rows, "errors_vs_fp32": errors,
    }
    for row in rows:
        print(f"{row['setting']:>14} batch {row['batch']:>3}: {row['tokens_per_s']:7.0f} tokens/s")
    for s, e in errors.items():
        print(f"{s:>14}: features rel L2 {e['features_rel_l2']:.2e}, last hidden "
              f"{e['last_hidden_rel_l2']:.2e}, argmax agreement {e['argmax_agreement']:.4f}")
    if args.output:
        Path(args.output).write_text(json.dumps(result, indent=2))
    return result


# ------------------------------------------------------------------------------ --what regen
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


def regen(argv: list[str] | None = None) -> dict:
    """`--what regen`: see the module docstring."""
    parser = argparse.ArgumentParser(
        prog="lightning-spec bench pace --what regen", description=WHAT["regen"][1]
    )
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


# ------------------------------------------------------------------------------ --what sft-step
def _batch(tokenizer, batch: int, length: int) -> dict[str, torch.Tensor]:
    """[batch, length] real ShareGPT text, every token a label."""
    ids = sharegpt_rows(tokenizer, batch, length)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "loss_mask": torch.ones_like(ids)}


def _time_step(
    module: SFT, optimizer: torch.optim.Optimizer, batch: dict, ttt: int, bf16: bool
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


def sft_step(argv: list[str] | None = None) -> dict:
    """`--what sft-step`: see the module docstring."""
    parser = argparse.ArgumentParser(
        prog="lightning-spec bench pace --what sft-step", description=WHAT["sft-step"][1]
    )
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--length", type=int, default=512)
    parser.add_argument("--ttt", default="2,3")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--no-prepack", action="store_true", help="time the unpacked target")
    parser.add_argument("--output", type=Path, default=None)
    args = parser.parse_args(argv)
    machine = machine_info()
    torch.manual_seed(0)
    module = SFT(
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


# ------------------------------------------------------------------------------ the command
WHAT: dict[str, tuple[Callable[[list[str] | None], dict], str]] = {
    "features": (
        features,
        "target-feature tokens per second, and what a cheaper dtype costs in accuracy",
    ),
    "regen": (
        regen,
        "regeneration throughput: the target's greedy answers, tokens/s and fidelity",
    ),
    "sft-step": (
        sft_step,
        "where an EAGLE-3 SFT step with streamed target features spends its time",
    ),
}


def main(argv: list[str] | None = None) -> int:
    """`lightning-spec bench pace --what WHAT [that measurement's options]`."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(
        prog="lightning-spec bench pace",
        description=__doc__.split("\n\n")[0],
        epilog="measurements:\n"
        + "\n".join(f"  {name:<9} {text}" for name, (_, text) in WHAT.items())
        + "\n\n`--what WHAT --help` lists that measurement's options.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        add_help=False,
        allow_abbrev=False,
    )
    parser.add_argument("--what", choices=WHAT, help="which measurement")
    parser.add_argument("-h", "--help", action="store_true", help="show this help and exit")
    known, rest = parser.parse_known_args(argv)
    if known.what is None:
        if known.help:
            parser.print_help()
            return 0
        parser.error("--what is required: " + ", ".join(WHAT))
    WHAT[known.what][0](["--help", *rest] if known.help else rest)
    return 0
