"""Drafter loading without an import cycle: `base` imports no implementation, yet
`load_drafter` (imported from `base`, where callers import it) knows every built-in type."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import lightning_spec.models.drafters as drafters
from lightning_spec.models.drafters import base

IMPLEMENTATIONS = ("bigram", "eagle3", "standalone")


def _imported_modules(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def test_base_imports_no_implementation() -> None:
    imported = _imported_modules(Path(base.__file__))
    for name in IMPLEMENTATIONS:
        assert f"lightning_spec.models.drafters.{name}" not in imported, name


def test_public_names_stay_where_callers_import_them() -> None:
    assert base.load_drafter is drafters.load_drafter
    assert base.register_drafter is drafters.register_drafter
    assert base.DRAFTER_TYPES is drafters.DRAFTER_TYPES
    assert set(IMPLEMENTATIONS) <= set(base.DRAFTER_TYPES)


def test_importing_base_alone_registers_every_builtin_drafter() -> None:
    code = (
        "from lightning_spec.models.drafters.base import DRAFTER_TYPES, load_drafter; "
        "print(','.join(sorted(DRAFTER_TYPES)))"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    assert set(IMPLEMENTATIONS) <= set(result.stdout.strip().split(","))


def test_exported_layer_ids_give_every_engine_the_trained_layers(tmp_path) -> None:
    """The folder's config gives each engine the layers the drafter trained on (ours: indices
    into HF hidden_states): vLLM's top-level eagle_aux_hidden_state_layer_ids as they are,
    SGLang's eagle_config ids and the newer runner's top-level target_layer_ids minus one
    (both add 1); our loader reads ours back; older folders (ours under target_layer_ids)
    and foreign EAGLE-3 folders (eagle_config only) still load."""
    import json

    from lightning_spec.models.drafters.base import load_drafter
    from lightning_spec.models.drafters.dflash import DFlashDrafter
    from lightning_spec.models.drafters.eagle3 import Eagle3Drafter
    from lightning_spec.models.layer_ids import feature_layers_of
    from lightning_spec.models.target import TargetModel
    from lightning_spec.models.tiny import tiny_config

    target = TargetModel.from_config(tiny_config("llama", num_layers=6), feature_layers=[2, 4, 6])
    folder = Eagle3Drafter.from_target(target).save_pretrained(tmp_path / "eagle")
    config = json.loads((folder / "config.json").read_text())
    assert config["eagle_aux_hidden_state_layer_ids"] == [2, 4, 6]  # vLLM: as is
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 3, 5]  # SGLang: +1
    assert config["target_layer_ids"] == [1, 3, 5]  # vLLM's newer runner: +1
    assert config["torch_dtype"] == "float32"
    assert load_drafter(folder).config["target_layer_ids"] == [2, 4, 6]
    old = {k: v for k, v in config.items()
           if k not in ("feature_layers_hidden_states", "eagle_aux_hidden_state_layer_ids")}  # fmt: skip
    old["target_layer_ids"] = [2, 4, 6]  # an older folder: ours under target_layer_ids
    assert feature_layers_of(old) == [2, 4, 6]
    foreign = {"eagle_config": {"eagle_aux_hidden_state_layer_ids": [2, 4, 6]}}
    assert feature_layers_of(foreign) == [2, 4, 6]

    block = DFlashDrafter.from_target(target, block_size=3).save_pretrained(tmp_path / "dflash")
    config = json.loads((block / "config.json").read_text())
    assert config["target_layer_ids"] == [1, 3, 5] == config["dflash_config"]["target_layer_ids"]
    assert load_drafter(block).config["target_layer_ids"] == [2, 4, 6]
