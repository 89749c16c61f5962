"""DraftTree: masks, depths, positions and paths on hand-made trees, plus random-tree properties."""

from __future__ import annotations

import random

import pytest
import torch

from lightning_spec.decoding.tree import DraftTree


def make_tree(parents: list[int], tokens: list[int] | None = None, **kwargs) -> DraftTree:
    n = len(parents)
    return DraftTree(
        tokens=torch.tensor(tokens if tokens is not None else list(range(10, 10 + n))),
        parents=torch.tensor(parents, dtype=torch.long),
        logprobs=torch.full((n,), -0.5),
        **kwargs,
    )


def random_parents(n: int, rng: random.Random) -> list[int]:
    return [rng.randrange(-1, i) for i in range(n)]


def naive_ancestors(parents: list[int], node: int) -> set[int]:
    result = set()
    while node >= 0:
        result.add(node)
        node = parents[node]
    return result


def test_chain() -> None:
    tree = make_tree([-1, 0, 1]).validate()
    assert tree.num_nodes == 3
    assert tree.depth.tolist() == [1, 2, 3]
    assert tree.max_depth == 3
    assert tree.ancestor_mask().tolist() == [
        [True, False, False],
        [True, True, False],
        [True, True, True],
    ]
    assert tree.position_ids(10).tolist() == [10, 11, 12]
    assert tree.paths() == [[0, 1, 2]]
    assert tree.children(-1) == [0]
    assert tree.children(1) == [2]
    assert tree.children(2) == []
    assert tree.leaves().tolist() == [2]
    assert tree.path_to(2) == [0, 1, 2]


def test_star() -> None:
    tree = make_tree([-1, -1, -1, -1])
    assert tree.depth.tolist() == [1, 1, 1, 1]
    assert torch.equal(tree.ancestor_mask(), torch.eye(4, dtype=torch.bool))
    assert tree.position_ids(7).tolist() == [7, 7, 7, 7]
    assert tree.paths() == [[0], [1], [2], [3]]
    assert tree.children(-1) == [0, 1, 2, 3]
    assert tree.has_children().tolist() == [False] * 4


def test_mixed() -> None:
    #  root -> 0 -> {2 -> 5, 3};  root -> 1 -> 4 -> 6
    tree = make_tree([-1, -1, 0, 0, 1, 2, 4]).validate()
    assert tree.depth.tolist() == [1, 1, 2, 2, 2, 3, 3]
    expected = [
        [1, 0, 0, 0, 0, 0, 0],
        [0, 1, 0, 0, 0, 0, 0],
        [1, 0, 1, 0, 0, 0, 0],
        [1, 0, 0, 1, 0, 0, 0],
        [0, 1, 0, 0, 1, 0, 0],
        [1, 0, 1, 0, 0, 1, 0],
        [0, 1, 0, 0, 1, 0, 1],
    ]
    assert tree.ancestor_mask().to(torch.int64).tolist() == expected
    assert tree.position_ids(100).tolist() == [100, 100, 101, 101, 101, 102, 102]
    assert tree.paths() == [[0, 3], [0, 2, 5], [1, 4, 6]]
    assert tree.children(-1) == [0, 1]
    assert tree.children(0) == [2, 3]
    assert tree.children(4) == [6]
    assert tree.leaves().tolist() == [3, 5, 6]
    assert tree.path_to(5) == [0, 2, 5]


def test_empty() -> None:
    tree = DraftTree.empty(vocab_size=5)
    assert tree.num_nodes == 0
    assert tree.max_depth == 0
    assert tree.ancestor_mask().shape == (0, 0)
    assert tree.position_ids(3).shape == (0,)
    assert tree.paths() == []
    assert tree.children(-1) == []
    assert tree.draft_probs is not None and tree.draft_probs.shape == (1, 5)
    tree.validate()


@pytest.mark.parametrize(
    "parents",
    [[0], [-1, 1], [-1, 0, 3, 1], [-2], [-1, 5]],
)
def test_validate_rejects_non_topological(parents: list[int]) -> None:
    with pytest.raises(ValueError, match="parent"):
        make_tree(parents).validate()


def test_validate_rejects_shapes() -> None:
    tree = DraftTree(
        tokens=torch.tensor([1, 2]), parents=torch.tensor([-1]), logprobs=torch.zeros(2)
    )
    with pytest.raises(ValueError, match="same length"):
        tree.validate()
    tree = make_tree([-1, 0], draft_probs=torch.zeros(2, 4))
    with pytest.raises(ValueError, match="draft_probs"):
        tree.validate()


def test_select_reindexes_subtree() -> None:
    draft_probs = torch.arange(8 * 3, dtype=torch.float32).view(8, 3)
    tree = make_tree([-1, -1, 0, 0, 1, 2, 4], draft_probs=draft_probs, iid_children=True)
    sub = tree.select(torch.tensor([0, 1, 2, 5]))
    assert sub.parents.tolist() == [-1, -1, 0, 2]
    assert sub.tokens.tolist() == [10, 11, 12, 15]
    assert sub.depth.tolist() == [1, 1, 2, 3]
    assert sub.iid_children
    assert torch.equal(sub.draft_probs, draft_probs[[0, 1, 2, 3, 6]])


def test_to_device_copies() -> None:
    tree = make_tree([-1, 0, 0])
    tree.ancestor_mask()
    moved = tree.to("cpu")
    assert moved is not tree
    assert torch.equal(moved.ancestor_mask(), tree.ancestor_mask())
    assert torch.equal(moved.tokens, tree.tokens)


def test_random_trees_match_naive_ancestors() -> None:
    rng = random.Random(0)
    for _ in range(200):
        n = rng.randrange(1, 40)
        parents = random_parents(n, rng)
        tree = make_tree(parents).validate()
        mask = tree.ancestor_mask().tolist()
        for i in range(n):
            ancestors = naive_ancestors(parents, i)
            assert {j for j in range(n) if mask[i][j]} == ancestors
            assert tree.depth[i] == len(ancestors)
            assert tree.path_to(i) == sorted(ancestors)
        paths = tree.paths()
        leaves = [i for i in range(n) if i not in parents]
        assert [path[-1] for path in paths] == leaves
        for path in paths:
            assert parents[path[0]] == -1
            assert all(parents[b] == a for a, b in zip(path, path[1:], strict=False))
        for node in range(-1, n):
            assert tree.children(node) == [i for i in range(n) if parents[i] == node]


def test_follow_finds_the_longest_prefix_that_is_a_path() -> None:
    # root -> 5 (0) -> 7 (1); root -> 6 (2) -> 7 (3)
    tree = DraftTree(torch.tensor([5, 7, 6, 7]), torch.tensor([-1, 0, -1, 2]), torch.zeros(4))
    assert tree.follow([6, 7, 9]) == [2, 3]
    assert tree.follow([5, 7]) == [0, 1]
    assert tree.follow([7]) == []
    assert tree.follow([]) == []
