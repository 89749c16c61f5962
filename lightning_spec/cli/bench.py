"""`lightning-spec bench`: acceptance length and wall-clock speedup, side by side with baselines.

The command line of `lightning_spec.bench.runner.run_bench` (the methods, the measurement rules
of docs/benchmarking.md and the meaning of tau are described there); targets, drafters, prompt sets and
trees are resolved by `lightning_spec.specs`. ``--tree auto`` calibrates first
(`lightning_spec.bench.calibrate`). The markdown table goes to stdout, ``--output`` writes the
JSON and the table beside it.

The rest of the benchmark suite are subcommands, ``lightning-spec bench NAME ...`` (`SUITE`):
each is a module of `lightning_spec.bench` with its own parser and ``main(argv)``, imported
only when named.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
import textwrap
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from lightning_spec import specs
from lightning_spec.bench.machine import git_commit, machine_info, warn_if_busy
from lightning_spec.bench.report import to_markdown, write_outputs
from lightning_spec.bench.runner import METHODS, run_bench
from lightning_spec.specs import PromptItem

__all__ = ["SUITE", "build_parser", "drafter_labels", "main"]

# name -> (module with `main(argv) -> int`, one-line help): `lightning-spec bench NAME ...`
SUITE: dict[str, tuple[str, str]] = {
    "vllm": (
        "lightning_spec.bench.vllm_bench",
        "vLLM plain vs vLLM + your drafter vs vLLM's ngram, one run (vLLM's CPU build)",
    ),
    "llamacpp": (
        "lightning_spec.bench.llamacpp_bench",
        "llama.cpp plain vs llama.cpp + your drafter vs llama.cpp's own speculation",
    ),
    "paired": (
        "lightning_spec.bench.paired_tau",
        "paired tau comparisons between the drafters of bench runs, with intervals",
    ),
    "compare": (
        "lightning_spec.bench.compare_objectives",
        "train several objectives from one drafter at an equal budget, in turn",
    ),
    "online": (
        "lightning_spec.bench.online_compare",
        "every OnlineSpec strategy on the same request stream, and their table",
    ),
    "profile": (
        "lightning_spec.bench.profile_step",
        "where one speculative-decoding step spends its time, and the machine's floor",
    ),
    "vocab": (
        "lightning_spec.bench.vocab_coverage",
        "how much of the target's greedy text a draft vocabulary of each size can draft",
    ),
    "plot": (
        "lightning_spec.bench.plot_runs",
        "one metric of several training runs over training, as a PNG",
    ),
    "kernels": (
        "lightning_spec.bench.kernels_bench",
        "the Triton tree kernels against SDPA and the references (GPU)",
    ),
    "pace": (
        "lightning_spec.bench.pace",
        "machine pace: feature, regeneration and SFT-step throughput (--what)",
    ),
    "load": (
        "lightning_spec.bench.serve_load",
        "replay a request stream against an OpenAI-compatible server at a set concurrency",
    ),
    "gpu-check": (
        "lightning_spec.bench.gpu_check",
        "fit, lossless decoding, rollouts and ONNX export on CUDA in one short check (--dry: CPU)",
    ),
}


def suite_help() -> str:
    """The suite's subcommands, one line each, for `lightning-spec bench --help`."""
    lines = ["the benchmark suite: lightning-spec bench NAME ... (NAME --help for its options)"]
    lines += [f"  {name:<9} {text}" for name, (_, text) in SUITE.items()]
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="lightning-spec bench",
        description=textwrap.fill(
            "Measure tau, per-depth acceptance and wall-clock speedup of speculative "
            "decoding against autoregressive decoding, HF generate and HF prompt lookup, "
            "interleaved per prompt.",
            width=94,
        ),
        epilog=suite_help(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--target", default="smollm2", help="smollm2, a model folder or hub id")
    parser.add_argument(
        "--drafter",
        action="append",
        default=None,
        help="drafter folder, random, self or bigram:<folder|data source>; repeat to compare "
        "several drafters in one interleaved run",
    )
    parser.add_argument(
        "--dataset",
        action="append",
        default=None,
        help="mtbench, humaneval or a .jsonl path; repeatable or comma-separated (default mtbench)",
    )
    parser.add_argument("--limit", type=int, default=None, help="prompts per dataset")
    parser.add_argument(
        "--selection",
        default="stratified",
        choices=["stratified", "first"],
        help="how --limit picks prompts: round-robin over categories, or file order",
    )
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument(
        "--tree",
        action="append",
        default=None,
        help="chain:K, dynamic:DEPTH,TOP_K,TOTAL, static:NAME, or auto (each drafter calibrated "
        "first, each at its own tree), each "
        "optionally +lookup[:MAX_NGRAM,TOKENS] (a prompt-lookup branch at T = 0); repeat to "
        "bench several trees side by side (default chain:4); auto adds the self-tuning "
        f"prompt-lookup branch {AUTO_LOOKUP!r} (see --no-lookup)",
    )
    parser.add_argument(
        "--no-lookup",
        action="store_true",
        help="--tree auto without the prompt-lookup branch (the drafter's tree only)",
    )
    parser.add_argument(
        "--calibration", default=None, help="with --tree auto: reuse a calibrate JSON"
    )
    parser.add_argument(
        "--calibrate-prompts", type=int, default=3, help="with --tree auto: acceptance probe size"
    )
    parser.add_argument(
        "--recalibrate",
        action="store_true",
        help="with --tree auto: ignore the calibration cached for this machine and drafter",
    )
    parser.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    parser.add_argument(
        "--text-format",
        default="auto",
        choices=["auto", "chat", "plain"],
        help="prompt rendering: the chat template (plain text for a base model without one), "
        "chat (a made-up role format without a template) or plain (see data.chat)",
    )
    parser.add_argument(
        "--prepack",
        action="store_true",
        help="CPU fp32: prepack the target's and drafters' linear weights for oneDNN "
        "(lightning_spec.models.packed); every method then runs on the prepacked models",
    )
    parser.add_argument("--threads", type=int, default=2, help="torch.set_num_threads (recorded)")
    parser.add_argument(
        "--methods",
        default=None,
        help=f"comma-separated subset of {','.join(METHODS)} (default: all; "
        "hf_generate_optimized only with --prepack)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--replay",
        action="store_true",
        help="T = 0, drafters only: the target's greedy answers generated once (batched, "
        "cached) and every drafter and tree replayed on them (exact tau and acceptance, no "
        "speeds; lightning_spec.bench.replay)",
    )
    parser.add_argument(
        "--replay-cache",
        default=None,
        help="with --replay: the greedy answers' JSONL (default: under the asset cache, named "
        "by the prompt sets, --limit, --selection and --max-new-tokens)",
    )
    parser.add_argument("--warmup", type=int, default=1, help="prompts run first and discarded")
    parser.add_argument("--order", default="rotate", choices=["rotate", "fixed"])
    parser.add_argument("--ignore-eos", action="store_true", help="always decode max-new-tokens")
    parser.add_argument("--prompt-lookup-num-tokens", type=int, default=10)
    parser.add_argument("--max-matching-ngram-size", type=int, default=2)
    parser.add_argument("--draft-vocab-size", type=int, default=None, help="for --drafter random")
    parser.add_argument("--bigram-limit", type=int, default=2000, help="conversations counted")
    parser.add_argument("--bootstrap", type=int, default=2000, help="bootstrap resamples")
    parser.add_argument("--output", default=None, help="JSON path; the .md goes next to it")
    parser.add_argument("--require-idle", action="store_true", help="exit 3 when the CPU is busy")
    parser.add_argument("--no-progress", action="store_true")
    return parser


def _split(values: Sequence[str] | None, default: str) -> list[str]:
    out = [part.strip() for value in (values or [default]) for part in value.split(",")]
    return [part for part in out if part]


def _drafter_label(spec: str, parts: int = 1) -> str:
    """A short method label for a --drafter value: its last `parts` path components."""
    if spec in ("random", "self"):
        return spec
    prefix, path = ("bigram:", spec.split(":", 1)[1]) if spec.startswith("bigram:") else ("", spec)
    tail = Path(path).parts[-parts:]
    return prefix + ("/".join(tail) if tail else spec)


def drafter_labels(specs: Sequence[str]) -> list[str]:
    """Unique labels for the --drafter values, as short as possible.

    Two runs' `drafter/last` folders must not collapse into one `speculative:last` method (the
    second would silently replace the first): colliding labels take more path components
    (`a/drafter/last`, `b/drafter/last`). The same drafter given twice is an error.
    """
    if len(set(specs)) != len(specs):
        raise ValueError("bench: the same --drafter was given twice")
    parts = [1] * len(specs)
    while True:
        labels = [_drafter_label(spec, n) for spec, n in zip(specs, parts, strict=True)]
        clashes = {label for label in labels if labels.count(label) > 1}
        if not clashes:
            return labels
        grown = False
        for index, label in enumerate(labels):
            if label in clashes and parts[index] < len(Path(specs[index]).parts):
                parts[index] += 1
                grown = True
        if not grown:  # e.g. `x` and `./x`: distinct strings, same components
            return [f"{label}#{i}" if label in clashes else label for i, label in enumerate(labels)]


def drafter_weights_sha256(specs: Sequence[str]) -> dict[str, str]:
    """{drafter spec: sha256 of its weights file} for every drafter given as a folder, so a
    results file names exactly which drafters it compared, after their folders are gone."""
    from lightning_spec.io import sha256_file

    out = {}
    for spec in specs:
        weights = Path(spec) / "model.safetensors"
        if weights.is_file():
            out[spec] = sha256_file(weights)
    return out


def main(argv: list[str] | None = None) -> int:
    """`lightning-spec bench`; returns 0, 1 when greedy outputs mismatched, 3 when busy and
    --require-idle was given. ``lightning-spec bench NAME ...`` runs the suite's `NAME`."""
    if argv is None:
        argv = sys.argv[1:]
    if argv and argv[0] in SUITE:
        module = importlib.import_module(SUITE[argv[0]][0])
        return int(module.main(list(argv[1:])) or 0)
    args = build_parser().parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    machine = machine_info(args.dtype)
    if warn_if_busy(machine) and args.require_idle:
        return 3
    default = [m for m in METHODS if m != "hf_generate_optimized" or args.prepack]
    methods = _split([args.methods] if args.methods else None, ",".join(default))
    dataset_specs = _split(args.dataset, "mtbench")
    drafter_specs = args.drafter or []
    if "speculative" in methods and not drafter_specs:
        print("bench: --drafter is required for the speculative method", file=sys.stderr)
        return 2
    target = specs.resolve_target(args.target, args.dtype)
    if target.tokenizer is not None:
        from lightning_spec.data.chat import set_text_format

        set_text_format(target.tokenizer, args.text_format)
    datasets: dict[str, list[PromptItem]] = {}
    for spec in dataset_specs:
        name, items = specs.load_prompts(spec, target.tokenizer, args.limit, args.selection)
        datasets[name] = items
    drafters = {}
    if "speculative" in methods:
        try:
            labels = drafter_labels(drafter_specs)
        except ValueError as error:
            print(error, file=sys.stderr)
            return 2
        for label, spec in zip(labels, drafter_specs, strict=True):
            drafters[label] = specs.resolve_drafter(
                spec,
                target,
                draft_vocab_size=args.draft_vocab_size,
                bigram_limit=args.bigram_limit,
                seed=args.seed,
            )
    prepacked: dict[str, Any] = {}
    if args.prepack:
        from lightning_spec.models.packed import prepack_where_possible

        prepacked = prepack_where_possible({"target": target.model, **drafters}, who="bench")
        if "target" not in prepacked and not args.methods and "hf_generate_optimized" in methods:
            methods.remove("hf_generate_optimized")  # nothing optimised to compare
    config: dict[str, Any] = {
        "flags": dict(vars(args)),
        "prepacked_linears": prepacked,
        "argv": list(sys.argv[1:] if argv is None else argv),
        "commit": git_commit(),
        "machine": machine,
        "drafter": drafter_specs,
        "drafter_sha256": drafter_weights_sha256(drafter_specs),
        "threads": args.threads,
    }
    trees: Any = args.tree or ["chain:4"]
    if "speculative" in methods and any(_is_auto(t) for t in trees):
        # Each drafter at the tree calibrated for it: drafting costs and acceptance differ
        # between drafters (a block drafter's tree is bounded by its block), so one tree for
        # all would favour the drafter it was calibrated on.
        by_label, calibrations = {}, {}
        for label, drafter in drafters.items():
            auto, calibrations[label] = _auto_tree(args, target, {label: drafter}, datasets)
            by_label[label] = [
                _resolve_auto(t, auto, lookup=not args.no_lookup) if _is_auto(t) else t
                for t in trees
            ]
        config["calibration"] = next(iter(calibrations.values()))
        if len(drafters) > 1:
            config["calibrations"] = calibrations
            config["trees_by_drafter"] = by_label
        distinct = {tuple(v) for v in by_label.values()}
        trees = list(next(iter(distinct))) if len(distinct) == 1 else by_label
        print(f"bench: trees {trees}", file=sys.stderr)
    if args.replay:
        return _replay(args, target, drafters, trees, datasets, methods, config)
    if isinstance(trees, list):
        trees = trees if len(trees) > 1 else trees[0]
    result = run_bench(
        target,
        (drafters if len(drafters) > 1 else next(iter(drafters.values()))) if drafters else None,
        trees if "speculative" in methods else None,
        datasets,
        methods=methods,
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        seed=args.seed,
        warmup=args.warmup,
        order=args.order,
        stop_on_eos=not args.ignore_eos,
        prompt_lookup_num_tokens=args.prompt_lookup_num_tokens,
        max_matching_ngram_size=args.max_matching_ngram_size,
        bootstrap_resamples=args.bootstrap,
        progress=not args.no_progress,
        config=config,
    )
    markdown = to_markdown(result)
    print(markdown)
    if args.output:
        json_path, md_path = write_outputs(result, args.output)
        print(f"wrote {json_path} and {md_path}", file=sys.stderr)
    mismatched = sum(row["mismatches"] or 0 for row in result["rows"] if row["category"] is None)
    if mismatched:
        print(f"bench: {mismatched} greedy mismatch(es); see the table", file=sys.stderr)
    return 1 if mismatched else 0


def _replay(
    args: argparse.Namespace,
    target: Any,
    drafters: dict[str, Any],
    trees: Any,
    datasets: dict[str, list[PromptItem]],
    methods: list[str],
    config: dict[str, Any],
) -> int:
    """`bench --replay` (lightning_spec.bench.replay): tau by exact replay, no speeds."""
    from lightning_spec.bench.replay import default_cache, replay_bench, replay_markdown
    from lightning_spec.bench.report import dumps_result

    lookup = isinstance(trees, list) and any("+lookup" in t for t in trees)
    if args.temperature != 0 or methods != ["speculative"] or not isinstance(trees, list) or lookup:
        print(
            "bench --replay: T = 0, --methods speculative and one tree list for every drafter "
            "only, without a prompt-lookup branch (a replay measures the drafter's tau, not speed; "
            "--tree auto gives drafters their own trees)",
            file=sys.stderr,
        )
        return 2
    cache = args.replay_cache
    if cache is None:
        cache = default_cache(target, datasets, args.limit, args.selection, args.max_new_tokens)
    try:
        result = replay_bench(
            target, drafters, trees, datasets, max_new_tokens=args.max_new_tokens, cache=cache,
            resamples=args.bootstrap, seed=args.seed, progress=not args.no_progress,
            config=config,
        )  # fmt: skip
    except ValueError as error:
        print(f"bench --replay: {error}", file=sys.stderr)
        return 2
    markdown = replay_markdown(result)
    print(markdown)
    if args.output:
        path = Path(args.output)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(dumps_result(result))
        path.with_suffix(".md").write_text(markdown)
        print(f"wrote {path} and {path.with_suffix('.md')}", file=sys.stderr)
    return 0


def _is_auto(tree: str) -> bool:
    """``auto`` or ``auto+lookup...``: the base tree comes from a calibration."""
    return tree.partition("+")[0].strip() == "auto"


AUTO_LOOKUP = "+lookup:3,8,0.05"
"""What ``--tree auto`` adds to the calibrated tree: the prompt-lookup branch that learns its
own depth (T = 0 only; experiments/cpu-speed/LOG.md: faster on MT-Bench and HumanEval alike)."""


def _resolve_auto(tree: str, calibrated: str, *, lookup: bool) -> str:
    """``auto`` -> the calibrated tree plus `AUTO_LOOKUP` (unless `lookup` is off);
    ``auto+lookup...`` -> the calibrated tree plus that branch."""
    extra = "".join(tree.partition("+")[1:])
    if not extra and lookup:
        extra = AUTO_LOOKUP
    return calibrated + extra


def _auto_tree(
    args: argparse.Namespace,
    target: Any,
    drafters: dict[str, Any],
    datasets: dict[str, list[PromptItem]],
) -> tuple[str, dict[str, Any]]:
    """`--tree auto` for the (first) drafter of `drafters`: a policy from a saved, cached or
    fresh calibration of it (`main` calls it once per drafter).

    Fresh calibrations are cached per machine, threads, dtype, prepacking, target, drafter and
    probe settings (`bench.calibration_cache`) and reused until one of those changes.
    """
    from lightning_spec.bench import calibrate, calibration_cache
    from lightning_spec.models.packed import is_prepacked

    drafter = next(iter(drafters.values()))
    if args.calibration:
        data = json.loads(Path(args.calibration).read_text())
        spec, speedup, _ = calibrate.suggestion_from_calibration(data)
        calibration = {"source": args.calibration, "suggestion": spec, "expected_speedup": speedup}
        print(f"bench: --tree auto -> {spec} (modelled speedup {speedup:.2f}x)", file=sys.stderr)
        return spec, calibration
    first_name, first = next(iter(datasets.items()))
    machine = calibration_cache.machine_fingerprint(
        threads=args.threads, dtype=args.dtype, prepacked=is_prepacked(target.model)
    )
    settings = {
        "dataset": first_name,
        "prompts": args.calibrate_prompts,
        "max_new_tokens": args.max_new_tokens,
        "seed": args.seed,
    }
    key, identity = calibration_cache.calibration_key(machine, target.model, drafter, settings)
    cached = None if args.recalibrate else calibration_cache.load_calibration(key)
    if cached is not None:
        calibration = dict(cached["calibration"])
        calibration["cached"] = cached["path"]
        origin = f"cached calibration {cached['path']}; --recalibrate for a fresh one"
    else:
        prompts = [ids for ids, _ in first[: args.calibrate_prompts]]
        calibration = calibrate.calibrate(
            target, drafter, prompts, max_new_tokens=args.max_new_tokens, seed=args.seed
        )
        try:
            path = calibration_cache.save_calibration(key, identity, calibration)
            origin = f"calibrated now, cached in {path}"
        except OSError as error:  # a read-only cache costs a recalibration next time, no more
            origin = f"calibrated now (not cached: {error})"
    calibration["key"] = key
    spec = calibration["suggestion"]["policy"]
    speedup = calibration["suggestion"]["expected_speedup"]
    print(
        f"bench: --tree auto -> {spec} (modelled speedup {speedup:.2f}x; {origin})",
        file=sys.stderr,
    )
    return spec, calibration


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
