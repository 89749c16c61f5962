"""Target-feature tokens per second on this CPU, and what a cheaper dtype costs in accuracy.

An EAGLE-3 step on a CPU is dominated by the frozen target's forward over the batch (the
features and the final hidden state the labels come from), so a feature token's price sets how
much unique data a CPU-hour buys (issue 55, deliver 2). This runs that forward exactly as
`EagleSFT._target_outputs` does (`output_features=True, logits_to_keep=1`), on real ShareGPT
text, for each setting named, in one process, rotating the settings so drift in the machine's
speed hits all of them alike, and reports:

* tokens/s (padded tokens of [batch, length] inputs; the step trains on these),
* the setting's feature error against fp32: relative L2 error of the fused features and of the
  final hidden state, and the agreement of the target's argmax (the hard label) with fp32's.

    python bench/feature_throughput.py --settings fp32,fp32-prepack,bf16 --batch 4,8 \
        --length 256 --repeats 3 --output runs/bench/smollm2_feature_throughput.json
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from lightning_spec.bench.machine import cpu_flags
from lightning_spec.bench.texts import sharegpt_rows
from lightning_spec.data.assets import default_target_path
from lightning_spec.models.target import TargetModel


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


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
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


if __name__ == "__main__":
    main()
