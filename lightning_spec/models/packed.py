"""Prepacked linear weights for CPU inference: verifying k tokens costs about what 1 does.

On this CPU class (AVX2/FMA, 2 cores) the default `F.linear` path pays a large penalty as soon
as a matmul has more than one row: one SmolLM2 layer's seven projections take 0.44 ms for 1 row
and 0.86 ms for 4, against 0.27 / 0.32 ms with the same fp32 weights reordered once into
oneDNN's blocked layout (`torch.ops.mkldnn._reorder_linear_weight`, the op PyTorch's own
inductor uses on CPU); 32 rows: 2.6 vs 1.3 ms (experiments/cpu-speed/LOG.md). Speculative decoding verifies
several tokens per target forward, so this is the lever that makes it pay on a CPU.

The weights stay fp32 and the maths is the same GEMM with another summation order, so logits
move by ~1e-6: greedy outputs of the packed target are checked against the unpacked target's in
tests, and losslessness is always judged against the target as it runs (as for dtypes). The
packed copy is inference-only: it is not saved, not trained and not moved between devices.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = [
    "PackedLinear",
    "is_prepacked",
    "packing",
    "prepack_linears",
    "prepack_where_possible",
    "prepack_unavailable_reason",
]

DEFAULT_ROWS_HINT = 32
"""Batch-size hint for the reorder: tree verification feeds up to a few dozen rows."""


def prepack_unavailable_reason(module: nn.Module) -> str | None:
    """Why `module` cannot be prepacked here (None when it can)."""
    if not torch.backends.mkldnn.is_available() or not hasattr(
        torch.ops.mkldnn, "_reorder_linear_weight"
    ):
        return "this torch build has no oneDNN (mkldnn) linear prepacking"
    parameter = next(module.parameters(), None)
    if parameter is None:
        return "the module has no parameters"
    if parameter.device.type != "cpu":
        return f"prepacking is a CPU path; the module is on {parameter.device.type}"
    if parameter.dtype != torch.float32:
        return f"prepacking keeps fp32 exactness; the module is {parameter.dtype}"
    return None


class PackedLinear(nn.Module):
    """`nn.Linear` for inference with its weight prepacked for oneDNN (see module docstring)."""

    def __init__(self, linear: nn.Linear, rows_hint: int = DEFAULT_ROWS_HINT) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        weight = linear.weight.detach()
        self.register_buffer(
            "packed", torch.ops.mkldnn._reorder_linear_weight(weight, rows_hint), persistent=False
        )
        bias = None if linear.bias is None else linear.bias.detach()
        self.register_buffer("bias", bias, persistent=False)
        self.weight = linear.weight  # kept for code that reads it (tied embeddings, shapes)
        self.enabled = True
        """False: run the plain `F.linear` on the original weight (see `packing`)."""

    def forward(self, x: Tensor) -> Tensor:
        if not self.enabled:
            return F.linear(x, self.weight, self.bias)
        leading = x.shape[:-1]
        flat = x.reshape(-1, self.in_features)
        if not flat.is_contiguous():
            flat = flat.contiguous()
        out = torch.ops.mkldnn._linear_pointwise(flat, self.packed, self.bias, "none", [], "")
        return out.reshape(*leading, self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, prepacked"


def prepack_linears(module: nn.Module, rows_hint: int = DEFAULT_ROWS_HINT) -> int:
    """Replace every `nn.Linear` inside `module` by a `PackedLinear`; returns how many.

    Raises ValueError with the reason when the module cannot be prepacked (GPU, bf16/fp16,
    no oneDNN): callers that only want it where it helps check `prepack_unavailable_reason`.
    """
    reason = prepack_unavailable_reason(module)
    if reason is not None:
        raise ValueError(f"cannot prepack linear weights: {reason}")
    count = 0
    for name, child in list(module.named_modules()):
        for attr, sub in list(child.named_children()):
            if isinstance(sub, nn.Linear) and not isinstance(sub, PackedLinear):
                setattr(child, attr, PackedLinear(sub, rows_hint))
                count += 1
        del name
    return count


def is_prepacked(module: nn.Module) -> bool:
    """Whether any linear inside `module` is a `PackedLinear`."""
    return any(isinstance(sub, PackedLinear) for sub in module.modules())


@contextlib.contextmanager
def packing(module: nn.Module, enabled: bool) -> Iterator[None]:
    """Run `module` with its packed linears on (`enabled`) or off, restoring them afterwards.

    Off means the default `F.linear` path on the very same weights: one loaded target serves
    as both "the model a user has" and "our optimised model" side by side in one bench run,
    without a second 500 MB copy.
    """
    layers = [sub for sub in module.modules() if isinstance(sub, PackedLinear)]
    saved = [layer.enabled for layer in layers]
    for layer in layers:
        layer.enabled = enabled
    try:
        yield
    finally:
        for layer, state in zip(layers, saved, strict=True):
            layer.enabled = state


def prepack_where_possible(modules: dict[str, nn.Module | None], *, who: str) -> dict[str, object]:
    """Prepack each named module where it can run; {name: linears packed} plus ``skipped``
    {name: reason} for the others, each said once on stderr (an optimisation, not a must: a
    GPU or bf16 run goes on unpacked). `who` names the command in the message."""
    import sys

    done: dict[str, object] = {}
    skipped: dict[str, str] = {}
    for name, module in modules.items():
        if module is None or is_prepacked(module):
            continue
        reason = prepack_unavailable_reason(module)
        if reason is None:
            done[name] = prepack_linears(module)
        else:
            skipped[name] = reason
            print(f"{who}: --prepack skipped for the {name}: {reason}", file=sys.stderr)
    if skipped:
        done["skipped"] = skipped
    return done
