"""Greedy tree verification as a pure ONNX graph, refereed by a plain-Python walk."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
import torch

from lightning_spec.export.parity import (
    OnnxTreeVerifier,
    random_tree,
    reference_greedy_verify,
    verify_graph_parity,
)
from lightning_spec.export.verify_graph import (
    VERIFY_INPUTS,
    VERIFY_OUTPUTS,
    build_verify_graph,
    export_verify_graph,
    jump_rounds,
)

#: Pointer jumping needs only these (plus shape plumbing); nothing data-dependent.
ALLOWED_OPS = {
    "Gather",
    "ArgMax",
    "Equal",
    "And",
    "Add",
    "Sub",
    "Mul",
    "Where",
    "GreaterOrEqual",
    "Concat",
    "Range",
    "Shape",
    "Squeeze",
}


@pytest.fixture(scope="module")
def verifier(tmp_path_factory: pytest.TempPathFactory) -> OnnxTreeVerifier:
    path = tmp_path_factory.mktemp("verify") / "tree_verify.onnx"
    export_verify_graph(path, max_nodes=64)
    return OnnxTreeVerifier(path)


def _run(verifier: OnnxTreeVerifier, tokens, parents, logits) -> tuple[int, list[int], int]:
    length, path, bonus = verifier.run(
        torch.as_tensor(tokens, dtype=torch.long),
        torch.as_tensor(parents, dtype=torch.long),
        torch.as_tensor(logits, dtype=torch.float32),
    )
    assert path.shape[0] == len(tokens)
    assert (path[length:] == -1).all(), "padding after the accepted path must be -1"
    return length, path[:length].tolist(), bonus


def test_graph_is_flat_and_valid() -> None:
    model = build_verify_graph(max_nodes=1024)
    onnx.checker.check_model(model, full_check=True)
    ops = {node.op_type for node in model.graph.node}
    assert ops <= ALLOWED_OPS, ops - ALLOWED_OPS
    assert [i.name for i in model.graph.input] == list(VERIFY_INPUTS)
    assert [o.name for o in model.graph.output] == list(VERIFY_OUTPUTS)
    props = {p.key: p.value for p in model.metadata_props}
    assert props == {"max_nodes": "1024", "jump_rounds": "10"}
    assert jump_rounds(1) == 1 and jump_rounds(64) == 6 and jump_rounds(65) == 7


def test_matches_reference_on_random_trees(verifier: OnnxTreeVerifier) -> None:
    result = verify_graph_parity(verifier, trees=300, max_nodes=64, seed=1)
    assert result["mismatches"] == 0, result["examples"]


def test_matches_decoding_verify_greedy(verifier: OnnxTreeVerifier) -> None:
    decoding = pytest.importorskip("lightning_spec.decoding.verify")
    from lightning_spec.decoding.tree import DraftTree

    rng = np.random.default_rng(7)
    for _ in range(100):
        n = int(rng.integers(0, 40))
        tokens, parents, logits = random_tree(n, 6, rng)
        tree = DraftTree(torch.from_numpy(tokens), torch.from_numpy(parents), torch.zeros(n))
        expected = decoding.verify_greedy(tree, torch.from_numpy(logits))
        got = verifier(tree, torch.from_numpy(logits))
        assert got.accepted.tolist() == expected.accepted.tolist()
        assert got.bonus_token == expected.bonus_token
        # The referee agrees with both.
        assert reference_greedy_verify(tokens, parents, logits)[1] == expected.accepted.tolist()


@pytest.mark.parametrize("max_nodes", [1, 2, 7, 8, 9, 16])
def test_full_length_chains_at_the_bound(tmp_path: Path, max_nodes: int) -> None:
    """A chain as long as max_nodes is the deepest tree the unrolled rounds must cover."""
    path = tmp_path / "v.onnx"
    export_verify_graph(path, max_nodes=max_nodes)
    verifier = OnnxTreeVerifier(path)
    rng = np.random.default_rng(max_nodes)
    logits = rng.standard_normal((max_nodes + 1, 5)).astype(np.float32)
    parents = np.arange(-1, max_nodes - 1)
    tokens = logits.argmax(-1)[parents + 1]  # every node matches: accept everything
    assert _run(verifier, tokens, parents, logits) == (
        max_nodes,
        list(range(max_nodes)),
        int(logits[-1].argmax()),
    )
    tokens[-1] = (tokens[-1] + 1) % 5  # the last node fails
    assert _run(verifier, tokens, parents, logits) == reference_greedy_verify(
        tokens.tolist(), parents.tolist(), logits
    )


def test_empty_tree_gives_root_bonus(verifier: OnnxTreeVerifier) -> None:
    logits = np.array([[0.0, 3.0, 1.0]], dtype=np.float32)
    assert _run(verifier, [], [], logits) == (0, [], 1)


def test_ties_go_to_the_lowest_index(verifier: OnnxTreeVerifier) -> None:
    # Node 0 and node 1 are both accepted depth-1 children (same token); their children 2 (of
    # 1) and 3 (of 0) are both accepted at depth 2: the lowest index at the deepest depth wins.
    logits = np.zeros((5, 4), dtype=np.float32)
    logits[0, 2] = logits[1, 3] = logits[2, 3] = 1.0
    logits[3, 1] = 1.0  # bonus after node 2
    logits[4, 0] = 1.0  # bonus after node 3
    tokens, parents = [2, 2, 3, 3], [-1, -1, 1, 0]
    assert _run(verifier, tokens, parents, logits) == (2, [1, 2], 1)
    assert reference_greedy_verify(tokens, parents, logits) == (2, [1, 2], 1)


def test_rejected_parent_blocks_matching_child(verifier: OnnxTreeVerifier) -> None:
    logits = np.zeros((3, 4), dtype=np.float32)
    logits[0, 1] = logits[1, 2] = logits[2, 3] = 1.0
    # node 0 has token 0 (argmax at the root is 1): rejected, so its matching child is too.
    assert _run(verifier, [0, 2], [-1, 0], logits) == (0, [], 1)


def test_verifier_refuses_trees_over_the_bound(verifier: OnnxTreeVerifier) -> None:
    assert verifier.max_nodes == 64
    n = 65
    with pytest.raises(ValueError, match="max_nodes=64"):
        verifier.run(
            torch.zeros(n, dtype=torch.long), torch.arange(-1, n - 1), torch.zeros(n + 1, 3)
        )
