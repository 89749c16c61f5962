"""llama.cpp plain vs llama.cpp + our EAGLE-3 drafter vs llama.cpp's own speculation, one run.

    lightning-spec bench llamacpp --drafter DIR --target-types f32,q8_0,q4_1 \
        --dataset mtbench,humaneval --limit 40 --max-new-tokens 64 --n-max 2,3,4 \
        --ours --output runs/bench/llamacpp.json

Builds llama.cpp once into the cache (`lightning_spec.tools.llamacpp`), exports the drafter to
GGUF and the target at each weight type (`export --format gguf`), measures llama.cpp's own
cost curve (``llama-bench``: one forward of b tokens), then serves every prompt through every
mode (`lightning_spec.bench.llamacpp`) and reports per target type: tok/s, speedup over plain
llama.cpp with a paired bootstrap interval over prompts, llama.cpp's acceptance and tau,
greedy mismatches against plain and against self-drafting, and the ceiling the cost curve
allows at the measured tau (tau x t(1) / t(K + 1): verification cost only, the drafter free).
With ``--ours``, our own decoder runs the same drafter on the same prompt ids under
``chain:K`` (PyTorch, f32), so acceptance can be compared across engines.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from lightning_spec.bench.engines import (
    engine_drafter,
    engine_prompts,
    ours_tau,
    ours_tau_interval,
    pick_chain,
    summarize,
    verifications,
)
from lightning_spec.bench.llamacpp import NGRAM_TYPES, mode_args, run_modes
from lightning_spec.data.assets import cache_root
from lightning_spec.export.gguf_package import export_gguf_package
from lightning_spec.io import atomic_write_json, sha256_file
from lightning_spec.tools.llamacpp import ensure_llamacpp

AUTO_DEPTH = 6  # --n-max auto: our per-depth acceptance from chain:6, picks within 1 .. 6


def _csv(text: str) -> list[str]:
    return [part.strip() for part in text.split(",") if part.strip()]


def cost_curve(bench_binary: Path, target_gguf: Path, sizes: list[int], threads: int) -> dict[int, float]:
    """Seconds per target forward of b tokens (llama-bench prompt processing, 3 repeats)."""
    result = subprocess.run(
        [str(bench_binary), "-m", str(target_gguf), "-p", ",".join(map(str, sizes)), "-n", "0",
         "-t", str(threads), "-r", "3", "-o", "json"],
        check=True, capture_output=True, text=True,
    )
    curve = {}
    for entry in json.loads(result.stdout):
        size = int(entry["n_prompt"])
        curve[size] = size / float(entry["avg_ts"])
    return curve


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="lightning-spec bench llamacpp", description=__doc__.split("\n\n")[0])
    parser.add_argument("--drafter", type=Path, required=True)
    parser.add_argument("--target", default=None, help="default: the drafter's target")
    parser.add_argument("--target-types", default="f32", help="comma list of f32,f16,q8_0,q4_1")
    parser.add_argument("--dataset", default="mtbench,humaneval")
    parser.add_argument("--limit", type=int, default=40, help="prompts per dataset")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument(
        "--n-max", default="4",
        help="chain lengths (comma list), or auto: the pick of llama.cpp's cost curve x our "
        "per-depth acceptance (needs --ours), measured with its neighbours",
    )
    parser.add_argument("--p-min", type=float, default=0.0)
    parser.add_argument(
        "--modes", default="plain,eagle3,self," + ",".join(NGRAM_TYPES[:3]),
        help="plain, eagle3, self and ngram spec types",
    )
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--ours", action="store_true", help="our decoder's tau at chain:K too")
    parser.add_argument(
        "--ours-from", type=Path, default=None,
        help="reuse the 'ours' section of an earlier report of this bench (same drafter, "
        "prompts and length) instead of decoding again",
    )
    parser.add_argument("--workdir", type=Path, default=None)
    parser.add_argument("--output", type=Path, required=True)
    args = parser.parse_args(argv)
    auto = args.n_max == "auto"
    if auto and not (args.ours or args.ours_from):
        parser.error("--n-max auto needs --ours or --ours-from (our decoder's per-depth acceptance)")
    try:  # before anything long: the paths llama.cpp's tools get are absolute and load
        drafter, config = engine_drafter(args.drafter, "llama.cpp")
    except ValueError as error:
        parser.error(str(error))
    method = config.get("drafter_type", "eagle3")
    target = args.target or config.get("target_model") or "smollm2"
    drafter_sha = sha256_file(drafter / "model.safetensors")
    workdir = (args.workdir or cache_root() / "llamacpp" / "exports" / drafter_sha[:16]).expanduser().resolve()
    output = args.output.expanduser().resolve()
    built = ensure_llamacpp()
    prompts, origin = engine_prompts(target, args.dataset, args.limit)
    n_maxes = [AUTO_DEPTH] if auto else [int(k) for k in _csv(args.n_max)]
    report: dict[str, Any] = {
        "command": " ".join([sys.executable, *sys.argv]),
        "drafter": str(drafter), "drafter_sha256": drafter_sha, "method": method,
        "llamacpp": built.version, "threads": args.threads, "prompts": len(prompts),
        "datasets": _csv(args.dataset), "max_new_tokens": args.max_new_tokens,
        "p_min": args.p_min, "per_type": {},
    }
    if args.ours_from is not None:
        earlier = json.loads(args.ours_from.read_text())
        same = (earlier.get("drafter_sha256") == drafter_sha and earlier.get("prompts") == len(prompts)
                and earlier.get("max_new_tokens") == args.max_new_tokens
                and earlier.get("datasets") == _csv(args.dataset))  # fmt: skip
        if not same or "ours" not in earlier:
            parser.error(f"--ours-from {args.ours_from}: not a report of this drafter, prompt set and length")
        report["ours"] = earlier["ours"]
        report["ours_from"] = str(args.ours_from)
    # the drafter and target exported first (minutes at most): a drafter llama.cpp cannot take
    # fails here, not after our decoder's side of the bench (`--ours`)
    packages = {
        ttype: export_gguf_package(
            drafter, workdir, target=target, with_target=ttype, outtype="f32", reuse_target=True
        )
        for ttype in _csv(args.target_types)
    }
    if args.ours_from is None and args.ours:
        report["ours"] = {}
        for k in n_maxes:
            tic = time.perf_counter()
            ours = ours_tau(drafter, target, prompts, k, args.max_new_tokens)
            ours["seconds"] = time.perf_counter() - tic
            report["ours"][f"chain:{k}"] = {key: v for key, v in ours.items() if key != "tokens"}
            print(f"[ours] chain:{k} tau {ours['tau']:.3f}", flush=True)
    for ttype, package in packages.items():
        target_gguf = workdir / package["files"]["target"]["path"]
        drafter_gguf = workdir / package["files"]["drafter"]["path"]
        curve = cost_curve(built.binary("llama-bench"), target_gguf, list(range(1, max(n_maxes) + 2)), args.threads)
        chains = n_maxes
        pick = None
        if auto:
            alphas = report["ours"][f"chain:{AUTO_DEPTH}"]["alphas"]
            # before measuring: a drafted token costs what its share of the weights' bytes does
            estimate = curve[1] * drafter_gguf.stat().st_size / target_gguf.stat().st_size
            pick = pick_chain(alphas, curve, estimate, max_k=AUTO_DEPTH)
            best = int(pick["n_max"])
            chains = sorted({k for k in (best - 1, best, best + 1) if 1 <= k <= AUTO_DEPTH})
        modes = []
        for name in _csv(args.modes):
            if name in ("eagle3", "dflash", "self"):
                kind = name if name == "self" else method  # "eagle3" in --modes: the drafter's own type
                modes += [mode_args(kind, drafter_gguf=drafter_gguf, target_gguf=target_gguf, n_max=k, p_min=args.p_min) for k in chains]
            else:
                modes.append(mode_args(name))
        log_dir = output.parent / f"{output.stem}-logs-{ttype}"
        log_dir.mkdir(parents=True, exist_ok=True)
        results = run_modes(
            built.binary("llama-server"), target_gguf, modes, prompts,
            max_new_tokens=args.max_new_tokens, threads=args.threads, log_dir=log_dir,
        )
        reference = next((m.name for m in modes if m.name.startswith("self@")), None)
        rows = summarize(results, reference=reference)
        by_dataset = {}
        for dataset in dict.fromkeys(origin):
            keep = [i for i, o in enumerate(origin) if o == dataset]
            by_dataset[dataset] = summarize(
                {m: [r[i] for i in keep] for m, r in results.items()}, reference=reference
            )
        for name, row in rows.items():
            k = int(name.split("@")[1]) if "@" in name else None
            if k is not None and row.get("tau"):
                row["ceiling"] = row["tau"] * curve[1] / curve[k + 1]
            ours = report.get("ours", {}).get(f"chain:{k}")
            if name.startswith(f"{method}@") and ours and "accepted_lengths" in ours:
                # llama.cpp reports totals, not positions: parity on tau, our interval over prompts
                row["ours_tau_ci"] = ours_tau_interval(ours["accepted_lengths"])
                low, high = row["ours_tau_ci"]["tau_ci"]
                row["parity_tau"] = row["tau"] is not None and low <= row["tau"] <= high
        if pick is not None:
            # the drafter's measured cost per drafted token: decode time not spent verifying
            measured = []
            for k in chains:
                row = rows[f"{method}@{k}"]
                items = results[f"{method}@{k}"]
                verify = sum(verifications(r) for r in items) * curve[k + 1]
                if row["drafted"]:
                    measured.append(max(sum(r.seconds for r in items) - verify, 0.0) / row["drafted"])
            pick["measured_draft_cost"] = sum(measured) / len(measured) if measured else None
            if pick["measured_draft_cost"] is not None:
                again = pick_chain(alphas, curve, pick["measured_draft_cost"], max_k=AUTO_DEPTH)
                pick["n_max_with_measured_cost"] = again["n_max"]
                pick["predicted_speedup_with_measured_cost"] = again["predicted_speedup"]
        report["per_type"][ttype] = {
            "chain_pick": pick,
            "target_gguf_sha256": package["files"]["target"]["sha256"],
            "drafter_gguf_sha256": package["files"]["drafter"]["sha256"],
            "cost_seconds": {str(b): s for b, s in curve.items()},
            "rows": rows,
            "by_dataset": by_dataset,
            "tokens": {m: [r.tokens for r in rs] for m, rs in results.items()},
        }
        for name, row in rows.items():
            print(
                f"[{ttype}] {name:>16}: {row['tok_per_s'] or 0:7.1f} tok/s  x{row.get('speedup') or 1:.3f} "
                f"{row.get('speedup_ci') or ''}  tau {row['tau'] or 0:.3f}  "
                f"acc {row['acceptance'] if row['acceptance'] is not None else '-'}  "
                f"mm/plain {row.get('mismatches_vs_plain', '-')}  mm/self {row.get('mismatches_vs_self', '-')}"
                + (f"  ours {row['ours_tau_ci']['tau']:.3f} {row['ours_tau_ci']['tau_ci']} parity {row['parity_tau']}"
                   if "parity_tau" in row else ""),
                flush=True,
            )
        atomic_write_json(output, report)
    digest = hashlib.sha256(output.read_bytes()).hexdigest()[:12]
    print(f"wrote {output} ({digest})")
    return 0

