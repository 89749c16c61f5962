"""A bigram drafter: next-token counts from a corpus, behind the ordinary Drafter interface.

The cheapest drafter that still uses the data: it proposes the most frequent successor of the
current token, so it costs almost nothing to run and shows how much of a learned drafter's gain
comes from plain token statistics (a floor every trained drafter must beat).

Storing a full V x V table is out of the question for real vocabularies (49,152^2 entries for
SmolLM2), so each token keeps its `top_successors` most frequent successors and their counts;
every other token gets a backoff score from the unigram distribution:

    logit(v | x) = log(count(x, v) + backoff * p_uni(v))   for the stored successors v of x
                 = log(backoff * p_uni(v))                  otherwise,

with add-one smoothed unigrams, so the row is finite everywhere. As `backoff < 1 <= count`, the
argmax is the most frequent stored successor (ties go to the more frequent unigram), and a token
never seen with a successor falls back to the unigram argmax.

The decoder needs a state it can roll back: the state is the list of absorbed tokens (its last
entry is the context token), truncated and gathered like a KV cache. Logits depend only on each
input token, so tree masks and positions are accepted and ignored.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from lightning_spec.models.drafters.base import Drafter, DrafterOutput, register_drafter

__all__ = ["BigramDrafter", "BigramState", "count_bigrams"]

_COMPACT_EVERY = 4_000_000  # codes buffered before merging duplicates (bounds memory)


@dataclass
class BigramState:
    """Absorbed tokens per batch row; `tokens[b][-1]` is the row's context token."""

    tokens: list[list[int]] = field(default_factory=lambda: [[]])


def count_bigrams(
    sequences: Iterable[Iterable[int]], vocab_size: int
) -> tuple[Tensor, Tensor, Tensor]:
    """(pair codes, pair counts, unigram counts) over token-id sequences.

    A pair (x, v) is coded as x * vocab_size + v (int64). Duplicates are merged every few
    million pairs, so memory follows the number of distinct pairs, not the corpus size.
    """
    codes = torch.zeros(0, dtype=torch.long)
    counts = torch.zeros(0, dtype=torch.long)
    unigrams = torch.zeros(vocab_size, dtype=torch.long)
    pending: list[Tensor] = []
    pending_size = 0

    def merge() -> None:
        nonlocal codes, counts, pending, pending_size
        if not pending:
            return
        new = torch.cat(pending)
        everything = torch.cat([codes, new])
        weights = torch.cat([counts, torch.ones_like(new)])
        codes, inverse = torch.unique(everything, return_inverse=True)
        counts = torch.zeros(codes.numel(), dtype=torch.long).index_add_(0, inverse, weights)
        pending, pending_size = [], 0

    for sequence in sequences:
        ids = torch.as_tensor(list(sequence), dtype=torch.long)
        if ids.numel() == 0:
            continue
        if int(ids.min()) < 0 or int(ids.max()) >= vocab_size:
            raise ValueError(f"token id out of range for a vocabulary of {vocab_size}")
        unigrams += torch.bincount(ids, minlength=vocab_size)
        if ids.numel() > 1:
            pending.append(ids[:-1] * vocab_size + ids[1:])
            pending_size += ids.numel() - 1
            if pending_size >= _COMPACT_EVERY:
                merge()
    merge()
    return codes, counts, unigrams


@register_drafter
class BigramDrafter(Drafter):
    """Most-frequent-successor drafter; see the module docstring for the scores."""

    drafter_type = "bigram"
    needs_features = False

    def __init__(self, config: dict[str, Any]) -> None:
        config = dict(config)
        config.setdefault("top_successors", 8)
        config.setdefault("backoff", 0.5)
        if not 0.0 < float(config["backoff"]) < 1.0:
            raise ValueError("backoff must be in (0, 1) so a seen successor outranks the backoff")
        super().__init__(config)
        vocab, top = int(config["target_vocab_size"]), int(config["top_successors"])
        # Integer buffers: `.to(bfloat16)` leaves them exact (counts above 256 would not be).
        self.register_buffer("successor_ids", torch.full((vocab, top), -1, dtype=torch.long))
        self.register_buffer("successor_counts", torch.zeros(vocab, top, dtype=torch.long))
        self.register_buffer("unigram_counts", torch.zeros(vocab, dtype=torch.long))

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_sequences(
        cls,
        sequences: Iterable[Iterable[int]],
        vocab_size: int,
        *,
        top_successors: int = 8,
        backoff: float = 0.5,
        target_model: str = "",
        source: str = "",
    ) -> BigramDrafter:
        """Count successors in `sequences` (token ids of the target's tokenizer)."""
        if top_successors < 1:
            raise ValueError("top_successors must be >= 1")
        codes, counts, unigrams = count_bigrams(sequences, vocab_size)
        drafter = cls(
            {
                "target_vocab_size": vocab_size,
                "top_successors": top_successors,
                "backoff": backoff,
                "target_model": target_model,
                "source": source,
                "num_tokens": int(unigrams.sum()),
                "num_pairs": int(counts.sum()),
            }
        )
        if codes.numel():
            previous, successor = codes // vocab_size, codes % vocab_size
            # Order: previous token, then count descending, then successor id ascending
            # (stable sorts applied from the last key to the first).
            order = torch.argsort(successor, stable=True)
            order = order[torch.argsort(-counts[order], stable=True)]
            order = order[torch.argsort(previous[order], stable=True)]
            previous, successor, counts = previous[order], successor[order], counts[order]
            group_start = torch.searchsorted(previous, previous, right=False)
            rank = torch.arange(previous.numel()) - group_start
            keep = rank < top_successors
            drafter.successor_ids[previous[keep], rank[keep]] = successor[keep]
            drafter.successor_counts[previous[keep], rank[keep]] = counts[keep]
        drafter.unigram_counts.copy_(unigrams)
        return drafter

    # ------------------------------------------------------------------ state
    def new_state(self, batch_size: int = 1) -> BigramState:
        return BigramState([[] for _ in range(batch_size)])

    def state_length(self, state: BigramState) -> int:
        return len(state.tokens[0])

    def truncate_state(self, state: BigramState, length: int) -> None:
        if length > self.state_length(state):
            raise ValueError(f"cannot truncate a state of {self.state_length(state)} to {length}")
        state.tokens = [row[:length] for row in state.tokens]

    def keep_state_entries(
        self, state: BigramState, drop_last: int, keep: Tensor | list[int]
    ) -> None:
        if drop_last <= 0:
            return
        offsets = [int(k) for k in torch.as_tensor(keep).tolist()]
        start = self.state_length(state) - drop_last
        state.tokens = [row[:start] + [row[start + k] for k in offsets] for row in state.tokens]

    # ------------------------------------------------------------------ compute
    def backoff_logits(self) -> Tensor:
        """[V] log(backoff * p_uni(v)) with add-one smoothing: the score of unseen successors."""
        unigrams = self.unigram_counts.double() + 1.0
        probs = unigrams / unigrams.sum()
        return torch.log(float(self.config["backoff"]) * probs).float()

    def step(
        self,
        state: BigramState,
        input_ids: Tensor,
        position_ids: Tensor,
        *,
        features: Tensor | None = None,
        hidden: Tensor | None = None,
        mask: Tensor | None = None,
    ) -> DrafterOutput:
        """Successor scores of every input token; `state` absorbs the tokens."""
        del position_ids, features, hidden, mask  # a bigram reads only the token itself
        batch, length = input_ids.shape
        if len(state.tokens) != batch:
            raise ValueError(f"state holds {len(state.tokens)} rows, input has {batch}")
        for row, ids in zip(state.tokens, input_ids.tolist(), strict=True):
            row.extend(int(t) for t in ids)
        base = self.backoff_logits()  # [V]
        ids = self.successor_ids[input_ids]  # [B, T, K]
        counts = self.successor_counts[input_ids].float()  # [B, T, K]
        valid = ids >= 0
        safe = ids.clamp_min(0)
        boosted = torch.log(counts + base.exp()[safe])
        boosted = boosted.masked_fill(~valid, float("-inf"))
        logits = base.expand(batch, length, -1).clone()  # [B, T, V]
        # amax: a seen successor always beats its own backoff score; padding (-inf) changes nothing
        logits.scatter_reduce_(-1, safe, boosted, reduce="amax", include_self=True)
        zeros = logits.new_zeros(batch, length, 1)  # no hidden state: the engine only carries it
        return DrafterOutput(logits=logits, hidden=zeros)

    def most_likely_successor(self, token: int) -> int:
        """The drafter's greedy proposal after `token` (for inspection and tests)."""
        ids = torch.tensor([[token]], device=self.successor_ids.device)
        return int(self.step(self.new_state(1), ids, ids).logits[0, 0].argmax())

    # ------------------------------------------------------------------ persistence
    @classmethod
    def from_config_dict(cls, config: dict[str, Any]) -> BigramDrafter:
        return cls(config)
