"""Closed-form acceptance quantities of a draft tree, differentiable in the target probabilities.

With deterministic children verified by the EAGLE rule, a child c of an accepted node is accepted
with marginal probability p(c | context): a node v is accepted with probability
``prod_{u on the path root -> v} p(u | parent context of u)``, so

    E[accepted drafts] = sum_v prod_{u on path(v)} p(u | .)        (tau = 1 + this)

(the EAGLE acceptance rule in expectation). With one-hot p (T = 0) it is the longest prefix match of
any branch with the target's greedy continuation. GTO (arXiv 2509.22134) scores each root-to-leaf
branch i by ``L_i = sum_{j <= l_i} prod_{k <= j} p(branch token k)`` and the tree by an
aggregation of the branch values (log-sum-exp by default).

Nothing here modifies its inputs in place, so gradients flow to `target_probs` when they need to.
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor

from lightning_spec.decoding.tree import DraftTree

__all__ = [
    "branch_values",
    "branch_values_from_factors",
    "expected_accepted",
    "node_accept_probs",
    "node_accept_probs_from_factors",
    "per_token_alpha",
    "tree_reward",
]

Aggregation = Literal["lse", "max", "mean", "sum"]


def _node_target_probs(tree: DraftTree, target_probs: Tensor) -> Tensor:
    """[N] p(node token | parent context): row parent + 1 of `target_probs` [N + 1, V]."""
    if target_probs.dim() != 2 or target_probs.shape[0] != tree.num_nodes + 1:
        raise ValueError(
            f"target_probs must be [N + 1, V] = [{tree.num_nodes + 1}, V], "
            f"got {tuple(target_probs.shape)}"
        )
    return target_probs[tree.parents + 1, tree.tokens]


def node_accept_probs(tree: DraftTree, target_probs: Tensor) -> Tensor:
    """[N] probability that each node is accepted: the product of p along its path."""
    return node_accept_probs_from_factors(tree, _node_target_probs(tree, target_probs))


def node_accept_probs_from_factors(tree: DraftTree, factors: Tensor) -> Tensor:
    """[N] acceptance probabilities from per-node factors [N] = p(node token | parent context)
    (e.g. `TreeScores.token_logprobs.exp()`): no dense [N + 1, V] rows needed."""
    mask = tree.ancestor_mask().to(factors.device)  # [N, N]
    ones = torch.ones((), dtype=factors.dtype, device=factors.device)
    return torch.where(mask, factors.unsqueeze(0), ones).prod(dim=-1)


def expected_accepted(tree: DraftTree, target_probs: Tensor) -> Tensor:
    """Scalar E[accepted draft tokens] under EAGLE-rule verification (deterministic children)."""
    return node_accept_probs(tree, target_probs).sum()


def branch_values(tree: DraftTree, target_probs: Tensor) -> Tensor:
    """[num_leaves] GTO branch values, one per root-to-leaf branch in `tree.paths()` order."""
    return branch_values_from_factors(tree, _node_target_probs(tree, target_probs))


def branch_values_from_factors(tree: DraftTree, factors: Tensor) -> Tensor:
    """`branch_values` from per-node factors [N] (see `node_accept_probs_from_factors`)."""
    accept = node_accept_probs_from_factors(tree, factors)  # [N]
    on_branch = tree.ancestor_mask().to(accept.device)[tree.leaves()]  # [num_leaves, N]
    return (on_branch.to(accept.dtype) * accept.unsqueeze(0)).sum(dim=-1)


def tree_reward(
    branch_values: Tensor, aggregation: Aggregation = "lse", eta: float = 1.0
) -> Tensor:
    """Aggregate branch values [..., num_branches] into a tree reward [...].

    ``lse`` is GTO's smooth maximum (1 / eta) log sum_i exp(eta L_i); ``max``, ``mean`` and
    ``sum`` are its ablations. A tree without branches scores 0 (nothing can be accepted).
    """
    if aggregation not in ("lse", "max", "mean", "sum"):
        raise ValueError(f"aggregation must be one of lse|max|mean|sum, got {aggregation!r}")
    if branch_values.shape[-1] == 0:
        return branch_values.new_zeros(branch_values.shape[:-1])
    if aggregation == "lse":
        if eta <= 0:
            raise ValueError(f"eta must be > 0, got {eta}")
        return torch.logsumexp(branch_values * eta, dim=-1) / eta
    if aggregation == "max":
        return branch_values.max(dim=-1).values
    if aggregation == "mean":
        return branch_values.mean(dim=-1)
    return branch_values.sum(dim=-1)


def per_token_alpha(p: Tensor, q: Tensor) -> Tensor:
    """Per-token acceptance rate sum_v min(p(v), q(v)) = 1 - TV(p, q), over the last dim."""
    return torch.minimum(p, q).sum(dim=-1)
