"""Tree policies against a synthetic proposer whose distributions are a fixed table keyed by the
drafted path, including a brute-force reference of EAGLE-2 selection."""

from __future__ import annotations

import itertools
import math
import zlib

import pytest
import torch
from torch import Tensor

from lightning_spec.decoding.build import (
    STATIC_TREES,
    ChainPolicy,
    DynamicTreePolicy,
    Proposer,
    StaticTreePolicy,
    TreePolicy,
    parse_tree_spec,
)
from lightning_spec.decoding.tree import DraftTree


class TableProposer:
    """Log-probs keyed by the drafted path (so equal tokens on different branches differ).

    It reads each node's path from the tree it is handed, which checks the contract that
    expanded nodes are already in that tree, and it records every call.
    """

    def __init__(self, vocab: int, seed: int, mode: str = "random", scale: float = 2.0) -> None:
        self.vocab, self.seed, self.mode, self.scale = vocab, seed, mode, scale
        self.cache: dict[tuple[int, ...], Tensor] = {}
        self.root_calls = 0
        self.expand_calls: list[tuple[int, list[tuple[int, ...]]]] = []  # (tree size, paths)

    def dist(self, path: tuple[int, ...]) -> Tensor:
        if path not in self.cache:
            if self.mode == "uniform":  # every candidate of a level ties
                row = torch.zeros(self.vocab)
            elif self.mode == "onehot":  # q = 1 on one token: ties at -inf below it
                row = torch.full((self.vocab,), -math.inf)
                row[(sum(path) + len(path)) % self.vocab] = 0.0
            else:
                key = zlib.crc32(repr((self.seed, path)).encode())
                generator = torch.Generator().manual_seed(key)
                row = torch.randn(self.vocab, generator=generator) * self.scale
            self.cache[path] = torch.log_softmax(row, dim=-1)
        return self.cache[path]

    def root(self) -> Tensor:
        self.root_calls += 1
        return self.dist(())

    def expand(self, tree: DraftTree, nodes: Tensor) -> Tensor:
        assert nodes.dtype == torch.long and nodes.dim() == 1 and nodes.numel() > 0
        assert int(nodes.max()) < tree.num_nodes and int(nodes.min()) >= 0
        tree.validate()
        paths = [node_path(tree, node) for node in nodes.tolist()]
        self.expand_calls.append((tree.num_nodes, paths))
        return torch.stack([self.dist(path) for path in paths])


def node_path(tree: DraftTree, node: int) -> tuple[int, ...]:
    return tuple(tree.tokens[tree.path_to(node)].tolist())


def tree_paths(tree: DraftTree) -> list[tuple[int, ...]]:
    return [node_path(tree, node) for node in range(tree.num_nodes)]


def check_tree(tree: DraftTree, proposer: TableProposer) -> None:
    """Topological order, depths matching the parents, and log-probs matching the table."""
    tree.validate()
    fresh = DraftTree(tree.tokens, tree.parents, tree.logprobs)  # depth derived from scratch
    assert torch.equal(fresh.depth, tree.depth)
    for node, path in enumerate(tree_paths(tree)):
        assert len(path) == int(tree.depth[node])
        expected = proposer.dist(path[:-1])[path[-1]]
        assert torch.isclose(tree.logprobs[node], expected)


def test_protocols_are_satisfied() -> None:
    assert isinstance(TableProposer(8, 0), Proposer)
    for policy in [ChainPolicy(2), StaticTreePolicy([(0,)]), DynamicTreePolicy(2, 2, 4)]:
        assert isinstance(policy, TreePolicy)


# ----------------------------------------------------------------------------------------- chain
def test_chain_greedy_follows_argmax() -> None:
    proposer = TableProposer(vocab=12, seed=3)
    tree = ChainPolicy(4).build(proposer)
    check_tree(tree, proposer)
    assert tree.parents.tolist() == [-1, 0, 1, 2]
    assert not tree.iid_children and tree.draft_probs is None
    path: tuple[int, ...] = ()
    for node in range(4):
        expected = int(proposer.dist(path).argmax())
        assert int(tree.tokens[node]) == expected
        path += (expected,)
    assert proposer.root_calls == 1
    # k - 1 expand calls, each feeding only the newest node of the chain built so far
    assert [size for size, _ in proposer.expand_calls] == [1, 2, 3]
    assert [paths for _, paths in proposer.expand_calls] == [[path[:1]], [path[:2]], [path[:3]]]


def test_chain_keep_draft_probs() -> None:
    proposer = TableProposer(vocab=10, seed=4)
    tree = ChainPolicy(3).build(proposer, keep_draft_probs=True)
    paths = tree_paths(tree)
    assert tree.draft_probs is not None and tree.draft_probs.shape == (4, 10)
    assert torch.allclose(tree.draft_probs[0], proposer.dist(()).exp())
    assert torch.allclose(tree.draft_probs[1], proposer.dist(paths[0]).exp())
    assert torch.allclose(tree.draft_probs[2], proposer.dist(paths[1]).exp())
    assert torch.equal(tree.draft_probs[3], torch.zeros(10))  # the leaf is never expanded


def test_chain_sampling_draws_from_q() -> None:
    proposer = TableProposer(vocab=6, seed=5, scale=1.0)
    generator = torch.Generator().manual_seed(0)
    tree = ChainPolicy(3).build(proposer, temperature=0.8, generator=generator)
    check_tree(tree, proposer)
    assert tree.iid_children and tree.draft_probs is None
    draws = 4000
    counts = torch.zeros(6)
    for _ in range(draws):  # k = 1 needs no expand calls: the first token's law is q at the root
        tree = ChainPolicy(1).build(proposer, temperature=0.8, generator=generator)
        counts[tree.tokens[0]] += 1
    expected = proposer.dist(()).exp() * draws
    chi_square = float(((counts - expected) ** 2 / expected).sum())
    assert chi_square < 40.0  # 5 degrees of freedom: a ~1e-7 tail; greedy would score thousands
    assert int((counts > 0).sum()) == 6


def test_chain_rejects_bad_length() -> None:
    with pytest.raises(ValueError, match="k >= 1"):
        ChainPolicy(0)


# ---------------------------------------------------------------------------------------- static
def test_static_tree_ranks_and_order() -> None:
    proposer = TableProposer(vocab=9, seed=6)
    policy = StaticTreePolicy([(1, 0), (0, 1), (1,), (0,), (0, 0)])  # deliberately shuffled
    assert policy.paths == ((0,), (1,), (0, 0), (0, 1), (1, 0))
    tree = policy.build(proposer, keep_draft_probs=True)
    check_tree(tree, proposer)
    assert tree.parents.tolist() == [-1, -1, 0, 0, 1]
    assert not tree.iid_children
    ranked_root = proposer.dist(()).argsort(descending=True).tolist()
    assert tree.tokens[:2].tolist() == ranked_root[:2]
    ranked_0 = proposer.dist((ranked_root[0],)).argsort(descending=True).tolist()
    ranked_1 = proposer.dist((ranked_root[1],)).argsort(descending=True).tolist()
    assert tree.tokens[2:].tolist() == [ranked_0[0], ranked_0[1], ranked_1[0]]
    # one expand call for the whole second level, with exactly the two nodes that have children
    assert proposer.expand_calls == [(2, [(ranked_root[0],), (ranked_root[1],)])]
    assert torch.allclose(tree.draft_probs[0], proposer.dist(()).exp())
    assert torch.allclose(tree.draft_probs[1], proposer.dist((ranked_root[0],)).exp())
    assert torch.allclose(tree.draft_probs[2], proposer.dist((ranked_root[1],)).exp())
    assert torch.equal(tree.draft_probs[3:], torch.zeros(3, 9))


def test_static_tree_expands_only_inner_nodes_per_level() -> None:
    proposer = TableProposer(vocab=8, seed=7)
    tree = StaticTreePolicy(STATIC_TREES["tiny"]).build(proposer, temperature=0.7)
    check_tree(tree, proposer)
    assert tree.parents.tolist() == [-1, -1, 0, 0, 1, 2]
    sizes = [size for size, _ in proposer.expand_calls]
    expanded = [len(paths) for _, paths in proposer.expand_calls]
    assert sizes == [2, 5] and expanded == [2, 1]
    # ranks: node 5 = (0, 0, 0) is the argmax child of node 2
    assert int(tree.tokens[5]) == int(proposer.dist(node_path(tree, 2)).argmax())


@pytest.mark.parametrize("name", sorted(STATIC_TREES))
def test_builtin_static_trees(name: str) -> None:
    policy = parse_tree_spec(f"static:{name}")
    assert isinstance(policy, StaticTreePolicy)
    proposer = TableProposer(vocab=16, seed=8)
    tree = policy.build(proposer)
    check_tree(tree, proposer)
    assert tree.num_nodes == policy.max_nodes == len(STATIC_TREES[name])
    assert tree.max_depth == policy.max_depth
    assert len(proposer.expand_calls) == policy.max_depth - 1
    assert {"tiny": 6, "small": 15, "medium": 31}[name] == tree.num_nodes


@pytest.mark.parametrize(
    ("paths", "message"),
    [
        ([], "at least one"),
        ([(0,), (0, 1, 0)], "prefix"),
        ([(0,), (0,)], "distinct"),
        ([(0,), (-1,)], ">= 0"),
        ([()], "non-empty"),
        ([0, 1], "tuples"),
    ],
)
def test_static_tree_rejects_bad_paths(paths: list, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        StaticTreePolicy(paths)


def test_static_tree_rank_beyond_vocabulary() -> None:
    with pytest.raises(ValueError, match="vocabulary"):
        StaticTreePolicy([(0,), (5,)]).build(TableProposer(vocab=4, seed=0))


# --------------------------------------------------------------------------------------- dynamic
def reference_eagle2(
    proposer: TableProposer, depth: int, top_k: int, total_tokens: int
) -> tuple[dict[tuple[int, ...], float], list[list[tuple[int, ...]]]]:
    """Naive EAGLE-2: kept {path: score} and the frontier paths expanded at each level.

    Scores are added as float32 tensors, exactly like the policy, so orderings agree bit for bit.
    """
    vocab = proposer.vocab
    k = min(top_k, vocab)

    def best_children(path: tuple[int, ...]) -> list[int]:
        row = proposer.dist(path).tolist()
        return sorted(range(vocab), key=lambda token: (-row[token], token))[:k]

    candidates: list[tuple[tuple[int, ...], Tensor]] = []
    for token in best_children(()):
        candidates.append(((token,), proposer.dist(())[token]))
    frontier = list(range(len(candidates)))
    expanded: list[list[tuple[int, ...]]] = []
    for _ in range(depth - 1):
        expanded.append([candidates[i][0] for i in frontier])
        level = []
        for i in frontier:
            path, score = candidates[i]
            for token in best_children(path):
                level.append((path + (token,), score + proposer.dist(path)[token]))
        start = len(candidates)
        candidates.extend(level)
        order = sorted(range(len(level)), key=lambda i: (-float(level[i][1]), i))[:k]
        frontier = [start + i for i in order]
    ranking = sorted(range(len(candidates)), key=lambda i: (-float(candidates[i][1]), i))
    kept = {candidates[i][0]: float(candidates[i][1]) for i in ranking[: total_tokens - 1]}
    return kept, expanded


CONFIGS = list(itertools.product([8, 13], [1, 2, 3, 4], [1, 2, 3, 4], [2, 5, 12, 40, 1000], [0, 1]))


@pytest.mark.parametrize("vocab", [8, 13])
def test_dynamic_tree_matches_brute_force(vocab: int) -> None:
    for _, depth, top_k, total_tokens, seed in [c for c in CONFIGS if c[0] == vocab]:
        proposer = TableProposer(vocab=vocab, seed=seed)
        policy = DynamicTreePolicy(depth, top_k, total_tokens)
        tree = policy.build(proposer)
        check_tree(tree, proposer)
        kept, expanded = reference_eagle2(proposer, depth, top_k, total_tokens)
        paths = tree_paths(tree)
        assert set(paths) == set(kept)
        assert len(paths) == len(kept)
        for node, path in enumerate(paths):  # the node's score = its cumulative log-prob
            score = float(tree.logprobs[tree.path_to(node)].sum())
            assert math.isclose(score, kept[path], rel_tol=1e-5, abs_tol=1e-5)
        # the drafter saw exactly the reference frontiers, once per level, with all candidates
        k = min(top_k, vocab)
        assert proposer.root_calls == 1
        assert [paths for _, paths in proposer.expand_calls] == expanded
        assert [size for size, _ in proposer.expand_calls] == [
            k + level * k * k for level in range(depth - 1)
        ]
        assert tree.num_nodes == min(total_tokens - 1, k + (depth - 1) * k * k)
        assert tree.num_nodes == policy.max_nodes or k < top_k


def test_dynamic_tree_candidates_and_mapping() -> None:
    proposer = TableProposer(vocab=10, seed=2)
    policy = DynamicTreePolicy(depth=3, top_k=3, total_tokens=8)
    tree, candidates, kept = policy.build_candidates(proposer)
    assert candidates.num_nodes == 3 + 2 * 9
    assert kept.tolist() == sorted(kept.tolist()) and len(kept) == 7
    assert torch.equal(tree.tokens, candidates.tokens[kept])
    assert torch.equal(tree.depth, candidates.depth[kept])
    kept_set = set(kept.tolist())
    for node in kept.tolist():  # closed under ancestors
        parent = int(candidates.parents[node])
        assert parent == -1 or parent in kept_set


@pytest.mark.parametrize("mode", ["uniform", "onehot"])
def test_dynamic_tree_ties_never_drop_a_parent(mode: str) -> None:
    for depth, top_k, total_tokens in itertools.product([2, 3, 4], [2, 3], [2, 3, 4, 7, 11, 30]):
        proposer = TableProposer(vocab=6, seed=0, mode=mode)
        tree, candidates, kept = DynamicTreePolicy(depth, top_k, total_tokens).build_candidates(
            proposer
        )
        kept_set = set(kept.tolist())
        for node in kept.tolist():
            parent = int(candidates.parents[node])
            assert parent == -1 or parent in kept_set
        fresh = DraftTree(tree.tokens, tree.parents, tree.logprobs).validate()
        assert torch.equal(fresh.depth, candidates.depth[kept])
        assert tree.num_nodes == min(total_tokens - 1, top_k + (depth - 1) * top_k**2)


def test_dynamic_tree_keep_draft_probs() -> None:
    proposer = TableProposer(vocab=9, seed=11)
    tree = DynamicTreePolicy(depth=3, top_k=2, total_tokens=6).build(
        proposer, temperature=1.0, keep_draft_probs=True
    )
    assert tree.draft_probs is not None and tree.draft_probs.shape == (tree.num_nodes + 1, 9)
    assert not tree.iid_children
    expanded = {path for _, paths in proposer.expand_calls for path in paths}
    assert torch.allclose(tree.draft_probs[0], proposer.dist(()).exp())
    rows_checked = 0
    for node, path in enumerate(tree_paths(tree)):
        row = tree.draft_probs[node + 1]
        if path in expanded:
            assert torch.allclose(row, proposer.dist(path).exp())
            rows_checked += 1
        else:
            assert torch.equal(row, torch.zeros(9))
    assert rows_checked >= 1


def test_dynamic_tree_depth_one_is_root_top_k() -> None:
    proposer = TableProposer(vocab=8, seed=1)
    tree = DynamicTreePolicy(depth=1, top_k=4, total_tokens=60).build(proposer)
    assert tree.num_nodes == 4 and proposer.expand_calls == []
    assert tree.tokens.tolist() == proposer.dist(()).topk(4).indices.tolist()


@pytest.mark.parametrize("args", [(0, 2, 4), (2, 0, 4), (2, 2, 1)])
def test_dynamic_tree_rejects_bad_arguments(args: tuple[int, int, int]) -> None:
    with pytest.raises(ValueError, match="DynamicTreePolicy"):
        DynamicTreePolicy(*args)


# ------------------------------------------------------------------------------------------ spec
def test_parse_tree_spec_good() -> None:
    assert parse_tree_spec("chain:4") == ChainPolicy(4)
    assert parse_tree_spec(" Dynamic: 5, 8, 32 ") == DynamicTreePolicy(5, 8, 32)
    tiny = parse_tree_spec("static:tiny")
    assert isinstance(tiny, StaticTreePolicy) and tiny.paths == STATIC_TREES["tiny"]
    explicit = parse_tree_spec("static:[(0,), (1,), (0, 0)]")
    assert isinstance(explicit, StaticTreePolicy) and explicit.parents == [-1, -1, 0]


@pytest.mark.parametrize(
    "spec",
    [
        "",
        "chain",
        "chain:",
        "chain:0",
        "chain:x",
        "chain:2,3",
        "dynamic:5,8",
        "dynamic:5,8,32,1",
        "dynamic:0,8,32",
        "dynamic:a,b,c",
        "static:nope",
        "static:[(0,), (0, 1, 1)]",
        "static:[(0,), (0,)",
        "beam:4",
    ],
)
def test_parse_tree_spec_bad(spec: str) -> None:
    with pytest.raises(ValueError, match="bad tree spec"):
        parse_tree_spec(spec)
