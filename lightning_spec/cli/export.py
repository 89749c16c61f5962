"""`lightning-spec export`: ship a trained EAGLE-3 drafter folder as ONNX (and TensorRT), or as
GGUF for llama.cpp (``--format gguf``, `lightning_spec.export.gguf_package`).

The command line of `lightning_spec.export.cli.export_package` (the output folder, the checks
and the manifest are described there). Exit codes: 0 success; 1 parity failure (or
TensorRT-compatibility errors with ``--strict-compat``); 2 bad arguments or an unusable drafter
folder; 3 ``--tensorrt`` asked for but TensorRT or a CUDA device is missing (the ONNX export is
complete and the message names the missing piece); 4 the TensorRT build or the engine parity
failed.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from lightning_spec.export.cli import EXIT_OK, EXIT_USAGE, ExportError, export_package

__all__ = ["build_parser", "main"]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="lightning-spec export",
        description="Export an EAGLE-3 drafter folder to ONNX (and TensorRT engines), with "
        "parity checks against PyTorch and a manifest.",
        epilog="Exit codes: 0 ok, 1 parity failed, 2 bad arguments/drafter folder, "
        "3 TensorRT or a GPU missing (ONNX export done), 4 TensorRT build/parity failed.",
    )
    parser.add_argument(
        "--drafter", required=True, type=Path, help="drafter folder written by save_pretrained"
    )
    parser.add_argument("--output", required=True, type=Path, help="output folder")
    parser.add_argument(
        "--format",
        choices=("onnx", "gguf"),
        default="onnx",
        help="onnx: ONNX graphs (+ TensorRT); gguf: a llama.cpp draft-eagle3 GGUF",
    )
    gguf = parser.add_argument_group("gguf (llama.cpp)")
    gguf.add_argument(
        "--outtype", choices=("f32", "f16"), default="f32", help="drafter GGUF weight type"
    )
    gguf.add_argument(
        "--with-target",
        choices=("f32", "f16", "q8_0", "q4_1"),
        default=None,
        help="also write the target's GGUF of this type beside the drafter",
    )
    gguf.add_argument(
        "--target-gguf",
        type=Path,
        default=None,
        help="the target's GGUF to take the tokenizer from (default: the embedded default's "
        "own GGUF, or one converted from --target's model folder)",
    )
    parser.add_argument(
        "--tensorrt",
        action="store_true",
        help="also build TensorRT engines (needs tensorrt and a CUDA device)",
    )
    parser.add_argument(
        "--precision",
        choices=("fp32", "fp16", "bf16"),
        default="fp32",
        help="TensorRT engine precision (the ONNX graphs are float32)",
    )
    parser.add_argument("--opset", type=int, default=18, help="ONNX opset (>= 18)")
    parser.add_argument(
        "--mlflow-run-id", default=None, help="log artifacts and parity metrics to this MLflow run"
    )
    parser.add_argument(
        "--target",
        default=None,
        help="target model (path, hub id or 'smollm2') for parity on real "
        "features and through the speculative decoder",
    )
    parser.add_argument(
        "--max-tree-nodes",
        type=int,
        default=1024,
        help="largest tree the verify graph handles (log2 of it = jump rounds)",
    )
    parser.add_argument(
        "--trt-dim",
        action="append",
        default=[],
        metavar="NAME=MIN:OPT:MAX",
        help="TensorRT profile range of a dynamic dimension (batch, tokens, "
        "past, nodes, vocab); repeatable",
    )
    parser.add_argument(
        "--timing-cache",
        type=Path,
        default=None,
        help="TensorRT timing cache file (default: OUTPUT/tensorrt/timing.cache)",
    )
    parser.add_argument(
        "--strict-compat",
        action="store_true",
        help="fail when a graph has TensorRT-compatibility errors",
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``lightning-spec export``; returns the exit code (module docstring)."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as error:  # argparse exits 2 on bad arguments, 0 on --help
        return int(error.code or 0)
    if args.format == "gguf":
        return _export_gguf(args)
    from lightning_spec.export.tensorrt import DimRange

    dim_ranges = {}
    try:
        for item in args.trt_dim:
            name, _, spec = item.partition("=")
            dim_ranges[name.strip()] = DimRange.parse(spec)
    except ValueError as error:
        print(f"lightning-spec export: bad --trt-dim: {error}", file=sys.stderr)
        return EXIT_USAGE
    if args.opset < 18:
        print("lightning-spec export: --opset must be >= 18", file=sys.stderr)
        return EXIT_USAGE
    if args.precision != "fp32" and not args.tensorrt:
        print(
            f"note: --precision {args.precision} applies to TensorRT engines; the ONNX graphs "
            "are float32",
            file=sys.stderr,
        )
    try:
        manifest = export_package(
            args.drafter,
            args.output,
            opset=args.opset,
            max_tree_nodes=args.max_tree_nodes,
            target=args.target,
            tensorrt=args.tensorrt,
            precision=args.precision,
            dim_ranges=dim_ranges,
            timing_cache=args.timing_cache,
            strict_compat=args.strict_compat,
            mlflow_run_id=args.mlflow_run_id,
        )
    except ExportError as error:
        print(f"lightning-spec export: {error}", file=sys.stderr)
        return error.exit_code
    random_result = manifest["parity"]["random"]
    print(
        f"exported {len(manifest['graphs'])} graphs to {args.output} "
        f"(max abs diff {random_result['max_abs_diff']:.2e}, "
        f"argmax agreement {random_result['argmax_agreement']:.4f})"
    )
    return EXIT_OK


def _export_gguf(args: argparse.Namespace) -> int:
    from lightning_spec.export.gguf import GgufExportError
    from lightning_spec.export.gguf_package import export_gguf_package

    try:
        manifest = export_gguf_package(
            args.drafter,
            args.output,
            target=args.target,
            target_gguf=args.target_gguf,
            with_target=args.with_target,
            outtype=args.outtype,
        )
    except (GgufExportError, FileNotFoundError, RuntimeError) as error:
        print(f"lightning-spec export: error: {error}", file=sys.stderr)
        return EXIT_USAGE
    names = ", ".join(entry["path"] for entry in manifest["files"].values())
    print(f"wrote {names} to {args.output}")
    for line in manifest.get("run", {}).values():
        print(f"  {line}")
    return EXIT_OK


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
