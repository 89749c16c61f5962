"""Old import paths kept for one release.

A module that moved leaves a shim at its old path: importing the shim warns (DeprecationWarning)
and hands over the new module itself (`sys.modules` points the old name at it), so every name,
private ones included, and every class path a saved config or checkpoint stores still resolves
to the same object. A renamed class stays reachable under its old name through the module's
``__getattr__`` (`renamed`), which warns on each access. `tests/repo/test_deprecated_paths.py` checks
each shim.
"""

from __future__ import annotations

import importlib
import warnings
from types import ModuleType

__all__ = ["moved", "renamed"]


def moved(old: str, new: str) -> ModuleType:
    """Warn that module `old` moved to `new` and return `new` (imported)."""
    warnings.warn(
        f"{old} moved to {new}; the old path goes in the next release",
        DeprecationWarning,
        stacklevel=3,
    )
    return importlib.import_module(new)


def renamed(old: str, new: str) -> None:
    """Warn that the name `old` is now `new` (dotted paths; called by a module's ``__getattr__``)."""
    warnings.warn(
        f"{old} is now {new}; the old name goes in the next release",
        DeprecationWarning,
        stacklevel=3,
    )
