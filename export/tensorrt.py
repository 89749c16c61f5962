"""TensorRT engines from the exported ONNX graphs, and engine-driven parity.

Written against TensorRT's documented Python API (10.x) and guarded: `tensorrt_available()`
says exactly what is missing (the package, or a CUDA device), and nothing here imports
`tensorrt` at module import. The build path, per graph in an export folder's manifest:

1. ``trt.Builder`` -> ``create_network`` (explicit batch; the flag is passed where the
   installed version still defines it) -> ``trt.OnnxParser.parse_from_file``; every parser
   error is reported with its node (`TensorRTBuildError`).
2. ``create_builder_config``: workspace limit and the precision flag (fp32: none, fp16:
   ``BuilderFlag.FP16``, bf16: ``BuilderFlag.BF16``). TensorRT 11 removed these weak-typing
   flags; there a reduced-precision request fails with a message saying so.
3. One optimization profile covering every dynamic input: each named dimension of the
   manifest (``batch``, ``tokens``, ``past``, ``nodes``, ``vocab`` ...) gets a ``DimRange``
   (min/opt/max) and derived dimensions (``kv_length = past + tokens``,
   ``nodes_plus_one = nodes + 1``) are computed from them, so shapes agree across inputs.
4. A timing cache loaded from / saved to a file (``create_timing_cache``,
   ``set_timing_cache``), shared by every engine of the folder.
5. ``build_serialized_network``; the plan is written atomically (temp file + rename) next to
   an ``engine_manifest.json`` (TensorRT version, device, precision, profiles, sha256).

`TrtEngineRunner` runs an engine with torch CUDA tensors as buffers (``set_input_shape``,
``set_tensor_address``, ``execute_async_v3`` on the current stream) and `engine_parity`
compares it with onnxruntime on random inputs inside the profile.
"""

from __future__ import annotations

import json
import logging
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from lightning_spec.io import atomic_write_bytes, sha256_file

log = logging.getLogger(__name__)

ENGINE_DIR = "tensorrt"
ENGINE_MANIFEST = "engine_manifest.json"
TIMING_CACHE = "timing.cache"
PRECISIONS = ("fp32", "fp16", "bf16")
#: precision -> names of the `trt.BuilderFlag` members to set.
PRECISION_FLAGS: dict[str, tuple[str, ...]] = {"fp32": (), "fp16": ("FP16",), "bf16": ("BF16",)}
#: Engine-vs-onnxruntime tolerances per precision (max abs diff of logits / hidden states).
ENGINE_TOLERANCES = {"fp32": 1e-3, "fp16": 5e-2, "bf16": 2e-1}
DEFAULT_WORKSPACE_BYTES = 2 << 30


class TensorRTUnavailable(RuntimeError):
    """TensorRT or a CUDA device is missing; the message names which."""


class TensorRTBuildError(RuntimeError):
    """Parsing or building failed; `errors` holds the parser's messages."""

    def __init__(self, message: str, errors: Sequence[str] = ()) -> None:
        details = "".join(f"\n  {error}" for error in errors)
        super().__init__(message + details)
        self.errors = list(errors)


def tensorrt_available() -> tuple[bool, str]:
    """(True, "tensorrt X on DEVICE") or (False, the exact missing piece)."""
    try:
        import tensorrt as trt
    except Exception as error:  # ImportError, or OSError from a missing libnvonnxparser
        return False, f"python package tensorrt not importable: {type(error).__name__}: {error}"
    import torch

    if not torch.cuda.is_available():
        return False, "no CUDA device: torch.cuda.is_available() is False"
    return True, f"tensorrt {trt.__version__} on {torch.cuda.get_device_name()}"


def require_tensorrt() -> Any:
    """Import and return the tensorrt module, or raise `TensorRTUnavailable`."""
    ok, reason = tensorrt_available()
    if not ok:
        raise TensorRTUnavailable(reason)
    import tensorrt as trt

    return trt


# ------------------------------------------------------------------------------------ profiles
@dataclass(frozen=True)
class DimRange:
    """min <= opt <= max for one named dynamic dimension."""

    min: int
    opt: int
    max: int

    def __post_init__(self) -> None:
        if not 0 <= self.min <= self.opt <= self.max:
            raise ValueError(f"need 0 <= min <= opt <= max, got {self}")

    @classmethod
    def parse(cls, text: str) -> DimRange:
        """``"MIN:OPT:MAX"`` or a single ``"N"`` (a fixed size)."""
        parts = [int(part) for part in text.split(":")]
        if len(parts) == 1:
            parts *= 3
        if len(parts) != 3:
            raise ValueError(f"expected MIN:OPT:MAX, got {text!r}")
        return cls(*parts)


#: Defaults for the dimensions our graphs declare. `vocab` has no default on purpose: it is the
#: target's vocabulary size and comes from the drafter config (`default_dim_ranges`).
#: ``past`` may be 0: prefill runs the step graph on an empty cache (TensorRT accepts empty
#: tensors; raise the minimum if a deployment never prefills through the engine).
DEFAULT_DIM_RANGES: dict[str, DimRange] = {
    "batch": DimRange(1, 1, 4),
    "tokens": DimRange(1, 16, 64),
    "past": DimRange(0, 256, 2048),
    "nodes": DimRange(1, 32, 128),
}


def default_dim_ranges(drafter_config: Mapping[str, Any] | None = None) -> dict[str, DimRange]:
    """`DEFAULT_DIM_RANGES` plus ``vocab`` fixed to the target vocabulary when known."""
    ranges = dict(DEFAULT_DIM_RANGES)
    if drafter_config and drafter_config.get("target_vocab_size"):
        vocab = int(drafter_config["target_vocab_size"])
        ranges["vocab"] = DimRange(vocab, vocab, vocab)
    return ranges


_TERM = re.compile(r"^\s*([A-Za-z_][A-Za-z0-9_]*|\d+)\s*$")


def _evaluate(expression: str, values: Mapping[str, int]) -> int:
    """Value of ``"a + b + 1"``-style sums of dimension names and integers."""
    total = 0
    for term in expression.split("+"):
        match = _TERM.match(term)
        if not match:
            raise ValueError(f"unsupported dimension expression {expression!r}")
        token = match.group(1)
        total += int(token) if token.isdigit() else int(values[token])
    return total


def derive_profile(
    graph: Mapping[str, Any], ranges: Mapping[str, DimRange]
) -> dict[str, tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]]:
    """Input name -> (min, opt, max) shapes for every input of a manifest graph entry.

    Static axes keep their size; a named dimension takes its `DimRange`; a derived one
    (``graph["derived_dims"]``, e.g. ``"kv_length": "past + tokens"``) is evaluated from the
    ranges at each of min / opt / max. A dynamic dimension without a range is an error that
    names it.
    """
    derived = dict(graph.get("derived_dims") or {})
    profile = {}
    for tensor in graph["inputs"]:
        shapes: list[list[int]] = [[], [], []]
        for axis, dim in enumerate(tensor["shape"]):
            for which, field in enumerate(("min", "opt", "max")):
                if isinstance(dim, int):
                    shapes[which].append(dim)
                    continue
                if dim in derived:
                    picked = {name: getattr(r, field) for name, r in ranges.items()}
                    try:
                        shapes[which].append(_evaluate(derived[dim], picked))
                    except KeyError as error:
                        raise ValueError(
                            f"{graph.get('name')}: input {tensor['name']} axis {axis} is "
                            f"{dim} = {derived[dim]} but dimension {error} has no range"
                        ) from None
                elif dim in ranges:
                    shapes[which].append(getattr(ranges[dim], field))
                else:
                    raise ValueError(
                        f"{graph.get('name')}: input {tensor['name']} axis {axis} is the dynamic "
                        f"dimension {dim!r}, which has no range: pass --trt-dim "
                        f"{dim}=MIN:OPT:MAX"
                    )
        profile[tensor["name"]] = tuple(tuple(shape) for shape in shapes)
    return profile


def precision_flags(precision: str) -> tuple[str, ...]:
    """Names of the `trt.BuilderFlag` members a precision needs (fp32: none)."""
    try:
        return PRECISION_FLAGS[precision]
    except KeyError:
        raise ValueError(f"unknown precision {precision!r}; choose one of {PRECISIONS}") from None


def apply_precision(config: Any, trt: Any, precision: str) -> list[str]:
    """Set the precision flags on a builder config; return the names set."""
    names = list(precision_flags(precision))
    for name in names:
        flag = getattr(trt.BuilderFlag, name, None)
        if flag is None:
            raise TensorRTBuildError(
                f"TensorRT {getattr(trt, '__version__', '?')} has no BuilderFlag.{name}: "
                f"{precision} needs TensorRT 10.x weak typing (TensorRT 11 builds strongly "
                "typed networks only; export the ONNX graph in that precision instead)"
            )
        config.set_flag(flag)
    return names


# ------------------------------------------------------------------------------------ building
@dataclass
class EngineRecord:
    """What `engine_manifest.json` says about one engine."""

    graph: str
    onnx_file: str
    engine_file: str
    precision: str
    flags: list[str]
    profile: dict[str, dict[str, list[int]]]
    sha256: str
    bytes: int
    build_seconds: float


def build_engine(
    onnx_path: str | Path,
    engine_path: str | Path,
    profile: Mapping[str, tuple[Sequence[int], Sequence[int], Sequence[int]]],
    *,
    precision: str = "fp32",
    timing_cache: str | Path | None = None,
    workspace_bytes: int = DEFAULT_WORKSPACE_BYTES,
    graph_name: str | None = None,
) -> EngineRecord:
    """Parse `onnx_path`, build one engine with `profile`, write it atomically."""
    import time

    trt = require_tensorrt()
    onnx_path, engine_path = Path(onnx_path), Path(engine_path)
    logger = trt.Logger(trt.Logger.WARNING)
    builder = trt.Builder(logger)
    flags = 0
    explicit = getattr(trt.NetworkDefinitionCreationFlag, "EXPLICIT_BATCH", None)
    if explicit is not None and int(trt.__version__.split(".")[0]) < 10:
        flags |= 1 << int(explicit)  # implicit by default before TensorRT 10 only
    network = builder.create_network(flags)
    parser = trt.OnnxParser(network, logger)
    if not parser.parse_from_file(str(onnx_path)):
        errors = []
        for index in range(parser.num_errors):
            error = parser.get_error(index)
            errors.append(
                f"node {error.node()} ({error.node_name()}): {error.desc()}"
                if hasattr(error, "node_name")
                else f"node {error.node()}: {error.desc()}"
            )
        raise TensorRTBuildError(f"TensorRT's ONNX parser rejected {onnx_path}", errors)
    config = builder.create_builder_config()
    config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, int(workspace_bytes))
    flag_names = apply_precision(config, trt, precision)

    optimization_profile = builder.create_optimization_profile()
    network_inputs = {network.get_input(i).name for i in range(network.num_inputs)}
    for name, (low, opt, high) in profile.items():
        if name not in network_inputs:
            raise TensorRTBuildError(f"profile names {name!r}, which is not a network input")
        optimization_profile.set_shape(name, tuple(low), tuple(opt), tuple(high))
    missing = [
        network.get_input(i).name
        for i in range(network.num_inputs)
        if -1 in tuple(network.get_input(i).shape) and network.get_input(i).name not in profile
    ]
    if missing:
        raise TensorRTBuildError(f"dynamic inputs without a profile: {missing}")
    config.add_optimization_profile(optimization_profile)

    cache_path = Path(timing_cache) if timing_cache else None
    cache_bytes = cache_path.read_bytes() if cache_path and cache_path.is_file() else b""
    cache = config.create_timing_cache(cache_bytes)
    config.set_timing_cache(cache, ignore_mismatch=False)

    start = time.perf_counter()
    serialized = builder.build_serialized_network(network, config)
    seconds = time.perf_counter() - start
    if serialized is None:
        raise TensorRTBuildError(f"build_serialized_network failed for {onnx_path}")
    atomic_write_bytes(engine_path, bytes(serialized))
    if cache_path is not None:
        atomic_write_bytes(cache_path, bytes(config.get_timing_cache().serialize()))
    return EngineRecord(
        graph=graph_name or onnx_path.stem,
        onnx_file=onnx_path.name,
        engine_file=engine_path.name,
        precision=precision,
        flags=flag_names,
        profile={
            name: {"min": list(low), "opt": list(opt), "max": list(high)}
            for name, (low, opt, high) in profile.items()
        },
        sha256=sha256_file(engine_path),
        bytes=engine_path.stat().st_size,
        build_seconds=round(seconds, 3),
    )


def build_engines(
    export_dir: str | Path,
    *,
    precision: str = "fp32",
    dim_ranges: Mapping[str, DimRange] | None = None,
    timing_cache: str | Path | None = None,
    graphs: Sequence[str] | None = None,
    workspace_bytes: int = DEFAULT_WORKSPACE_BYTES,
) -> dict[str, Any]:
    """Build an engine for every graph of an export folder; write `engine_manifest.json`."""
    import platform

    trt = require_tensorrt()
    import torch

    export_dir = Path(export_dir)
    manifest = json.loads((export_dir / "manifest.json").read_text())
    ranges = default_dim_ranges(manifest.get("drafter", {}).get("config"))
    ranges.update(dim_ranges or {})
    engine_dir = export_dir / ENGINE_DIR
    cache_path = Path(timing_cache) if timing_cache else engine_dir / TIMING_CACHE
    records = []
    for name, graph in manifest["graphs"].items():
        if graphs is not None and name not in graphs:
            continue
        profile = derive_profile(graph, ranges)
        records.append(
            build_engine(
                export_dir / graph["file"],
                engine_dir / f"{name}.{precision}.engine",
                profile,
                precision=precision,
                timing_cache=cache_path,
                workspace_bytes=workspace_bytes,
                graph_name=name,
            )
        )
    engine_manifest = {
        "tensorrt_version": trt.__version__,
        "device": torch.cuda.get_device_name(),
        "compute_capability": list(torch.cuda.get_device_capability()),
        "host": platform.node(),
        "precision": precision,
        "dim_ranges": {name: asdict(r) for name, r in ranges.items()},
        "timing_cache": os.path.relpath(cache_path, engine_dir),
        "engines": {record.graph: asdict(record) for record in records},
    }
    atomic_write_bytes(engine_dir / ENGINE_MANIFEST, json.dumps(engine_manifest, indent=2).encode())
    return engine_manifest


# ------------------------------------------------------------------------------------- running
class TrtEngineRunner:
    """One deserialized engine and execution context; torch CUDA tensors in and out."""

    def __init__(self, engine_path: str | Path) -> None:
        trt = require_tensorrt()
        self.trt = trt
        self.logger = trt.Logger(trt.Logger.WARNING)
        self.runtime = trt.Runtime(self.logger)
        self.engine = self.runtime.deserialize_cuda_engine(Path(engine_path).read_bytes())
        if self.engine is None:
            raise TensorRTBuildError(f"could not deserialize {engine_path}")
        self.context = self.engine.create_execution_context()
        names = [self.engine.get_tensor_name(i) for i in range(self.engine.num_io_tensors)]
        mode = trt.TensorIOMode.INPUT
        self.inputs = [n for n in names if self.engine.get_tensor_mode(n) == mode]
        self.outputs = [n for n in names if self.engine.get_tensor_mode(n) != mode]

    def _torch_dtype(self, name: str) -> Any:
        import torch

        trt = self.trt
        table = {
            trt.DataType.FLOAT: torch.float32,
            trt.DataType.HALF: torch.float16,
            trt.DataType.INT32: torch.int32,
            trt.DataType.INT8: torch.int8,
            trt.DataType.BOOL: torch.bool,
        }
        for trt_name, torch_dtype in (
            ("INT64", torch.int64),
            ("BF16", torch.bfloat16),
            ("UINT8", torch.uint8),
        ):
            if hasattr(trt.DataType, trt_name):
                table[getattr(trt.DataType, trt_name)] = torch_dtype
        return table[self.engine.get_tensor_dtype(name)]

    def __call__(self, feeds: Mapping[str, Any]) -> dict[str, Any]:
        """Run once; `feeds` maps input names to tensors (moved to CUDA and cast as needed)."""
        import torch

        keep_alive = []
        placeholder = torch.empty(1, dtype=torch.uint8, device="cuda")  # for empty tensors
        for name in self.inputs:
            tensor = torch.as_tensor(feeds[name]).to(device="cuda", dtype=self._torch_dtype(name))
            tensor = tensor.contiguous()
            keep_alive.append(tensor)
            if not self.context.set_input_shape(name, tuple(tensor.shape)):
                raise ValueError(f"{name}: shape {tuple(tensor.shape)} outside the profile")
            address = tensor.data_ptr() if tensor.numel() else placeholder.data_ptr()
            self.context.set_tensor_address(name, address)
        outputs = {}
        for name in self.outputs:
            shape = tuple(self.context.get_tensor_shape(name))
            if any(size < 0 for size in shape):
                raise RuntimeError(f"{name}: unresolved output shape {shape}")
            tensor = torch.empty(shape, dtype=self._torch_dtype(name), device="cuda")
            outputs[name] = tensor
            address = tensor.data_ptr() if tensor.numel() else placeholder.data_ptr()
            self.context.set_tensor_address(name, address)
        stream = torch.cuda.current_stream()
        if not self.context.execute_async_v3(stream.cuda_stream):
            raise RuntimeError("execute_async_v3 failed")
        stream.synchronize()
        return outputs


def engine_parity(
    export_dir: str | Path,
    *,
    cases: Sequence[tuple[int, int, int]] = ((1, 1, 0), (1, 4, 7), (2, 8, 16)),
    trees: int = 50,
    seed: int = 0,
) -> dict[str, Any]:
    """Engines vs onnxruntime on random inputs inside each engine's profile."""
    import numpy as np
    import torch

    from lightning_spec.export.onnx import STEP_INPUTS
    from lightning_spec.export.parity import ort_session, random_tree, random_tree_mask

    export_dir = Path(export_dir)
    manifest = json.loads((export_dir / ENGINE_DIR / ENGINE_MANIFEST).read_text())
    export_manifest = json.loads((export_dir / "manifest.json").read_text())
    config = export_manifest["drafter"]["config"]
    precision = manifest["precision"]
    tolerance = ENGINE_TOLERANCES[precision]
    generator = torch.Generator().manual_seed(seed)
    result: dict[str, Any] = {"precision": precision, "tolerance": tolerance}
    engines = manifest["engines"]

    if "drafter_step" in engines:
        runner = TrtEngineRunner(export_dir / ENGINE_DIR / engines["drafter_step"]["engine_file"])
        session = ort_session(export_dir / export_manifest["graphs"]["drafter_step"]["file"])
        step_cases = []
        for batch, tokens, past in cases:
            feeds = {
                "input_ids": torch.randint(
                    0, int(config["target_vocab_size"]), (batch, tokens), generator=generator
                ),
                "position_ids": torch.arange(past, past + tokens).expand(batch, -1).contiguous(),
                "hidden_in": torch.randn(
                    batch, tokens, int(config["hidden_size"]), generator=generator
                ),
                "past_keys": torch.randn(
                    batch,
                    int(config["num_key_value_heads"]),
                    past,
                    int(config["head_dim"]),
                    generator=generator,
                ),
                "attention_mask": random_tree_mask(batch, tokens, past, generator),
            }
            feeds["past_values"] = torch.randn_like(feeds["past_keys"])
            expected = session.run(None, {n: feeds[n].numpy() for n in STEP_INPUTS})
            got = runner(feeds)
            diffs = {
                name: float(np.abs(got[name].float().cpu().numpy() - ref).max(initial=0.0))
                for name, ref in zip(
                    ("logits", "hidden_out", "present_keys", "present_values"),
                    expected,
                    strict=True,
                )
            }
            agreement = float(
                (got["logits"].float().cpu().numpy().argmax(-1) == expected[0].argmax(-1)).mean()
            )
            step_cases.append(
                {
                    "batch": batch,
                    "tokens": tokens,
                    "past": past,
                    "max_abs_diff": diffs,
                    "argmax_agreement": agreement,
                }
            )
        result["drafter_step"] = {
            "cases": step_cases,
            "max_abs_diff": max(max(c["max_abs_diff"].values()) for c in step_cases),
            "argmax_agreement": min(c["argmax_agreement"] for c in step_cases),
        }

    if "fc" in engines:
        runner = TrtEngineRunner(export_dir / ENGINE_DIR / engines["fc"]["engine_file"])
        session = ort_session(export_dir / export_manifest["graphs"]["fc"]["file"])
        width = export_manifest["graphs"]["fc"]["inputs"][0]["shape"][-1]
        features = torch.randn(2, 5, int(width), generator=generator)
        (expected,) = session.run(None, {"features": features.numpy()})
        got = runner({"features": features})["hidden"].float().cpu().numpy()
        result["fc"] = {"max_abs_diff": float(np.abs(got - expected).max())}

    if "tree_verify" in engines:
        runner = TrtEngineRunner(export_dir / ENGINE_DIR / engines["tree_verify"]["engine_file"])
        profile = engines["tree_verify"]["profile"]["draft_tokens"]
        low, high = max(1, profile["min"][0]), profile["max"][0]
        vocab = engines["tree_verify"]["profile"]["target_logits"]["opt"][1]
        rng = np.random.default_rng(seed)
        mismatches = 0
        from lightning_spec.export.parity import reference_greedy_verify

        for _ in range(trees):
            n = int(rng.integers(low, high + 1))
            tokens, parents, logits = random_tree(n, vocab, rng)
            got = runner(
                {
                    "draft_tokens": torch.from_numpy(tokens),
                    "parents": torch.from_numpy(parents),
                    "target_logits": torch.from_numpy(logits),
                }
            )
            length = int(got["accept_length"].item())
            path = got["path"].cpu().tolist()
            expected = reference_greedy_verify(tokens.tolist(), parents.tolist(), logits)
            if (length, path[:length], int(got["bonus_token"].item())) != expected:
                mismatches += 1
        result["tree_verify"] = {"trees": trees, "mismatches": mismatches}

    step = result.get("drafter_step", {})
    result["passed"] = bool(
        step.get("max_abs_diff", 0.0) <= tolerance
        and result.get("fc", {}).get("max_abs_diff", 0.0) <= tolerance
        and result.get("tree_verify", {}).get("mismatches", 0) == 0
    )
    return result
