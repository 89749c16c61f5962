"""The DFlash layer count / block size trade-off: accuracy at equal training steps, side by side.

`experiments/drafters/scripts/drafting_cost.py` measures the cost side (one block forward per verification: flat in the
block size, ~1.5-2 ms per layer here). This script measures the accuracy side: it trains DFlash
variants of `configs/train/dflash_2h_cpu.yaml` (the same data, cached target features, seed and
schedule; only the layer count, the block size and optionally ``anchor_feature`` differ) for the
same number of optimizer steps, one after another (`lightning-spec bench compare --steps`, each
run alone on the cores; a killed invocation resumes), then benches every drafter's real decoding
at T = 0 in one run at the depth all of them can draft (``chain:3``), and each at the chain of its
whole block, and prints one table (tau with 95% bootstrap intervals, per-depth acceptance,
drafting and verification ms per step, training seconds per step).

    python experiments/drafters/scripts/dflash_tradeoff.py --steps 1200 --out ~/.cache/lightning-spec/compare/dflash_tradeoff \\
        --variant L1B8=1,8 --variant L2B8=2,8 --variant L4B8=4,8 --variant L2B4=2,4 \\
        --variant L2B16=2,16 --variant L2B8A=2,8,anchor

Variants are NAME=LAYERS,BLOCK[,anchor]. Run it alone on the machine (training and timing).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[3]
BASE_CONFIG = ROOT / "configs" / "train" / "dflash_2h_cpu.yaml"
ACCEPTANCE = "lightning_spec.callbacks.acceptance.AcceptanceEval"


def parse_variant(text: str) -> tuple[str, int, int, bool]:
    """NAME=LAYERS,BLOCK[,anchor] -> (name, layers, block, anchor_feature)."""
    name, _, spec = text.partition("=")
    parts = spec.split(",")
    if not name or len(parts) not in (2, 3) or (len(parts) == 3 and parts[2] != "anchor"):
        raise SystemExit(f"bad variant {text!r}: expected NAME=LAYERS,BLOCK[,anchor]")
    layers, block = int(parts[0]), int(parts[1])
    if layers < 1 or block < 2:
        raise SystemExit(f"bad variant {text!r}: layers >= 1 and block >= 2 required")
    return name, layers, block, len(parts) == 3


def variant_config(base: dict[str, Any], layers: int, block: int, anchor: bool) -> dict[str, Any]:
    """`base` with the variant's drafter shape; its in-training acceptance check drafts the
    chain of the whole block (a deeper tree than the block cannot be drafted)."""
    config = json.loads(json.dumps(base))  # a deep copy of plain YAML data
    model = config["model"]["init_args"]
    model.update(num_layers=layers, block_size=block)
    if anchor:
        model["anchor_feature"] = True
    for callback in config["trainer"].get("callbacks", []):
        if isinstance(callback, dict) and callback.get("class_path") == ACCEPTANCE:
            callback.setdefault("init_args", {})["tree"] = f"chain:{block - 1}"
    return config


def _bench(drafters: list[Path], tree: str, args: argparse.Namespace, output: Path) -> None:
    if output.is_file():
        return
    command = [str(Path(sys.executable).with_name("lightning-spec")), "bench"]
    for drafter in drafters:
        command += ["--drafter", str(drafter)]
    command += ["--dataset", args.datasets, "--limit", str(args.limit), "--max-new-tokens",
                str(args.max_new_tokens), "--tree", tree, "--prepack", "--methods", "speculative",
                "--no-progress", "--output", str(output)]  # fmt: skip
    print(" ".join(command), flush=True)
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL)


def _rows(path: Path) -> list[dict[str, Any]]:
    result = json.loads(path.read_text())
    return [
        r for r in result["rows"] if r["method"].startswith("speculative") and not r["category"]
    ]


def _fmt(value: float | None, ci: list[float] | None = None) -> str:
    if value is None:
        return "-"
    text = f"{value:.2f}"
    return text + (f" [{ci[0]:.2f}, {ci[1]:.2f}]" if ci else "")


def table(variants: list[tuple[str, int, int, bool]], out: Path) -> str:
    """Markdown: one line per variant, tree and dataset."""
    lines = [
        "| variant | layers | block | run s/step | tree | dataset | tau [95% CI] | alpha_1.. "
        "| draft / verify ms per step |",
        "|---|---:|---:|---:|---|---|---:|---|---:|",
    ]
    runs = json.loads((out / "summary.json").read_text())["runs"]
    shared = _rows(out / "bench_chain3.json") if (out / "bench_chain3.json").is_file() else []
    for name, layers, block, anchor in variants:
        record = runs.get(name, {})
        pace = record.get("seconds_per_step")
        own = out / f"bench_{name}_block.json"  # this drafter alone: all its rows are ours
        # a label is "speculative:NAME/drafter", "@TREE" appended when a run had several trees
        rows = [r for r in shared if r["method"].split("@")[0] == f"speculative:{name}/drafter"]
        rows += _rows(own) if own.is_file() else []
        for row in rows:
            alpha = " ".join(f"{a:.2f}" for a in (row.get("alpha") or []))
            ms = row.get("ms_per_step") or {}
            lines.append(
                f"| {name}{' (anchor_feature)' if anchor else ''} | {layers} | {block} | "
                f"{_fmt(pace)} | {row['tree']} | {row['dataset']} | "
                f"{_fmt(row['tau'], row.get('tau_ci'))} | {alpha} | "
                f"{_fmt(ms.get('draft'))} / {_fmt(ms.get('verify'))} |"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, required=True, help="optimizer steps of every run")
    parser.add_argument("--minutes", type=float, default=60.0, help="RunBudget cap of every run")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument(
        "--variant", action="append", required=True, help="NAME=LAYERS,BLOCK[,anchor]"
    )
    parser.add_argument("--datasets", default="mtbench,humaneval")
    parser.add_argument("--limit", type=int, default=20, help="prompts per dataset")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    args = parser.parse_args(argv)
    variants = [parse_variant(v) for v in args.variant]
    base = yaml.safe_load(BASE_CONFIG.read_text())
    configs = args.out / "configs"
    configs.mkdir(parents=True, exist_ok=True)
    runs = []
    for name, layers, block, anchor in variants:
        path = configs / f"{name}.yaml"
        path.write_text(yaml.safe_dump(variant_config(base, layers, block, anchor)))
        runs.append(f"{name}={path}")
    subprocess.run(
        [sys.executable, "-m", "lightning_spec.cli", "bench", "compare", "--minutes",
         str(args.minutes), "--steps", str(args.steps), "--pick", "last", "--out",
         str(args.out), *runs],
        check=True,
    )  # fmt: skip
    summary = json.loads((args.out / "summary.json").read_text())
    for name, *_ in variants:  # training pace, for the table
        record = summary["runs"][name]
        record["seconds_per_step"] = record["seconds"] / args.steps
    (args.out / "summary.json").write_text(json.dumps(summary, indent=1))
    drafters = [args.out / name / "drafter" for name, *_ in variants]
    shallowest = min(block for _, _, block, _ in variants) - 1
    _bench(drafters, f"chain:{min(3, shallowest)}", args, args.out / "bench_chain3.json")
    for (name, _, block, _), drafter in zip(variants, drafters, strict=True):
        if block - 1 > min(3, shallowest):
            _bench([drafter], f"chain:{block - 1}", args, args.out / f"bench_{name}_block.json")
    text = table(variants, args.out)
    (args.out / "tradeoff.md").write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
