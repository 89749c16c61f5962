"""DFlash block drafter -> ONNX: the context graph and the block graph, with onnxruntime parity.

A DFlash drafter does two things while decoding (`models/drafters/dflash.py`), and each is one
graph:

``dflash_context.onnx`` absorbs committed tokens: the target features of the token before each
become context entries (keys and values of every drafter layer, rotated to the entries'
positions; and the projected rows, which the anchor slot of an ``anchor_feature`` drafter
reads)::

    features       float [batch, tokens, F]      target features f_{j-1} of absorbed token t_j
    position_ids   int64 [batch, tokens]         positions j of the absorbed tokens
    ->
    context_keys   float [layers, batch, Hkv, tokens, D]   entries at positions j - 1
    context_values float [layers, batch, Hkv, tokens, D]
    context_rows   float [batch, tokens, H]

``dflash_block.onnx`` drafts a whole block in one forward: the block [anchor, MASK x (B - 1)] at
positions root .. root + B - 1 over the cached context entries (the engine appends each
context graph output to its cache along the past axis)::

    anchor_embeds  float [batch, H]              the target's input embedding of the root token
    root_positions int64 [batch]
    past_keys      float [layers, batch, Hkv, past, D]
    past_values    float [layers, batch, Hkv, past, D]
    context_mask   bool  [batch, past]           True = the block may see this entry
    anchor_context float [batch, H]              (anchor_feature drafters only) the root's row
    ->
    logits         float [batch, B - 1, V_draft] draft slots 1 .. B - 1 (draft ids; d2t maps)
    hidden         float [batch, B - 1, H]       the slots' normed hidden states

Both graphs run the drafter's own methods (`DFlashDrafter.context_entries`, `anchor_input`,
`block_hidden`, `head_logits`), so nothing here re-implements the drafter. The input embedding
table stays outside the graph (it is the target's, which the serving engine already holds: for
today's vocabularies it would be 0.1-1 GB of constants); the LM head rows of the draft
vocabulary are inside it as a constant (the folder does not hold them either: export needs the
target). Dynamic sizes follow `export.onnx`: traced at distinct sizes >= 2, run at batch 1 and
past 0 by onnxruntime (the parity cases include both).
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from lightning_spec.export.onnx import (
    DEFAULT_OPSET,
    TRACE_BATCH,
    TRACE_PAST,
    TRACE_TOKENS,
    GraphSpec,
    export_module,
    graph_spec,
)
from lightning_spec.export.parity import argmax_agreement, compare_outputs, ort_session
from lightning_spec.models.drafters.dflash import DFlashDrafter

CONTEXT_FILE = "dflash_context.onnx"
BLOCK_FILE = "dflash_block.onnx"
CONTEXT_INPUTS = ("features", "position_ids")
CONTEXT_OUTPUTS = ("context_keys", "context_values", "context_rows")
BLOCK_INPUTS = ("anchor_embeds", "root_positions", "past_keys", "past_values", "context_mask")
BLOCK_OUTPUTS = ("logits", "hidden")
#: (batch, past) of the random block parity: batch 1 and an empty context included.
BLOCK_CASES = ((1, 0), (1, 7), (3, 16))


class ContextGraph(nn.Module):
    """`DFlashDrafter.context_entries` with the layers stacked into one tensor."""

    def __init__(self, drafter: DFlashDrafter) -> None:
        super().__init__()
        self.drafter = drafter

    def forward(self, features: Tensor, position_ids: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        rows, entries = self.drafter.context_entries(features, position_ids)
        keys = torch.stack([k for k, _ in entries])
        values = torch.stack([v for _, v in entries])
        return keys, values, rows


class BlockGraph(nn.Module):
    """One block forward (`anchor_input`, `block_hidden`, `head_logits`) over explicit caches."""

    def __init__(self, drafter: DFlashDrafter) -> None:
        super().__init__()
        self.drafter = drafter

    def forward(
        self,
        anchor_embeds: Tensor,
        root_positions: Tensor,
        past_keys: Tensor,
        past_values: Tensor,
        context_mask: Tensor,
        anchor_context: Tensor | None = None,
    ) -> tuple[Tensor, Tensor]:
        drafter = self.drafter
        contexts: list[tuple[Tensor, Tensor] | None] = [
            (past_keys[i], past_values[i]) for i in range(len(drafter.layers))
        ]
        anchor = drafter.anchor_input(anchor_embeds, anchor_context)
        hidden = drafter.block_hidden(anchor, root_positions, contexts, context_mask)
        return drafter.head_logits(hidden), hidden


def export_ready_dflash(drafter: DFlashDrafter) -> DFlashDrafter:
    """A float32, eval-mode CPU copy bound to float32 copies of the target's weights."""
    if not isinstance(drafter, DFlashDrafter):
        raise TypeError(f"expected a DFlashDrafter, got {type(drafter).__name__}")
    weights = drafter._weights()  # raises when no target was bound
    model = copy.deepcopy(drafter).to(device="cpu", dtype=torch.float32).eval()
    model._target = type(weights)(
        weights.embedding.detach().to("cpu", torch.float32),
        weights.head.detach().to("cpu", torch.float32).clone(),
        None if weights.head_bias is None else weights.head_bias.detach().to("cpu", torch.float32),
    )
    return model


def _block_inputs(model: DFlashDrafter) -> tuple[str, ...]:
    return BLOCK_INPUTS + (("anchor_context",) if model.anchor_feature else ())


def block_example_inputs(
    model: DFlashDrafter, batch: int, past: int, *, seed: int = 0
) -> tuple[Tensor, ...]:
    """Random block-graph inputs (in `_block_inputs` order); every block sees >= 1 entry when
    there is context, the rest of the mask random."""
    config = model.config
    generator = torch.Generator().manual_seed(seed)
    hidden, layers = int(config["hidden_size"]), len(model.layers)
    kv_heads, head_dim = int(config["num_key_value_heads"]), int(config["head_dim"])
    anchor = torch.randn(batch, hidden, generator=generator)
    roots = torch.randint(past, past + 50, (batch,), generator=generator)
    keys = torch.randn(layers, batch, kv_heads, past, head_dim, generator=generator)
    values = torch.randn(layers, batch, kv_heads, past, head_dim, generator=generator)
    mask = torch.rand(batch, past, generator=generator) < 0.7
    if past:
        mask[:, 0] = True
    inputs = (anchor, roots, keys, values, mask)
    if model.anchor_feature:
        inputs += (torch.randn(batch, hidden, generator=generator),)
    return inputs


def export_context_graph(
    drafter: DFlashDrafter, path: str | Path, *, opset: int = DEFAULT_OPSET
) -> GraphSpec:
    """Write `dflash_context.onnx` to `path`; return its spec."""
    from torch.export import Dim

    path = Path(path)
    model = export_ready_dflash(drafter)
    batch, tokens = Dim("batch", min=2), Dim("tokens", min=2)
    features = torch.randn(TRACE_BATCH, TRACE_TOKENS, model.fc.in_features)
    positions = torch.arange(1, TRACE_TOKENS + 1).expand(TRACE_BATCH, -1).contiguous()
    export_module(
        ContextGraph(model),
        (features, positions),
        {"features": {0: batch, 1: tokens}, "position_ids": {0: batch, 1: tokens}},
        CONTEXT_INPUTS,
        CONTEXT_OUTPUTS,
        path,
        opset,
    )
    return graph_spec(
        path,
        name="dflash_context",
        opset=opset,
        dynamic_dims=["batch", "tokens"],
        notes=(
            "DFlash context absorb: target features of committed tokens -> per-layer context "
            "keys/values (appended to the past cache) and projected rows."
        ),
    )


def export_block_graph(
    drafter: DFlashDrafter, path: str | Path, *, opset: int = DEFAULT_OPSET
) -> GraphSpec:
    """Write `dflash_block.onnx` to `path`; return its spec."""
    from torch.export import Dim

    path = Path(path)
    model = export_ready_dflash(drafter)
    batch, past = Dim("batch", min=2), Dim("past", min=2)
    names = _block_inputs(model)
    shapes: dict[str, dict[int, Any]] = {
        "anchor_embeds": {0: batch},
        "root_positions": {0: batch},
        "past_keys": {1: batch, 3: past},
        "past_values": {1: batch, 3: past},
        "context_mask": {0: batch, 1: past},
    }
    if model.anchor_feature:
        shapes["anchor_context"] = {0: batch}
    example = block_example_inputs(model, TRACE_BATCH, TRACE_PAST)
    export_module(BlockGraph(model), example, shapes, names, BLOCK_OUTPUTS, path, opset)
    slots = model.block_size - 1
    return graph_spec(
        path,
        name="dflash_block",
        opset=opset,
        dynamic_dims=["batch", "past"],
        notes=(
            f"One DFlash block forward: {slots} draft slots in one call. anchor_embeds is the "
            "target's input embedding of the root token (the table is not in the graph); "
            "context_mask is bool, True = visible; logits are over the draft vocabulary (d2t)."
        ),
    )


def export_dflash(
    drafter: DFlashDrafter, output_dir: str | Path, *, opset: int = DEFAULT_OPSET
) -> dict[str, GraphSpec]:
    """Export both graphs into `output_dir`."""
    output_dir = Path(output_dir)
    return {
        "dflash_context": export_context_graph(drafter, output_dir / CONTEXT_FILE, opset=opset),
        "dflash_block": export_block_graph(drafter, output_dir / BLOCK_FILE, opset=opset),
    }


# ------------------------------------------------------------------------------------ parity
class _Tally:
    """Worst difference, reference scale and argmax agreement over parity cases."""

    def __init__(self) -> None:
        self.worst = self.scale = 0.0
        self.agree = self.total = 0

    def diffs(self, pairs: dict[str, tuple[Tensor, np.ndarray]]) -> dict[str, float]:
        out = {}
        for name, (reference, candidate) in pairs.items():
            diff, scale = compare_outputs(reference, candidate)
            out[name] = diff
            self.worst, self.scale = max(self.worst, diff), max(self.scale, scale)
        return out

    def logits(self, reference: Tensor, candidate: np.ndarray) -> float:
        hits, count = argmax_agreement(reference, candidate)
        self.agree, self.total = self.agree + hits, self.total + count
        return hits / max(count, 1)

    def result(self, cases: list[dict[str, Any]]) -> dict[str, Any]:
        return {
            "cases": cases,
            "max_abs_diff": self.worst,
            "reference_scale": self.scale,
            "argmax_agreement": self.agree / max(self.total, 1),
        }


def _sessions(export_dir: Path, providers: Any) -> tuple[Any, Any]:
    return ort_session(export_dir / CONTEXT_FILE, providers), ort_session(export_dir / BLOCK_FILE, providers)


@torch.no_grad()
def random_parity(
    drafter: DFlashDrafter, export_dir: str | Path, *, seed: int = 0, providers: Any = None
) -> dict[str, Any]:
    """Both graphs against the PyTorch drafter on random inputs (`BLOCK_CASES`)."""
    model = export_ready_dflash(drafter)
    context_session, block_session = _sessions(Path(export_dir), providers)
    graph, block = ContextGraph(model), BlockGraph(model)
    tally, cases = _Tally(), []
    generator = torch.Generator().manual_seed(seed)
    for index, (batch, past) in enumerate(BLOCK_CASES):
        tokens = max(1, past)
        features = torch.randn(batch, tokens, model.fc.in_features, generator=generator)
        positions = torch.arange(1, tokens + 1).expand(batch, -1).contiguous()
        context = context_session.run(None, {"features": features.numpy(),
                                             "position_ids": positions.numpy()})  # fmt: skip
        reference = graph(features, positions)
        diffs = tally.diffs(
            {f"context_{n}": (r, c) for n, r, c in zip(CONTEXT_OUTPUTS, reference, context, strict=True)}
        )
        inputs = block_example_inputs(model, batch, past, seed=seed + index)
        feeds = {name: t.numpy() for name, t in zip(_block_inputs(model), inputs, strict=True)}
        logits, hidden = block_session.run(None, feeds)
        ref_logits, ref_hidden = block(*inputs)
        diffs.update(tally.diffs({"logits": (ref_logits, logits), "hidden": (ref_hidden, hidden)}))
        agreement = tally.logits(ref_logits, logits)
        cases.append({"batch": batch, "past": past, "max_abs_diff": diffs, "argmax_agreement": agreement})
    return tally.result(cases)


@torch.no_grad()
def sequence_parity(
    drafter: DFlashDrafter,
    export_dir: str | Path,
    *,
    features: Tensor | None = None,
    absorbed_ids: Tensor | None = None,
    seed: int = 0,
    providers: Any = None,
) -> dict[str, Any]:
    """The decoder's own path against the graphs on one sequence.

    PyTorch: the drafter absorbs the sequence through `step` and drafts blocks at several roots
    with `draft_block` (what `BlockProposer` runs while decoding). ONNX: the context graph
    absorbs the same (token, feature) pairs, the block graph drafts from its outputs with the
    target's embeddings of the root tokens. `features` [1, C, F] are f_{j-1} of the absorbed
    tokens `absorbed_ids` [1, C] (t_1 .. t_C at positions 1 .. C; real target features when
    given, random otherwise).
    """
    from lightning_spec.models.drafters.proposer import absorb

    model = export_ready_dflash(drafter)
    context_session, block_session = _sessions(Path(export_dir), providers)
    generator = torch.Generator().manual_seed(seed)
    if features is None or absorbed_ids is None:
        count = 24
        features = torch.randn(1, count, model.fc.in_features, generator=generator)
        absorbed_ids = torch.randint(0, model.target_vocab_size, (1, count), generator=generator)
    features = features.detach().to("cpu", torch.float32)
    absorbed_ids = absorbed_ids.detach().to("cpu").long()
    count = int(absorbed_ids.shape[1])
    state = model.new_state(1)
    absorb(model, state, absorbed_ids, 1, features)
    positions = torch.arange(1, count + 1).unsqueeze(0)
    keys, values, rows = context_session.run(
        None, {"features": features.numpy(), "position_ids": positions.numpy()}
    )
    tally = _Tally()
    diffs = tally.diffs(
        {
            "context_keys": (torch.stack([c.keys for c in state.layers]), keys),
            "context_values": (torch.stack([c.values for c in state.layers]), values),
        }
    )
    # Blocks rooted at several committed tokens: root R sees entries 0 .. R - 1, its anchor is
    # the absorbed token of entry R - 1 (t_R) and, with anchor_feature, that entry's row.
    roots = torch.unique(torch.linspace(1, count, steps=min(count, 6)).round().long())
    reference = model.draft_block(state, roots, context_lengths=roots)
    batch = int(roots.shape[0])
    embeds = nn.functional.embedding(absorbed_ids[0, roots - 1], model._weights().embedding)
    feeds = {
        "anchor_embeds": embeds.numpy(),
        "root_positions": roots.numpy(),
        "past_keys": np.repeat(keys, batch, axis=1),
        "past_values": np.repeat(values, batch, axis=1),
        "context_mask": (torch.arange(count).unsqueeze(0) < roots.unsqueeze(1)).numpy(),
    }
    if model.anchor_feature:
        feeds["anchor_context"] = rows[0, (roots - 1).numpy()]
    logits, _ = block_session.run(None, feeds)
    diffs.update(tally.diffs({"logits": (reference, logits)}))
    agreement = tally.logits(reference, logits)
    case = {"absorbed": count, "roots": roots.tolist(), "max_abs_diff": diffs,
            "argmax_agreement": agreement}  # fmt: skip
    return tally.result([case])
