"""Verification of a draft tree against one target forward pass: greedy and lossless sampling.

Both functions take target rows over N + 1 positions: row 0 is the target at the root (it scores
the depth-1 nodes) and row ``i + 1`` the target at node i (it scores node i's children). They
return the accepted node path and the bonus token the target contributes after it, so every
verification commits ``accept_length + 1`` tokens.

* Greedy (T = 0): a node is accepted iff its parent is accepted and its token is the argmax of the
  parent's row; the deepest accepted node wins (ties go to the lowest index) and the bonus is the
  argmax of its row. The output equals the target's own greedy decode.
* Sampling (T > 0), recursive rejection sampling over siblings; both rules leave the committed
  tokens distributed exactly as the target's (Leviathan et al. 2023; SpecInfer, Miao et al. 2024;
  EAGLE-2, Li et al. 2024):
  - i.i.d. children (chains drawn from q, SpecInfer trees): accept child x with probability
    min(1, p(x) / q(x)); on rejection p <- normalize(max(0, p - q)) and try the next sibling.
  - deterministic top-k children (EAGLE rule): accept child c with probability p(c) under the
    current p; on rejection set p(c) = 0, renormalise and try the next sibling.
  If every child is rejected the correction token is drawn from the current p; if the walk ends
  at a leaf the bonus is drawn from the leaf's own target row.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from lightning_spec.decoding.tree import DraftTree

__all__ = [
    "Verification",
    "draw_uniforms",
    "inverse_cdf_sample",
    "verify_greedy",
    "verify_greedy_argmax",
    "verify_sample",
]


@dataclass(eq=False)
class Verification:
    """The outcome of verifying one tree."""

    accepted: Tensor
    """[a] long node indices along the accepted path, from depth 1 down (may be empty)."""
    bonus_token: int
    """Target token appended after the accepted path (correction or bonus)."""

    @property
    def accept_length(self) -> int:
        """Number of accepted draft tokens; the step commits ``accept_length + 1`` tokens."""
        return int(self.accepted.shape[0])

    def committed_tokens(self, tree: DraftTree) -> list[int]:
        """The tokens this step commits: the accepted draft tokens then the bonus token."""
        return tree.tokens[self.accepted].tolist() + [self.bonus_token]


def _check_rows(tree: DraftTree, rows: Tensor, name: str) -> None:
    if rows.dim() != 2 or rows.shape[0] != tree.num_nodes + 1:
        raise ValueError(
            f"{name} must be [N + 1, V] = [{tree.num_nodes + 1}, V], got {tuple(rows.shape)}"
        )


# ---------------------------------------------------------------------------------------- greedy
def verify_greedy(tree: DraftTree, target_logits: Tensor) -> Verification:
    """Longest target-greedy match over the tree; `target_logits` is [N + 1, V]."""
    _check_rows(tree, target_logits, "target_logits")
    return verify_greedy_argmax(tree, target_logits.argmax(dim=-1))


def verify_greedy_argmax(tree: DraftTree, argmax: Tensor) -> Verification:
    """`verify_greedy` from the target's argmax rows [N + 1] (when the caller has them)."""
    if argmax.shape != (tree.num_nodes + 1,):
        raise ValueError(f"argmax must be [N + 1] = [{tree.num_nodes + 1}], got {tuple(argmax.shape)}")
    n = tree.num_nodes
    if n == 0:
        return Verification(tree.tokens.new_zeros(0), int(argmax[0]))
    mask = tree.ancestor_mask()  # [N, N]
    matches = tree.tokens == argmax[tree.parents + 1]  # [N]
    accepted = ~(mask & ~matches.unsqueeze(0)).any(dim=-1)  # every node on the path matches
    index = torch.arange(n, device=tree.tokens.device)
    # deepest first, then lowest index: a unique integer key per node
    key = torch.where(accepted, tree.depth * (n + 1) + (n - index), torch.full_like(index, -1))
    best = int(key.argmax())
    if not bool(accepted[best]):
        return Verification(tree.tokens.new_zeros(0), int(argmax[0]))
    path = mask[best].nonzero().flatten()  # ancestors in index order = depth order
    return Verification(path, int(argmax[best + 1]))


# -------------------------------------------------------------------------------------- sampling
def draw_uniforms(count: int, generator: torch.Generator | None) -> list[float]:
    """`count` U[0, 1) draws from `generator` on its own device, as Python floats (so a CPU
    generator can drive sampling of tensors on any device)."""
    device = generator.device if generator is not None else torch.device("cpu")
    return torch.rand(count, generator=generator, device=device).tolist()


def inverse_cdf_sample(probs: Tensor, uniform: float, fallback: Tensor | None = None) -> int:
    """Inverse-CDF draw from non-negative, unnormalised `probs` [V] with one uniform.

    With u < 1 the search lands on a token of positive mass; it runs off the end (index V) only
    when `probs` has no mass at all (a residual emptied by rounding): then `fallback` is used.
    """
    cdf = torch.cumsum(probs, dim=0, dtype=torch.float64)
    index = int(torch.searchsorted(cdf, cdf[-1:] * uniform, right=True))
    if index < probs.shape[0]:
        return index
    if fallback is None:
        raise ValueError("verify_sample: a target row has no probability mass")
    return inverse_cdf_sample(fallback, uniform)


def _eagle_accept_probability(p_child: float, remaining_mass: float) -> float:
    """P(accept) of a deterministic child: its mass under the renormalised current p."""
    if remaining_mass <= 0.0:
        return 1.0 if p_child > 0.0 else 0.0
    return min(1.0, max(0.0, p_child / remaining_mass))


def _specinfer_accept_probability(p_child: float, q_child: float) -> float:
    """P(accept) of an i.i.d. child: min(1, p / q); a q of zero accepts any p > 0."""
    if q_child <= 0.0:
        return 1.0 if p_child > 0.0 else 0.0
    return min(1.0, max(0.0, p_child / q_child))


def _specinfer_residual(p: Tensor, q: Tensor) -> Tensor:
    """max(0, p - q), unnormalised (normalising is left to whoever reads it).

    Where p == q up to rounding the residual can be empty; a rejection had probability ~0
    there, and the callers then fall back to p itself.
    """
    return (p - q).clamp(min=0.0)


def _children_lists(parents: list[int]) -> list[list[int]]:
    """children[parent + 1] = ascending child indices (slot 0 holds the root's children)."""
    children: list[list[int]] = [[] for _ in range(len(parents) + 1)]
    for node, parent in enumerate(parents):
        children[parent + 1].append(node)
    return children


def verify_sample(
    tree: DraftTree, target_probs: Tensor, *, generator: torch.Generator | None = None
) -> Verification:
    """Lossless recursive rejection sampling over the tree (see the module docstring).

    `target_probs` is [N + 1, V], already temperature-adjusted; rows need not be normalised.
    Trees with ``iid_children`` need ``tree.draft_probs``. All randomness is N + 1 uniforms
    drawn from `generator` (on the generator's device), so a seeded generator reproduces a step.
    """
    _check_rows(tree, target_probs, "target_probs")
    n = tree.num_nodes
    if tree.iid_children and n > 0 and tree.draft_probs is None:
        raise ValueError(
            "verify_sample: a tree with i.i.d. children needs draft_probs (q at every expanded "
            "node); build it with keep_draft_probs=True"
        )
    children = _children_lists(tree.parents.tolist())
    tokens = tree.tokens.tolist()
    uniforms = draw_uniforms(n + 1, generator)  # one per node, the last for the final draw
    # Target (and draft) mass of every node's token under its parent's row: one gather each.
    p_nodes: list[float] = []
    q_nodes: list[float] = []
    if n:
        p_nodes = target_probs[tree.parents + 1, tree.tokens].tolist()
        if tree.iid_children:
            assert tree.draft_probs is not None
            q_nodes = tree.draft_probs[tree.parents + 1, tree.tokens].tolist()

    accepted: list[int] = []
    row = 0  # target row of the current node (0 = root)
    while True:
        kids = children[row]
        p_row = target_probs[row]
        if not kids:  # a leaf (or an empty tree): bonus from the node's own target row
            bonus = inverse_cdf_sample(p_row, uniforms[n])
            break
        if tree.iid_children:
            assert tree.draft_probs is not None
            chosen, residual = _specinfer_siblings(
                kids, tokens, p_nodes, q_nodes, uniforms, p_row, tree.draft_probs[row]
            )
        else:
            chosen, residual = _eagle_siblings(kids, tokens, p_nodes, uniforms, p_row)
        if chosen < 0:  # every child rejected: the correction comes from the residual
            bonus = inverse_cdf_sample(residual, uniforms[n], fallback=p_row)
            break
        accepted.append(chosen)
        row = chosen + 1
    accepted_tensor = torch.tensor(accepted, dtype=torch.long, device=tree.tokens.device)
    return Verification(accepted_tensor, bonus)


def _eagle_siblings(
    kids: list[int], tokens: list[int], p_nodes: list[float], uniforms: list[float], p_row: Tensor
) -> tuple[int, Tensor]:
    """EAGLE rule at one node: (accepted child, unused) or (-1, the residual p to sample)."""
    remaining = float(p_row.sum())
    rejected: list[int] = []
    for child in kids:
        token = tokens[child]
        p_child = 0.0 if token in rejected else p_nodes[child]
        if uniforms[child] < _eagle_accept_probability(p_child, remaining):
            return child, p_row
        if token not in rejected:
            rejected.append(token)
            remaining -= p_child
    residual = p_row.index_fill(0, torch.tensor(rejected, device=p_row.device), 0.0)
    return -1, residual


def _specinfer_siblings(
    kids: list[int],
    tokens: list[int],
    p_nodes: list[float],
    q_nodes: list[float],
    uniforms: list[float],
    p_row: Tensor,
    q_row: Tensor,
) -> tuple[int, Tensor]:
    """SpecInfer rule at one node: (accepted child, unused) or (-1, the residual p to sample)."""
    tiny = torch.finfo(torch.float32).tiny
    current = p_row  # unnormalised current p; its mass is tracked in `mass`
    mass = float(p_row.sum())
    for index, child in enumerate(kids):
        p_child = p_nodes[child] if index == 0 else float(current[tokens[child]])
        p_child = p_child / mass if mass > tiny else 0.0
        if uniforms[child] < _specinfer_accept_probability(p_child, q_nodes[child]):
            return child, p_row
        normalised = current / mass if mass > tiny else current
        residual = _specinfer_residual(normalised, q_row)
        mass = float(residual.sum())
        if mass <= tiny:  # p == q up to rounding: keep p (see _specinfer_residual)
            residual, mass = normalised, float(normalised.sum())
        current = residual
    return -1, current
