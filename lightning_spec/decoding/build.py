"""Tree policies: how a drafter's next-token distributions become a draft tree.

A policy talks to the drafter only through a `Proposer` (log-probs at the root, log-probs of the
children of given nodes), so one policy serves every drafter and the engine decides how nodes are
fed to the model (KV cache, tree attention). Three policies:

* `ChainPolicy(k)`: a chain of k tokens (classic speculative decoding, Leviathan et al. 2023):
  argmax at T = 0, i.i.d. samples from q at T > 0 (verified with the SpecInfer rule).
* `StaticTreePolicy(paths)`: a fixed tree of child ranks (Medusa, EAGLE-1); children are the
  deterministic top-k tokens of q at any temperature (verified with the EAGLE rule).
* `DynamicTreePolicy(depth, top_k, total_tokens)`: EAGLE-2 (Li et al. 2024) context-aware trees,
  expanded best-first by cumulative draft log-prob and reranked globally.

`parse_tree_spec` turns strings such as ``chain:4``, ``dynamic:5,8,32`` or ``static:tiny`` into a
policy (config files and the CLI use it).

Why one file (~630 lines): the three tree policies share the batched policy base, the tree
constructor and `parse_tree_spec`, which names them all.
"""

from __future__ import annotations

import ast
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch
from torch import Tensor

from lightning_spec.decoding.tree import DraftTree, TreeBatch
from lightning_spec.decoding.verify import draw_uniforms, inverse_cdf_sample

__all__ = [
    "STATIC_TREES",
    "BatchProposer",
    "ChainPolicy",
    "DynamicTreePolicy",
    "Proposer",
    "StaticTreePolicy",
    "TreePolicy",
    "as_batch_proposer",
    "parse_tree_spec",
    "select_best",
]


@runtime_checkable
class Proposer(Protocol):
    """One tree's drafter as a policy sees it (B = 1). Log-probs are over the TARGET vocabulary
    (tokens a reduced draft vocabulary cannot produce carry -inf), already temperature-scaled."""

    def root(self) -> Tensor:
        """[V] log-probs of the first draft token given the committed context."""
        ...

    def expand(self, tree: DraftTree, nodes: Tensor) -> Tensor:
        """[k, V] log-probs of the children of `nodes` ([k] long indices already in `tree`)."""
        ...


@runtime_checkable
class BatchProposer(Protocol):
    """B trees' drafter (`lightning_spec.models.drafters.proposer.DrafterProposer` is one)."""

    batch_size: int

    def root(self) -> Tensor:
        """[B, V] log-probs of the first draft token of each tree."""
        ...

    def expand(self, trees: TreeBatch, nodes: Tensor) -> Tensor:
        """[B, k, V] log-probs of the children of `nodes` [B, k] (already in `trees`)."""
        ...


class _SingleTree:
    """A one-tree `Proposer` seen as a `BatchProposer` of batch 1."""

    batch_size = 1

    def __init__(self, proposer: Proposer) -> None:
        self.proposer = proposer

    def root(self) -> Tensor:
        return self.proposer.root().reshape(1, -1)

    def expand(self, trees: TreeBatch, nodes: Tensor) -> Tensor:
        return self.proposer.expand(trees.tree(0), nodes[0]).unsqueeze(0)


def as_batch_proposer(proposer: Proposer | BatchProposer) -> BatchProposer:
    """Batched proposers pass through; a one-tree proposer becomes a batch of 1."""
    return proposer if hasattr(proposer, "batch_size") else _SingleTree(proposer)  # type: ignore[return-value]


@runtime_checkable
class TreePolicy(Protocol):
    """Builds the draft trees of verification steps: B roots at once, or one (B = 1)."""

    def build_batch(
        self,
        proposer: BatchProposer,
        *,
        temperature: float = 0.0,
        generator: torch.Generator | None = None,
        keep_draft_probs: bool = False,
    ) -> list[DraftTree]:
        """Query `proposer` once per level for all B trees and return the B trees."""
        ...

    def build(
        self,
        proposer: Proposer | BatchProposer,
        *,
        temperature: float = 0.0,
        generator: torch.Generator | None = None,
        keep_draft_probs: bool = False,
    ) -> DraftTree:
        """The B = 1 case of `build_batch`."""
        ...

    def needs_draft_probs(self, temperature: float) -> bool:
        """Whether lossless verification at `temperature` reads the q rows of the tree."""
        ...


class _BatchPolicy:
    """`build` as the B = 1 case of `build_batch`, shared by every policy."""

    def build(
        self,
        proposer: Proposer | BatchProposer,
        *,
        temperature: float = 0.0,
        generator: torch.Generator | None = None,
        keep_draft_probs: bool = False,
    ) -> DraftTree:
        batch = as_batch_proposer(proposer)
        if batch.batch_size != 1:
            raise ValueError(f"build() drafts one tree; the proposer holds {batch.batch_size}")
        return self.build_batch(  # type: ignore[attr-defined]
            batch, temperature=temperature, generator=generator, keep_draft_probs=keep_draft_probs
        )[0]

    def needs_draft_probs(self, temperature: float) -> bool:
        """Deterministic top-k children: the EAGLE rule never reads q rows."""
        del temperature
        return False


def _log_probs(raw: Tensor, proposer: object) -> Tensor:
    """Float log-probs, renormalised so proposers may hand back logits as well (skipped for
    proposers that declare ``normalized = True``, like the drafting seam: it saves a [k, V]
    log-softmax per expansion)."""
    if getattr(proposer, "normalized", False):
        return raw.float()
    return torch.log_softmax(raw.float(), dim=-1)


def _make_tree(
    tokens: Tensor,
    parents: Tensor,
    logprobs: Tensor,
    depth: Tensor,
    draft_probs: Tensor | None = None,
    iid_children: bool = False,
) -> DraftTree:
    tree = DraftTree(tokens, parents, logprobs, draft_probs, iid_children)
    tree._depth = depth  # known while building: saves deriving it from the parents
    return tree


def _rows(values: Tensor, batch: int) -> Tensor:
    """A per-level index vector [n] repeated for B trees: [B, n]."""
    return values.unsqueeze(0).expand(batch, -1)


# ----------------------------------------------------------------------------------------- chain
@dataclass(frozen=True)
class ChainPolicy(_BatchPolicy):
    """A chain of `k` draft tokens: greedy at T = 0, sampled from q (i.i.d. children) at T > 0."""

    k: int

    def __post_init__(self) -> None:
        if self.k < 1:
            raise ValueError(f"ChainPolicy needs k >= 1, got {self.k}")

    @property
    def max_nodes(self) -> int:
        return self.k

    @property
    def max_depth(self) -> int:
        return self.k

    def needs_draft_probs(self, temperature: float) -> bool:
        """Sampled chains are verified with the SpecInfer rule, which reads q."""
        return temperature > 0.0

    def build_batch(
        self,
        proposer: BatchProposer,
        *,
        temperature: float = 0.0,
        generator: torch.Generator | None = None,
        keep_draft_probs: bool = False,
    ) -> list[DraftTree]:
        """One `expand` call per token after the first (k - 1 in all), for all B chains."""
        sampling = temperature > 0.0
        log_q = _log_probs(proposer.root(), proposer)  # [B, V]
        batch, device = log_q.shape[0], log_q.device
        tokens: list[Tensor] = []
        logprobs: list[Tensor] = []
        rows: list[Tensor] = [log_q.exp()] if keep_draft_probs else []
        # the generator may live on another device than the drafter: draw on its own device
        uniforms = draw_uniforms(batch * self.k, generator) if sampling else []
        arange = torch.arange(self.k + 1, device=device)
        for step in range(self.k):
            if sampling:
                probs = log_q.exp()
                token = torch.tensor(
                    [
                        inverse_cdf_sample(probs[b], uniforms[b * self.k + step])
                        for b in range(batch)
                    ],
                    device=device,
                )
            else:
                token = log_q.argmax(dim=-1)
            tokens.append(token)
            logprobs.append(log_q.gather(1, token.unsqueeze(1)).squeeze(1))
            if step == self.k - 1:
                break
            n = step + 1
            trees = TreeBatch(
                torch.stack(tokens, dim=1),
                _rows(arange[:n] - 1, batch),
                torch.stack(logprobs, dim=1),
                _rows(arange[1 : n + 1], batch),
            )
            nodes = torch.full((batch, 1), step, dtype=torch.long, device=device)
            log_q = _log_probs(proposer.expand(trees, nodes)[:, 0], proposer)
            if keep_draft_probs:
                rows.append(log_q.exp())
        draft_probs = None
        if keep_draft_probs:
            rows.append(torch.zeros_like(rows[0]))  # the last node is never expanded
            draft_probs = torch.stack(rows, dim=1)  # [B, k + 1, V]
        token_rows, logprob_rows = torch.stack(tokens, dim=1), torch.stack(logprobs, dim=1)
        return [
            _make_tree(
                token_rows[b],
                arange[: self.k] - 1,
                logprob_rows[b],
                arange[1 : self.k + 1],
                draft_probs=None if draft_probs is None else draft_probs[b],
                iid_children=sampling,
            )
            for b in range(batch)
        ]


# ---------------------------------------------------------------------------------------- static
STATIC_TREES: dict[str, tuple[tuple[int, ...], ...]] = {
    # 6 nodes, depth 3: two candidates at depth 1, the best branch widened once and deepened
    "tiny": ((0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0)),
    # 15 nodes, depth 5: widths 3-5-4-2-1, rank budget concentrated on the top-ranked branch
    "small": (
        (0,),
        (1,),
        (2,),
        (0, 0),
        (0, 1),
        (0, 2),
        (1, 0),
        (2, 0),
        (0, 0, 0),
        (0, 0, 1),
        (0, 1, 0),
        (1, 0, 0),
        (0, 0, 0, 0),
        (0, 0, 0, 1),
        (0, 0, 0, 0, 0),
    ),
    # 31 nodes, depth 6: for GPUs, where verifying a wider tree costs almost nothing extra
    "medium": (
        (0,),
        (1,),
        (2,),
        (3,),
        (0, 0),
        (0, 1),
        (0, 2),
        (0, 3),
        (1, 0),
        (1, 1),
        (2, 0),
        (3, 0),
        (0, 0, 0),
        (0, 0, 1),
        (0, 0, 2),
        (0, 1, 0),
        (0, 1, 1),
        (1, 0, 0),
        (2, 0, 0),
        (0, 0, 0, 0),
        (0, 0, 0, 1),
        (0, 0, 1, 0),
        (0, 1, 0, 0),
        (1, 0, 0, 0),
        (0, 0, 0, 0, 0),
        (0, 0, 0, 0, 1),
        (0, 0, 0, 1, 0),
        (0, 1, 0, 0, 0),
        (0, 0, 0, 0, 0, 0),
        (0, 0, 0, 0, 0, 1),
        (0, 0, 0, 0, 1, 0),
    ),
}
"""Built-in static trees (our own designs), named for ``static:<name>`` specs."""


class StaticTreePolicy(_BatchPolicy):
    """A fixed tree of child ranks, e.g. ``[(0,), (1,), (0, 0)]``: rank r is the r-th most likely
    child of its parent under q. Every prefix of a path must be present. Nodes are ordered by
    depth, then lexicographically by ranks (a topological order); children are deterministic
    top-k at any temperature, so sampling verification uses the EAGLE rule."""

    def __init__(self, paths: Sequence[Sequence[int]]) -> None:
        normalised = []
        for path in paths:
            if isinstance(path, int):
                raise ValueError(f"static tree paths must be tuples of ranks, got {path!r}")
            path = tuple(int(rank) for rank in path)
            if not path or min(path) < 0:
                raise ValueError(f"static tree path {path} must be a non-empty tuple of ranks >= 0")
            normalised.append(path)
        if not normalised:
            raise ValueError("a static tree needs at least one path")
        if len(set(normalised)) != len(normalised):
            raise ValueError("static tree paths must be distinct")
        known = set(normalised)
        for path in normalised:
            if len(path) > 1 and path[:-1] not in known:
                raise ValueError(f"static tree path {path} lacks its prefix {path[:-1]}")
        self.paths: tuple[tuple[int, ...], ...] = tuple(
            sorted(normalised, key=lambda p: (len(p), p))
        )
        index = {path: i for i, path in enumerate(self.paths)}
        self.parents: list[int] = [index[p[:-1]] if len(p) > 1 else -1 for p in self.paths]
        self.ranks: list[int] = [p[-1] for p in self.paths]
        self.depths: list[int] = [len(p) for p in self.paths]

    def __repr__(self) -> str:
        return f"StaticTreePolicy(paths={list(self.paths)})"

    @property
    def max_nodes(self) -> int:
        return len(self.paths)

    @property
    def max_depth(self) -> int:
        return self.depths[-1]

    def build_batch(
        self,
        proposer: BatchProposer,
        *,
        temperature: float = 0.0,
        generator: torch.Generator | None = None,
        keep_draft_probs: bool = False,
    ) -> list[DraftTree]:
        """One `expand` call per level that has children, with exactly the nodes that do.

        `temperature` and `generator` are unused: children are top-k at every temperature.
        """
        del temperature, generator
        n = len(self.paths)
        root = _log_probs(proposer.root(), proposer)  # [B, V]
        batch, device, vocab = root.shape[0], root.device, root.shape[-1]
        if max(self.ranks) >= vocab:
            raise ValueError(f"static tree rank {max(self.ranks)} needs a vocabulary > {vocab}")
        tokens = torch.zeros(batch, n, dtype=torch.long, device=device)
        logprobs = torch.zeros(batch, n, device=device)
        parents = torch.tensor(self.parents, dtype=torch.long, device=device)
        depth = torch.tensor(self.depths, dtype=torch.long, device=device)
        draft_probs = torch.zeros(batch, n + 1, vocab, device=device) if keep_draft_probs else None
        level_start = 0
        # the log-prob rows of the expanded nodes of the previous level, keyed by parent index
        expanded_parents = [-1]
        expanded_rows = root.unsqueeze(1)  # [B, e, V]
        for level in range(1, self.max_depth + 1):
            level_end = level_start
            while level_end < n and self.depths[level_end] == level:
                level_end += 1
            members = range(level_start, level_end)
            width = max(self.ranks[i] for i in members) + 1
            top_logprobs, top_tokens = expanded_rows.topk(width, dim=-1)  # [B, e, width]
            slot = {parent: row for row, parent in enumerate(expanded_parents)}
            rows = torch.tensor([slot[self.parents[i]] for i in members], device=device)
            ranks = torch.tensor([self.ranks[i] for i in members], device=device)
            tokens[:, level_start:level_end] = top_tokens[:, rows, ranks]
            logprobs[:, level_start:level_end] = top_logprobs[:, rows, ranks]
            if draft_probs is not None:
                index = torch.tensor(expanded_parents, device=device) + 1
                draft_probs[:, index] = expanded_rows.exp()
            # nodes of this level that have children are expanded next, in one call
            parents_next = sorted({self.parents[i] for i in range(level_end, n)} & set(members))
            if not parents_next:
                break
            partial = TreeBatch(
                tokens[:, :level_end].clone(),
                _rows(parents[:level_end], batch),
                logprobs[:, :level_end].clone(),
                _rows(depth[:level_end], batch),
            )
            nodes = _rows(torch.tensor(parents_next, dtype=torch.long, device=device), batch)
            expanded_rows = _log_probs(proposer.expand(partial, nodes), proposer)
            expanded_parents = parents_next
            level_start = level_end
        return [
            _make_tree(
                tokens[b],
                parents,
                logprobs[b],
                depth,
                draft_probs=None if draft_probs is None else draft_probs[b],
            )
            for b in range(batch)
        ]


# --------------------------------------------------------------------------------------- dynamic
@dataclass(frozen=True)
class DynamicTreePolicy(_BatchPolicy):
    """EAGLE-2 dynamic tree: best-first expansion by cumulative draft log-prob, global rerank.

    `depth` counts draft levels (1 = only children of the root); `total_tokens` counts the root
    too (EAGLE convention), so the tree keeps ``total_tokens - 1`` nodes, capped by the number of
    candidates ``top_k + (depth - 1) * top_k**2``.
    """

    depth: int
    top_k: int
    total_tokens: int

    def __post_init__(self) -> None:
        if self.depth < 1 or self.top_k < 1 or self.total_tokens < 2:
            raise ValueError(
                "DynamicTreePolicy needs depth >= 1, top_k >= 1 and total_tokens >= 2, got "
                f"depth={self.depth}, top_k={self.top_k}, total_tokens={self.total_tokens}"
            )

    @property
    def max_nodes(self) -> int:
        candidates = self.top_k + (self.depth - 1) * self.top_k**2
        return min(self.total_tokens - 1, candidates)

    @property
    def max_depth(self) -> int:
        return self.depth

    def build_batch(
        self,
        proposer: BatchProposer,
        *,
        temperature: float = 0.0,
        generator: torch.Generator | None = None,
        keep_draft_probs: bool = False,
    ) -> list[DraftTree]:
        """Grow the candidate trees level by level, then keep the best nodes (re-indexed).

        Each `expand` call receives the trees of all candidates so far and the current frontier
        (the ``top_k`` best nodes of the newest level), so only frontier nodes are ever fed to the
        drafter. Each returned tree is a re-indexed subset of its candidates; `build_candidates`
        exposes the candidates and the mapping. `temperature` and `generator` are unused.
        """
        del temperature, generator
        trees, _, _ = self.build_candidates_batch(proposer, keep_draft_probs=keep_draft_probs)
        return trees

    def build_candidates(
        self, proposer: Proposer | BatchProposer, *, keep_draft_probs: bool = False
    ) -> tuple[DraftTree, DraftTree, Tensor]:
        """(final tree, candidate tree, kept) of one tree: ``final`` is
        ``candidates.select(kept)`` plus, when asked, its q rows. Candidate node j's score is
        the sum of ``candidates.logprobs`` along its path; candidates carry no draft_probs."""
        trees, candidates, kept = self.build_candidates_batch(
            as_batch_proposer(proposer), keep_draft_probs=keep_draft_probs
        )
        return trees[0], candidates.tree(0), kept[0]

    def build_candidates_batch(
        self, proposer: BatchProposer, *, keep_draft_probs: bool = False
    ) -> tuple[list[DraftTree], TreeBatch, Tensor]:
        """`build_candidates` for B trees: (final trees, candidates [B, C], kept [B, N])."""
        root = _log_probs(proposer.root(), proposer)  # [B, V]
        batch, device, vocab = root.shape[0], root.device, root.shape[-1]
        k = min(self.top_k, vocab)
        scores, tokens = root.topk(k, dim=-1)  # [B, k]
        all_tokens, all_parents, all_logprobs = [tokens], [torch.full_like(tokens, -1)], [scores]
        all_scores, all_depths = [scores], [torch.ones_like(tokens)]
        expanded_nodes: list[Tensor] = []
        expanded_rows: list[Tensor] = []
        frontier = _rows(torch.arange(k, device=device), batch)  # [B, k] node indices
        frontier_scores = scores
        count = k
        for level in range(2, self.depth + 1):
            candidates = TreeBatch(
                torch.cat(all_tokens, dim=1),
                torch.cat(all_parents, dim=1),
                torch.cat(all_logprobs, dim=1),
                torch.cat(all_depths, dim=1),
            )
            log_q = _log_probs(proposer.expand(candidates, frontier), proposer)  # [B, f, V]
            if keep_draft_probs:
                expanded_nodes.append(frontier)
                expanded_rows.append(log_q.exp())
            child_logprobs, child_tokens = log_q.topk(k, dim=-1)  # [B, f, k]
            child_scores = frontier_scores.unsqueeze(-1) + child_logprobs  # [B, f, k]
            child_parents = frontier.unsqueeze(-1).expand_as(child_tokens)
            all_tokens.append(child_tokens.flatten(1))
            all_parents.append(child_parents.flatten(1))
            all_logprobs.append(child_logprobs.flatten(1))
            all_scores.append(child_scores.flatten(1))
            all_depths.append(torch.full_like(child_tokens.flatten(1), level))
            # next frontier: the global top-k of this level (stable: ties keep creation order)
            order = torch.sort(-child_scores.flatten(1), dim=-1, stable=True).indices[:, :k]
            frontier = count + order
            frontier_scores = child_scores.flatten(1).gather(1, order)
            count += child_tokens[0].numel()
        candidates = TreeBatch(
            torch.cat(all_tokens, dim=1),
            torch.cat(all_parents, dim=1),
            torch.cat(all_logprobs, dim=1),
            torch.cat(all_depths, dim=1),
        )
        kept = select_best(torch.cat(all_scores, dim=1), self.total_tokens - 1)  # [B, N]
        trees = [candidates.tree(b).select(kept[b]) for b in range(batch)]
        if keep_draft_probs:
            # q rows only for the kept nodes: [N + 1, V], never [num_candidates + 1, V]
            for b, tree in enumerate(trees):
                slot = torch.zeros(count, dtype=torch.long, device=device)  # 0 = not expanded
                rows = [torch.zeros(1, vocab, device=device)]
                if expanded_nodes:
                    nodes = torch.cat([f[b] for f in expanded_nodes])
                    slot[nodes] = torch.arange(1, nodes.shape[0] + 1, device=device)
                    rows += [r[b] for r in expanded_rows]
                tree.draft_probs = torch.cat(
                    [root[b].exp().unsqueeze(0), torch.cat(rows)[slot[kept[b]]]]
                )
        return trees, candidates, kept


def select_best(scores: Tensor, count: int) -> Tensor:
    """Ascending indices of the `count` best candidates by score, ties to the lower index
    (over the last dimension: [C] -> [count], or [B, C] -> [B, count]).

    Candidates are in topological order and a child's score is its parent's plus a log-prob
    <= 0, so a parent is never worse than its child and wins ties by its lower index: the kept
    set is closed under ancestors, and ascending indices keep it topologically ordered.
    """
    order = torch.sort(-scores, dim=-1, stable=True).indices[..., :count]
    return order.sort(dim=-1).values


# ------------------------------------------------------------------------------------------ spec
def parse_tree_spec(spec: str) -> TreePolicy:
    """Policy from a string: ``chain:K``, ``dynamic:DEPTH,TOP_K,TOTAL_TOKENS``,
    ``static:NAME`` (see `STATIC_TREES`) or ``static:[(0,), (1,), (0, 0)]`` (explicit ranks),
    optionally followed by ``+lookup`` or ``+lookup:MAX_NGRAM,TOKENS[,MIN_REACH]`` (a
    prompt-lookup branch grafted at T = 0, `decoding.lookup`; defaults 3, 8 and 0)."""
    base, plus, extra = spec.partition("+")
    if plus:
        try:
            tree = parse_tree_spec(base)
        except ValueError as error:  # quote the whole spec the user wrote, not its first part
            raise ValueError(f"bad tree spec {spec!r}: its tree part: {error}") from error
        return _lookup_policy(tree, extra.strip(), spec)
    kind, sep, args = spec.strip().partition(":")
    kind, args = kind.strip().lower(), args.strip()
    usage = (
        "expected 'chain:K', 'dynamic:DEPTH,TOP_K,TOTAL_TOKENS', 'static:NAME' with NAME in "
        f"{sorted(STATIC_TREES)}, or 'static:[(0,), (1,), (0, 0), ...]'"
    )
    if not sep or not args:
        raise ValueError(f"bad tree spec {spec!r}: {usage}")
    try:
        if kind == "chain":
            return ChainPolicy(_ints(args, 1)[0])
        if kind == "dynamic":
            depth, top_k, total_tokens = _ints(args, 3)
            return DynamicTreePolicy(depth, top_k, total_tokens)
        if kind == "static":
            if args in STATIC_TREES:
                return StaticTreePolicy(STATIC_TREES[args])
            if args.startswith(("[", "(")):
                return StaticTreePolicy(ast.literal_eval(args))
            raise ValueError(f"unknown static tree {args!r}")
    except (ValueError, SyntaxError, TypeError) as error:
        raise ValueError(f"bad tree spec {spec!r}: {error}; {usage}") from error
    raise ValueError(f"bad tree spec {spec!r}: unknown kind {kind!r}; {usage}")


def _ints(text: str, count: int) -> list[int]:
    parts = [part.strip() for part in text.split(",")]
    if len(parts) != count:
        raise ValueError(f"expected {count} comma-separated integers, got {text!r}")
    return [int(part) for part in parts]


def _lookup_policy(base: TreePolicy, extra: str, spec: str) -> TreePolicy:
    from lightning_spec.decoding.lookup import LookupPolicy, PromptLookup

    kind, _, args = extra.partition(":")
    usage = "expected '+lookup' or '+lookup:MAX_NGRAM,TOKENS[,MIN_REACH]'"
    if kind.strip().lower() != "lookup":
        raise ValueError(f"bad tree spec {spec!r}: after '+' only lookup; {usage}")
    parts = [part.strip() for part in args.split(",")] if args.strip() else []
    try:
        if parts and len(parts) not in (2, 3):
            raise ValueError(f"{len(parts)} values")
        lookup = PromptLookup(int(parts[0]), int(parts[1])) if parts else PromptLookup()
        min_reach = float(parts[2]) if len(parts) == 3 else 0.0
        return LookupPolicy(base, lookup, min_reach)  # type: ignore[return-value]
    except ValueError as error:
        raise ValueError(f"bad tree spec {spec!r}: {error}; {usage}") from error
