"""Kernel tests run the real Triton code: on a GPU natively, on CPU through Triton's interpreter.

``TRITON_INTERPRET`` is read when ``@triton.jit`` decorates a kernel, so it has to be set
before ``lightning_spec.kernels`` is first imported; pytest imports this file before the test
modules beside it. If something imported the kernels earlier in the session without the
interpreter, they are reloaded so the Triton path is really exercised.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from pathlib import Path

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"


def _import_kernels() -> None:
    """Import ``lightning_spec.kernels``; from a source checkout that was not pip-installed,
    load the top-level ``kernels/`` folder under that name (the mapping pyproject declares)."""
    try:
        importlib.import_module("lightning_spec.kernels")
        return
    except ModuleNotFoundError as error:
        if error.name != "lightning_spec.kernels":
            raise
    import lightning_spec

    folder = Path(__file__).resolve().parents[2] / "kernels"
    spec = importlib.util.spec_from_file_location(
        "lightning_spec.kernels", folder / "__init__.py", submodule_search_locations=[str(folder)]
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules["lightning_spec.kernels"] = module
    spec.loader.exec_module(module)
    lightning_spec.kernels = module


def _reload_if_compiled_for_gpu() -> None:
    """Reload kernel modules that an earlier import built without the interpreter."""
    names = ["lightning_spec.kernels.tree_attention", "lightning_spec.kernels.tree_verify"]
    if os.environ.get("TRITON_INTERPRET") != "1":
        return
    stale = [name for name in names if sys.modules.get(name) is not None]
    stale = [name for name in stale if not sys.modules[name]._kernels_interpreted()]
    if stale and sys.modules[names[0]].TRITON_AVAILABLE:
        for name in stale:
            importlib.reload(sys.modules[name])
        importlib.reload(sys.modules["lightning_spec.kernels"])


_import_kernels()
_reload_if_compiled_for_gpu()
