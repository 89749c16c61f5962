"""Train one drafter per data mode at equal wall time, then bench them side by side.

The question of issue #4: given the same minutes on the same machine, which training data makes
the better EAGLE-3 drafter: the dataset's own answers (features cheap: one target forward),
the target's regenerated answers (on-distribution, but generation costs ~4x a forward per
token), or a mixture of both? Every mode gets the same wall-clock budget *including* its data
preparation (`RunBudget`, which also fits the learning-rate schedule to the deadline), starts
from an empty rollout cache of its own (so nobody reuses anyone's features), and trains the same
objective from `configs/train/eagle3_quickstart_cpu.yaml`. Then one interleaved `lightning-spec bench` measures
every drafter on the same prompts (docs/benchmarking.md: ratios from one run).

    python experiments/drafters/scripts/bench_data_modes_train.py --minutes 10 \\
        --conversations dataset=300 regenerated=100 mixture=70 \\
        --output experiments/drafters/results/smollm2_data_modes_equal_time.json

How many conversations each mode prepares is part of the recipe (a mode that prepares more
has less time left to train); the defaults spend roughly 40% of a 10-minute budget on data in
every mode, measured on 2 cores. The summary records what each mode actually spent.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[3]
DEFAULT_CONVERSATIONS = {"dataset": 300, "regenerated": 100, "mixture": 70}


def mode_config(
    base: dict[str, Any], *, mode: str, conversations: int, minutes: float, workdir: Path
) -> dict[str, Any]:
    """The base config with one data mode, its own empty cache and a whole-run budget."""
    config = json.loads(json.dumps(base))  # deep copy of plain YAML data
    trainer = config["trainer"]
    run_dir = str(workdir / mode)
    trainer["default_root_dir"] = run_dir
    trainer["max_time"] = None  # the budget below covers data preparation too
    trainer["max_steps"] = 100_000  # the budget stops the run; the schedule is fitted to it
    trainer["logger"]["init_args"].update(experiment_name="data_modes", run_dir=run_dir)
    replaced = (
        "RichProgressBar",
        "SpecProgressBar",
        "RunBudget",
    )  # no bar in a log file; one budget, ours
    callbacks = [c for c in trainer.get("callbacks", []) if not c["class_path"].endswith(replaced)]
    callbacks.append(
        {
            "class_path": "lightning_spec.callbacks.budget.RunBudget",
            "init_args": {"minutes": minutes},
        }
    )
    trainer["callbacks"] = callbacks
    trainer["enable_progress_bar"] = False
    data = config["data"]["init_args"]
    data.update(mode=mode, max_conversations=conversations)
    return config


def fresh_cache(root: Path) -> Path:
    """An asset cache with the real models, datasets and vocabulary counts but no rollouts.

    Each mode then renders, regenerates and caches its features from nothing. (A data-only
    `cache_dir` would not do: Lightning refuses a data module and a module whose `cache_dir`
    hparams differ.)
    """
    from lightning_spec.data.assets import cache_root

    real = cache_root()
    root.mkdir(parents=True)
    for name in ("assets", "models", "vocab"):
        if (real / name).exists():
            (root / name).symlink_to(real / name, target_is_directory=True)
    return root


def train(config: dict[str, Any], path: Path, log_path: Path, cache: Path) -> dict[str, Any]:
    """Run `lightning-spec fit` on `config` (written to `path`) with the asset cache `cache`,
    and time it."""
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    started = time.monotonic()
    with log_path.open("w") as log:
        process = subprocess.run(
            [sys.executable, "-m", "lightning_spec.cli", "fit", "--config", str(path)],
            cwd=ROOT,
            stdout=log,
            stderr=subprocess.STDOUT,
            check=False,
            env={**os.environ, "LIGHTNING_SPEC_CACHE": str(cache)},
        )
    seconds = time.monotonic() - started
    if process.returncode != 0:
        raise SystemExit(f"fit failed ({process.returncode}); see {log_path}")
    return {"wall_seconds": round(seconds, 1)}


def training_state(run_dir: Path) -> dict[str, Any]:
    state = run_dir / "drafter" / "last" / "training_state.json"
    return json.loads(state.read_text()) if state.is_file() else {}


def prep_seconds(run_dir: Path) -> float | None:
    """`budget/prep_seconds` from the run's MLflow mirror (what RunBudget logged)."""
    from lightning_spec.tracking import MIRROR_NAME, read_mirror

    if not (run_dir / MIRROR_NAME).is_file():
        return None
    records, _ = read_mirror(run_dir)
    for record in records:
        metrics = record.get("metrics") or {}
        if "budget/prep_seconds" in metrics:
            return round(float(metrics["budget/prep_seconds"]), 1)
    return None


def prebuild_vocabulary(base: dict[str, Any]) -> None:
    """Count the draft vocabulary once before any timed run (it is cached under the asset
    cache), so the first mode does not pay for what the others then reuse."""
    from lightning_spec.models.target import load_target
    from lightning_spec.objectives.sft import draft_token_counts

    model = base["model"]["init_args"]
    if not model.get("vocab_source"):
        return
    target = load_target(model.get("target", "smollm2"))
    draft_token_counts(
        target, source=model["vocab_source"], conversations=int(model["vocab_conversations"])
    )


def parse_conversations(values: list[str]) -> dict[str, int]:
    out = dict(DEFAULT_CONVERSATIONS)
    for value in values:
        mode, _, count = value.partition("=")
        if mode not in DEFAULT_CONVERSATIONS or not count.isdigit():
            raise SystemExit(f"--conversations: expected mode=N with mode in {list(out)}")
        out[mode] = int(count)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="configs/train/eagle3_quickstart_cpu.yaml")
    parser.add_argument("--modes", nargs="+", default=list(DEFAULT_CONVERSATIONS))
    parser.add_argument("--minutes", type=float, default=10.0, help="wall budget per mode")
    parser.add_argument("--conversations", nargs="*", default=[], help="mode=N (see defaults)")
    parser.add_argument("--workdir", default="runs/data_modes")
    parser.add_argument("--limit", type=int, default=20, help="MT-Bench prompts in the bench")
    parser.add_argument("--max-new-tokens", type=int, default=24)
    parser.add_argument("--tree", default="dynamic:6,10,32")
    parser.add_argument("--output", required=True, help="JSON summary; the bench JSON goes beside")
    args = parser.parse_args(argv)
    counts = parse_conversations(args.conversations)
    workdir = (ROOT / args.workdir).resolve()
    if workdir.exists():
        shutil.rmtree(workdir)  # every mode starts from an empty cache
    workdir.mkdir(parents=True)
    base = yaml.safe_load((ROOT / args.config).read_text())
    prebuild_vocabulary(base)
    summary: dict[str, Any] = {
        "budget_minutes": args.minutes,
        "config": args.config,
        "argv": sys.argv[1:] if argv is None else argv,
        "cpu_count": os.cpu_count(),
        "modes": {},
    }
    for mode in args.modes:
        config = mode_config(
            base, mode=mode, conversations=counts[mode], minutes=args.minutes, workdir=workdir
        )
        print(
            f"[{mode}] training for {args.minutes} min ({counts[mode]} conversations)", flush=True
        )
        cache = fresh_cache(workdir / "cache" / mode)
        result = train(config, workdir / f"{mode}.yaml", workdir / f"{mode}.log", cache)
        state = training_state(workdir / mode)
        result.update(
            conversations=counts[mode],
            prep_seconds=prep_seconds(workdir / mode),
            steps=state.get("global_step"),
        )
        summary["modes"][mode] = result
        print(f"[{mode}] {result}", flush=True)
    output = Path(args.output)
    bench_json = output.with_name(output.stem + "_bench.json")
    command = [
        sys.executable, "-m", "lightning_spec.cli", "bench",
        *[x for mode in args.modes for x in ("--drafter", str(workdir / mode / "drafter" / "last"))],
        "--dataset", "mtbench", "--limit", str(args.limit),
        "--max-new-tokens", str(args.max_new_tokens), "--tree", args.tree,
        "--methods", "hf_generate,speculative", "--no-progress", "--output", str(bench_json),
    ]  # fmt: skip
    summary["bench_command"] = " ".join(command[2:])
    subprocess.run(command, cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
    rows = json.loads(bench_json.read_text())["rows"]
    for mode in args.modes:
        row = next(
            r
            for r in rows
            if r["category"] is None and r["method"].startswith(f"speculative:{mode}/")
        )
        summary["modes"][mode].update(
            tau=row["tau"], tau_ci=row["tau_ci"], alpha=row["alpha"], mismatches=row["mismatches"]
        )
    output.write_text(json.dumps(summary, indent=2))
    for mode, result in summary["modes"].items():
        print(f"{mode:12s} tau {result['tau']:.2f} {result['tau_ci']}  {result}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
