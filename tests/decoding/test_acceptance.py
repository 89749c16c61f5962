"""Expected acceptance, GTO branch values and tree rewards: hand arithmetic, Monte-Carlo against
EAGLE-rule sampling verification, and the T = 0 limit against greedy verification."""

from __future__ import annotations

import math
import random

import pytest
import torch

from lightning_spec.decoding.acceptance import (
    branch_values,
    expected_accepted,
    node_accept_probs,
    per_token_alpha,
    tree_reward,
)
from lightning_spec.decoding.tree import DraftTree
from lightning_spec.decoding.verify import verify_greedy, verify_sample


def make_tree(parents: list[int], tokens: list[int]) -> DraftTree:
    return DraftTree(
        tokens=torch.tensor(tokens, dtype=torch.long),
        parents=torch.tensor(parents, dtype=torch.long),
        logprobs=torch.zeros(len(tokens)),
    )


def hand_tree() -> tuple[DraftTree, torch.Tensor]:
    """root -> 0 -> {2 -> 4, 3};  root -> 1, with p(node | parent) = .5, .3, .4, .2, .5."""
    tree = make_tree([-1, -1, 0, 0, 2], [0, 1, 2, 3, 1])
    target = torch.full((6, 4), 0.05)
    target[0, 0], target[0, 1] = 0.5, 0.3  # root row scores nodes 0 and 1
    target[1, 2], target[1, 3] = 0.4, 0.2  # node 0's row scores nodes 2 and 3
    target[3, 1] = 0.5  # node 2's row scores node 4
    return tree, target


def test_hand_made_tree_arithmetic() -> None:
    tree, target = hand_tree()
    # path products: node0 .5, node1 .3, node2 .5*.4 = .2, node3 .5*.2 = .1, node4 .2*.5 = .1
    assert torch.allclose(node_accept_probs(tree, target), torch.tensor([0.5, 0.3, 0.2, 0.1, 0.1]))
    assert math.isclose(float(expected_accepted(tree, target)), 1.2, rel_tol=1e-6)
    # leaves 1, 3, 4: L = .3 ; .5 + .1 = .6 ; .5 + .2 + .1 = .8
    assert tree.paths() == [[1], [0, 3], [0, 2, 4]]
    assert torch.allclose(branch_values(tree, target), torch.tensor([0.3, 0.6, 0.8]))


def test_tree_reward_aggregations() -> None:
    values = torch.tensor([0.3, 0.6, 0.8])
    lse = math.log(math.exp(0.3) + math.exp(0.6) + math.exp(0.8))
    assert math.isclose(float(tree_reward(values)), lse, rel_tol=1e-6)
    lse_eta2 = 0.5 * math.log(math.exp(0.6) + math.exp(1.2) + math.exp(1.6))
    assert math.isclose(float(tree_reward(values, "lse", eta=2.0)), lse_eta2, rel_tol=1e-6)
    assert math.isclose(float(tree_reward(values, "max")), 0.8, rel_tol=1e-6)
    assert math.isclose(float(tree_reward(values, "mean")), 1.7 / 3, rel_tol=1e-6)
    assert math.isclose(float(tree_reward(values, "sum")), 1.7, rel_tol=1e-6)
    # lse tends to max as eta grows and is always >= max
    assert float(tree_reward(values, "lse", eta=200.0)) == pytest.approx(0.8, abs=0.01)
    batched = tree_reward(torch.stack([values, values * 2]), "max")
    assert batched.tolist() == pytest.approx([0.8, 1.6])
    assert float(tree_reward(torch.zeros(0))) == 0.0
    with pytest.raises(ValueError, match="aggregation"):
        tree_reward(values, "median")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="eta"):
        tree_reward(values, "lse", eta=0.0)


def test_per_token_alpha() -> None:
    p = torch.tensor([0.5, 0.3, 0.2])
    q = torch.tensor([0.2, 0.3, 0.5])
    assert float(per_token_alpha(p, q)) == pytest.approx(0.7)  # = 1 - TV = 1 - 0.3
    assert float(per_token_alpha(p, p)) == pytest.approx(1.0)
    batch = per_token_alpha(torch.stack([p, p]), torch.stack([q, p]))
    assert batch.tolist() == pytest.approx([0.7, 1.0])


def test_empty_tree() -> None:
    tree = DraftTree.empty()
    target = torch.full((1, 3), 1 / 3)
    assert float(expected_accepted(tree, target)) == 0.0
    assert branch_values(tree, target).shape == (0,)


def test_shape_check() -> None:
    tree, _ = hand_tree()
    with pytest.raises(ValueError, match="N \\+ 1"):
        expected_accepted(tree, torch.zeros(3, 4))


def test_gradients_and_no_in_place_updates() -> None:
    tree, target = hand_tree()
    target = target.double().requires_grad_(True)
    version = target._version
    before = target.detach().clone()
    torch.autograd.gradcheck(lambda t: expected_accepted(tree, t), (target,))
    torch.autograd.gradcheck(lambda t: tree_reward(branch_values(tree, t)), (target,))
    reward = tree_reward(branch_values(tree, target), "lse")
    reward.backward()
    assert target.grad is not None and float(target.grad.abs().sum()) > 0
    assert target._version == version and torch.equal(target.detach(), before)
    # d E[accepted] / d p(node 0 | root) = 1 + p2 + p3 + p2 p4 = 1 + .4 + .2 + .2 = 1.8
    target.grad = None
    expected_accepted(tree, target).backward()
    assert float(target.grad[0, 0]) == pytest.approx(1.8)
    # zero factors keep finite gradients (no log of zero)
    zeroed = target.detach().clone()
    zeroed[0, 0] = 0.0
    zeroed.requires_grad_(True)
    expected_accepted(tree, zeroed).backward()
    assert torch.isfinite(zeroed.grad).all() and float(zeroed.grad[0, 0]) == pytest.approx(1.8)


def test_expected_accepted_matches_eagle_rule_simulation() -> None:
    """Monte-Carlo: mean accepted drafts of EAGLE-rule sampling verification on a fixed tree."""
    vocab = 6
    parents = [-1, -1, -1, 0, 0, 1, 3, 3, 6]
    generator = torch.Generator().manual_seed(0)
    target = torch.softmax(torch.randn(len(parents) + 1, vocab, generator=generator) * 1.5, -1)
    # deterministic, distinct children: each node's children take its row's most likely tokens
    tokens, taken = [], {}
    for parent in parents:
        rank = taken.get(parent, 0)
        taken[parent] = rank + 1
        tokens.append(int(target[parent + 1].argsort(descending=True)[rank]))
    tree = make_tree(parents, tokens)
    draws = 10_000
    counts = torch.zeros(len(parents))
    lengths = torch.zeros(draws, dtype=torch.float64)
    for draw in range(draws):
        accepted = verify_sample(tree, target, generator=generator).accepted
        counts[accepted] += 1
        lengths[draw] = accepted.shape[0]
    mean, stderr = float(lengths.mean()), float(lengths.std()) / math.sqrt(draws)
    expected = float(expected_accepted(tree, target))
    assert abs(mean - expected) < 5 * stderr, (mean, expected, stderr)
    assert expected > 1.0  # a tree where deep acceptances matter
    # and per node: the empirical acceptance frequency matches the path product
    accept = node_accept_probs(tree, target)
    bound = 5 * torch.sqrt(accept * (1 - accept) / draws) + 1e-3
    assert ((counts / draws - accept).abs() <= bound).all(), (counts / draws, accept)


def test_t0_limit_equals_greedy_longest_prefix() -> None:
    rng = random.Random(0)
    torch.manual_seed(0)
    lengths_seen = set()
    for _ in range(200):
        vocab = rng.randrange(2, 5)
        n = rng.randrange(0, 20)
        parents: list[int] = []
        tokens: list[int] = []
        used: dict[int, set[int]] = {}
        for node in range(n):
            parent = rng.randrange(-1, node)
            free = [t for t in range(vocab) if t not in used.setdefault(parent, set())]
            if not free:
                parent = -1 if node == 0 else node - 1
                free = [t for t in range(vocab) if t not in used.setdefault(parent, set())]
            token = rng.choice(free)
            used[parent].add(token)
            parents.append(parent)
            tokens.append(token)
        tree = make_tree(parents, tokens)
        logits = torch.randn(n + 1, vocab)
        one_hot = torch.nn.functional.one_hot(logits.argmax(-1), vocab).float()
        greedy = verify_greedy(tree, logits).accept_length
        assert float(expected_accepted(tree, one_hot)) == greedy
        if n:
            assert float(tree_reward(branch_values(tree, one_hot), "max")) == greedy
        lengths_seen.add(greedy)
    assert {0, 1, 2, 3} <= lengths_seen
