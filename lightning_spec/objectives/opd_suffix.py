"""Draft-OPD's blocks as the reference builds them: chains, and the states after the first error.

The reference (docs/methods/draft-opd.md) rolls out a chain drafter with the current weights at
T = 0. At each verification step (anchor a) the drafter proposes d_1 .. d_K, the target accepts
the first n and corrects slot n + 1. Its loss reads every drafted slot of the block:

* the **accepted stream**, slots 1 .. n + 1 (the accepted drafts and the correction), under the
  committed prefix: forward KL towards the target's rows along the committed text;
* the **rejected stream**, slots n + 1 .. K: reverse KL, where the teacher at slot k > n + 1 is
  the target conditioned on the drafter's OWN prefix d_1 .. d_{k-1}, which holds the wrong
  d_{n+1}. These post-rejection states are what SFT on the target's text never visits.

At T = 0 nothing here needs a token-by-token rollout. On the target's greedy text the committed
tokens do not depend on the drafter, so the decoder's exact replay (`decoding.replay.
replay_greedy` with a `ChainPolicy`) gives the current drafter's anchors, chains and accept
lengths from one teacher-forced pass; the teacher rows along the committed text are the LM head
on that pass's final hidden states (cached with the features by the regenerated store); and only
the post-rejection suffixes take target compute: one tree-block forward for all blocks of a
sequence through the decoder's own scoring (`score_trees_target`), on top of the sequence's cache.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from lightning_spec.decoding.build import ChainPolicy
from lightning_spec.decoding.replay import TextPass, replay_greedy
from lightning_spec.decoding.score import score_trees_target
from lightning_spec.decoding.tree import DraftTree
from lightning_spec.models.drafters.base import Drafter
from lightning_spec.models.target import TargetModel

__all__ = [
    "ChainBlocks",
    "chain_blocks",
    "default_chain",
    "moved_blocks",
    "SuffixRows",
    "realised_tokens",
    "stream_masks",
    "teacher_rows",
]

DEFAULT_EAGLE_CHAIN = 6


def default_chain(drafter: Drafter) -> int:
    """The reference's block: a block drafter's whole block (B - 1 drafts), else chain:6."""
    block = getattr(drafter, "block_size", None)
    return int(block) - 1 if block else DEFAULT_EAGLE_CHAIN


@dataclass
class ChainBlocks:
    """The verification steps of one greedy text under a chain drafter (S blocks)."""

    anchors: Tensor
    """[S] position of each block's root (the last committed token before the step)."""
    drafts: Tensor
    """[S, K] the drafter's chain d_1 .. d_K (target ids)."""
    accepted: Tensor
    """[S] n: how many leading drafts the target accepted."""
    corrections: Tensor
    """[S] the committed token after the accepted drafts (slot n + 1; -1: the text ends)."""

    @property
    def rejected(self) -> Tensor:
        """[S] bool: slot n + 1 was drafted and verified wrong (the text holds its correction)."""
        return (self.accepted < self.drafts.shape[1]) & (self.corrections >= 0)

    @property
    def num_blocks(self) -> int:
        return int(self.anchors.shape[0])


@torch.no_grad()
def chain_blocks(
    target: TargetModel,
    drafter: Drafter,
    ids: Tensor,
    start: int,
    *,
    chain: int,
    text: TextPass,
) -> ChainBlocks | None:
    """The blocks the current `drafter` would verify on the greedy text `ids` [L] whose
    continuation starts at `start` (replayed by the decoder with `ChainPolicy(chain)`).

    `text` is the target's pass over `ids` (`replay.text_pass`, or the cached features and final
    hidden states). Raises `replay.ReplayMismatch` when the continuation is not the target's
    greedy one (cut it first: `replay.greedy_prefix`). None when no step fits."""
    ids = ids.reshape(-1)
    length = int(ids.shape[0])
    if length - 1 <= start:
        return None
    generation = replay_greedy(
        target, drafter, ChainPolicy(chain), ids[:start].tolist(), ids[start:].tolist(), text=text
    )
    records = generation.records
    if not records:
        return None
    anchors = torch.tensor([r.anchor for r in records], dtype=torch.long)
    drafts = torch.stack([r.tree.tokens.cpu().long() for r in records])
    accepted = torch.tensor([r.accept_length for r in records], dtype=torch.long)
    after = anchors + accepted + 1
    cpu_ids = ids.cpu()
    corrections = torch.where(
        after < length, cpu_ids[after.clamp(max=length - 1)], torch.full_like(after, -1)
    )
    return ChainBlocks(anchors, drafts, accepted, corrections)


@torch.no_grad()
def teacher_rows(
    target: TargetModel,
    cache: object,
    ids: Tensor,
    blocks: ChainBlocks,
    text_logits: Tensor,
    *,
    text_start: int,
    max_tokens: int = 512,
    suffix: bool = True,
) -> Tensor:
    """[S, K, V] the target's logits at every drafted slot of every block, each under the
    prefix the drafter drafted it from.

    Slot j + 1 (row j) of a block at anchor a with n accepted drafts: for j <= n the context is
    committed text, so the row is `text_logits[a + j - text_start]` (`text_logits` [T, V]: the
    target after each position from `text_start` on); for j > n (after the first rejection)
    the context is the committed prefix up to a + n followed by the drafter's d_{n+1} .. d_j,
    scored as one chain per block rooted at a + n through `score_trees_target`, which needs
    `cache` to hold the target's entries of `ids` [L] up to at least the largest such root.
    ``suffix=False``: text rows only (blocks whose chains follow the text; no cache needed).
    """
    ids = ids.reshape(-1)
    count, width = blocks.drafts.shape
    device = text_logits.device
    anchors, accepted = blocks.anchors, blocks.accepted
    slots = torch.arange(width).unsqueeze(0)
    on_text = (anchors.unsqueeze(1) + torch.minimum(slots, accepted.unsqueeze(1))) - text_start
    rows = text_logits[on_text.clamp(0, text_logits.shape[0] - 1).to(device)].clone()
    if not suffix:
        return rows
    suffix_blocks = [
        b for b in range(count) if bool(blocks.rejected[b]) and int(accepted[b]) < width - 1
    ]
    if not suffix_blocks:
        return rows
    trees, roots, root_tokens = [], [], []
    for b in suffix_blocks:
        n = int(accepted[b])
        nodes = blocks.drafts[b, n : width - 1].to(device)  # d_{n+1} .. d_{K-1}
        size = int(nodes.shape[0])
        trees.append(
            DraftTree(nodes, torch.arange(size, device=device) - 1, torch.zeros(size, device=device))
        )
        root = int(anchors[b]) + n
        roots.append(root)
        root_tokens.append(int(ids[root]))
    scores = score_trees_target(
        target,
        cache,
        trees,
        root_tokens,
        roots,
        outputs=("rows",),
        max_tokens=max(int(max_tokens), max(t.num_nodes + 1 for t in trees)),
    )
    for b, score in zip(suffix_blocks, scores, strict=True):
        n = int(accepted[b])
        assert score.rows is not None
        rows[b, n + 1 :] = score.rows[1:].to(rows.dtype)  # row i + 1: after d_{n+1} .. d_{n+1+i}
    return rows


@dataclass
class SuffixRows:
    """One text's blocks with their teacher and drafter rows: `real` (blocks, teacher [S, K, V],
    drafter [S, K, V]); `moved` the same for the random-anchor ablation's moved blocks."""

    real: tuple[ChainBlocks, Tensor, Tensor]
    moved: tuple[ChainBlocks, Tensor, Tensor] | None = None


def moved_blocks(
    blocks: ChainBlocks, ids: Tensor, start: int, generator: torch.Generator
) -> ChainBlocks:
    """The random-anchor ablation: each block moved to a uniformly drawn response position,
    keeping its accept length (clipped to the text), its chain now the text itself, so only
    its accepted stream (accepted drafts and correction) means anything."""
    ids = ids.reshape(-1).cpu()
    length = int(ids.shape[0])
    count, width = blocks.drafts.shape
    anchors = torch.randint(start, max(start, length - 2) + 1, (count,), generator=generator)
    accepted = torch.minimum(blocks.accepted, length - 1 - anchors).clamp_min(0)
    index = anchors.unsqueeze(1) + torch.arange(1, width + 1).unsqueeze(0)
    drafts = torch.where(index < length, ids[index.clamp(max=length - 1)], torch.zeros_like(index))
    after = anchors + accepted + 1
    corrections = torch.where(
        (after < length) & (accepted < width), ids[after.clamp(max=length - 1)],
        torch.full_like(after, -1),
    )  # fmt: skip
    return ChainBlocks(anchors, drafts, accepted, corrections)


def stream_masks(blocks: ChainBlocks, *, correction: bool = True) -> tuple[Tensor, Tensor]:
    """(accepted [S, K], rejected [S, K]) bool masks over the drafted slots (row j = slot j + 1).

    Accepted: the accepted drafts and, when the text holds it and it lies inside the block, the
    correction's slot n + 1. Rejected: slots n + 1 .. K of a block whose slot n + 1 was verified
    wrong (slot n + 1 is in both streams, as in the reference)."""
    width = blocks.drafts.shape[1]
    slots = torch.arange(width).unsqueeze(0)
    n = blocks.accepted.unsqueeze(1)
    correction = (blocks.corrections >= 0).unsqueeze(1) & (n < width) & correction
    accepted = (slots < n) | ((slots == n) & correction)
    rejected = blocks.rejected.unsqueeze(1) & (slots >= n)
    return accepted, rejected


def realised_tokens(blocks: ChainBlocks) -> Tensor:
    """[S, K] the token the accepted stream's per-token estimator reads at each slot: the
    accepted draft, and the correction at slot n + 1 (other slots: the draft)."""
    width = blocks.drafts.shape[1]
    slots = torch.arange(width).unsqueeze(0)
    at_n = slots == blocks.accepted.unsqueeze(1)
    fix = blocks.corrections.clamp_min(0).unsqueeze(1).expand_as(blocks.drafts)
    return torch.where(at_n & (blocks.corrections >= 0).unsqueeze(1), fix, blocks.drafts)
