"""EAGLE-3 drafter step -> ONNX, with the KV cache as explicit inputs and outputs.

Serving stacks run a drafter one step at a time: append T tokens (a chain step, a tree level or
a prefill block) after P cached positions and read logits for them. That step is exported as
``drafter_step.onnx``::

    input_ids      int64 [batch, tokens]
    position_ids   int64 [batch, tokens]
    hidden_in      float [batch, tokens, H]        the drafter's own hidden stream
    past_keys      float [batch, Hkv, past, D]
    past_values    float [batch, Hkv, past, D]
    attention_mask bool  [batch, tokens, kv_length] True = may attend; kv_length = past + tokens
    ->
    logits         float [batch, tokens, V_draft]
    hidden_out     float [batch, tokens, H]        fed back as the next step's hidden_in
    present_keys   float [batch, Hkv, kv_length, D] past followed by the new positions
    present_values float [batch, Hkv, kv_length, D]

The target-feature path (EAGLE-3's ``fc``: fused low/middle/high target hidden states -> H) is a
second, tiny graph ``fc.onnx`` (``features [batch, tokens, F] -> hidden [batch, tokens, H]``):
a step fed by target features runs ``fc`` then the step graph; a step fed by the drafter's own
hidden state runs the step graph alone. Both graphs stay free of control flow and booleans that
pick a path.

Dynamic sizes. ``torch.export`` specialises any dimension whose example size is 0 or 1, so the
graphs are traced with example sizes >= 2 (batch 2, tokens 3, past 5: distinct, so no two
dimensions are unified by accident) and named, shared ``torch.export.Dim`` objects declared with
``min=2``. That bound only constrains tracing: the ONNX file carries symbolic dimensions and no
bounds, and onnxruntime runs it at batch 1, tokens 1 and past 0 (tests check all three). Prefill
therefore goes through the same graph with an empty past (``past = 0``); no separate prefill
graph exists. ``kv_length`` is ``past + tokens``: torch.export cannot declare a sum of two
dimensions, so the mask's last axis is traced as ``Dim.AUTO`` and renamed afterwards; the
relation is recorded under ``derived_dims`` in the manifest for TensorRT profiles.

The graphs are exported in float32 whatever dtype the drafter was trained in; reduced precision
is a TensorRT build option (``export/tensorrt.py``).
"""

from __future__ import annotations

import copy
import logging
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from lightning_spec.io import atomic_path
from lightning_spec.models.drafters.eagle3 import Eagle3Drafter, KVState

log = logging.getLogger(__name__)

DEFAULT_OPSET = 18
MIN_OPSET = 18
STEP_FILE = "drafter_step.onnx"
FC_FILE = "fc.onnx"
STEP_INPUTS = (
    "input_ids",
    "position_ids",
    "hidden_in",
    "past_keys",
    "past_values",
    "attention_mask",
)
STEP_OUTPUTS = ("logits", "hidden_out", "present_keys", "present_values")
FC_INPUTS = ("features",)
FC_OUTPUTS = ("hidden",)
#: Example sizes used for tracing: >= 2 and pairwise distinct (see the module docstring).
TRACE_BATCH, TRACE_TOKENS, TRACE_PAST = 2, 3, 5
#: Derived dimensions of the step graph, as sums of named dimensions (and integers).
STEP_DERIVED_DIMS = {"kv_length": "past + tokens"}

_ONNX_DTYPES = {
    1: "float32",
    6: "int32",
    7: "int64",
    9: "bool",
    10: "float16",
    11: "float64",
    16: "bfloat16",
}


@dataclass
class TensorSpec:
    """Name, dtype and shape of a graph input or output; strings in `shape` are dynamic."""

    name: str
    dtype: str
    shape: list[int | str]


@dataclass
class GraphSpec:
    """What the manifest records about one exported graph."""

    name: str
    file: str
    opset: int
    inputs: list[TensorSpec]
    outputs: list[TensorSpec]
    dynamic_dims: list[str]
    derived_dims: dict[str, str] = field(default_factory=dict)
    notes: str = ""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class DrafterStepGraph(nn.Module):
    """`Eagle3Drafter.step` on the hidden stream with the cache passed in and out explicitly."""

    def __init__(self, drafter: Eagle3Drafter) -> None:
        super().__init__()
        self.drafter = drafter

    def forward(
        self,
        input_ids: Tensor,  # [B, T]
        position_ids: Tensor,  # [B, T]
        hidden_in: Tensor,  # [B, T, H]
        past_keys: Tensor,  # [B, Hkv, P, D]
        past_values: Tensor,  # [B, Hkv, P, D]
        attention_mask: Tensor,  # [B, T, P + T] bool
    ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        state = KVState(past_keys, past_values)
        out = self.drafter.step(
            state, input_ids, position_ids, hidden=hidden_in, mask=attention_mask
        )
        return out.logits, out.hidden, state.keys, state.values


class FeatureProjection(nn.Module):
    """EAGLE-3's `fc` (after its per-layer feature norms, EAGLE-3.1): fused target features
    [B, T, F] -> drafter hidden [B, T, H]."""

    def __init__(self, drafter: Eagle3Drafter) -> None:
        super().__init__()
        self.fc = drafter.fc
        self.feature_norms = drafter.feature_norms
        self.drafter_fuse = drafter.fuse

    def forward(self, features: Tensor) -> Tensor:
        return self.drafter_fuse(features)


def export_ready(drafter: Eagle3Drafter) -> Eagle3Drafter:
    """A float32, eval-mode copy on the CPU (the drafter passed in is left untouched)."""
    if not isinstance(drafter, Eagle3Drafter) or drafter.drafter_type != "eagle3":
        # Hydra subclasses the EAGLE-3 head for its vocabulary but has heads, not the layer
        # this graph exports
        raise TypeError(
            f"ONNX export supports Eagle3Drafter, got {type(drafter).__name__} "
            f"(drafter_type {getattr(drafter, 'drafter_type', '?')!r})"
        )
    return copy.deepcopy(drafter).to(device="cpu", dtype=torch.float32).eval()


def step_example_inputs(
    drafter: Eagle3Drafter,
    batch: int = TRACE_BATCH,
    tokens: int = TRACE_TOKENS,
    past: int = TRACE_PAST,
    *,
    seed: int = 0,
) -> tuple[Tensor, ...]:
    """Random step inputs (in `STEP_INPUTS` order) with a causal mask over past + new tokens."""
    config = drafter.config
    generator = torch.Generator().manual_seed(seed)
    hidden = int(config["hidden_size"])
    kv_heads, head_dim = int(config["num_key_value_heads"]), int(config["head_dim"])
    vocab = int(config["target_vocab_size"])
    input_ids = torch.randint(0, vocab, (batch, tokens), generator=generator)
    position_ids = torch.arange(past, past + tokens).expand(batch, -1).clone()
    hidden_in = torch.randn(batch, tokens, hidden, generator=generator)
    past_keys = torch.randn(batch, kv_heads, past, head_dim, generator=generator)
    past_values = torch.randn(batch, kv_heads, past, head_dim, generator=generator)
    mask = torch.ones(batch, tokens, past + tokens, dtype=torch.bool)
    mask[:, :, past:] = torch.tril(torch.ones(tokens, tokens, dtype=torch.bool))
    return input_ids, position_ids, hidden_in, past_keys, past_values, mask


def export_module(
    module: nn.Module,
    args: tuple[Tensor, ...],
    dynamic_shapes: dict[str, dict[int, Any]],
    input_names: tuple[str, ...],
    output_names: tuple[str, ...],
    path: Path,
    opset: int,
) -> None:
    """Export `module` called on `args` to the ONNX file `path` with torch's dynamo exporter
    (`dynamic_shapes` naming the axes that vary), inputs and outputs named as given."""
    if opset < MIN_OPSET:
        raise ValueError(f"opset {opset} is too old: the dynamo exporter needs >= {MIN_OPSET}")
    path.parent.mkdir(parents=True, exist_ok=True)
    # "torchvision is not installed. Skipping torchvision::nms" and similar, once per export.
    registry_log = logging.getLogger("torch.onnx._internal.exporter._registration")
    previous_level = registry_log.level
    registry_log.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            # "axis name X will not be used, since it shares the same shape constraints": our
            # names are shared on purpose.
            warnings.filterwarnings("ignore", message=".*shares the same shape constraints.*")
            # torch-internal deprecation noise from pytree specs during tracing
            warnings.filterwarnings("ignore", category=FutureWarning, message=".*LeafSpec.*")
            program = torch.onnx.export(
                module.eval(),
                args,
                dynamo=True,
                dynamic_shapes=dynamic_shapes,
                input_names=list(input_names),
                output_names=list(output_names),
                opset_version=opset,
                external_data=False,
                verbose=False,
            )
    finally:
        registry_log.setLevel(previous_level)
    if program is None:  # pragma: no cover - the dynamo exporter always returns a program
        raise RuntimeError("torch.onnx.export returned no program")
    with atomic_path(path) as tmp:
        program.save(str(tmp), external_data=False)


def _rename_dims(path: Path, names: dict[tuple[str, int], str]) -> None:
    """Give (tensor, axis) pairs the dimension names the manifest uses."""
    import onnx

    model = onnx.load(str(path))
    for value in list(model.graph.input) + list(model.graph.output):
        for (tensor, axis), name in names.items():
            if value.name == tensor:
                dim = value.type.tensor_type.shape.dim[axis]
                dim.ClearField("dim_value")
                dim.dim_param = name
    with atomic_path(path) as tmp:
        onnx.save(model, str(tmp))


def export_step_graph(
    drafter: Eagle3Drafter, path: str | Path, *, opset: int = DEFAULT_OPSET
) -> GraphSpec:
    """Write the step graph (see the module docstring) to `path`; return its spec."""
    from torch.export import Dim

    path = Path(path)
    model = export_ready(drafter)
    batch, tokens, past = Dim("batch", min=2), Dim("tokens", min=2), Dim("past", min=2)
    dynamic_shapes = {
        "input_ids": {0: batch, 1: tokens},
        "position_ids": {0: batch, 1: tokens},
        "hidden_in": {0: batch, 1: tokens},
        "past_keys": {0: batch, 2: past},
        "past_values": {0: batch, 2: past},
        "attention_mask": {0: batch, 1: tokens, 2: Dim.AUTO},
    }
    export_module(
        DrafterStepGraph(model),
        step_example_inputs(model),
        dynamic_shapes,
        STEP_INPUTS,
        STEP_OUTPUTS,
        path,
        opset,
    )
    _rename_dims(
        path,
        {
            ("attention_mask", 2): "kv_length",
            ("present_keys", 2): "kv_length",
            ("present_values", 2): "kv_length",
        },
    )
    return graph_spec(
        path,
        name="drafter_step",
        opset=opset,
        dynamic_dims=["batch", "tokens", "past", "kv_length"],
        derived_dims=STEP_DERIVED_DIMS,
        notes=(
            "One EAGLE-3 drafter step over the hidden stream. past may be 0 (prefill); "
            "attention_mask is bool, True = may attend; present_* = past then the new tokens."
        ),
    )


def export_fc_graph(
    drafter: Eagle3Drafter, path: str | Path, *, opset: int = DEFAULT_OPSET
) -> GraphSpec:
    """Write the feature projection graph `fc.onnx` to `path`; return its spec."""
    from torch.export import Dim

    path = Path(path)
    model = export_ready(drafter)
    batch, tokens = Dim("batch", min=2), Dim("tokens", min=2)
    features = torch.randn(TRACE_BATCH, TRACE_TOKENS, model.fc.in_features)
    export_module(
        FeatureProjection(model),
        (features,),
        {"features": {0: batch, 1: tokens}},
        FC_INPUTS,
        FC_OUTPUTS,
        path,
        opset,
    )
    return graph_spec(
        path,
        name="fc",
        opset=opset,
        dynamic_dims=["batch", "tokens"],
        notes="EAGLE-3 fc: fused target features -> the hidden_in of drafter_step.",
    )


def export_drafter(
    drafter: Eagle3Drafter, output_dir: str | Path, *, opset: int = DEFAULT_OPSET
) -> dict[str, GraphSpec]:
    """Export `fc.onnx` and `drafter_step.onnx` into `output_dir`."""
    output_dir = Path(output_dir)
    return {
        "fc": export_fc_graph(drafter, output_dir / FC_FILE, opset=opset),
        "drafter_step": export_step_graph(drafter, output_dir / STEP_FILE, opset=opset),
    }


def graph_spec(
    path_or_model: str | Path | Any,
    *,
    name: str,
    opset: int,
    dynamic_dims: list[str],
    notes: str,
    derived_dims: dict[str, str] | None = None,
) -> GraphSpec:
    """The manifest entry of an exported graph: its file name and signature, read back from
    the ONNX file (or ModelProto, whose file is `name`.onnx)."""
    inputs, outputs = graph_io(path_or_model)
    file = Path(path_or_model).name if isinstance(path_or_model, (str, Path)) else f"{name}.onnx"
    return GraphSpec(
        name=name,
        file=file,
        opset=opset,
        inputs=inputs,
        outputs=outputs,
        dynamic_dims=dynamic_dims,
        derived_dims=dict(derived_dims or {}),
        notes=notes,
    )


def graph_io(path_or_model: str | Path | Any) -> tuple[list[TensorSpec], list[TensorSpec]]:
    """Inputs and outputs of an ONNX file or ModelProto as TensorSpecs."""
    import onnx

    model = path_or_model
    if isinstance(path_or_model, (str, Path)):
        model = onnx.load(str(path_or_model), load_external_data=False)

    def spec(value: Any) -> TensorSpec:
        tensor_type = value.type.tensor_type
        shape: list[int | str] = []
        for dim in tensor_type.shape.dim:
            if dim.HasField("dim_value"):
                shape.append(int(dim.dim_value))
            else:
                shape.append(dim.dim_param or "?")
        dtype = _ONNX_DTYPES.get(tensor_type.elem_type, f"onnx:{tensor_type.elem_type}")
        return TensorSpec(value.name, dtype, shape)

    return [spec(v) for v in model.graph.input], [spec(v) for v in model.graph.output]
