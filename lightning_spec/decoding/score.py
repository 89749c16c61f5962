"""Scoring draft trees with the target: the one home of the tree-block conventions.

A *tree block* feeds a tree to the target after a sequence cache: the block holds the root (the
last committed token t_R, at position R) followed by the N draft nodes at positions R + depth.
The root row sees the cache entries 0 .. R-1 and itself; node i sees the same entries, the root
and its own ancestors (the tree-attention mask of `DraftTree.ancestor_mask`). Rows follow the
`DraftTree` convention: row 0 is the target at the root (it scores the depth-1 nodes), row i + 1
the target at node i.

The decoder verifies its single tree through `score_trees_target` (its cache holds exactly
t_0 .. t_{R-1}); training objectives score many trees over ONE sequence cache that holds a whole
training sequence: tree b is rooted at R_b and sees only the cache entries before R_b, so
several trees share one forward (chunked by `max_tokens` so memory stays bounded) and the cache
is restored afterwards. Both paths build the same block, mask and positions, so what a training
objective scores is exactly what verification would have computed.

`text_scores` is the cheap case at T = 0: on the target's own greedy text the argmax rows of
every tree are read off the cached teacher-forced pass (no forward), exactly where that is exact.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from lightning_spec.decoding.tree import DraftTree
from lightning_spec.models.cache import cache_length, keep_cache_entries
from lightning_spec.models.logits import tempered_log_softmax
from lightning_spec.models.target import TargetModel

__all__ = ["TreeBlock", "TreeScores", "score_trees_target", "text_scores", "tree_block"]

OUTPUTS = frozenset({"logprobs", "argmax", "topk", "rows", "features"})


@dataclass
class TreeBlock:
    """The target inputs of one block of trees over a cache of `past` entries."""

    input_ids: Tensor  # [1, M]
    position_ids: Tensor  # [1, M]
    mask: Tensor  # bool [1, M, past + M]
    starts: list[int]  # block row of each tree's root; its nodes follow


def tree_block(
    trees: Sequence[DraftTree],
    root_tokens: Sequence[int] | Tensor,
    root_positions: Sequence[int] | Tensor,
    past: int,
) -> TreeBlock:
    """Inputs for [root_b, nodes of tree b] for every b after a cache of `past` entries.

    Tree b sees the cache entries before its root position (``root_positions[b] <= past``).
    """
    tokens, positions, starts = [], [], []
    roots = [int(r) for r in torch.as_tensor(root_positions).reshape(-1).tolist()]
    root_ids = [int(t) for t in torch.as_tensor(root_tokens).reshape(-1).tolist()]
    if len(roots) != len(trees) or len(root_ids) != len(trees):
        raise ValueError("one root token and one root position per tree")
    total = 0
    for tree, root, token in zip(trees, roots, root_ids, strict=True):
        if not 0 <= root <= past:
            raise ValueError(f"a root at position {root} needs a cache of >= {root} entries")
        starts.append(total)
        tokens.append(torch.cat([torch.tensor([token]), tree.tokens.cpu()]))
        depth = torch.cat([torch.zeros(1, dtype=torch.long), tree.depth.cpu()])
        positions.append(root + depth)
        total += tree.num_nodes + 1
    mask = torch.zeros(total, past + total, dtype=torch.bool)
    for tree, root, start in zip(trees, roots, starts, strict=True):
        size = tree.num_nodes + 1
        rows = slice(start, start + size)
        mask[rows, :root] = True
        mask[rows, past + start] = True  # every row sees its root
        if tree.num_nodes:
            nodes = slice(past + start + 1, past + start + size)
            mask[start + 1 : start + size, nodes] = tree.ancestor_mask().cpu()
    return TreeBlock(
        input_ids=torch.cat(tokens).unsqueeze(0),
        position_ids=torch.cat(positions).unsqueeze(0),
        mask=mask.unsqueeze(0),
        starts=starts,
    )


@dataclass
class TreeScores:
    """What the target says about one tree (rows: 0 = root, i + 1 = node i)."""

    token_logprobs: Tensor | None = None  # [N] log p(node token | parent context)
    argmax: Tensor | None = None  # [N + 1]
    topk_logprobs: Tensor | None = None  # [N + 1, k]
    topk_ids: Tensor | None = None  # [N + 1, k]
    logsumexp: Tensor | None = None  # [N + 1] of the tempered logits (with top-k)
    rows: Tensor | None = None  # [N + 1, V] float logits
    features: Tensor | None = None  # [N + 1, F] the target features of the block rows


def score_trees_target(
    target: TargetModel,
    cache: object,
    trees: Sequence[DraftTree],
    root_tokens: Sequence[int] | Tensor,
    root_positions: Sequence[int] | Tensor,
    *,
    outputs: Collection[str] = ("logprobs",),
    top_k: int = 0,
    temperature: float = 0.0,
    max_tokens: int = 512,
    keep_block: bool = False,
) -> list[TreeScores]:
    """Score `trees` after `cache` in chunked target forwards (see the module docstring).

    `outputs` picks the fields of each `TreeScores`: ``logprobs`` (per-node token log-probs),
    ``argmax``, ``topk`` (``top_k`` best log-probs and ids per row, plus the logsumexp of the
    tempered logits), ``rows`` (full logits) and ``features``. Chunks hold at most `max_tokens`
    block rows (a larger tree gets a chunk of its own). The cache is restored after each chunk,
    unless `keep_block` (one tree, one chunk): then the block stays for the caller to compact,
    as the decoder does with the accepted path.
    """
    unknown = set(outputs) - OUTPUTS
    if unknown:
        raise ValueError(f"unknown outputs {sorted(unknown)}; choose from {sorted(OUTPUTS)}")
    if "topk" in outputs and top_k < 1:
        raise ValueError("outputs 'topk' needs top_k >= 1")
    roots = torch.as_tensor(root_positions).reshape(-1).tolist()
    tokens = torch.as_tensor(root_tokens).reshape(-1).tolist()
    if keep_block and len(trees) != 1:
        raise ValueError("keep_block keeps the block of exactly one tree")
    past = cache_length(cache)
    device = target.device
    results: list[TreeScores] = []
    for chunk in _chunks([t.num_nodes + 1 for t in trees], max_tokens):
        block = tree_block(
            [trees[i] for i in chunk], [tokens[i] for i in chunk], [roots[i] for i in chunk], past
        )
        output = target(
            block.input_ids.to(device),
            position_ids=block.position_ids.to(device),
            tree_mask=block.mask.to(device),
            cache=cache,
            output_features="features" in outputs,
        )
        if not keep_block:
            keep_cache_entries(cache, block.input_ids.shape[1], [])
        logits = output.logits[0]  # [M, V]
        for index, start in zip(chunk, block.starts, strict=True):
            tree = trees[index]
            rows = logits[start : start + tree.num_nodes + 1].float()
            feats = None if output.features is None else output.features[0, start : start + rows.shape[0]]
            results.append(_scores(tree, rows, feats, outputs, top_k, temperature))
    return results


def _scores(
    tree: DraftTree,
    rows: Tensor,
    features: Tensor | None,
    outputs: Collection[str],
    top_k: int,
    temperature: float,
) -> TreeScores:
    scores = TreeScores(features=features, rows=rows if "rows" in outputs else None)
    if "argmax" in outputs:
        scores.argmax = rows.argmax(dim=-1)
    if "logprobs" in outputs or "topk" in outputs:
        logprobs = tempered_log_softmax(rows, temperature)  # [N + 1, V]
        if "logprobs" in outputs:
            parents = tree.parents.to(rows.device) + 1
            scores.token_logprobs = logprobs[parents, tree.tokens.to(rows.device)]
        if "topk" in outputs:
            values, ids = logprobs.topk(min(top_k, logprobs.shape[-1]), dim=-1)
            scores.topk_logprobs, scores.topk_ids = values, ids
            scaled = rows if temperature <= 0 else rows / temperature
            scores.logsumexp = torch.logsumexp(scaled, dim=-1)
    return scores


def _chunks(sizes: Sequence[int], max_tokens: int) -> list[list[int]]:
    """Consecutive groups of tree indices whose block rows fit `max_tokens` (>= one tree)."""
    groups: list[list[int]] = []
    current: list[int] = []
    used = 0
    for index, size in enumerate(sizes):
        if current and used + size > max_tokens:
            groups.append(current)
            current, used = [], 0
        current.append(index)
        used += size
    if current:
        groups.append(current)
    return groups


def text_scores(
    trees: list[DraftTree], ids: Tensor, target_argmax: Tensor, roots: Tensor
) -> list[TreeScores] | None:
    """The greedy scores of trees drafted at `roots` of the text `ids`, read off the cached
    teacher-forced pass instead of a target forward; None when that would not be exact.

    `target_argmax[t]` is the target's argmax after ids[:t + 1]. A node whose path from the
    root follows the text (its tokens are ids[R + 1 .. R + d]) has the argmax row
    target_argmax[R + d]; any other node gets a row no token equals. That is exact for greedy
    verification and 0/1 factors when, over the tree's depth, the text is the target's own
    greedy text (ids[R + j + 1] == target_argmax[R + j]): then every node off the text has an
    ancestor (or is itself) a node that is not the argmax, so its product of factors is 0
    whatever its own row says. The argmax rows go through the decoder's own verification
    (`verify_greedy_argmax`) exactly as scored rows would.
    """
    length = int(ids.shape[0])
    out: list[TreeScores] = []
    for tree, root in zip(trees, roots.tolist(), strict=True):
        depth = int(tree.max_depth)
        if root + depth >= length:
            return None  # the text ends inside the tree's reach: not known without a forward
        window = slice(root, root + depth)
        if not torch.equal(target_argmax[window].to(ids.device), ids[root + 1 : root + depth + 1]):
            return None  # not the greedy text here (a near-tie, a cut): score this sequence
        rows = torch.full((tree.num_nodes + 1,), -1, dtype=torch.long, device=ids.device)
        rows[0] = target_argmax[root]
        if tree.num_nodes:
            node_depth = tree.depth.to(ids.device)
            on_text = tree.tokens.to(ids.device) == ids[root + node_depth]
            # on the text only if every ancestor is too: the ancestor mask holds the node itself
            on_path = ~(tree.ancestor_mask().to(ids.device) & ~on_text.unsqueeze(0)).any(dim=-1)
            positions = root + node_depth
            rows[1:] = torch.where(on_path, target_argmax[positions].to(ids.device), rows[1:])
        out.append(TreeScores(argmax=rows))
    return out
