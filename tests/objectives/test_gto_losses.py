"""GTO's pure functions (objectives/losses.py section 5) on hand-made tensors."""

from __future__ import annotations

import math

import pytest
import torch

from lightning_spec.decoding.acceptance import expected_accepted
from lightning_spec.decoding.tree import DraftTree
from lightning_spec.decoding.verify import verify_sample
from lightning_spec.objectives import losses


def _tree(parents: list[int], tokens: list[int] | None = None) -> DraftTree:
    tokens = tokens if tokens is not None else list(range(1, len(parents) + 1))
    return DraftTree(
        torch.tensor(tokens), torch.tensor(parents), torch.zeros(len(parents))
    ).validate()


def test_branch_values_from_per_node_factors() -> None:
    # root -> A(0) -> C(2); root -> B(1): branches end at B and C
    tree = _tree([-1, -1, 0])
    factors = torch.tensor([0.5, 0.2, 0.4])
    l_b, l_c = 0.2, 0.5 + 0.5 * 0.4
    for aggregation, expected in (
        ("lse", math.log(math.exp(l_b) + math.exp(l_c))),
        ("max", l_c),
        ("mean", (l_b + l_c) / 2),
    ):
        reward = losses.gto_tree_reward(tree=tree, factors=factors, aggregation=aggregation)
        assert float(reward) == pytest.approx(expected, abs=1e-6), aggregation
    eta2 = losses.gto_tree_reward(tree=tree, factors=factors, eta=2.0)
    assert float(eta2) == pytest.approx(math.log(math.exp(2 * l_b) + math.exp(2 * l_c)) / 2)
    empty = DraftTree.empty()
    assert float(losses.gto_tree_reward(tree=empty, factors=torch.zeros(0))) == 0.0
    with pytest.raises(ValueError, match="aggregation"):
        losses.gto_tree_reward(tree=tree, factors=factors, aggregation="median")


@pytest.mark.parametrize("eta", [0.5, 1.0, 4.0])
def test_lse_lies_between_max_and_max_plus_log_n_over_eta(eta: float) -> None:
    generator = torch.Generator().manual_seed(0)
    for size in (1, 4, 9, 20):
        parents = [-1] + [
            int(torch.randint(-1, i, (1,), generator=generator)) for i in range(1, size)
        ]
        tree = _tree(parents)
        factors = torch.rand(size, generator=generator)
        lse = float(losses.gto_tree_reward(tree=tree, factors=factors, eta=eta))
        top = float(losses.gto_tree_reward(tree=tree, factors=factors, aggregation="max"))
        leaves = int(tree.leaves().numel())
        assert top - 1e-6 <= lse <= top + math.log(leaves) / eta + 1e-6


def test_debiasing_subtracts_the_reference_and_can_be_switched_off() -> None:
    rewards, reference = torch.tensor([1.0, 2.0, 0.5]), torch.tensor([0.5, 2.5, 0.5])
    assert torch.equal(
        losses.debiased_rewards(rewards=rewards, reference_rewards=reference),
        torch.tensor([0.5, -0.5, 0.0]),
    )
    off = losses.debiased_rewards(rewards=rewards, reference_rewards=reference, enabled=False)
    assert torch.equal(off, rewards)
    with pytest.raises(ValueError, match="differ"):
        losses.debiased_rewards(rewards=rewards, reference_rewards=reference[:2])


def test_group_advantages_standardise_each_group_and_zero_a_flat_one() -> None:
    rewards = torch.tensor([[1.0, 2.0, 3.0, 6.0], [0.7, 0.7, 0.7, 0.7]])
    advantages = losses.group_advantages(rewards=rewards, delta=1e-6)
    first = advantages[0]
    assert float(first.mean()) == pytest.approx(0.0, abs=1e-6)
    assert float(first.std(correction=0)) == pytest.approx(1.0, abs=1e-5)
    expected = (rewards[0] - 3.0) / (math.sqrt(3.5) + 1e-6)
    torch.testing.assert_close(first, expected)
    assert torch.equal(advantages[1], torch.zeros(4))  # no signal, no update
    single = losses.group_advantages(rewards=torch.tensor([[0.3], [-0.2]]))
    assert torch.equal(single, torch.tensor([[0.3], [-0.2]]))  # m = 1: the reward itself
    with pytest.raises(ValueError, match="groups"):
        losses.group_advantages(rewards=torch.ones(4))


def test_sequence_ratio_is_the_per_token_geometric_mean() -> None:
    logq = torch.tensor([[-0.1, -0.2, -0.3], [-1.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
    logq_ref = torch.tensor([[-0.4, -0.5, -0.6], [-0.5, 9.0, 9.0], [5.0, 5.0, 5.0]])
    lengths = torch.tensor([3, 1, 0])
    ratio = losses.sequence_ratio(logprobs=logq, reference_logprobs=logq_ref, lengths=lengths)
    torch.testing.assert_close(ratio, torch.tensor([math.exp(0.3), math.exp(-0.5), 1.0]))


def test_clipped_surrogate_at_and_beyond_the_clip_boundaries() -> None:
    eps = 0.2
    # (ratio, advantage, expected term, gradient d term / d ratio, clipped-is-active)
    cases = [
        (1.0, 1.0, 1.0, 1.0, False),  # inside: plain s A
        (1.2, 1.0, 1.2, None, False),  # at the upper boundary: both terms equal
        (1.5, 1.0, 1.2, 0.0, True),  # beyond, A > 0: capped, no gradient
        (1.5, -1.0, -1.5, -1.0, False),  # beyond, A < 0: the pessimistic unclipped term
        (0.5, -1.0, -0.8, 0.0, True),  # below 1 - eps, A < 0: capped, no gradient
        (0.5, 1.0, 0.5, 1.0, False),  # below 1 - eps, A > 0: unclipped
    ]
    for value, advantage, term, gradient, active in cases:
        ratio = torch.tensor([value], requires_grad=True)
        loss, clip_fraction = losses.clipped_surrogate(
            ratio=ratio, advantages=torch.tensor([advantage]), eps=eps
        )
        assert float(loss.detach()) == pytest.approx(-term), (value, advantage)
        assert float(clip_fraction) == float(active), (value, advantage)
        loss.backward()
        if gradient is not None:
            assert float(ratio.grad) == pytest.approx(-gradient), (value, advantage)
    loss, fraction = losses.clipped_surrogate(
        ratio=torch.tensor([1.0, 1.5]), advantages=torch.tensor([2.0, 1.0]), eps=eps
    )
    assert float(loss) == pytest.approx(-(2.0 + 1.2) / 2) and float(fraction) == 0.5
    empty, _ = losses.clipped_surrogate(ratio=torch.zeros(0), advantages=torch.zeros(0))
    assert float(empty) == 0.0


@pytest.mark.parametrize("aggregation", ["lse", "max"])
def test_tree_reward_tracks_the_simulated_acceptance_length(aggregation: str) -> None:
    """Monte-Carlo: verify trees against random target rows with the decoder's own sampler.
    E[accepted] (the closed form) matches the simulation, and the tree reward ranks trees of
    one shape (what one policy builds for one group) as their simulated acceptance does. LSE
    carries a log(num_leaves) offset, constant within a shape: compare like with like."""
    generator = torch.Generator().manual_seed(3)
    vocab, draws = 6, 600
    parents = [-1, -1, -1, 0, 0, 1, 3, 6]  # 8 nodes, 4 leaves, depth 4
    rewards, simulated = [], []
    for _ in range(16):
        tokens = []
        for node, parent in enumerate(parents):  # distinct tokens among siblings (EAGLE rule)
            used = {tokens[i] for i in range(node) if parents[i] == parent}
            free = [t for t in range(vocab) if t not in used]
            tokens.append(free[int(torch.randint(0, len(free), (1,), generator=generator))])
        tree = _tree(parents, tokens)
        sharpness = 0.5 + float(torch.rand(1, generator=generator)) * 4
        logits = torch.randn(tree.num_nodes + 1, vocab, generator=generator) * sharpness
        probs = torch.softmax(logits, -1)
        factors = probs[tree.parents + 1, tree.tokens]
        sampler = torch.Generator().manual_seed(11)
        lengths = [
            verify_sample(tree, probs, generator=sampler).accept_length for _ in range(draws)
        ]
        mean = sum(lengths) / draws
        spread = (sum((x - mean) ** 2 for x in lengths) / draws) ** 0.5
        closed = float(expected_accepted(tree, probs))
        assert abs(mean - closed) <= 4 * spread / draws**0.5 + 0.01
        reward = losses.gto_tree_reward(tree=tree, factors=factors, aggregation=aggregation)
        rewards.append(float(reward))
        simulated.append(mean)
    ranks = torch.stack([torch.tensor(x).argsort().argsort().float() for x in (rewards, simulated)])
    spearman = float(torch.corrcoef(ranks)[0, 1])
    assert spearman > 0.8, (rewards, simulated)
