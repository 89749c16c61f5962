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
