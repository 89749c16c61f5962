"""The drafting seam: how tree policies feed the nodes of B draft trees to a drafter.

Tree policies (`lightning_spec.decoding.build`) only ask a proposer for log-probs at the roots
and at given nodes; `DrafterProposer` answers by feeding those nodes to the drafter with the
tree-attention mask, positions ``root + depth`` and, for EAGLE heads, the parent's own hidden
state. The decoder drafts through it (B = 1), and training objectives draft B trees at once
through the very same code, so training sees exactly the trees inference builds:

* `DrafterProposer.from_sequence` runs ONE teacher-forced pass over a training sequence and
  serves B prefixes from that shared cache: tree b sees the cache up to its own root (a per-row
  mask) and its own ancestors, nothing is copied per prefix (GTO's per-prefix trees).
* `path_logprobs` re-scores chosen paths through the same `expand` (with gradients when they
  are enabled), so log q of a path at training equals log q at build time.

`Drafter.proposer(...)` builds the proposer, so a drafter that feeds nodes differently (Hydra
heads, block-parallel drafters) overrides `draft_step` or returns its own proposer; every
expansion passes the explicit draft depth of the nodes it feeds.

Cache conventions (the engine's too): an EAGLE drafter holds one entry per absorbed token t_j,
j >= 1, read with the target feature of t_{j-1}; a drafter without features holds entries from
t_0. For a root at sequence position R the drafter has absorbed ``R + 1 - offset`` entries
(offset 1 for EAGLE, 0 otherwise) and the root row is the last of them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from lightning_spec.models.logits import tempered_log_softmax

Drafter = Any  # models.drafters.base.Drafter (not imported: base builds proposers from here)
__all__ = ["DrafterProposer", "absorb", "absorbed_offset"]


def absorbed_offset(drafter: Drafter) -> int:
    """1 when the drafter's entry j is token t_{j+1} (EAGLE: t_0 has no feature), else 0."""
    return 1 if drafter.needs_features else 0


def absorb(
    drafter: Drafter,
    state: Any,
    tokens: Tensor,
    first_position: int,
    features: Tensor | None,
) -> Any:
    """Feed committed `tokens` [B, T] at positions first_position.. to the drafter's `state`.

    `features` [B, T, F] are the target features of the token before each input (EAGLE). Returns
    the drafter output (logits and hidden of every fed token).
    """
    batch, length = tokens.shape
    positions = torch.arange(first_position, first_position + length, device=tokens.device)
    kwargs = {}
    if drafter.needs_features:
        if features is None:
            raise ValueError(f"{type(drafter).__name__} needs target features to absorb tokens")
        kwargs["features"] = features
    return drafter.step(state, tokens, positions.expand(batch, -1), **kwargs)


class DrafterProposer:
    """Serves `root` / `expand` for B trees from one drafter state (see the module docstring).

    Log-probs are over the TARGET vocabulary (off-vocabulary tokens carry -inf) at the step's
    temperature, already normalised (`normalized`: policies need not renormalise). Call
    `finish` after drafting to roll the drafter state back to the committed entries.
    """

    normalized = True

    def __init__(
        self,
        drafter: Drafter,
        state: Any,
        root_logits: Tensor,
        root_hidden: Tensor,
        root_positions: Tensor,
        *,
        temperature: float = 0.0,
        context_lengths: Tensor | None = None,
    ) -> None:
        """`root_logits` [B, V_draft], `root_hidden` [B, H], `root_positions` [B] long;
        `context_lengths` [B]: how many committed state entries each tree sees (None: all)."""
        if root_logits.dim() != 2 or root_hidden.dim() != 2:
            raise ValueError("root_logits and root_hidden must be [B, V] and [B, H]")
        self.drafter = drafter
        self.state = state
        self.root_logits = root_logits
        self.root_hidden = root_hidden
        self.root_positions = root_positions.to(root_logits.device).long().reshape(-1)
        self.temperature = float(temperature)
        self.context_lengths = context_lengths
        self.committed_length = drafter.state_length(state)
        self.batch_size = int(root_logits.shape[0])
        device = root_logits.device
        self._offsets = torch.full((self.batch_size, 0), -1, dtype=torch.long, device=device)
        self._hidden: Tensor | None = None  # [B, block, H] output hidden of fed nodes
        self._block = 0

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_sequence(
        cls,
        drafter: Drafter,
        input_ids: Tensor,
        root_positions: Tensor,
        *,
        features: Tensor | None = None,
        temperature: float = 0.0,
    ) -> DrafterProposer:
        """B trees rooted at `root_positions` [B] of ONE sequence `input_ids` [1, L].

        One teacher-forced pass (gradients as the caller's grad mode says) builds the shared
        state; root rows are the pass's outputs at each root. `features` [1, L, F] are the
        target's features of the whole sequence (EAGLE heads).
        """
        if input_ids.dim() != 2 or input_ids.shape[0] != 1:
            raise ValueError("from_sequence takes one sequence: input_ids [1, L]")
        offset = absorbed_offset(drafter)
        roots = root_positions.reshape(-1).long().to(input_ids.device)
        length = int(input_ids.shape[1])
        if bool((roots < offset).any()) or bool((roots >= length).any()):
            raise ValueError(f"root positions must lie in [{offset}, {length})")
        state = drafter.new_state(1)
        fed = input_ids[:, offset:]
        feats = None if features is None else features[:, : length - offset]
        output = absorb(drafter, state, fed, offset, feats)
        rows = roots - offset  # entry of each root
        return cls(
            drafter,
            state,
            output.logits[0, rows],
            output.hidden[0, rows],
            roots,
            temperature=temperature,
            context_lengths=rows + 1,
        )

    # ------------------------------------------------------------------ the policy protocol
    def root(self) -> Tensor:
        """[B, V] log-probs of the depth-1 tokens."""
        return self._logprobs(self.root_logits)

    def expand(self, trees: Any, nodes: Tensor) -> Tensor:
        """[B, k, V] log-probs of the children of `nodes` [B, k] of `trees` (a TreeBatch).

        Every ancestor of an expanded node must have been expanded before (policies expand
        parents first); each node is fed once.
        """
        return self._expand_logits(trees, nodes, self._logprobs)

    def _expand_logits(self, trees: Any, nodes: Tensor, convert: Any) -> Tensor:
        """`expand` with the drafter logits turned into rows by `convert`."""
        parents, depth, tokens = trees.parents, trees.depth, trees.tokens  # [B, N]
        batch, count = nodes.shape
        num_nodes = parents.shape[1]
        device = self.root_logits.device
        nodes = nodes.to(device)
        if self._offsets.shape[1] < num_nodes:
            grow = num_nodes - self._offsets.shape[1]
            pad = torch.full((batch, grow), -1, dtype=torch.long, device=device)
            self._offsets = torch.cat([self._offsets, pad], dim=1)
        offsets = self._offsets[:, :num_nodes]
        ancestors = _ancestor_rows(parents.to(device), nodes)  # [B, k, N] strict ancestors
        if bool((ancestors & (offsets < 0).unsqueeze(1)).any()):
            raise RuntimeError(
                "a node is expanded before its ancestor: tree policies must expand parents first"
            )
        mask = self._mask(ancestors, offsets, count)
        parent = torch.take_along_dim(parents.to(device), nodes, dim=1)  # [B, k]
        if self._hidden is None:
            parent_hidden = self.root_hidden.unsqueeze(1).expand(-1, count, -1)
        else:
            slot = torch.take_along_dim(offsets, parent.clamp(min=0), dim=1).clamp(min=0)
            gathered = torch.take_along_dim(self._hidden, slot.unsqueeze(-1), dim=1)
            root = self.root_hidden.unsqueeze(1).expand_as(gathered)
            parent_hidden = torch.where((parent < 0).unsqueeze(-1), root, gathered)
        node_depth = torch.take_along_dim(depth.to(device), nodes, dim=1)  # [B, k]
        positions = self.root_positions.unsqueeze(1) + node_depth
        node_tokens = torch.take_along_dim(tokens.to(device), nodes, dim=1)
        output = self.drafter.draft_step(
            self.state,
            node_tokens,
            positions,
            depth=node_depth,
            hidden=parent_hidden.to(self.root_hidden.dtype),
            mask=mask,
        )
        new_slots = self._block + torch.arange(count, device=device).expand(batch, -1)
        self._offsets = self._offsets.scatter(1, nodes, new_slots)
        hidden = output.hidden
        self._hidden = hidden if self._hidden is None else torch.cat([self._hidden, hidden], 1)
        self._block += count
        return convert(output.logits)

    @property
    def hidden(self) -> Tensor | None:
        """[B, fed, H] the drafter's output hidden state of every fed node, in feeding order."""
        return self._hidden

    def finish(self) -> None:
        """Roll the drafter state back to the committed entries (drop the drafted block)."""
        self.drafter.truncate_state(self.state, self.committed_length)
        self._hidden = None
        self._block = 0
        self._offsets = self._offsets[:, :0]

    # ------------------------------------------------------------------ re-scoring
    def path_logprobs(self, paths: Tensor, lengths: Tensor) -> Tensor:
        """[B, l] log q of each path token (0 beyond `lengths` [B]); paths [B, l] target ids.

        Runs through `root` / `expand` exactly as drafting did, so the values equal the
        build-time log-probs; call it with gradients enabled to train on them. The drafted
        block is rolled back afterwards.
        """
        batch, width = paths.shape
        device = self.root_logits.device
        paths = paths.to(device)
        if width == 0:
            return torch.zeros(batch, 0, device=device)
        rows = self.path_rows(paths[:, :-1])  # row j scores path token j
        values = rows.gather(2, paths.unsqueeze(-1)).squeeze(-1)
        valid = torch.arange(width, device=device).unsqueeze(0) < lengths.to(device).unsqueeze(1)
        return torch.where(valid, values, torch.zeros_like(values))

    def path_rows(self, paths: Tensor, *, draft_space: bool = False) -> Tensor:
        """[B, l + 1, V] the drafter's log-prob rows along each path: row 0 at the root, row
        j + 1 after path token j (paths [B, l] target ids, fed as a chain through `expand`).

        ``draft_space`` gives rows over the draft vocabulary [B, l + 1, V_draft] (the raw
        tempered log-softmax, before the map to target ids): what distillation losses compare.
        Rows past a path's real length are computed on its padding and are the caller's to
        mask. Gradients follow the caller's grad mode; the drafted block is rolled back.
        """
        batch, width = paths.shape
        device = self.root_logits.device
        paths = paths.to(device)
        convert = self._draft_logprobs if draft_space else self._logprobs
        rows = [convert(self.root_logits)]  # [B, V]
        chain = torch.arange(width, device=device).expand(batch, -1)
        for step in range(width):
            nodes = torch.full((batch, 1), step, dtype=torch.long, device=device)
            trees = _Chain(paths[:, : step + 1], chain[:, : step + 1] - 1, chain[:, : step + 1] + 1)
            rows.append(self._expand_logits(trees, nodes, convert)[:, 0])
        self.finish()
        return torch.stack(rows, dim=1)

    # ------------------------------------------------------------------ helpers
    def _logprobs(self, logits: Tensor) -> Tensor:
        return self.drafter.to_target(self._draft_logprobs(logits))

    def _draft_logprobs(self, logits: Tensor) -> Tensor:
        return tempered_log_softmax(logits, self.temperature)

    def _mask(self, ancestors: Tensor, offsets: Tensor, count: int) -> Tensor:
        """Bool [B, k, committed + block + k]: context, fed ancestors, and the node itself."""
        batch = ancestors.shape[0]
        device = ancestors.device
        committed = self.committed_length
        if self.context_lengths is None:
            context = torch.ones(batch, count, committed, dtype=torch.bool, device=device)
        else:
            limit = self.context_lengths.to(device).reshape(-1, 1, 1)
            context = torch.arange(committed, device=device).reshape(1, 1, -1) < limit
            context = context.expand(batch, count, committed)
        block = torch.zeros(batch, count, self._block + 1, dtype=torch.bool, device=device)
        if self._block:
            slots = torch.where(offsets >= 0, offsets, self._block)  # unfed -> spare column
            block.scatter_(2, slots.unsqueeze(1).expand(-1, count, -1), ancestors)
        own = torch.eye(count, dtype=torch.bool, device=device).expand(batch, -1, -1)
        return torch.cat([context, block[..., : self._block], own], dim=-1)


@dataclass
class _Chain:
    """The TreeBatch view of B chains (the paths being re-scored)."""

    tokens: Tensor  # [B, n]
    parents: Tensor  # [B, n]
    depth: Tensor  # [B, n]


def _ancestor_rows(parents: Tensor, nodes: Tensor) -> Tensor:
    """Bool [B, k, N]: the strict ancestors of each of `nodes` [B, k] (parents [B, N])."""
    batch, count = nodes.shape
    rows = torch.zeros(batch, count, parents.shape[1] + 1, dtype=torch.bool, device=nodes.device)
    current = torch.take_along_dim(parents, nodes, dim=1)  # [B, k]
    for _ in range(parents.shape[1]):
        alive = current >= 0
        if not bool(alive.any()):
            break
        slot = torch.where(alive, current, parents.shape[1])  # dead rows mark the spare column
        rows.scatter_(2, slot.unsqueeze(-1), True)
        current = torch.where(
            alive, torch.take_along_dim(parents, current.clamp(min=0), dim=1), current
        )
    return rows[..., :-1]
