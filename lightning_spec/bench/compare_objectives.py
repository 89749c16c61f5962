"""Train several objectives from one baseline drafter at an equal wall-clock budget, in turn.

The runs behind the GTO / Draft-OPD comparisons (experiments/gto-draft-opd): every run starts from the same
drafter folder (its sha256 is printed and written beside the results), gets the same RunBudget
minutes (the budget callback of each config is re-sized, nothing else changes) and runs alone on
the machine, one after the other; each best drafter is copied out under OUT/<name>/drafter with
its sha256. A killed comparison resumes: finished runs (a drafter folder in OUT) are skipped.
Without ``--baseline`` the runs train from scratch (SFT variants compared at equal budget, e.g.
``experiments/drafters/scripts/dflash_tradeoff.py``); ``--steps`` gives them all the same step count as well (the
budget then only caps them) and ``--pick last`` keeps the last drafter instead of ``best/``.

    lightning-spec bench compare --baseline ~/.cache/lightning-spec/baselines/X/drafter \\
        --minutes 30 --out ~/.cache/lightning-spec/compare/gto \\
        gto=experiments/gto-draft-opd/configs/gto_on_dataset.yaml \\
        control=experiments/gto-draft-opd/configs/control_sft_continue.yaml \\
        "gto_mean=experiments/gto-draft-opd/configs/gto_on_dataset.yaml --model.init_args.aggregation mean"

Then bench them side by side in one run, e.g. ``lightning-spec bench --drafter BASE --drafter
OUT/gto/drafter --drafter OUT/control/drafter --dataset mtbench,humaneval --tree TREE
--prepack --methods hf_generate,speculative``.
"""

from __future__ import annotations

import argparse
import json
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

from lightning_spec.io import sha256_file
from lightning_spec.overlays import composed

BUDGET = "lightning_spec.callbacks.budget.RunBudget"


def budgeted_config(path: Path, minutes: float, run_dir: Path, *, steps: int | None = None) -> dict:
    """The config at `path` with its RunBudget set to `minutes` and its outputs in `run_dir`
    (and `trainer.max_steps` set to `steps` when given). An experiment's overlay is composed on
    its recipe first, so the budget and folders set here are the ones the run uses."""
    config = composed(path)
    trainer = config.setdefault("trainer", {})
    if steps is not None:
        trainer["max_steps"] = int(steps)
    callbacks = trainer.setdefault("callbacks", [])
    budgets = [c for c in callbacks if isinstance(c, dict) and c.get("class_path") == BUDGET]
    if not budgets:
        callbacks.append({"class_path": BUDGET, "init_args": {"minutes": minutes}})
    for budget in budgets:
        budget.setdefault("init_args", {})["minutes"] = minutes
    trainer["default_root_dir"] = str(run_dir)
    logger = trainer.get("logger")
    if isinstance(logger, dict):
        logger.setdefault("init_args", {})["run_dir"] = str(run_dir)
    for callback in callbacks:
        args = callback.get("init_args", {}) if isinstance(callback, dict) else {}
        if "dirpath" in args:
            args["dirpath"] = str(run_dir / "checkpoints")
    return config


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="lightning-spec bench compare", description=__doc__.splitlines()[0])
    parser.add_argument("--baseline", type=Path, help="the starting drafter folder (none: scratch)")
    parser.add_argument("--minutes", type=float, required=True, help="RunBudget of every run")
    parser.add_argument("--steps", type=int, help="trainer.max_steps of every run (equal steps)")
    parser.add_argument("--pick", choices=("best", "last"), default="best",
                        help="which drafter of each run is kept (default: best/)")  # fmt: skip
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("runs", nargs="+", help="NAME=CONFIG [extra fit arguments], quoted")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    summary: dict = {"minutes": args.minutes, "steps": args.steps, "pick": args.pick, "runs": {}}
    if args.baseline is not None:
        weights = args.baseline / "model.safetensors"
        if not weights.is_file():
            print(f"no drafter at {args.baseline}", file=sys.stderr)
            return 2
        summary.update(baseline=str(args.baseline), baseline_sha256=sha256_file(weights))
        print(f"baseline {args.baseline} sha256 {summary['baseline_sha256']}", flush=True)
    lightning_spec = Path(sys.executable).with_name("lightning-spec")
    for spec in args.runs:
        name, _, rest = spec.partition("=")
        config_path, *extra = shlex.split(rest)
        final = args.out / name / "drafter"
        if (final / "model.safetensors").is_file():
            print(f"{name}: done before, skipped", flush=True)
            summary["runs"][name] = json.loads((args.out / name / "run.json").read_text())
            continue
        run_dir = args.out / name / "run"
        config = budgeted_config(Path(config_path), args.minutes, run_dir, steps=args.steps)
        with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as handle:
            yaml.safe_dump(config, handle)
        command = [str(lightning_spec), "fit", "--config", handle.name]
        if args.baseline is not None:
            command.append(f"--model.init_args.drafter_init={args.baseline}")
        command += extra
        if (run_dir / "checkpoints" / "last.ckpt").is_file():
            command.append("--ckpt_path=last")  # a killed comparison continues this run
        print(f"{name}: {shlex.join(command)}", flush=True)
        tic = time.time()
        code = subprocess.call(command)
        if code != 0:
            print(f"{name}: fit exited {code}", file=sys.stderr)
            return code
        shutil.copytree(run_dir / "drafter" / args.pick, final)
        record = {"config": config_path, "extra": extra, "seconds": time.time() - tic,
                  "sha256": sha256_file(final / "model.safetensors")}  # fmt: skip
        (args.out / name / "run.json").write_text(json.dumps(record, indent=1))
        summary["runs"][name] = record
        print(f"{name}: {record['seconds']:.0f} s, drafter sha256 {record['sha256']}", flush=True)
    (args.out / "summary.json").write_text(json.dumps(summary, indent=1))
    return 0

