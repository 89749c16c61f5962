"""Prompt lookup grafted onto the drafter's tree: n-gram drafts for text that repeats.

Code, edits and summaries copy long spans of their context (a function signature, a variable
name, a quoted line). A learned drafter of a few layers predicts such spans one token at a time
and only as deep as its tree; the n-gram match of prompt lookup decoding (Saxena 2023; HF
``prompt_lookup_num_tokens``) finds them for free: the last n committed tokens occurred earlier,
so propose what followed them there. Neither wins everywhere (lookup has nothing to say on fresh
chat text, the drafter is shallow on copies), so `LookupPolicy` drafts with the drafter's policy
and grafts the lookup chain onto the same tree: one verification forward checks both, and greedy
verification keeps the deepest accepted path, whichever proposer made it.

Losslessness. At T = 0 greedy verification accepts a node only when it is the target's argmax
after its accepted ancestors, so any extra branch is lossless. At T > 0 the sampling rules need
every node drawn from (SpecInfer) or ranked by (EAGLE) the drafter's q; a copied span is neither,
so the graft is skipped and the tree is the drafter's own.

Bookkeeping. Grafted nodes are appended after the drafter's nodes, so ``tree.drafter_nodes``
nodes (a prefix of the node list) are the drafter's and the rest are copies; their draft
log-prob is 0 (the point mass the lookup proposes). Training objectives draft through
`build_batch` only (never grafted), and rollout sources refuse a lookup policy
(`require_drafter_policy`): a copied token the target rejected is not the drafter's error.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import torch
from torch import Tensor

from lightning_spec.decoding.tree import DraftTree

__all__ = ["LookupPolicy", "LookupStats", "PromptLookup", "graft_chain", "require_drafter_policy"]


@dataclass(frozen=True)
class PromptLookup:
    """The n-gram proposer: the continuation of the latest earlier occurrence of the context's
    last n tokens, n from `max_ngram` down to `min_ngram` (the longest match wins)."""

    max_ngram: int = 3
    num_tokens: int = 8
    min_ngram: int = 1
    window: int = 4096
    """Only the last `window` committed tokens are searched (bounded cost per step)."""

    def __post_init__(self) -> None:
        if not 1 <= self.min_ngram <= self.max_ngram:
            raise ValueError(
                f"prompt lookup needs 1 <= min_ngram <= max_ngram, got {self.min_ngram}, "
                f"{self.max_ngram}"
            )
        if self.num_tokens < 1:
            raise ValueError(f"prompt lookup proposes at least 1 token, got {self.num_tokens}")
        if self.window <= self.max_ngram:
            raise ValueError(f"the lookup window ({self.window}) must exceed max_ngram")

    def propose(self, sequence: Sequence[int]) -> list[int]:
        """Up to `num_tokens` tokens that followed the latest earlier match of the suffix."""
        return self.match(sequence)[0]

    def match(self, sequence: Sequence[int]) -> tuple[list[int], int]:
        """(`propose`'s tokens, the length n of the matched n-gram; 0 when nothing matched)."""
        context = torch.as_tensor(list(sequence[-self.window :]), dtype=torch.long)
        length = int(context.shape[0])
        for n in range(min(self.max_ngram, length - 1), self.min_ngram - 1, -1):
            suffix = context[length - n :]
            # windows starting at 0 .. length - n - 1: every occurrence before the suffix itself
            windows = context[: length - 1].unfold(0, n, 1)
            hits = (windows == suffix).all(dim=1).nonzero().flatten()
            if hits.numel():
                start = int(hits[-1]) + n  # the latest match: closest in topic and style
                return context[start : start + self.num_tokens].tolist(), n
        return [], 0


class LookupStats:
    """Running acceptance of lookup branches per matched n-gram length and depth.

    ``cond[n][d]``: of the branches from an n-gram match that reached depth d (their tokens
    1 .. d - 1 were the target's), how many had token d right too. With a pseudo-count prior
    of one accepted try per cell, an unseen cell starts at 1 (a new decoder proposes the whole
    branch and learns). `reach(n, d)` = prod of cond over depths 1 .. d: the chance that a
    branch node at depth d is accepted, which is what it must beat to be worth its share of
    the verification forward.
    """

    def __init__(self, max_ngram: int, depth: int, prior: float = 1.0) -> None:
        self.accepted = torch.zeros(max_ngram + 1, depth)
        self.tried = torch.zeros(max_ngram + 1, depth)
        self.prior = float(prior)
        self.pending: tuple[list[int], int] | None = None

    def reach(self, n: int) -> Tensor:
        """[depth] estimated P(accepted through depth d) of a branch from an n-gram match."""
        cond = (self.accepted[n] + self.prior) / (self.tried[n] + self.prior)
        return torch.cumprod(cond, dim=0)

    def observe(self, committed: Sequence[int]) -> None:
        """Update from the tokens the step committed (accepted drafts, then the bonus)."""
        if self.pending is None:
            return
        chain, n = self.pending
        self.pending = None
        matched = 0
        for proposed, token in zip(chain, committed, strict=False):
            if proposed != token:
                break
            matched += 1
        reached = min(matched + 1, len(chain))  # depths 1 .. matched + 1 were looked at
        self.tried[n, :reached] += 1
        self.accepted[n, :matched] += 1


def graft_chain(tree: DraftTree, chain: Sequence[int]) -> DraftTree:
    """`tree` with `chain` (target ids, from the root) added as a branch.

    The chain follows existing nodes while their tokens agree and continues with new nodes
    (parents before children, appended after every existing node, draft log-prob 0). The
    drafter's q rows, if any, are not extended: a grafted tree is verified greedily.
    """
    path = tree.follow(chain)
    rest = list(chain[len(path) :])
    if not rest:
        return tree
    n = tree.num_nodes
    device = tree.tokens.device
    first_parent = path[-1] if path else -1
    parents = [first_parent] + list(range(n, n + len(rest) - 1))
    grafted = replace(
        tree,
        tokens=torch.cat([tree.tokens, torch.tensor(rest, dtype=torch.long, device=device)]),
        parents=torch.cat([tree.parents, torch.tensor(parents, dtype=torch.long, device=device)]),
        logprobs=torch.cat([tree.logprobs, torch.zeros(len(rest), device=device)]),
        draft_probs=None,
        drafter_nodes=tree.drafter_nodes if tree.drafter_nodes is not None else n,
    )
    base_depth = len(path)
    grafted._depth = torch.cat(
        [tree.depth, torch.arange(base_depth + 1, base_depth + 1 + len(rest), device=device)]
    )
    return grafted


@dataclass(frozen=True)
class LookupPolicy:
    """A drafter tree policy plus the prompt-lookup branch (``<base spec>+lookup:N,K``).

    `build_batch` / `build` are the base policy's (what training objectives and rollouts see);
    the decoder calls `graft` with the committed sequence before verifying.
    """

    base: object  # a TreePolicy
    lookup: PromptLookup
    min_reach: float = 0.0
    """> 0: cut each branch where its estimated chance of acceptance (`LookupStats`, learnt
    while decoding) falls below this; 0 always grafts `num_tokens` tokens."""
    stats: LookupStats | None = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        if not 0.0 <= self.min_reach < 1.0:
            raise ValueError(f"min_reach must lie in [0, 1), got {self.min_reach}")
        if self.stats is None:
            stats = LookupStats(self.lookup.max_ngram, self.lookup.num_tokens)
            object.__setattr__(self, "stats", stats)

    @property
    def max_nodes(self) -> int:
        return int(self.base.max_nodes) + self.lookup.num_tokens  # type: ignore[attr-defined]

    @property
    def max_depth(self) -> int:
        return max(int(self.base.max_depth), self.lookup.num_tokens)  # type: ignore[attr-defined]

    def build_batch(self, proposer, **kwargs):  # type: ignore[no-untyped-def]
        return self.base.build_batch(proposer, **kwargs)  # type: ignore[attr-defined]

    def build(self, proposer, **kwargs):  # type: ignore[no-untyped-def]
        return self.base.build(proposer, **kwargs)  # type: ignore[attr-defined]

    def needs_draft_probs(self, temperature: float) -> bool:
        return bool(self.base.needs_draft_probs(temperature))  # type: ignore[attr-defined]

    def graft(self, tree: DraftTree, sequence: Sequence[int], temperature: float) -> DraftTree:
        """The tree to verify: with the lookup chain at T = 0, unchanged at T > 0."""
        self.stats.pending = None  # type: ignore[union-attr]
        if temperature > 0:
            return tree
        chain, n = self.lookup.match(sequence)
        if chain and self.min_reach > 0:
            keep = int((self.stats.reach(n)[: len(chain)] >= self.min_reach).sum())  # type: ignore[union-attr]
            chain = chain[:keep]  # reach falls with depth: the kept depths are a prefix
        if not chain:
            return tree
        self.stats.pending = (chain, n)  # type: ignore[union-attr]
        return graft_chain(tree, chain)

    def observe(self, committed: Sequence[int]) -> None:
        """The decoder reports what a grafted step committed (`LookupStats.observe`)."""
        self.stats.observe(committed)  # type: ignore[union-attr]


def require_drafter_policy(policy: object, where: str) -> None:
    """Refuse a lookup policy where the trees must be the drafter's own (rollouts, training)."""
    if isinstance(policy, LookupPolicy):
        raise ValueError(
            f"{where} needs the drafter's own trees: a '+lookup' branch copies context tokens, "
            "so its rejections are not the drafter's errors; use the base tree spec here"
        )
