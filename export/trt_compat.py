"""Static check that an ONNX graph only uses what TensorRT's ONNX parser accepts.

TensorRT cannot be installed without an NVIDIA GPU, so CI cannot simply try to parse our graphs. This
module checks each graph against TensorRT's published support matrix instead:

* every operator is in the parser's supported list, from the default ONNX domain (a custom
  domain needs a plugin), and the default-domain opset lies in the supported range;
* the data type of each operator's data input is one the parser lists for that operator, and
  graph inputs and outputs use TensorRT types (no double, string, complex, 16-bit or unsigned
  32/64-bit integers);
* no output shape depends on tensor *values* (NonZero, Unique, NonMaxSuppression, Compress, or
  a Range / Reshape / Expand / Tile / Slice / Pad / ConstantOfShape / TopK whose shape operand
  is computed from input data rather than from input shapes and constants);
* a few per-operator restrictions from the same table (reduction ``axes``, ``Squeeze`` and
  ``Unsqueeze`` axes, ``TopK``'s ``K`` and ``sorted``, ``Dropout`` in training mode, string
  constants, ``ScatterND`` reductions, pooling dilations, ``MaxPool`` indices);
* dynamic input dimensions carry names (TensorRT profiles are derived from those names).

Model-local functions are inlined first and ``If`` / ``Loop`` / ``Scan`` bodies are checked
recursively. `check_trt_compat` returns a `CompatReport`; ``strict=True`` raises
`TrtCompatError` when the report holds errors. ``python -m lightning_spec.export.trt_compat
FILE...`` runs the check from a shell and exits 1 on errors.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

# Source: onnx/onnx-tensorrt docs/operators.md, "TensorRT 10.15 supports operators in the
# inclusive range of opset 9 to opset 24" (retrieved 2026-11). Re-typed here as
# "Operator: type codes" for the operators marked supported; the codes name the data types the
# table lists for each: F fp32, H fp16, B bf16, I int32, L int64, O bool, U uint8,
# Q quantized types (int8 / int4 / fp8 / fp4, through Q/DQ only).
TRT_VERSION = "10.15"
SUPPORTED_OPSETS = (9, 24)
_SUPPORT_TABLE = """
Abs: FHBIL | Acos: FHB | Acosh: FHB | Add: FHBIL | And: O | ArgMax: FHBIL | ArgMin: FHBIL
Asin: FHB | Asinh: FHB | Atan: FHB | Atanh: FHB | Attention: FHBQ | AveragePool: FHB
BatchNormalization: FHB | BlackmanWindow: FH | Cast: FHBILUO | CastLike: FHBILUO | Ceil: FHB
Celu: FHB | Clip: FHB | Concat: FHBILO | Constant: FHBILOQ | ConstantOfShape: FHBILOQ
Conv: FHB | ConvTranspose: FHB | Cos: FHB | Cosh: FHB | CumSum: FHB | DeformConv: FH
DepthToSpace: FHBIL | DequantizeLinear: Q | Div: FHBIL | Dropout: FHB | Einsum: FHB | Elu: FHB
Equal: FHBIL | Erf: FHB | Exp: FHB | Expand: FHBILO | EyeLike: FHBILO | Flatten: FHBILO
Floor: FHB | Gather: FHBILO | GatherElements: FHBILO | GatherND: FHBILO | Gelu: FHBILQ
Gemm: FHB | GlobalAveragePool: FHB | GlobalLpPool: FHB | GlobalMaxPool: FHB | Greater: FHBIL
GreaterOrEqual: FHBIL | GridSample: FH | GroupNormalization: FHB | GRU: FHB
HammingWindow: FH | HannWindow: FH | HardSigmoid: FHB | HardSwish: FHB | Hardmax: FHB
Identity: FHBILO | If: FHBILO | ImageScaler: FHB | InstanceNormalization: FHB | IsInf: FHB
IsNaN: FHBIL | LayerNormalization: FHB | LeakyRelu: FHB | Less: FHBIL | LessOrEqual: FHBIL
Log: FHB | LogSoftmax: FHB | Loop: FHBILO | LRN: FHB | LSTM: FHB | LpNormalization: FHB
LpPool: FHB | MatMul: FHB | Max: FHBIL | MaxPool: FHB | Mean: FHBIL
MeanVarianceNormalization: FHB | Min: FHBIL | Mish: FH | Mod: FHBIL | Mul: FHBIL
Neg: FHBIL | NonMaxSuppression: FH | NonZero: FH | Not: O | OneHot: FHBILO | Or: O
Pad: FHBIL | ParametricSoftplus: FHB | Pow: FHBIL | PRelu: FHB | QuantizeLinear: FHB
RandomNormal: FHB | RandomNormalLike: FHB | RandomUniform: FHB | RandomUniformLike: FHB
Range: FHBIL | Reciprocal: FHB | ReduceL1: FHBIL | ReduceL2: FHBIL | ReduceLogSum: FHBIL
ReduceLogSumExp: FHBIL | ReduceMax: FHBIL | ReduceMean: FHBIL | ReduceMin: FHBIL
ReduceProd: FHBIL | ReduceSum: FHBIL | ReduceSumSquare: FHBIL | Relu: FHBIL | Reshape: FHBILO
Resize: FHB | ReverseSequence: FHBILO | RMSNormalization: FHB | RNN: FHB | RoiAlign: FH
RotaryEmbedding: FHB | Round: FHB | STFT: F | ScaledTanh: FHB | Scan: FHB | Scatter: FHBIL
ScatterElements: FHBIL | ScatterND: FHBIL | Selu: FHB | Shape: FHBILO | Shrink: FHBIL
Sigmoid: FHB | Sign: FHBIL | Sin: FHB | Sinh: FHB | Size: FHBILO | Slice: FHBILO
Softmax: FHB | Softplus: FHB | Softsign: FHB | SpaceToDepth: FHBIL | Split: FHBILO
Sqrt: FHB | Squeeze: FHBILO | Sub: FHBIL | Sum: FHBIL | Tan: FHB | Tanh: FHB
TensorScatter: FHBI | ThresholdedRelu: FHB | Tile: FHBILO | TopK: FHBIL | Transpose: FHBILO
Trilu: FHBILO | Unsqueeze: FHBILO | Upsample: FHB | Where: FHBILO | Xor: O
"""
_CODE_TYPES = {
    "F": {"float32"},
    "H": {"float16"},
    "B": {"bfloat16"},
    "I": {"int32"},
    "L": {"int64"},
    "O": {"bool"},
    "U": {"uint8"},
    "Q": {"int8", "int4", "uint4", "float8e4m3fn", "float8e5m2", "float4e2m1"},
}


def _parse_table(table: str) -> dict[str, frozenset[str]]:
    supported: dict[str, frozenset[str]] = {}
    for entry in table.replace("\n", "|").split("|"):
        if not entry.strip():
            continue
        op, codes = (part.strip() for part in entry.split(":"))
        supported[op] = frozenset().union(*(_CODE_TYPES[code] for code in codes))
    return supported


#: operator -> data types TensorRT's ONNX parser accepts for its data input.
SUPPORTED_OPS: dict[str, frozenset[str]] = _parse_table(_SUPPORT_TABLE)

#: Operators whose output shape depends on input values: avoided by policy even where
#: TensorRT accepts them, because they need data-dependent allocation at run time.
DATA_DEPENDENT_OPS = {
    "NonZero": "output length = number of non-zero entries",
    "Unique": "output length = number of distinct values",
    "NonMaxSuppression": "output length = number of kept boxes",
    "Compress": "output length = number of true conditions",
}

#: Inputs that decide an operator's output shape; they must be computed from constants and
#: input *shapes* only, never from input values.
SHAPE_OPERANDS: dict[str, tuple[int, ...]] = {
    "Range": (0, 1, 2),
    "ConstantOfShape": (0,),
    "Expand": (1,),
    "Reshape": (1,),
    "Tile": (1,),
    "Slice": (1, 2, 3, 4),
    "Pad": (1,),
    "Resize": (2, 3),
    "Upsample": (1,),
    "TopK": (1,),
    "OneHot": (1,),
    "CenterCropPad": (1,),
}

#: Inputs that TensorRT requires to be build-time constants (initializers / Constant nodes).
CONSTANT_OPERANDS: dict[str, tuple[int, ...]] = {
    **{
        op: (1,)
        for op in (
            "ReduceL1",
            "ReduceL2",
            "ReduceLogSum",
            "ReduceLogSumExp",
            "ReduceMax",
            "ReduceMean",
            "ReduceMin",
            "ReduceProd",
            "ReduceSum",
            "ReduceSumSquare",
            "Squeeze",
            "Unsqueeze",
            "CumSum",
            "TopK",
            "OneHot",
        )
    },
    "Dropout": (2,),
}

#: Index of the input whose type the support table describes (default 0).
DATA_INPUT = {"Where": 1}

#: Types TensorRT engines can take or return as graph inputs / outputs.
IO_TYPES = {
    "float32",
    "float16",
    "bfloat16",
    "int32",
    "int64",
    "bool",
    "uint8",
    "int8",
    "float8e4m3fn",
}

_ELEM_TYPES = {
    1: "float32",
    2: "uint8",
    3: "int8",
    4: "uint16",
    5: "int16",
    6: "int32",
    7: "int64",
    8: "string",
    9: "bool",
    10: "float16",
    11: "float64",
    12: "uint32",
    13: "uint64",
    14: "complex64",
    15: "complex128",
    16: "bfloat16",
    17: "float8e4m3fn",
    18: "float8e4m3fnuz",
    19: "float8e5m2",
    20: "float8e5m2fnuz",
    21: "uint4",
    22: "int4",
    23: "float4e2m1",
}


@dataclass
class Issue:
    """One finding: `severity` is "error" (the parser would reject it) or "warning"."""

    severity: str
    code: str
    message: str
    node: str | None = None
    op_type: str | None = None

    def __str__(self) -> str:
        where = f" [{self.op_type} {self.node}]" if self.node or self.op_type else ""
        return f"{self.severity}: {self.code}{where}: {self.message}"


@dataclass
class CompatReport:
    """The outcome of `check_trt_compat` for one graph."""

    graph: str
    opset: int | None
    operators: list[str]
    issues: list[Issue] = field(default_factory=list)
    trt_version: str = TRT_VERSION

    @property
    def errors(self) -> list[Issue]:
        return [issue for issue in self.issues if issue.severity == "error"]

    @property
    def warnings(self) -> list[Issue]:
        return [issue for issue in self.issues if issue.severity == "warning"]

    @property
    def ok(self) -> bool:
        return not self.errors

    def to_dict(self) -> dict[str, Any]:
        return {
            "graph": self.graph,
            "opset": self.opset,
            "operators": self.operators,
            "checked_against": f"TensorRT {self.trt_version} ONNX parser support matrix",
            "ok": self.ok,
            "issues": [asdict(issue) for issue in self.issues],
        }

    def raise_if_errors(self) -> None:
        if self.errors:
            raise TrtCompatError(self)


class TrtCompatError(RuntimeError):
    """A graph uses something TensorRT's ONNX parser does not support."""

    def __init__(self, report: CompatReport) -> None:
        lines = "\n  ".join(str(issue) for issue in report.errors)
        super().__init__(f"{report.graph}: not TensorRT-compatible:\n  {lines}")
        self.report = report


def _load(model_or_path: Any) -> tuple[Any, str]:
    import onnx

    if isinstance(model_or_path, (str, Path)):
        return onnx.load(str(model_or_path)), Path(model_or_path).name
    return model_or_path, model_or_path.graph.name or "<model>"


def _types(model: Any) -> dict[str, str]:
    """Tensor name -> dtype for everything shape inference can type (subgraphs included)."""
    import onnx

    try:
        inferred = onnx.shape_inference.infer_shapes(model, check_type=False, strict_mode=False)
    except Exception:  # a graph shape inference cannot read is still worth checking
        inferred = model
    types: dict[str, str] = {}

    def visit(graph: Any) -> None:
        for value in list(graph.input) + list(graph.output) + list(graph.value_info):
            elem = value.type.tensor_type.elem_type
            if elem:
                types[value.name] = _ELEM_TYPES.get(elem, f"onnx:{elem}")
        for tensor in graph.initializer:
            types[tensor.name] = _ELEM_TYPES.get(tensor.data_type, f"onnx:{tensor.data_type}")
        for node in graph.node:
            if node.op_type == "Constant":
                for attr in node.attribute:
                    if attr.name == "value" and node.output:
                        types[node.output[0]] = _ELEM_TYPES.get(attr.t.data_type, "?")
            for attr in node.attribute:
                if attr.g.node:
                    visit(attr.g)
                for sub in attr.graphs:
                    visit(sub)

    visit(inferred.graph)
    return types


def _attr(node: Any, name: str, default: Any = None) -> Any:
    from onnx import helper

    for attr in node.attribute:
        if attr.name == name:
            return helper.get_attribute_value(attr)
    return default


class _Checker:
    def __init__(self, types: dict[str, str], opset_range: tuple[int, int]) -> None:
        self.types = types
        self.opset_range = opset_range
        self.issues: list[Issue] = []
        self.operators: set[str] = set()

    def add(self, severity: str, code: str, message: str, node: Any = None) -> None:
        self.issues.append(
            Issue(
                severity,
                code,
                message,
                node=(node.name or (node.output[0] if node.output else None)) if node else None,
                op_type=node.op_type if node is not None else None,
            )
        )

    def check_graph(self, graph: Any, outer_constants: set[str], outer_shapes: set[str]) -> None:
        constants = set(outer_constants) | {t.name for t in graph.initializer}
        # "shape-derived": computed from constants and tensor shapes, never tensor values.
        shape_derived = set(outer_shapes) | constants
        for node in graph.node:
            self.check_node(node, constants, shape_derived)
            inputs = [name for name in node.input if name]
            if node.op_type == "Constant":
                constants.update(node.output)
                shape_derived.update(node.output)
            elif node.op_type in {"Shape", "Size"}:
                shape_derived.update(node.output)
            elif inputs and all(name in shape_derived for name in inputs):
                shape_derived.update(node.output)
                if all(name in constants for name in inputs):
                    constants.update(node.output)
            for attr in node.attribute:
                subgraphs = ([attr.g] if attr.g.node else []) + list(attr.graphs)
                for sub in subgraphs:
                    self.check_graph(sub, constants, shape_derived)

    def check_node(self, node: Any, constants: set[str], shape_derived: set[str]) -> None:
        op = node.op_type
        self.operators.add(op if node.domain in ("", "ai.onnx") else f"{node.domain}::{op}")
        if node.domain not in ("", "ai.onnx"):
            self.add(
                "error",
                "custom-domain",
                f"operator from domain {node.domain!r} needs a TensorRT plugin",
                node,
            )
            return
        if op in DATA_DEPENDENT_OPS:
            self.add(
                "error",
                "data-dependent-shape",
                f"{op} has a data-dependent output shape ({DATA_DEPENDENT_OPS[op]})",
                node,
            )
        if op not in SUPPORTED_OPS:
            self.add(
                "error",
                "unsupported-operator",
                f"{op} is not supported by TensorRT {TRT_VERSION}'s ONNX parser",
                node,
            )
            return
        self._check_types(node)
        for index in SHAPE_OPERANDS.get(op, ()):
            if index < len(node.input) and node.input[index]:
                if node.input[index] not in shape_derived:
                    self.add(
                        "error",
                        "data-dependent-shape",
                        f"input {index} ({node.input[index]!r}) decides the output shape but "
                        "is computed from tensor values, not from shapes and constants",
                        node,
                    )
        for index in CONSTANT_OPERANDS.get(op, ()):
            if index < len(node.input) and node.input[index]:
                if node.input[index] not in constants:
                    self.add(
                        "error",
                        "non-constant-operand",
                        f"input {index} ({node.input[index]!r}) must be a build-time constant",
                        node,
                    )
        self._check_attributes(node)

    def _check_types(self, node: Any) -> None:
        index = DATA_INPUT.get(node.op_type, 0)
        if index >= len(node.input) or not node.input[index]:
            return
        dtype = self.types.get(node.input[index])
        if dtype is None:
            return
        allowed = SUPPORTED_OPS[node.op_type]
        if dtype == "float64":
            self.add(
                "warning",
                "double",
                "float64 data: TensorRT casts it down to float32 (clamping at +-FLT_MAX)",
                node,
            )
        elif dtype not in allowed:
            self.add(
                "error",
                "unsupported-type",
                f"{node.op_type} on {dtype} data (TensorRT accepts {sorted(allowed)})",
                node,
            )

    def _check_attributes(self, node: Any) -> None:
        op = node.op_type
        if op == "Constant":
            for name in ("sparse_value", "value_string", "value_strings"):
                if _attr(node, name) is not None:
                    self.add("error", "unsupported-attribute", f"Constant {name}", node)
        if op == "TopK" and _attr(node, "sorted", 1) != 1:
            self.add("error", "unsupported-attribute", "TopK needs sorted=1", node)
        if op == "ScatterND" and _attr(node, "reduction", b"none") not in (b"none", "none"):
            self.add("error", "unsupported-attribute", "ScatterND reduction must be none", node)
        if op in {"AveragePool", "MaxPool", "LpPool"}:
            dilations = _attr(node, "dilations")
            if dilations and any(d != 1 for d in dilations):
                self.add("error", "unsupported-attribute", f"{op} dilations must be 1", node)
        if op == "MaxPool" and len([o for o in node.output if o]) > 1:
            self.add("error", "unsupported-output", "MaxPool Indices output", node)
        if op == "LayerNormalization" and len([o for o in node.output if o]) > 1:
            self.add("error", "unsupported-output", "LayerNormalization: only Y", node)
        if op == "LSTM" and (_attr(node, "input_forget", 0) or _attr(node, "layout", 0)):
            self.add("error", "unsupported-attribute", "LSTM input_forget/layout must be 0", node)
        if op == "Resize":
            mode = _attr(node, "mode", b"nearest")
            mode = mode.decode() if isinstance(mode, bytes) else mode
            if mode not in ("nearest", "linear"):
                self.add("error", "unsupported-attribute", f"Resize mode {mode!r}", node)
            if _attr(node, "antialias", 0):
                self.add("error", "unsupported-attribute", "Resize antialias", node)


def check_trt_compat(
    model_or_path: Any,
    *,
    strict: bool = False,
    opset_range: tuple[int, int] = SUPPORTED_OPSETS,
) -> CompatReport:
    """Check an ONNX file or ModelProto against TensorRT's ONNX parser support matrix."""
    from onnx import inliner

    model, name = _load(model_or_path)
    if model.functions:
        model = inliner.inline_local_functions(model)
    checker = _Checker(_types(model), opset_range)
    opset = None
    for entry in model.opset_import:
        if entry.domain in ("", "ai.onnx"):
            opset = int(entry.version)
    if opset is None:
        checker.add("error", "opset", "the model imports no default-domain opset")
    elif not opset_range[0] <= opset <= opset_range[1]:
        checker.add(
            "error",
            "opset",
            f"opset {opset} outside TensorRT {TRT_VERSION}'s range "
            f"{opset_range[0]}..{opset_range[1]}",
        )
    for value in list(model.graph.input) + list(model.graph.output):
        elem = value.type.tensor_type.elem_type
        dtype = _ELEM_TYPES.get(elem, f"onnx:{elem}")
        if not value.type.HasField("tensor_type"):
            checker.add("error", "io-type", f"{value.name}: not a tensor (sequence/map/optional)")
        elif dtype not in IO_TYPES:
            checker.add(
                "error", "io-type", f"{value.name}: {dtype} is not a TensorRT input/output type"
            )
    initializer_names = {t.name for t in model.graph.initializer}
    for value in model.graph.input:
        if value.name in initializer_names:
            continue
        for axis, dim in enumerate(value.type.tensor_type.shape.dim):
            if not dim.HasField("dim_value") and not dim.dim_param:
                checker.add(
                    "warning",
                    "unnamed-dynamic-dim",
                    f"{value.name} axis {axis} is dynamic without a name: no profile can be "
                    "derived for it",
                )
    checker.check_graph(model.graph, set(), set())
    report = CompatReport(
        graph=name, opset=opset, operators=sorted(checker.operators), issues=checker.issues
    )
    if strict:
        report.raise_if_errors()
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m lightning_spec.export.trt_compat",
        description="Check ONNX files against TensorRT's ONNX parser support matrix.",
    )
    parser.add_argument("files", nargs="+", type=Path)
    args = parser.parse_args(argv)
    failed = False
    for path in args.files:
        report = check_trt_compat(path)
        status = "ok" if report.ok else "FAILED"
        print(f"{path}: {status} (opset {report.opset}, {len(report.operators)} operators)")
        for issue in report.issues:
            print(f"  {issue}")
        failed |= not report.ok
    return 1 if failed else 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
