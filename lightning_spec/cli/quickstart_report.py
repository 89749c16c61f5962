"""The last step of the quickstart: one short summary of what was trained and how it did.

Reads the bench JSON written by ``lightning-spec bench --output`` and the run folder's MLflow
mirror (``tracking.MIRROR_NAME``: tracking URI and run id), and prints tau, speedups against
HF greedy ``generate`` and HF prompt lookup, mismatches, where the MLflow run is and where the
drafter folder is. ``python -m lightning_spec.cli.quickstart_report RUN_DIR BENCH_JSON``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

__all__ = ["main", "mlflow_run_info", "summary_lines"]


def mlflow_run_info(run_dir: Path) -> dict[str, Any]:
    """Tracking URI, experiment and run id of the latest session in ``run_dir``'s mirror."""
    from lightning_spec.tracking import MIRROR_NAME, read_mirror

    path = run_dir / MIRROR_NAME
    if not path.is_file():
        return {}
    info: dict[str, Any] = {}
    records, _ = read_mirror(path)
    for record in records:
        if record["type"] == "start":
            info = {
                "tracking_uri": record.get("tracking_uri"),
                "experiment": record.get("experiment_name"),
            }
        elif record["type"] == "run" and record.get("run_id"):
            info["run_id"] = record["run_id"]
        elif record["type"] == "offline":
            info["offline"] = True
    return info


def _overall(rows: list[dict[str, Any]], method: str) -> dict[str, Any] | None:
    for row in rows:
        if row["category"] is None and row["method"] == method:
            return row
    return None


def _fmt(value: float | None, digits: int = 2) -> str:
    return "n/a" if value is None else f"{value:.{digits}f}"


def summary_lines(result: dict[str, Any], run_dir: Path, drafter_dir: Path) -> list[str]:
    """The summary as lines of text (kept separate from printing for tests)."""
    rows = result["rows"]
    flags = result.get("config", {}).get("flags", {})
    spec = next(r for r in rows if r["category"] is None and r["method"].startswith("specul"))
    lookup = _overall(rows, "hf_prompt_lookup")
    lines = [
        f"Quickstart drafter on {spec['num_prompts']} {spec['dataset']} prompts "
        f"(T={_fmt(flags.get('temperature', 0.0), 1)}, tree {spec['tree']}, "
        f"{flags.get('max_new_tokens', '?')} new tokens):",
        f"  tau {_fmt(spec['tau'])} tokens per target forward"
        + (
            f" (95% CI {_fmt(spec['tau_ci'][0])}-{_fmt(spec['tau_ci'][1])})"
            if spec.get("tau_ci")
            else ""
        )
        + (f"; HF prompt lookup {_fmt(lookup['tau'])}" if lookup and lookup.get("tau") else ""),
        f"  wall-clock speedup vs HF generate {_fmt(spec.get('speedup_vs_hf_generate'))}, "
        f"vs HF prompt lookup {_fmt(spec.get('speedup_vs_hf_prompt_lookup'))} "
        "(median of per-prompt ratios over this short run; RESULTS.md has the "
        "40-prompt figures)",
        f"  greedy mismatches against the target's own output: {spec['mismatches']}",
    ]
    optimised = spec.get("speedup_vs_hf_generate_optimized")
    if flags.get("prepack") and optimised is not None:
        plain = _overall(rows, "hf_generate_optimized") or {}
        lines.insert(
            3,
            f"  vs HF generate on the same optimised target {_fmt(optimised)} (the algorithmic "
            "gain alone; HF generate itself runs "
            f"{_fmt(plain.get('speedup_vs_hf_generate'))}x faster there: linear weights "
            "prepacked for oneDNN, the CPU fast path, fp32, same greedy output)",
        )
    elif flags.get("prepack"):
        lines.insert(
            3,
            "  (the speculative decoder ran on the target with its linear weights prepacked for "
            "oneDNN: the CPU fast path, fp32, same greedy output; HF generate ran as loaded)",
        )
    info = mlflow_run_info(run_dir)
    if info.get("run_id"):
        lines.append(
            f"  MLflow run {info['run_id']} (experiment {info.get('experiment')}) in "
            f"{info.get('tracking_uri')}"
        )
        uri = str(info.get("tracking_uri") or "")
        if uri.startswith("sqlite:"):
            lines.append(f"    browse: mlflow ui --backend-store-uri {uri}")
    else:
        lines.append(f"  MLflow run: not recorded (see {run_dir})")
    lines.append(f"  drafter folder: {drafter_dir}")
    lines.append(f"  bench tables: {run_dir / 'bench.md'}")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m lightning_spec.cli.quickstart_report")
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("bench_json", type=Path)
    parser.add_argument("--drafter", type=Path, default=None, help="default RUN_DIR/drafter/last")
    args = parser.parse_args(argv)
    if not args.bench_json.is_file():
        print(f"no bench result at {args.bench_json}", file=sys.stderr)
        return 2
    result = json.loads(args.bench_json.read_text())
    drafter = args.drafter or args.run_dir / "drafter" / "last"
    print("\n".join(summary_lines(result, args.run_dir, drafter)))
    spec_rows = [
        r for r in result["rows"] if r["category"] is None and r["method"].startswith("specul")
    ]
    return 1 if any(r.get("mismatches") for r in spec_rows) else 0


if __name__ == "__main__":
    raise SystemExit(main())
