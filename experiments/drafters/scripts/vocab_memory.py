"""Peak memory of an EAGLE-3 SFT step against the target's vocabulary size (issue 19).

Today's families have 128k-262k vocabularies. A training step that materialised the target's
full logits [B, T, V] would need B * T * V * 4 bytes for them alone (4 GB at 4 x 1024 tokens and
262k); ours applies only the LM head's draft-vocabulary rows for the labels and takes the
full-vocabulary argmax in chunks (`TargetModel.head_argmax`), and the drafter shares the
target's embeddings instead of holding a copy. This script measures, in a fresh process per
vocabulary size, the peak resident memory a forward + backward step adds on top of the loaded
models, for a tiny stress target (`lightning_spec.models.tiny.stress_target`, hidden 32) and
on both data paths (the target run in the step, and cached features).

    python experiments/drafters/scripts/vocab_memory.py --vocab 49152 --vocab 131072 --vocab 262144 \
        --tokens 1024 --batch 4 --output experiments/drafters/results/vocab_memory.json
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
from pathlib import Path

from lightning_spec.bench.report import write_json


def _status_mb(key: str) -> float:
    """A /proc/self/status memory field (VmRSS: now, VmHWM: the peak), in MB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(f"{key}:"):
            return float(line.split()[1]) / 1024.0
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def _reset_peak() -> None:
    """Start VmHWM afresh (Linux: writing 5 to clear_refs), so building the models does not
    count as the step's peak."""
    Path("/proc/self/clear_refs").write_text("5")


PATHS = ("full logits", "chunked", "cached")


def measure(vocab: int, batch: int, tokens: int, draft_vocab: int, path: str) -> dict:
    """One configuration, in this process: the step's peak minus the memory before it.

    ``full logits`` is the step as it was before issue 19 (the target's [B, T, V] logits, then
    the draft-vocabulary softmax and the argmax over them), kept here as the reference;
    ``chunked`` is `SFT`'s step with the target run in it; ``cached`` reads the features,
    final hidden states and argmax from the feature cache.
    """
    import torch

    from lightning_spec.models.drafters.eagle3 import Eagle3Drafter
    from lightning_spec.models.tiny import stress_target
    from lightning_spec.objectives import losses
    from lightning_spec.objectives.sft import SFT
    from lightning_spec.objectives.ttt import draft_vocab_ids, eagle_ttt_losses

    torch.set_num_threads(1)
    target = stress_target("llama", vocab_size=vocab, hidden_peak=10.0)
    drafter = Eagle3Drafter.from_target(
        target, draft_vocab_size=draft_vocab, token_counts=torch.arange(vocab).flip(0)
    )
    module = SFT.from_objects(target, drafter, ttt_steps=3, lr=1e-3, warmup_steps=1)
    ids = torch.randint(4, vocab, (batch, tokens), generator=torch.Generator().manual_seed(0))
    step = {"input_ids": ids, "loss_mask": torch.ones_like(ids)}
    if path == "cached":
        with torch.no_grad():
            out = target(ids, use_cache=False, logits_to_keep=1)
        step |= {
            "features": out.features,
            "last_hidden": out.last_hidden,
            "target_argmax": target.head_argmax(out.last_hidden),
        }
        del out
    before = _status_mb("VmRSS")
    _reset_peak()
    if path == "full logits":
        with torch.no_grad():
            out = target(ids, use_cache=False)
            rows = out.logits[:, 1:]
            labels = losses.restrict_to_draft_vocab(
                target_logits=rows, draft_ids=draft_vocab_ids(drafter)
            )
            probs, argmax = torch.softmax(labels.float(), dim=-1), rows.argmax(dim=-1)
            features = out.features
            del out, rows, labels
        loss = eagle_ttt_losses(
            drafter, input_ids=ids, features=features, target_probs=probs,
            target_argmax=argmax, loss_mask=step["loss_mask"], steps=3, decay=1.0,
        ).loss  # fmt: skip
    else:
        loss = module._common_step(step).loss
    loss.backward()
    peak = _status_mb("VmHWM")
    return {
        "vocab": vocab,
        "batch": batch,
        "tokens": tokens,
        "draft_vocab": draft_vocab,
        "path": path,
        "models_mb": round(before, 1),
        "step_peak_mb": round(peak - before, 1),
        "full_logits_mb": round(batch * tokens * vocab * 4 / 2**20, 1),
        "drafter_embedding_copy_mb": round(vocab * target.hidden_size * 4 / 2**20, 1),
        "loss_finite": bool(torch.isfinite(loss)),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab", type=int, action="append", help="repeatable")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--draft-vocab", type=int, default=32768)
    parser.add_argument("--output", type=Path)
    parser.add_argument("--child", nargs=2, metavar=("VOCAB", "PATH"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        vocab, path = int(args.child[0]), PATHS[int(args.child[1])]
        row = measure(vocab, args.batch, args.tokens, min(args.draft_vocab, vocab), path)
        print(json.dumps(row))
        return 0
    rows = []
    for vocab in args.vocab or [49152, 131072, 262144]:
        for index in range(len(PATHS)):
            # A fresh process per configuration: nothing freed by one is reused by the next.
            command = [
                sys.executable, __file__, "--child", str(vocab), str(index),
                "--batch", str(args.batch), "--tokens", str(args.tokens),
                "--draft-vocab", str(args.draft_vocab),
            ]  # fmt: skip
            done = subprocess.run(command, capture_output=True, text=True, check=True)
            row = json.loads(done.stdout.strip().splitlines()[-1])
            rows.append(row)
            print(
                f"V={row['vocab']:>6} {row['path']:<12} step peak {row['step_peak_mb']:>7.1f} MB"
                f" (full logits would be {row['full_logits_mb']:.0f} MB), models "
                f"{row['models_mb']:.0f} MB, finite={row['loss_finite']}",
                flush=True,
            )
    if args.output:
        write_json(args.output, {"command": sys.argv, "rows": rows}, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
