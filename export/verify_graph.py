"""Greedy tree verification as a pure ONNX graph (no loops, no data-dependent shapes).

Inputs and outputs (N draft nodes, V target vocabulary)::

    draft_tokens  int64 [nodes]               target-vocabulary ids, topological order
    parents       int64 [nodes]               -1 = child of the root, else < own index
    target_logits float [nodes_plus_one, V]   row 0 at the root, row i + 1 at node i
    ->
    accept_length int64 []                    accepted draft tokens (0..N)
    path          int64 [nodes]               accepted node indices, depth 1 first, then -1
    bonus_token   int64 []                    argmax of the deepest accepted node's row

The rule is the project's greedy rule (`lightning_spec.decoding.verify.verify_greedy`): a node
is accepted iff its token is the argmax of its parent's row and its parent is accepted; the
deepest accepted node wins, ties going to the lowest node index.

How it stays a flat graph: nodes are shifted by one so that slot 0 is the root and slot i + 1
is node i; each slot holds a jump pointer (initially its parent, the root points at itself), a
flag "every node from here up to the pointer matches" and a count of nodes covered. One round
of pointer jumping (Wyllie's list ranking) composes each slot with its pointer's slot, doubling
the distance covered: ``ok &= ok[ptr]; depth += depth[ptr]; ptr = ptr[ptr]``. After
``ceil(log2(max_nodes))`` rounds, statically unrolled, every pointer reaches the root, so ``ok``
says "the whole path matches" and ``depth`` is the node's depth. The pointer tables of every
round are the 2^k-th-ancestor tables of binary lifting, which write out the accepted path with
one Gather per round and no NonZero. The only operators are Shape, Gather, ArgMax, Equal, And,
Add, Sub, Mul, Where, GreaterOrEqual, Concat, Range and Squeeze (constants are int64 and bool
initializers), all in TensorRT's ONNX parser list (`export/trt_compat.py` checks it). Trees larger than ``max_nodes`` need a
graph built with a larger bound (the host wrapper refuses them rather than return a wrong path).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

VERIFY_FILE = "tree_verify.onnx"
VERIFY_INPUTS = ("draft_tokens", "parents", "target_logits")
VERIFY_OUTPUTS = ("accept_length", "path", "bonus_token")
DEFAULT_MAX_NODES = 1024
VERIFY_DERIVED_DIMS = {"nodes_plus_one": "nodes + 1"}


def jump_rounds(max_nodes: int) -> int:
    """Rounds of pointer jumping that cover any path in a tree of `max_nodes` nodes."""
    if max_nodes < 1:
        raise ValueError(f"max_nodes must be >= 1, got {max_nodes}")
    return max(1, math.ceil(math.log2(max_nodes)))


class _GraphBuilder:
    """A few helpers over onnx.helper that name intermediate values uniquely."""

    def __init__(self) -> None:
        self.nodes: list[Any] = []
        self.initializers: list[Any] = []
        self._count = 0

    def fresh(self, hint: str) -> str:
        self._count += 1
        return f"{hint}_{self._count}"

    def op(self, op_type: str, inputs: list[str], hint: str | None = None, **attrs: Any) -> str:
        from onnx import helper

        output = self.fresh(hint or op_type.lower())
        self.nodes.append(helper.make_node(op_type, inputs, [output], name=output, **attrs))
        return output

    def op_to(self, op_type: str, inputs: list[str], output: str, **attrs: Any) -> str:
        from onnx import helper

        self.nodes.append(helper.make_node(op_type, inputs, [output], name=output, **attrs))
        return output

    def const(self, values: Any, hint: str = "const", dtype: type = int) -> str:
        """An int64 (or bool) initializer; a plain value gives a scalar."""
        import numpy as np
        from onnx import numpy_helper

        name = self.fresh(hint)
        array = np.asarray(values, dtype=np.bool_ if dtype is bool else np.int64)
        self.initializers.append(numpy_helper.from_array(array, name))
        return name


def build_verify_graph(
    *, max_nodes: int = DEFAULT_MAX_NODES, opset: int = 18, logits_dtype: str = "float32"
) -> Any:
    """The greedy tree-verification graph as an onnx.ModelProto (see the module docstring)."""
    import onnx
    from onnx import TensorProto, helper

    rounds = jump_rounds(max_nodes)
    elem = {"float32": TensorProto.FLOAT, "float16": TensorProto.FLOAT16}[logits_dtype]
    g = _GraphBuilder()
    zero, one, minus_one = g.const(0, "zero"), g.const(1, "one"), g.const(-1, "minus_one")
    axis0 = g.const([0], "axis0")

    # Sizes: N nodes, S = N + 1 slots (slot 0 = root).
    n_vec = g.op("Shape", ["draft_tokens"], "n_vec")  # [1]
    n = g.op("Squeeze", [n_vec, axis0], "n")  # []
    s = g.op("Add", [n, one], "slots")  # []
    slot_index = g.op("Range", [zero, s, one], "slot_index")  # [S]
    node_slots = g.op("Range", [one, s, one], "node_slots")  # [N] slots of the nodes

    # Argmax of every target row; row r belongs to slot r.
    row_argmax = g.op("ArgMax", ["target_logits"], "row_argmax", axis=1, keepdims=0)  # [S]

    # Initial pointers: the parent's slot; the root points at itself.
    parent_slot = g.op("Add", ["parents", one], "parent_slot")  # [N]
    pointer = g.op("Concat", [g.const([0], "root_slot"), parent_slot], "pointer0", axis=0)

    # ok[slot]: the node's token is the argmax of its parent's row (root: True).
    expected = g.op("Gather", [row_argmax, parent_slot], "expected", axis=0)  # [N]
    matches = g.op("Equal", ["draft_tokens", expected], "matches")  # [N] bool
    ok = g.op("Concat", [g.const([True], "root_ok", bool), matches], "ok0", axis=0)  # [S]

    # depth[slot]: nodes covered between the slot and its pointer (root: 0, nodes: 1).
    ones_n = g.op("Add", [g.op("Sub", [node_slots, node_slots]), one], "ones_n")  # [N] of 1
    depth = g.op("Concat", [g.const([0], "root_depth"), ones_n], "depth0", axis=0)  # [S]

    ancestors = [pointer]  # ancestors[k] = 2^k-th ancestor slot (saturating at the root)
    for k in range(rounds):
        ok_up = g.op("Gather", [ok, pointer], f"ok_up{k}", axis=0)
        ok = g.op("And", [ok, ok_up], f"ok{k + 1}")
        depth_up = g.op("Gather", [depth, pointer], f"depth_up{k}", axis=0)
        depth = g.op("Add", [depth, depth_up], f"depth{k + 1}")
        pointer = g.op("Gather", [pointer, pointer], f"pointer{k + 1}", axis=0)
        ancestors.append(pointer)

    # Best slot: deepest accepted, ties to the lowest index; the root (key 0) if none.
    # key = depth * S + (S - slot) for accepted nodes, 0 for the root, -1 for rejected nodes.
    zeros_s = g.op("Sub", [slot_index, slot_index], "zeros_s")  # [S] of 0
    node_key = g.op(
        "Add", [g.op("Mul", [depth, s]), g.op("Sub", [s, slot_index])], "node_key"
    )  # [S]
    is_root = g.op("Equal", [slot_index, zero], "is_root")
    key = g.op("Where", [is_root, zeros_s, node_key], "key_with_root")
    key = g.op("Where", [ok, key, g.op("Add", [zeros_s, minus_one])], "key")
    best = g.op("ArgMax", [key], "best", axis=0, keepdims=0)  # [] int64 slot

    g.op_to("Gather", [depth, best], "accept_length", axis=0)
    g.op_to("Gather", [row_argmax, best], "bonus_token", axis=0)

    # Path: output position p (0-based) holds the ancestor of `best` at depth p + 1, found by
    # climbing depth[best] - (p + 1) levels with the 2^k-th-ancestor tables.
    accept_length = "accept_length"
    position = g.op("Range", [zero, n, one], "position")  # [N]
    climb = g.op("Sub", [g.op("Sub", [accept_length, position]), one], "climb")  # [N]
    valid = g.op("GreaterOrEqual", [climb, zero], "valid")
    remaining = g.op("Where", [valid, climb, zero], "remaining")
    current = g.op("Add", [g.op("Sub", [position, position]), best], "start")  # [N] of best
    for k in reversed(range(rounds)):
        step = g.const(1 << k, f"pow{k}")
        take = g.op("GreaterOrEqual", [remaining, step], f"take{k}")
        jumped = g.op("Gather", [ancestors[k], current], f"jumped{k}", axis=0)
        current = g.op("Where", [take, jumped, current], f"current{k}")
        taken = g.op("Where", [take, step, zero], f"taken{k}")
        remaining = g.op("Sub", [remaining, taken], f"remaining{k}")
    node_index = g.op("Sub", [current, one], "node_index")
    zeros_n = g.op("Sub", [position, position], "zeros_n")  # [N] of 0
    g.op_to("Where", [valid, node_index, g.op("Add", [zeros_n, minus_one])], "path")

    inputs = [
        helper.make_tensor_value_info("draft_tokens", TensorProto.INT64, ["nodes"]),
        helper.make_tensor_value_info("parents", TensorProto.INT64, ["nodes"]),
        helper.make_tensor_value_info("target_logits", elem, ["nodes_plus_one", "vocab"]),
    ]
    outputs = [
        helper.make_tensor_value_info("accept_length", TensorProto.INT64, []),
        helper.make_tensor_value_info("path", TensorProto.INT64, ["nodes"]),
        helper.make_tensor_value_info("bonus_token", TensorProto.INT64, []),
    ]
    graph = helper.make_graph(
        g.nodes, "greedy_tree_verify", inputs, outputs, initializer=g.initializers
    )
    model = helper.make_model(
        graph,
        opset_imports=[helper.make_opsetid("", opset)],
        producer_name="lightning_spec.export.verify_graph",
    )
    model.ir_version = min(model.ir_version, 10)  # readable by older onnxruntime builds
    helper.set_model_props(model, {"max_nodes": str(max_nodes), "jump_rounds": str(rounds)})
    onnx.checker.check_model(model, full_check=True)
    return model


def export_verify_graph(
    path: str | Path, *, max_nodes: int = DEFAULT_MAX_NODES, opset: int = 18
) -> Any:
    """Write `tree_verify.onnx` to `path`; return its `GraphSpec` for the manifest."""
    import onnx

    from lightning_spec.export.onnx import graph_spec
    from lightning_spec.io import atomic_path

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    model = build_verify_graph(max_nodes=max_nodes, opset=opset)
    with atomic_path(path) as tmp:
        onnx.save(model, str(tmp))
    return graph_spec(
        path,
        name="tree_verify",
        opset=opset,
        dynamic_dims=["nodes", "nodes_plus_one", "vocab"],
        derived_dims=VERIFY_DERIVED_DIMS,
        notes=(
            f"Greedy tree verification, pointer jumping unrolled {jump_rounds(max_nodes)} rounds: "
            f"valid for trees of at most max_nodes={max_nodes} nodes. path is padded with -1."
        ),
    )
