"""Kernel tests run the real Triton code: on a GPU natively, on CPU through Triton's interpreter.

``TRITON_INTERPRET`` is read when ``@triton.jit`` decorates a function, and Triton's own
library functions (``tl.zeros``...) are decorated when ``triton`` is first imported: the
variable has to be set before anything in the session imports triton. This file sets it, which
is early enough when ``tests/kernels`` runs alone; in a full run an earlier test module may
import triton first (``import lightning`` does), and then the Triton tests here skip with that
reason unless ``tests/conftest.py`` or the environment sets ``TRITON_INTERPRET=1`` on CPU hosts.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

if not torch.cuda.is_available() and "triton" not in sys.modules:
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


_import_kernels()


_COMPILE_SCRIPT = """
import importlib, importlib.util, json, sys
request = json.loads(sys.argv[1])
try:
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    import triton
except ImportError as error:
    print(f"this triton has no ahead-of-time compile API: {error}")
    sys.exit(3)
try:
    module = importlib.import_module(request["module"])
except ImportError:
    folder = request["kernels_dir"]
    package = importlib.util.spec_from_file_location(
        "kernels_for_compile", folder + "/__init__.py", submodule_search_locations=[folder]
    )
    loaded = importlib.util.module_from_spec(package)
    sys.modules[package.name] = loaded
    package.loader.exec_module(loaded)
    module = importlib.import_module(package.name + "." + request["module"].rsplit(".", 1)[1])
target = GPUTarget("cuda", request["capability"], 32)
for build in request["builds"]:
    kernel = getattr(module, build["kernel"])
    signature = {
        name: "constexpr" if name in build["constexprs"] else build["signature"].get(name, "i32")
        for name in kernel.arg_names
    }
    source = ASTSource(kernel, signature, constexprs=build["constexprs"])
    compiled = triton.compile(source, target=target, options=build["options"])
    print(build["kernel"], "shared memory bytes:", compiled.metadata.shared)
"""


@pytest.fixture
def compile_for_gpu():
    """Compile kernels for an NVIDIA GPU without one: frontend, lowering and ptxas.

    The interpreter skips the type checks, layouts and register/shared-memory limits of a real
    build, so code that interprets fine can still fail to compile; this catches that on CPU.
    The builds share one subprocess, started without the TRITON_INTERPRET this session sets.
    Each build is a dict: ``kernel`` (its name in ``module``), ``signature`` (types of pointer
    and float arguments; the rest default to i32), ``constexprs`` and ``options`` (num_warps...).
    """

    def run(module: str, builds: list[dict[str, Any]], capability: int = 90) -> str:
        request = {
            "module": module,
            "builds": builds,
            "capability": capability,
            "kernels_dir": str(Path(__file__).resolve().parents[2] / "kernels"),
        }
        env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
        result = subprocess.run(
            [sys.executable, "-c", _COMPILE_SCRIPT, json.dumps(request)],
            capture_output=True,
            text=True,
            timeout=600,
            env=env,
        )
        if result.returncode == 3:
            pytest.skip(result.stdout.strip())
        assert result.returncode == 0, result.stderr[-4000:]
        return result.stdout

    return run
