"""Kernel tests run the real Triton code: on a GPU natively, on CPU through Triton's interpreter.

``TRITON_INTERPRET`` is read when ``@triton.jit`` decorates a kernel, so it has to be set
before ``lightning_spec.kernels`` is first imported; pytest imports this file before the test
modules beside it. If something imported the kernels earlier in the session without the
interpreter, they are reloaded so the Triton path is really exercised.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
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


_COMPILE_SCRIPT = """
import importlib, importlib.util, json, sys
spec = json.loads(sys.argv[1])
try:
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    import triton
except ImportError as error:
    print(f"this triton has no ahead-of-time compile API: {error}")
    sys.exit(3)
try:
    module = importlib.import_module(spec["module"])
except ImportError:
    folder = spec["kernels_dir"]
    package = importlib.util.spec_from_file_location(
        "kernels_for_compile", folder + "/__init__.py", submodule_search_locations=[folder]
    )
    loaded = importlib.util.module_from_spec(package)
    sys.modules[package.name] = loaded
    package.loader.exec_module(loaded)
    module = importlib.import_module(package.name + "." + spec["module"].rsplit(".", 1)[1])
kernel = getattr(module, spec["kernel"])
signature = {
    name: "constexpr" if name in spec["constexprs"] else spec["signature"].get(name, "i32")
    for name in kernel.arg_names
}
source = ASTSource(kernel, signature, constexprs=spec["constexprs"])
target = GPUTarget("cuda", spec["capability"], 32)
compiled = triton.compile(source, target=target, options=spec["options"])
print("shared memory bytes:", compiled.metadata.shared)
"""


@pytest.fixture
def compile_for_gpu():
    """Compile a kernel for an NVIDIA GPU without one: frontend, lowering and ptxas.

    The interpreter skips the type checks, layouts and register/shared-memory limits of a real
    build, so code that interprets fine can still fail to compile; this catches that on CPU.
    It runs in a subprocess without TRITON_INTERPRET, which this session has set.
    """

    def run(
        module: str,
        kernel: str,
        signature: dict[str, str],
        constexprs: dict[str, object],
        capability: int = 90,
        **options: object,
    ) -> str:
        spec = {
            "module": module,
            "kernel": kernel,
            "signature": signature,
            "constexprs": constexprs,
            "capability": capability,
            "options": options,
            "kernels_dir": str(Path(__file__).resolve().parents[2] / "kernels"),
        }
        env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
        result = subprocess.run(
            [sys.executable, "-c", _COMPILE_SCRIPT, json.dumps(spec)],
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
