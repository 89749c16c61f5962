"""One metric of several training runs over training, read from their MLflow mirrors, as a PNG.

Every `SpecMLFlowLogger` run folder holds `mlflow_mirror.jsonl` (every metric it logged, written
before MLflow sees it), so this works without the MLflow store and after a crash. It draws the
metric against the optimizer step or, for runs compared at an equal wall-clock budget, against
the minutes since each run's first record (an objective with costly steps makes fewer of them,
so the step axis alone would flatter it). It also prints, per run, the first, last and mean value
and how many points there were, so the figure's story is checkable in text.

    lightning-spec bench plot --run draft_opd=OUT/draft_opd/run \\
        --run opd_sft_control=OUT/opd_sft_control/run --metric rollout/rollout_tau \\
        --x minutes --output runs/bench/smollm2_draft_opd_rollout_tau.png
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

from lightning_spec.tracking.mirror import read_mirror


def metric_series(run_dir: str | Path, metric: str) -> list[dict[str, float]]:
    """Every finite value of `metric` in the run's mirror, in logging order, as rows of
    `step`, `minutes` (since the run's first record) and `value`."""
    records, _ = read_mirror(run_dir)
    if not records:
        return []
    start = min(float(r.get("time", 0.0)) for r in records)
    rows = []
    for record in records:
        if record.get("type") != "metrics":
            continue
        value = (record.get("metrics") or {}).get(metric)
        if value is None or not math.isfinite(float(value)):
            continue
        minutes = (float(record.get("time", start)) - start) / 60.0
        rows.append({"step": float(record.get("step", 0)), "minutes": minutes,
                     "value": float(value)})  # fmt: skip
    return rows


def summarise(rows: list[dict[str, float]]) -> dict[str, float]:
    """First, last and mean value and the number of points (NaN when there are none)."""
    values = [row["value"] for row in rows]
    if not values:
        return {"points": 0, "first": math.nan, "last": math.nan, "mean": math.nan}
    return {"points": len(values), "first": values[0], "last": values[-1],
            "mean": sum(values) / len(values)}  # fmt: skip


def draw(series: dict[str, list[dict[str, float]]], metric: str, x: str, path: Path) -> Path:
    """A small line plot of every run's series into `path`."""
    import matplotlib

    matplotlib.use("Agg", force=False)
    from matplotlib.figure import Figure

    figure = Figure(figsize=(6, 3.2), dpi=100)
    axis = figure.subplots()
    for name, rows in series.items():
        axis.plot([r[x] for r in rows], [r["value"] for r in rows], label=name, marker=".")
    axis.set_xlabel("minutes of training" if x == "minutes" else "optimizer step")
    axis.set_ylabel(metric)
    axis.legend(fontsize=7)
    axis.grid(alpha=0.3)
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path)
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="lightning-spec bench plot", description=__doc__.splitlines()[0])
    parser.add_argument("--run", action="append", required=True, metavar="NAME=RUN_DIR")
    parser.add_argument("--metric", required=True)
    parser.add_argument("--x", choices=("step", "minutes"), default="step")
    parser.add_argument("--output", type=Path, required=True, help="the PNG")
    parser.add_argument("--json", type=Path, help="also write the series and summaries here")
    args = parser.parse_args(argv)
    series: dict[str, list[dict[str, float]]] = {}
    for spec in args.run:
        name, sep, folder = spec.partition("=")
        if not sep or not name or not folder:
            parser.error(f"--run wants NAME=RUN_DIR, got {spec!r}")
        if not Path(folder).exists():
            print(f"{name}: no run folder at {folder}", file=sys.stderr)
            return 2
        series[name] = metric_series(folder, args.metric)
    summaries = {name: summarise(rows) for name, rows in series.items()}
    for name, summary in summaries.items():
        print(f"{name}: {args.metric} points {summary['points']} first {summary['first']:.3f} "
              f"last {summary['last']:.3f} mean {summary['mean']:.3f}")  # fmt: skip
    if not any(series.values()):
        print(f"no run logged {args.metric}", file=sys.stderr)
        return 1
    print(f"wrote {draw(series, args.metric, args.x, args.output)}")
    if args.json is not None:
        payload = {"metric": args.metric, "series": series, "summaries": summaries}
        args.json.write_text(json.dumps(payload, indent=1))
    return 0

