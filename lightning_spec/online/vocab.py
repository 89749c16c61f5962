"""A draft vocabulary that follows the served stream (OnlineSpec).

A reduced draft vocabulary is fixed when the drafter is built, from the text it trained on. Served
on a domain that text did not cover (a chat drafter on code), a sixth of the committed tokens can
lie outside it: the drafter never proposes them and no online update can teach it to, since they
are masked out of every loss. `VocabGrowth` counts the committed tokens of the stream and, every
round, swaps up to `swaps` draft slots whose tokens the stream has used least for the tokens it
uses most that the drafter cannot draft, so online learning can then reach them.

`swap_draft_vocab` does one swap on an EAGLE-3-style head (an `lm_head` over the draft ids, the
`d2t`/`t2d` maps): kept tokens keep their head rows (and their optimizer moments), a new token's
row starts from the target's embedding of it (the target's own output row for the tied-embedding
targets this project's defaults use, the prior `Eagle3Drafter.from_target` gives a fresh head)
with zeroed moments, and the draft ids stay ordered by target id (`models/vocab.py`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from lightning_spec.decoding.engine import Generation
from lightning_spec.models.drafters.base import Drafter
from lightning_spec.models.vocab import draft_to_target_ids


def supports_vocab_swap(drafter: Drafter) -> bool:
    """True for drafters with their own head over a reduced draft vocabulary."""
    head = getattr(drafter, "lm_head", None)
    d2t = getattr(drafter, "d2t", None)
    return (
        isinstance(head, torch.nn.Linear)
        and isinstance(d2t, Tensor)
        and d2t.numel() == head.weight.shape[0]
        and d2t.numel() < int(drafter.target_vocab_size)
    )


def swap_draft_vocab(
    drafter: Drafter,
    evict: Tensor,
    add: Tensor,
    optimizer: torch.optim.Optimizer | None = None,
) -> None:
    """Replace the draft ids `evict` by the target ids `add` (same length), in place.

    In place, so the optimizer keeps the same parameter objects; its per-row state of the head
    (AdamW's moments) is permuted with the rows and zeroed for the new ones.
    """
    evict = torch.as_tensor(evict, dtype=torch.long).flatten()
    add = torch.as_tensor(add, dtype=torch.long).flatten()
    if evict.numel() != add.numel():
        raise ValueError(f"{evict.numel()} slots to evict but {add.numel()} tokens to add")
    if evict.numel() == 0:
        return
    head: torch.nn.Linear = drafter.lm_head  # type: ignore[assignment]
    size = head.weight.shape[0]
    old_ids = draft_to_target_ids(drafter.d2t).cpu()
    if bool(drafter.t2d[add].any()) or add.unique().numel() != add.numel():
        raise ValueError("tokens to add must be new to the draft vocabulary and distinct")
    if evict.unique().numel() != evict.numel() or int(evict.min()) < 0 or int(evict.max()) >= size:
        raise ValueError(f"draft ids to evict must be distinct and in [0, {size})")
    keep = torch.ones(size, dtype=torch.bool)
    keep[evict] = False
    ids = torch.cat([old_ids[keep], add])
    source = torch.cat([torch.arange(size)[keep], torch.full((add.numel(),), -1)])
    order = torch.argsort(ids)
    ids, source = ids[order], source[order]
    kept, fresh = source >= 0, source < 0
    device = head.weight.device

    def permuted(rows: Tensor, init: Tensor | None) -> Tensor:
        out = torch.zeros_like(rows)
        out[kept.to(device)] = rows[source[kept].to(device)]
        if init is not None:
            out[fresh.to(device)] = init.to(out.dtype)
        return out

    with torch.no_grad():
        embedding = drafter.embed(ids[fresh].to(device)).float()
        head.weight.copy_(permuted(head.weight, embedding))
        if optimizer is not None:
            state = optimizer.state.get(head.weight, {})
            for value in state.values():
                if isinstance(value, Tensor) and value.shape == head.weight.shape:
                    value.copy_(permuted(value, None))
        drafter.d2t.copy_((ids - torch.arange(size)).to(drafter.d2t.device))
        drafter.t2d.zero_()
        drafter.t2d[ids.to(drafter.t2d.device)] = True


class VocabGrowth:
    """Counts of the stream's committed tokens, and the swaps they call for each round.

    A token outside the draft vocabulary replaces a slot when the stream has committed it more
    often than the slot's token (at least `min_count` times): the slots the stream never uses
    go first. `protected` ids (the target's end-of-sequence tokens) are never evicted.
    """

    def __init__(
        self, vocab_size: int, *, swaps: int, min_count: int = 2, protected: Sequence[int] = ()
    ) -> None:
        if swaps < 1 or min_count < 1:
            raise ValueError(f"vocab growth needs swaps >= 1 and min_count >= 1, got {swaps}, {min_count}")
        self.swaps, self.min_count = int(swaps), int(min_count)
        self.protected = torch.tensor(sorted({int(i) for i in protected}), dtype=torch.long)
        self.counts = torch.zeros(int(vocab_size), dtype=torch.long)
        self.swapped = 0

    def observe(self, generations: Sequence[Generation]) -> None:
        """Add a served round's committed tokens to the counts."""
        tokens = [t for g in generations for t in g.tokens]
        if tokens:
            ids = torch.tensor(tokens, dtype=torch.long)
            self.counts += torch.bincount(ids, minlength=self.counts.numel())[: self.counts.numel()]

    def plan(self, drafter: Drafter) -> tuple[Tensor, Tensor]:
        """(draft ids to evict, target ids to add), paired most-used-new with least-used-kept."""
        in_vocab = draft_to_target_ids(drafter.d2t).cpu()
        missing = self.counts.clone()
        missing[in_vocab] = -1
        best = torch.topk(missing, self.swaps)
        slot_counts = self.counts[in_vocab].to(torch.float64)
        if self.protected.numel():
            slot_counts[torch.isin(in_vocab, self.protected)] = float("inf")
        worst = torch.topk(slot_counts, self.swaps, largest=False)
        take = (best.values >= self.min_count) & (best.values.to(torch.float64) > worst.values)
        return worst.indices[take], best.indices[take]

    def step(self, drafter: Drafter, generations: Sequence[Generation],
             optimizer: torch.optim.Optimizer | None = None) -> int:  # fmt: skip
        """Observe a round, then swap; returns how many slots changed."""
        self.observe(generations)
        evict, add = self.plan(drafter)
        swap_draft_vocab(drafter, evict, add, optimizer)
        self.swapped += int(add.numel())
        return int(add.numel())

    def state_dict(self) -> dict[str, Any]:
        return {"counts": self.counts.clone(), "swapped": self.swapped}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.counts = state["counts"].clone()
        self.swapped = int(state.get("swapped", 0))
