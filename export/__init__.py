"""Ship drafters: ONNX graphs, onnxruntime parity, TensorRT engines (installs as
``lightning_spec.export``).

Submodules: `onnx` (drafter step and feature projection -> ONNX), `dflash_onnx` (the DFlash
context and block graphs, with their parity), `verify_graph` (greedy tree
verification as a pure ONNX graph), `parity` (onnxruntime vs PyTorch; `OnnxEagle3Drafter`,
`OnnxTreeVerifier`), `trt_compat` (static TensorRT-parser compatibility check), `tensorrt`
(engine building and engine-driven parity) and `cli` (``lightning-spec export``).

Names are imported lazily: ``import lightning_spec.export`` costs nothing, and torch.onnx,
onnxruntime, mlflow and tensorrt load only when the function that needs them is used.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "export_drafter": "onnx",
    "export_step_graph": "onnx",
    "export_fc_graph": "onnx",
    "GraphSpec": "onnx",
    "export_dflash": "dflash_onnx",
    "build_verify_graph": "verify_graph",
    "export_verify_graph": "verify_graph",
    "OnnxEagle3Drafter": "parity",
    "OnnxTreeVerifier": "parity",
    "step_parity": "parity",
    "rollout_parity": "parity",
    "decode_parity": "parity",
    "verify_graph_parity": "parity",
    "reference_greedy_verify": "parity",
    "check_trt_compat": "trt_compat",
    "CompatReport": "trt_compat",
    "TrtCompatError": "trt_compat",
    "tensorrt_available": "tensorrt",
    "build_engines": "tensorrt",
    "derive_profile": "tensorrt",
    "DimRange": "tensorrt",
    "TrtEngineRunner": "tensorrt",
    "engine_parity": "tensorrt",
    "export_package": "cli",
    "main": "cli",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
