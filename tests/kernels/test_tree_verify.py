"""Greedy tree verification: hand-made trees, a naive path enumeration, Triton against both.

The naive oracle enumerates every root-to-node path and checks it token by token, so it shares
no code or shortcut (one pass in index order, pointer jumping) with the implementations.
"""

from __future__ import annotations

import importlib
import random

import pytest
import torch

from lightning_spec.kernels import triton_unavailable_reason
from lightning_spec.kernels.tree_verify import (
    TRITON_AVAILABLE,
    tree_verify,
    tree_verify_batched,
    tree_verify_batched_reference,
    tree_verify_reference,
)

# The package re-exports the function under the module's name: fetch the module itself.
tree_verify_module = importlib.import_module("lightning_spec.kernels.tree_verify")
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
TRITON_SKIP_REASON = triton_unavailable_reason(DEVICE)
requires_triton = pytest.mark.skipif(bool(TRITON_SKIP_REASON), reason=TRITON_SKIP_REASON)
# Compiling for a GPU happens in a subprocess: it only needs triton installed.
requires_triton_installed = pytest.mark.skipif(
    not TRITON_AVAILABLE, reason="triton is not importable"
)
BOTH = pytest.mark.parametrize(
    "use_triton", [False, pytest.param(True, marks=requires_triton)], ids=["reference", "triton"]
)


def naive_verify(tokens: list[int], parents: list[int], target: list[int]) -> tuple[list[int], int]:
    """Enumerate every root-to-node path; keep the longest fully matching one, lowest end node."""
    best_path: list[int] = []
    for node in range(len(tokens)):
        path = [node]
        while parents[path[-1]] >= 0:
            path.append(parents[path[-1]])
        path.reverse()
        predictors = [0] + [step + 1 for step in path[:-1]]  # root, then each node on the path
        if all(tokens[n] == target[p] for n, p in zip(path, predictors, strict=True)):
            if len(path) > len(best_path):  # strict: the first (lowest) end node wins ties
                best_path = path
    bonus = target[best_path[-1] + 1] if best_path else target[0]
    return best_path, bonus


def random_tree(
    rng: random.Random, num_nodes: int, vocab: int
) -> tuple[list[int], list[int], list[int]]:
    """(tokens, parents, target): a small vocabulary makes partial acceptance common."""
    shape = rng.choice(["random", "chain", "star", "bushy"])
    if shape == "chain":
        parents = [node - 1 for node in range(num_nodes)]
    elif shape == "star":
        parents = [-1] * num_nodes
    elif shape == "bushy":  # few roots, wide levels: many equally deep candidates
        parents = [
            -1 if node < 2 else rng.randint(max(-1, node // 2 - 2), node // 2)
            for node in range(num_nodes)
        ]
    else:
        parents = [rng.randint(-1, node - 1) for node in range(num_nodes)]
    tokens = [rng.randrange(vocab) for _ in range(num_nodes)]
    target = [rng.randrange(vocab) for _ in range(num_nodes + 1)]
    return tokens, parents, target


def run_single(tokens, parents, target, use_triton: bool) -> tuple[int, list[int], int]:
    length, path, bonus = tree_verify(
        torch.tensor(tokens, device=DEVICE),
        torch.tensor(parents, device=DEVICE),
        torch.tensor(target, device=DEVICE),
        use_triton=use_triton,
    )
    assert path.dtype == torch.long and path.device.type == DEVICE.type
    assert isinstance(length, int) and isinstance(bonus, int)
    return length, path.tolist(), bonus


# --------------------------------------------------------------------------------------------
# Hand-made trees (reference and Triton)
# --------------------------------------------------------------------------------------------


@BOTH
def test_chain_fully_accepted(use_triton: bool) -> None:
    # Target at the root predicts 10, at node 0 predicts 11, ... at node 3 predicts 99 (bonus).
    assert run_single([10, 11, 12, 13], [-1, 0, 1, 2], [10, 11, 12, 13, 99], use_triton) == (
        4,
        [0, 1, 2, 3],
        99,
    )


@BOTH
def test_chain_stops_at_first_mismatch_even_if_later_tokens_match(use_triton: bool) -> None:
    # Node 1 is wrong (target at node 0 says 50), so node 2 is rejected although it "matches".
    assert run_single([10, 11, 12], [-1, 0, 1], [10, 50, 12, 13], use_triton) == (1, [0], 50)


@BOTH
def test_nothing_accepted_gives_root_argmax_as_bonus(use_triton: bool) -> None:
    assert run_single([1, 2, 3], [-1, -1, 0], [7, 8, 9, 4], use_triton) == (0, [], 7)


@BOTH
def test_star_accepts_the_lowest_matching_child(use_triton: bool) -> None:
    # Nodes 1 and 3 both carry the root's argmax 5: tie at depth 1, lowest index wins.
    assert run_single([4, 5, 6, 5], [-1, -1, -1, -1], [5, 10, 11, 12, 13], use_triton) == (
        1,
        [1],
        11,
    )


@BOTH
def test_deeper_path_beats_lower_index(use_triton: bool) -> None:
    # Branch A: node 0 (depth 1). Branch B: node 1 -> node 2 (depth 2). Both roots match.
    tokens, parents, target = [3, 3, 8], [-1, -1, 1], [3, 0, 8, 42]
    assert run_single(tokens, parents, target, use_triton) == (2, [1, 2], 42)


@BOTH
def test_tie_between_equally_deep_leaves_in_different_branches(use_triton: bool) -> None:
    # Depth-2 accepted leaves: node 3 (under node 0) and node 2 (under node 1): node 2 wins.
    tokens = [3, 3, 6, 7]
    parents = [-1, -1, 1, 0]
    target = [3, 7, 6, 60, 70]  # root->3; node0 predicts 7; node1 predicts 6
    assert run_single(tokens, parents, target, use_triton) == (2, [1, 2], 60)


@BOTH
def test_batched_padding_and_width(use_triton: bool) -> None:
    tokens = torch.tensor([[1, 2, 3], [1, 2, 3]], device=DEVICE)
    parents = torch.tensor([[-1, 0, 1], [-1, -1, -1]], device=DEVICE)
    target = torch.tensor([[1, 2, 3, 4], [2, 0, 0, 0]], device=DEVICE)
    length, path, bonus = tree_verify_batched(tokens, parents, target, use_triton=use_triton)
    assert length.tolist() == [3, 1] and bonus.tolist() == [4, 0]
    assert path.tolist() == [[0, 1, 2], [1, -1, -1]]
    length, path, bonus = tree_verify_batched(
        tokens, parents, target, max_depth=5, use_triton=use_triton
    )
    assert path.tolist() == [[0, 1, 2, -1, -1], [1, -1, -1, -1, -1]]
    assert all(t.dtype == torch.long for t in (length, path, bonus))


@BOTH
def test_empty_tree(use_triton: bool) -> None:
    empty = torch.zeros(0, dtype=torch.long, device=DEVICE)
    length, path, bonus = tree_verify(
        empty, empty, torch.tensor([9], device=DEVICE), use_triton=use_triton
    )
    assert (length, path.tolist(), bonus) == (0, [], 9)


def test_reference_rejects_parents_that_are_not_topological() -> None:
    with pytest.raises(ValueError, match="parents\\[1\\]"):
        tree_verify_reference(torch.tensor([1, 2]), torch.tensor([-1, 1]), torch.tensor([1, 2, 3]))
    with pytest.raises(ValueError, match="target_argmax"):
        tree_verify_batched(
            torch.zeros(1, 3, dtype=torch.long),
            torch.full((1, 3), -1),
            torch.zeros(1, 3, dtype=torch.long),
        )


# --------------------------------------------------------------------------------------------
# Property checks against the naive enumeration
# --------------------------------------------------------------------------------------------


def test_reference_matches_naive_enumeration_on_random_trees() -> None:
    rng = random.Random(0)
    for _ in range(400):
        num_nodes = rng.randint(1, 14)
        tokens, parents, target = random_tree(rng, num_nodes, vocab=rng.randint(1, 3))
        path, bonus = naive_verify(tokens, parents, target)
        expected = (len(path), path, bonus)
        assert run_single(tokens, parents, target, use_triton=False) == expected, (
            tokens,
            parents,
            target,
        )


@requires_triton
@pytest.mark.parametrize("num_nodes", [1, 7, 23, 60, 130])
def test_triton_matches_naive_enumeration_batched(num_nodes: int) -> None:
    """One launch over 12 trees of every shape; 130 nodes crosses the 128-node block."""
    rng = random.Random(num_nodes)
    trees = [random_tree(rng, num_nodes, vocab=2) for _ in range(12)]
    # Force some full accepts: a chain whose target agrees everywhere.
    chain_tokens = [rng.randrange(2) for _ in range(num_nodes)]
    trees[0] = (chain_tokens, [n - 1 for n in range(num_nodes)], chain_tokens + [1])
    tokens, parents, target = (
        torch.tensor(list(part), device=DEVICE) for part in zip(*trees, strict=True)
    )
    length, path, bonus = tree_verify_batched(tokens, parents, target, use_triton=True)
    for row, tree in enumerate(trees):
        expected_path, expected_bonus = naive_verify(*tree)
        assert length[row].item() == len(expected_path)
        assert path[row, : len(expected_path)].tolist() == expected_path
        assert (path[row, len(expected_path) :] == -1).all()
        assert bonus[row].item() == expected_bonus
    assert length[0].item() == num_nodes
    ref = tree_verify_batched_reference(tokens, parents, target)
    for got, want in zip((length, path, bonus), ref, strict=True):
        assert torch.equal(got, want)


@requires_triton
def test_triton_accepts_int32_inputs_and_strided_rows() -> None:
    tokens = torch.tensor([[4, 5, 6, 0], [4, 5, 6, 0]], device=DEVICE, dtype=torch.int32)
    parents = torch.tensor([[-1, 0, 0, 2], [-1, 0, 1, 2]], device=DEVICE, dtype=torch.int32)
    target = torch.tensor([[4, 6, 9, 9, 9], [4, 5, 6, 0, 1]], device=DEVICE)
    # A column slice makes every row non-contiguous in memory.
    wide = torch.zeros(2, 8, dtype=torch.int32, device=DEVICE)
    wide[:, ::2] = tokens
    got = tree_verify_batched(wide[:, ::2], parents, target, use_triton=True)
    want = tree_verify_batched_reference(tokens, parents, target)
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b)
    assert got[0].tolist() == [2, 4] and got[2].tolist() == [9, 1]


# --------------------------------------------------------------------------------------------
# Falling back to the reference
# --------------------------------------------------------------------------------------------


def test_cpu_tensors_without_interpreter_fall_back(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tree_verify_module, "_kernels_interpreted", lambda: False)
    args = (torch.tensor([[1]]), torch.tensor([[-1]]), torch.tensor([[1, 2]]))
    length, path, bonus = tree_verify_batched(*args)
    assert (length.tolist(), path.tolist(), bonus.tolist()) == ([1], [[0]], [2])
    if TRITON_AVAILABLE:
        with pytest.raises(RuntimeError, match="cannot run"):
            tree_verify_batched(*args, use_triton=True)


@requires_triton_installed
def test_kernel_compiles_for_hopper(compile_for_gpu) -> None:
    """The interpreter does not lower tl.gather; a real sm_90 build does (one and four warps)."""
    pointers = ("TOKENS", "PARENTS", "TARGET", "ACCEPT_LENGTH", "PATH", "BONUS")
    builds = [
        {
            "kernel": "_tree_verify_kernel",
            "signature": {name: "*i64" for name in pointers},
            "constexprs": {"BLOCK_N": block_n, "NUM_JUMPS": block_n.bit_length() - 1},
            "options": {"num_warps": num_warps},
        }
        for block_n, num_warps in ((16, 1), (1024, 4))
    ]
    output = compile_for_gpu("lightning_spec.kernels.tree_verify", builds)
    assert output.count("shared memory bytes") == 2


def test_triton_runs_in_this_test_session() -> None:
    """tests/conftest.py switches the interpreter on early enough: Triton tests must not skip."""
    if not TRITON_AVAILABLE:
        pytest.skip("triton is not importable")
    assert triton_unavailable_reason(DEVICE) == ""
