"""Experiment arms as overlays on a recipe: a study's config states only what differs.

An arm's first line names its recipe (``# Overlay on configs/X.yaml: ...``); LightningCLI composes
the two with ``--config RECIPE --config ARM``. Tools that edit a config before running it (the
objective comparison re-sizes budgets and output folders) need the composed YAML instead, so
this merges the two the way the parser does for these files: dicts key by key, a dict naming
another ``class_path`` or any list replaced whole.
"""

from __future__ import annotations

import re
from pathlib import Path

import yaml

OVERLAY = re.compile(r"# Overlay on (configs/\S+\.yaml):")


def overlay_recipe(path: str | Path) -> Path | None:
    """The recipe an overlay composes on (its first line names it, from the repository root,
    looked up beside the overlay's parents and then the working directory), else None."""
    path = Path(path)
    found = OVERLAY.match(path.read_text(encoding="utf-8"))
    if not found:
        return None
    for root in (*path.resolve().parents, Path.cwd()):
        if (root / found.group(1)).is_file():
            return root / found.group(1)
    raise FileNotFoundError(f"{path}: its recipe {found.group(1)} is not in any folder above it")


def merged(base: dict, overlay: dict) -> dict:
    """`overlay` over `base`: dicts key by key unless they name another `class_path` (then
    replaced whole), anything else (lists too) replaced."""
    out = dict(base)
    for key, value in overlay.items():
        below = base.get(key)
        same = (
            isinstance(value, dict) and isinstance(below, dict)
            and value.get("class_path", below.get("class_path")) == below.get("class_path")
        )  # fmt: skip
        out[key] = merged(below, value) if same else value
    return out


def composed(path: str | Path) -> dict:
    """The YAML of a config, an overlay merged into its recipe (a recipe as it is)."""
    recipe = overlay_recipe(path)
    own = yaml.safe_load(Path(path).read_text(encoding="utf-8")) or {}
    return merged(yaml.safe_load(recipe.read_text(encoding="utf-8")), own) if recipe else own
