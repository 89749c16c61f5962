"""The `lightning-spec` command: LightningCLI for training, thin subcommands for the rest.

`fit`, `validate` and `test` are LightningCLI subcommands (configs use `class_path`/`init_args`,
`${...}` interpolation resolved per file by OmegaConf at load time: a later command-line override
does not flow into values interpolated from it). Tasks that are not Trainer-shaped (assets,
prepare, generate, bench, calibrate, export, promote, relog) live in a small dispatcher in front of
LightningCLI, one module each in this package (`lightning_spec.cli.<name>`: its argparse parser
and `main(argv) -> int`; the work itself is done elsewhere), imported only when called so
`lightning-spec --help` answers fast.
"""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Sequence

# name -> (module with `main(argv) -> int`, one-line help)
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "assets": ("lightning_spec.cli.assets", "fetch and cache the default target and datasets"),
    "prepare": (
        "lightning_spec.cli.prepare",
        "build a fit config's data (regeneration, feature cache) without training",
    ),
    "generate": (
        "lightning_spec.cli.generate",
        "answer one prompt with speculative decoding (tau, greedy check)",
    ),
    "bench": (
        "lightning_spec.cli.bench",
        "measure tau and speedup side by side; `bench --help` lists the suite (vllm, ...)",
    ),
    "calibrate": (
        "lightning_spec.cli.calibrate",
        "measure verification cost and suggest the fastest tree policy",
    ),
    "export": ("lightning_spec.cli.export", "export a drafter to ONNX (and TensorRT engines)"),
    "promote": ("lightning_spec.cli.promote", "register a drafter and move the champion alias"),
    "online": (
        "lightning_spec.cli.online",
        "OnlineSpec: serve a request stream and keep training the drafter from its feedback",
    ),
    "serve": (
        "lightning_spec.cli.serve",
        "serve /v1/completions with speculative decoding, learning online from what it serves",
    ),
    "relog": (
        "lightning_spec.cli.relog",
        "replay a run's MLflow mirror into MLflow (after the tracking server went away)",
    ),
}
LIGHTNING_SUBCOMMANDS = {
    "fit": "train a drafter (LightningCLI; --config configs/train/eagle3_quickstart_cpu.yaml)",
    "validate": "run validation (acceptance evaluation) on a checkpoint",
    "test": "run the test loop",
}


def _usage() -> str:
    lines = ["usage: lightning-spec <command> [options]", "", "commands:"]
    for name, text in LIGHTNING_SUBCOMMANDS.items():
        lines.append(f"  {name:<10} {text}")
    for name, (module, text) in SUBCOMMANDS.items():
        if _available(module):
            lines.append(f"  {name:<10} {text}")
    lines += ["", "Run `lightning-spec <command> --help` for the options of one command."]
    return "\n".join(lines)


def _available(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def lightning_cli(args: Sequence[str] | None = None, run: bool = True) -> object:
    """Build the LightningCLI (tests call it with run=False to instantiate configs)."""
    from lightning.pytorch import LightningDataModule, LightningModule
    from lightning.pytorch.cli import LightningCLI

    from lightning_spec.cli.calm import calm_console

    calm_console()
    return LightningCLI(
        LightningModule,
        LightningDataModule,
        subclass_mode_model=True,
        subclass_mode_data=True,
        parser_kwargs={"parser_mode": "omegaconf"},
        save_config_kwargs={"overwrite": True},
        args=list(args) if args is not None else None,
        run=run,
        auto_configure_optimizers=False,
    )


SIGTERM_EXIT = 143  # 128 + SIGTERM, what a shell reports for a process the signal ended


def _run_lightning(args: Sequence[str] | None) -> int:
    """A Lightning subcommand; a run stopped by SIGTERM exits non-zero. Lightning ends it with
    `SIGTERMException`, a bare `SystemExit` (status 0), after the on-exception checkpoint: a
    wrapper (a scheduler, `lightning-spec bench compare`) would take the stopped run for a
    finished one and keep its half-trained drafter."""
    from lightning.pytorch.utilities.exceptions import SIGTERMException

    try:
        lightning_cli(args)
    except SIGTERMException:
        print("lightning-spec: stopped by SIGTERM before the run's end; its last checkpoint "
              "resumes it (--ckpt_path=last)", file=sys.stderr)  # fmt: skip
        return SIGTERM_EXIT
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    from_command_line = argv is None
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in {"-h", "--help", "help"}:
        print(_usage())
        return 0
    if argv[0] in {"-V", "--version"}:
        from lightning_spec import __version__

        print(f"lightning-spec {__version__}")
        return 0
    command = argv[0]
    if command not in SUBCOMMANDS and command not in LIGHTNING_SUBCOMMANDS:
        print(f"lightning-spec: unknown command {command!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    try:
        if command in LIGHTNING_SUBCOMMANDS:
            # From the shell, LightningCLI reads sys.argv itself (passing both makes it warn).
            return _run_lightning(None if from_command_line else argv)
        module_name = SUBCOMMANDS[command][0]
        if not _available(module_name):
            print(f"lightning-spec: `{command}` is not available in this version", file=sys.stderr)
            return 2
        module = importlib.import_module(module_name)
        return int(module.main(argv[1:]) or 0)
    except Exception as error:
        # From the shell, an error we raise on purpose (bad input, a drafter of another
        # target, a missing asset, a store of another configuration) is its message, not a
        # traceback through our internals; called from Python (tests, notebooks) it raises.
        if not from_command_line or os.environ.get(TRACEBACK_ENV) or not is_user_error(error):
            raise
        print(f"lightning-spec {command}: error: {error}", file=sys.stderr)
        print(f"(set {TRACEBACK_ENV}=1 for the traceback)", file=sys.stderr)
        return 1


TRACEBACK_ENV = "LIGHTNING_SPEC_TRACEBACK"


def is_user_error(error: BaseException) -> bool:
    """Errors that describe the user's input or environment and say what to do: shown as a
    message. Anything else (a bug, an interrupted run) keeps its traceback."""
    from lightning_spec.data.assets import AssetError
    from lightning_spec.data.shards import StoreError
    from lightning_spec.io import LockTimeout
    from lightning_spec.tracking.failures import TrackingUnavailableError

    expected = (ValueError, FileNotFoundError, NotADirectoryError, IsADirectoryError,
                PermissionError, AssetError, StoreError, LockTimeout,
                TrackingUnavailableError)  # fmt: skip
    return isinstance(error, expected)
