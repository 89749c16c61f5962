"""Old import paths and class names that users and saved configs use keep working for one release:
each warns (DeprecationWarning) and gives the very object at its new path."""

from __future__ import annotations

import importlib
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

MOVED_MODULES = {
    "lightning_spec.serving.online": "lightning_spec.online.loop",
    **{
        f"lightning_spec.serving.{name}": f"lightning_spec.online.{name}"
        for name in (
            "beside",
            "continuations",
            "engines",
            "hindsight",
            "http",
            "overlap",
            "stream",
            "vllm_draft",
            "vllm_engine",
        )
    },
    "lightning_spec.objectives.online": "lightning_spec.online.strategies",
    "lightning_spec.objectives.online_loss": "lightning_spec.online.losses",
    "lightning_spec.objectives.online_vocab": "lightning_spec.online.vocab",
    "lightning_spec.export.vllm": "lightning_spec.tools.vllm",
    "lightning_spec.export.llamacpp": "lightning_spec.tools.llamacpp",
    "lightning_spec.export.tool_cli": "lightning_spec.tools.cli",
}

RENAMED = {
    "lightning_spec.objectives.sft.EagleSFT": "lightning_spec.objectives.sft.SFT",
    "lightning_spec.objectives.gto.GroupTreeOptimization": "lightning_spec.objectives.gto.GTO",
    "lightning_spec.objectives.sft._draft_ids": "lightning_spec.objectives.ttt.draft_vocab_ids",
    "lightning_spec.objectives.sft.ttt_unroll": "lightning_spec.objectives.ttt.ttt_unroll",
    "lightning_spec.objectives.sft.ttt_loss_masks": "lightning_spec.objectives.ttt.ttt_loss_masks",
    "lightning_spec.objectives.sft.ttt_attention_mask": (
        "lightning_spec.objectives.ttt.ttt_attention_mask"
    ),
}

# What the saved configs and checkpoints of earlier releases name, through the old modules.
OLD_NAMES = {
    "lightning_spec.objectives.online.make_strategy": "lightning_spec.online.strategies",
    "lightning_spec.objectives.online.STRATEGIES": "lightning_spec.online.strategies",
    "lightning_spec.serving.online.run_stream": "lightning_spec.online.loop",
    "lightning_spec.serving.online.SafetyGuard": "lightning_spec.online.loop",
    "lightning_spec.export.vllm.ensure_vllm": "lightning_spec.tools.vllm",
    "lightning_spec.export.llamacpp.convert_dflash": "lightning_spec.tools.llamacpp",
}


def _resolve(path: str) -> object:
    module, name = path.rsplit(".", 1)
    return getattr(importlib.import_module(module), name)


@pytest.mark.parametrize(("old", "new"), MOVED_MODULES.items())
def test_an_old_module_path_warns_and_is_the_new_module(old: str, new: str) -> None:
    sys.modules.pop(old, None)  # import it afresh, as a new process would
    with pytest.warns(DeprecationWarning, match=f"{old} moved to {new}"):
        module = importlib.import_module(old)
    assert module is importlib.import_module(new)
    assert sys.modules[old] is module


@pytest.mark.parametrize(("old", "new"), RENAMED.items())
def test_an_old_name_warns_and_is_the_new_object(old: str, new: str) -> None:
    with pytest.warns(DeprecationWarning, match=f"{old} is now {new}"):
        value = _resolve(old)
    assert value is _resolve(new)


@pytest.mark.parametrize(("old", "module"), OLD_NAMES.items())
def test_names_through_an_old_module_are_the_new_objects(old: str, module: str) -> None:
    assert _resolve(old) is getattr(importlib.import_module(module), old.rsplit(".", 1)[1])


def test_new_paths_do_not_warn() -> None:
    """Nothing in the package imports a shim: a fresh process importing the new paths (and
    what they import) with DeprecationWarning as an error succeeds."""
    code = (
        "import lightning_spec.online.loop, lightning_spec.online.hindsight, "
        "lightning_spec.online.http, lightning_spec.online.vllm_engine, lightning_spec.tools.cli, "
        "lightning_spec.tools.llamacpp, lightning_spec.objectives.gto, "
        "lightning_spec.objectives.draft_opd, lightning_spec.cli.online, lightning_spec.cli.serve, "
        "lightning_spec.export.gguf_package"
    )
    result = subprocess.run(
        [sys.executable, "-W", "error::DeprecationWarning", "-c", code],
        capture_output=True, text=True, cwd=ROOT, timeout=120,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr


def test_an_old_module_runs_as_a_script() -> None:
    """``python -m lightning_spec.export.vllm ...`` (the installer's old command) still runs it."""
    result = subprocess.run(
        [sys.executable, "-m", "lightning_spec.export.vllm", "--help"],
        capture_output=True, text=True, cwd=ROOT, timeout=120,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "build" in result.stdout and "where" in result.stdout


def test_a_saved_config_naming_the_old_class_loads(tiny_cli_assets: dict[str, str], tmp_path: Path) -> None:
    """A config saved before the rename (``class_path: lightning_spec.objectives.sft.EagleSFT``)
    instantiates `SFT` through the real CLI."""
    from lightning_spec.cli import lightning_cli
    from lightning_spec.objectives.sft import SFT

    config = tmp_path / "saved.yaml"
    config.write_text(
        "model:\n"
        "  class_path: lightning_spec.objectives.sft.EagleSFT\n"
        "  init_args:\n"
        f"    target: {tiny_cli_assets['model']}\n"
        f"    draft_vocab_size: {tiny_cli_assets['vocab']}\n"
        f"    cache_dir: {tmp_path / 'cache'}\n"
        "    ttt_steps: 2\n"
        "data:\n"
        "  class_path: lightning_spec.data.datamodule.RolloutDataModule\n"
        "  init_args:\n"
        f"    target: {tiny_cli_assets['model']}\n"
        f"    dataset: {tiny_cli_assets['chats']}\n"
        f"    cache_dir: {tmp_path / 'data'}\n"
        "trainer:\n"
        "  accelerator: cpu\n"
        "  logger: false\n"
        f"  default_root_dir: {tmp_path / 'run'}\n"
    )
    with pytest.warns(DeprecationWarning, match="EagleSFT is now"):
        cli = lightning_cli(["--config", str(config)], run=False)
    assert type(cli.model) is SFT
