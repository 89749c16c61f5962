"""Draft trees: the flat, topologically ordered token trees that drafters propose and targets verify.

A tree holds N draft nodes. The root is the last committed token and is *not* a node; nodes whose
parent is -1 are its children (depth 1). Every parent index is smaller than its child's index, so
any prefix of the node list is itself a tree and a single pass in index order visits parents before
children. Token ids are target-vocabulary ids.

Rows of per-node distributions (``draft_probs`` here, the target rows passed to verification) use
N + 1 rows: row 0 belongs to the root (it predicts the depth-1 nodes) and row ``i + 1`` to node
``i`` (it predicts node i's children).

The ancestor mask is the tree-attention mask (SpecInfer, Medusa, EAGLE): node i sees node j iff j
is i or one of its ancestors; position ids follow depth so every branch sees ordinary positions.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

__all__ = ["DraftTree", "TreeBatch", "ancestor_masks"]


def ancestor_masks(parents: Tensor) -> Tensor:
    """Bool [..., N, N] ancestor masks of trees given by `parents` [..., N] (-1 = root child).

    Row i holds node i and its ancestors. Pointer jumping: after step k each row holds the
    ancestors closer than 2**k, so ceil(log2 N) gathers suffice, with no host synchronisation
    and no matmul (tiny multi-threaded matmuls stall on busy CPUs). The one implementation of
    tree-attention masks: the decoder, the drafting seam and the scoring module all use it.
    """
    n = parents.shape[-1]
    mask = torch.eye(n, dtype=torch.bool, device=parents.device).expand(*parents.shape, n)
    jump = parents  # the 2**k-th ancestor of each node, -1 past the root
    for _ in range(math.ceil(math.log2(n)) if n > 1 else 0):
        has_jump = jump >= 0
        target = jump.clamp(min=0)
        gathered = torch.take_along_dim(mask, target.unsqueeze(-1), dim=-2)
        mask = mask | (gathered & has_jump.unsqueeze(-1))
        jump = torch.where(has_jump, torch.take_along_dim(jump, target, dim=-1), jump)
    return mask.contiguous()


@dataclass(eq=False)
class DraftTree:
    """A speculative draft tree over N nodes in topological order (see the module docstring).

    Treat instances as immutable: the ancestor mask and depths are cached on first use.
    """

    tokens: Tensor
    """[N] long, target-vocabulary ids of the draft nodes."""
    parents: Tensor
    """[N] long, -1 for children of the root, otherwise an index smaller than the node's own."""
    logprobs: Tensor
    """[N] float, draft log q(token | parent context) at the draft temperature."""
    draft_probs: Tensor | None = None
    """[N + 1, V] float: q at the root (row 0) and at node i (row i + 1); rows of nodes that were
    never expanded may be zero. Needed to verify i.i.d.-sampled children losslessly."""
    iid_children: bool = False
    """True when children were drawn i.i.d. from q (SpecInfer rule at verification); False when
    they are deterministic distinct top-k tokens (EAGLE rule)."""
    drafter_nodes: int | None = None
    """How many nodes (a prefix of the node list) the drafter proposed; None: all of them. The
    rest were grafted by prompt lookup (`decoding.lookup`) and carry draft log-prob 0."""

    _mask: Tensor | None = field(default=None, init=False, repr=False)
    _depth: Tensor | None = field(default=None, init=False, repr=False)

    # ----------------------------------------------------------------------------- construction
    @staticmethod
    def empty(
        *,
        vocab_size: int | None = None,
        device: torch.device | str | None = None,
        iid_children: bool = False,
    ) -> DraftTree:
        """A tree without nodes (nothing drafted); `vocab_size` adds a zero root row of q."""
        draft_probs = None
        if vocab_size is not None:
            draft_probs = torch.zeros(1, vocab_size, device=device)
        return DraftTree(
            tokens=torch.zeros(0, dtype=torch.long, device=device),
            parents=torch.zeros(0, dtype=torch.long, device=device),
            logprobs=torch.zeros(0, device=device),
            draft_probs=draft_probs,
            iid_children=iid_children,
        )

    def validate(self) -> DraftTree:
        """Check shapes and the topological-order invariant (synchronises with the device)."""
        n = self.tokens.shape[0]
        if self.tokens.dim() != 1 or self.parents.shape != (n,) or self.logprobs.shape != (n,):
            raise ValueError(
                "tokens, parents and logprobs must all be 1-D of the same length, got "
                f"{tuple(self.tokens.shape)}, {tuple(self.parents.shape)}, "
                f"{tuple(self.logprobs.shape)}"
            )
        if self.tokens.dtype != torch.long or self.parents.dtype != torch.long:
            raise ValueError("tokens and parents must be torch.long")
        if self.draft_probs is not None and (
            self.draft_probs.dim() != 2 or self.draft_probs.shape[0] != n + 1
        ):
            raise ValueError(
                f"draft_probs must be [N + 1, V] = [{n + 1}, V], got {tuple(self.draft_probs.shape)}"
            )
        index = torch.arange(n, device=self.parents.device)
        bad = (self.parents < -1) | (self.parents >= index)
        if bool(bad.any()):
            first = int(bad.nonzero()[0, 0])
            raise ValueError(
                f"node {first} has parent {int(self.parents[first])}: parents must be -1 or a "
                "smaller node index (topological order)"
            )
        return self

    # -------------------------------------------------------------------------- derived arrays
    @property
    def num_nodes(self) -> int:
        """N, the number of draft nodes (the root is not counted)."""
        return int(self.tokens.shape[0])

    @property
    def device(self) -> torch.device:
        return self.tokens.device

    def ancestor_mask(self) -> Tensor:
        """Bool [N, N]: node i attends to node j iff j is i or an ancestor of i.

        See `ancestor_masks` (the batched form, shared with the drafting and scoring seams).
        """
        if self._mask is None:
            self._mask = ancestor_masks(self.parents)
        return self._mask

    @property
    def depth(self) -> Tensor:
        """[N] long, 1 for children of the root."""
        if self._depth is None:
            self._depth = self.ancestor_mask().sum(dim=-1).to(torch.long)
        return self._depth

    @property
    def max_depth(self) -> int:
        """Depth of the deepest node, 0 for an empty tree."""
        return int(self.depth.max()) if self.num_nodes > 0 else 0

    def position_ids(self, start: int) -> Tensor:
        """[N] long position of each node: ``start + depth - 1``.

        ``start`` is the position of the first draft depth, i.e. the root's position + 1.
        """
        return self.depth + (start - 1)

    def has_children(self) -> Tensor:
        """Bool [N]: whether each node has at least one child."""
        n = self.num_nodes
        marks = torch.zeros(n + 1, dtype=torch.bool, device=self.parents.device)
        marks = marks.index_fill(0, self.parents + 1, True)
        return marks[1:]

    def leaves(self) -> Tensor:
        """[num_leaves] long node indices of the leaves, ascending."""
        return (~self.has_children()).nonzero().flatten()

    def children(self, node: int) -> list[int]:
        """Indices of the children of `node` (-1 for the root), ascending."""
        return [i for i, parent in enumerate(self.parents.tolist()) if parent == node]

    def path_to(self, node: int) -> list[int]:
        """Node indices from depth 1 down to `node` (inclusive)."""
        parents = self.parents.tolist()
        path = []
        while node >= 0:
            path.append(node)
            node = parents[node]
        return path[::-1]

    def follow(self, tokens: Sequence[int]) -> list[int]:
        """Node indices of the longest prefix of `tokens` that is a path from the root (a
        chain drafted elsewhere, e.g. the drafter's greedy chain, looked up in this tree)."""
        parents, own = self.parents.tolist(), self.tokens.tolist()
        path: list[int] = []
        node = -1
        for token in tokens:
            child = next(
                (
                    i
                    for i, (p, t) in enumerate(zip(parents, own, strict=True))
                    if p == node and t == token
                ),
                None,
            )
            if child is None:
                break
            path.append(child)
            node = child
        return path

    def paths(self) -> list[list[int]]:
        """Root-to-leaf node index lists, one per leaf in ascending leaf index order."""
        parents = self.parents.tolist()
        has_child = [False] * len(parents)
        for parent in parents:
            if parent >= 0:
                has_child[parent] = True
        result = []
        for leaf, inner in enumerate(has_child):
            if inner:
                continue
            path, node = [], leaf
            while node >= 0:
                path.append(node)
                node = parents[node]
            result.append(path[::-1])
        return result

    # ------------------------------------------------------------------------------ transforms
    def select(self, nodes: Tensor) -> DraftTree:
        """The sub-tree made of `nodes` (ascending, closed under ancestors), re-indexed 0..k-1.

        Node ``nodes[j]`` of this tree becomes node ``j``; policies use this to cut a candidate
        tree down to the nodes they keep.
        """
        nodes = nodes.to(device=self.parents.device, dtype=torch.long)
        remap = torch.full((self.num_nodes,), -1, dtype=torch.long, device=nodes.device)
        remap[nodes] = torch.arange(nodes.shape[0], device=nodes.device)
        old_parents = self.parents[nodes]
        parents = torch.where(old_parents >= 0, remap[old_parents.clamp(min=0)], old_parents)
        draft_probs = None
        if self.draft_probs is not None:
            rows = torch.cat([nodes.new_zeros(1), nodes + 1])
            draft_probs = self.draft_probs[rows]
        tree = DraftTree(
            tokens=self.tokens[nodes],
            parents=parents,
            logprobs=self.logprobs[nodes],
            draft_probs=draft_probs,
            iid_children=self.iid_children,
            drafter_nodes=None
            if self.drafter_nodes is None
            else int((nodes < self.drafter_nodes).sum()),  # nodes ascend: still a prefix
        )
        if self._depth is not None:
            tree._depth = self._depth[nodes]
        return tree

    def to(self, device: torch.device | str) -> DraftTree:
        """A copy with every tensor on `device`."""
        tree = DraftTree(
            tokens=self.tokens.to(device),
            parents=self.parents.to(device),
            logprobs=self.logprobs.to(device),
            draft_probs=None if self.draft_probs is None else self.draft_probs.to(device),
            iid_children=self.iid_children,
            drafter_nodes=self.drafter_nodes,
        )
        if self._mask is not None:
            tree._mask = self._mask.to(device)
        if self._depth is not None:
            tree._depth = self._depth.to(device)
        return tree


@dataclass(eq=False)
class TreeBatch:
    """B trees of equal size N growing in lockstep: what batched tree policies hand a proposer.

    Every built-in policy adds the same number of nodes per level to every tree (chain: 1,
    static: fixed, dynamic: top_k**2 candidates), so a batch of B trees is a set of [B, N]
    tensors; `tree(b)` is row b as a `DraftTree`.
    """

    tokens: Tensor  # [B, N] long
    parents: Tensor  # [B, N] long
    logprobs: Tensor  # [B, N] float
    depth: Tensor  # [B, N] long, 1 for root children

    @property
    def batch_size(self) -> int:
        return int(self.tokens.shape[0])

    @property
    def num_nodes(self) -> int:
        return int(self.tokens.shape[1])

    def tree(self, row: int) -> DraftTree:
        tree = DraftTree(self.tokens[row], self.parents[row], self.logprobs[row])
        tree._depth = self.depth[row]
        return tree

    @staticmethod
    def stack(trees: list[DraftTree]) -> TreeBatch:
        """Trees of equal size as one batch (e.g. for re-scoring chosen paths)."""
        return TreeBatch(
            torch.stack([t.tokens for t in trees]),
            torch.stack([t.parents for t in trees]),
            torch.stack([t.logprobs for t in trees]),
            torch.stack([t.depth for t in trees]),
        )
