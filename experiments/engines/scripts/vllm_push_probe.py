"""Can a running vLLM engine (its CPU build) take a new drafter without a restart, losslessly?

    python experiments/engines/scripts/vllm_push_probe.py --drafter DIR --other DIR2 --prompts 8 \
        --output experiments/engines/results/vllm_push_probe.json

One engine serves `--drafter` (EAGLE-3, K drafts a step); between rounds of the same prompts it
is pushed, in order: the same drafter, `--other`, the first drafter again, a truncated file and a
NaN drafter (both must be refused with the engine untouched). Every round's replies are compared
with vLLM plain's (a separate engine), and its per-request, per-step acceptance with the round
that served the same drafter before: the push changes what is drafted, never what is output.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

from lightning_spec.bench.engines import engine_prompts
from lightning_spec.bench.vllm import run_vllm, target_folder, to_prompt_results, vllm_mode
from lightning_spec.io import atomic_write_json, sha256_file
from lightning_spec.online.engines import PushFailed
from lightning_spec.online.vllm_engine import VllmOnlineEngine
from lightning_spec.tools.vllm import ensure_vllm


def tau(results: list[Any]) -> float:
    steps = sum(len(r.meta["accepted_lengths"]) for r in results)
    return (sum(r.accepted for r in results) + steps) / steps if steps else float("nan")


def broken_copies(drafter: Path, root: Path) -> dict[str, Path]:
    """A truncated copy (a writer killed mid-write) and a NaN copy of `drafter`."""
    from safetensors.torch import load_file, save_file

    truncated = root / "truncated"
    shutil.copytree(drafter, truncated)
    weights = truncated / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    nan = root / "nan"
    shutil.copytree(drafter, nan)
    state = load_file(str(nan / "model.safetensors"))
    name = next(n for n, t in state.items() if t.is_floating_point())
    state[name] = state[name].clone().fill_(float("nan"))
    save_file(state, str(nan / "model.safetensors"))
    return {"truncated": truncated, "nan": nan}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--drafter", type=Path, required=True)
    parser.add_argument("--other", type=Path, required=True, help="a second drafter of the same shapes")
    parser.add_argument("--target", default="smollm2")
    parser.add_argument("--dataset", default="mtbench")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--k", type=int, default=3)
    parser.add_argument("--output", type=Path, required=True)
    args = parser.parse_args(argv)

    env = ensure_vllm()
    folder = target_folder(args.target)
    prompts, _ = engine_prompts(args.target, args.dataset, args.prompts)
    logs = args.output.parent / f"{args.output.stem}-logs"
    logs.mkdir(parents=True, exist_ok=True)
    plain = to_prompt_results(
        run_vllm(env, folder, [vllm_mode("plain")], prompts, max_new_tokens=args.max_new_tokens,
                 log=logs / "plain.log")
    )["plain"]  # fmt: skip
    reference = [r.tokens for r in plain]
    rounds: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="vllm-push-") as tmp:
        bad = broken_copies(args.drafter, Path(tmp))
        pushes = [("same", args.drafter), ("other", args.other), ("back", args.drafter),
                  ("truncated", bad["truncated"]), ("nan", bad["nan"])]  # fmt: skip
        with VllmOnlineEngine(env, folder, args.drafter, k=args.k, log=logs / "engine.log") as engine:
            def record(label: str, push: dict[str, Any]) -> None:
                served = engine.serve(prompts, args.max_new_tokens)
                row = {
                    "round": label, "served": engine.served, **push, "tau": tau(served),
                    "mismatches_vs_plain": sum(r.tokens != ref for r, ref in zip(served, reference, strict=True)),
                    "accepted_lengths": [r.meta["accepted_lengths"] for r in served],
                }  # fmt: skip
                rounds.append(row)
                print(json.dumps({k: v for k, v in row.items() if k != "accepted_lengths"}), flush=True)

            record("start", {})
            for label, path in pushes:
                try:
                    push = {"pushed": sha256_file(path / "model.safetensors"), "seconds": engine.push(path)}
                except PushFailed as error:
                    push = {"refused": str(error)}
                record(label, push)
    expected = sha256_file(args.drafter / "model.safetensors")
    by_label = {r["round"]: r for r in rounds}
    # drafts are compared request by request, step by step: pooled tau can coincide by chance
    # (two drafters of similar strength gave the same total steps on 8 prompts here)
    drafts = {label: row["accepted_lengths"] for label, row in by_label.items()}
    verdict = {
        "lossless": all(r["mismatches_vs_plain"] == 0 for r in rounds),
        "same_push_keeps_drafts": drafts["same"] == drafts["start"],
        "other_changes_drafts": drafts["other"] != drafts["start"],
        "back_restores_drafts": drafts["back"] == drafts["start"],
        "bad_files_refused": all("refused" in by_label[x] and by_label[x]["served"] == expected
                                 and drafts[x] == drafts["start"] for x in ("truncated", "nan")),
    }  # fmt: skip
    atomic_write_json(args.output, {"command": " ".join([sys.executable, *sys.argv]),
                                    "rounds": rounds, "verdict": verdict})  # fmt: skip
    print(json.dumps(verdict))
    return 0 if all(verdict.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
