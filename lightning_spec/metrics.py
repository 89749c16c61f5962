"""Acceptance metrics of speculative decoding, as torchmetrics `Metric`s.

* `AcceptanceLength`: tau = tokens committed per target verification (accepted drafts + the
  bonus/correction token), pooled over verification steps: sum of committed tokens / number of
  steps, the convention of EAGLE, GTO and Draft-OPD (MEASURING.md). A step whose output was cut
  by EOS or the token limit counts the tokens it actually committed, as `Generation.tau` does.
* `PerDepthAcceptance`: alpha_j = P(draft at depth j accepted | drafts 1 .. j-1 accepted), the
  per-depth acceptance rates. A step "attempts" depth j when drafts 1 .. j-1 were accepted and
  the tree offered a draft at depth j on that accepted path (a chain always does up to its
  length; a dynamic tree may end a branch early).

Both hold sums (`dist_reduce_fx="sum"`), so `compute()` after sharding prompts over DDP ranks
gives the same numbers as one process decoding every prompt.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor
from torchmetrics import Metric

__all__ = ["AcceptanceLength", "PerDepthAcceptance", "attempted_depth"]


class AcceptanceLength(Metric):
    """tau = committed tokens per verification, pooled over every step seen."""

    is_differentiable = False
    higher_is_better = True
    full_state_update = False

    committed: Tensor
    steps: Tensor

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.add_state(
            "committed", default=torch.tensor(0.0, dtype=torch.float64), dist_reduce_fx="sum"
        )
        self.add_state(
            "steps", default=torch.tensor(0.0, dtype=torch.float64), dist_reduce_fx="sum"
        )

    def update(self, committed_per_step: Tensor | Sequence[int]) -> None:
        """`committed_per_step` [S]: tokens committed by each of S verification steps."""
        values = torch.as_tensor(
            committed_per_step, dtype=torch.float64, device=self.committed.device
        )
        self.committed += values.sum()
        self.steps += values.numel()

    def update_from_records(self, records: Sequence[Any]) -> None:
        """Add the steps of a `Generation.records` list (`StepRecord.committed`)."""
        self.update([len(record.committed) for record in records])

    def compute(self) -> Tensor:
        """tau (NaN before any step)."""
        if self.steps == 0:
            return torch.tensor(float("nan"), dtype=torch.float64, device=self.steps.device)
        return self.committed / self.steps


def attempted_depth(record: Any) -> int:
    """Deepest draft depth a step tried: its accepted length, plus one when the tree offered a
    draft below the last accepted node (or below the root when nothing was accepted)."""
    accepted = int(record.accept_length)
    tree = record.tree
    if tree.num_nodes == 0:
        return 0
    if accepted == 0:
        return 1  # the root always has children in a non-empty tree
    last = int(record.accepted[-1])
    return accepted + int(bool(tree.has_children()[last]))


class PerDepthAcceptance(Metric):
    """alpha_j for depths j = 1 .. max_depth (depths beyond `max_depth` are not tracked)."""

    is_differentiable = False
    higher_is_better = True
    full_state_update = False

    attempts: Tensor
    accepted: Tensor

    def __init__(self, max_depth: int, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        if max_depth < 1:
            raise ValueError(f"max_depth must be >= 1, got {max_depth}")
        self.max_depth = int(max_depth)
        zeros = torch.zeros(self.max_depth, dtype=torch.float64)
        self.add_state("attempts", default=zeros.clone(), dist_reduce_fx="sum")
        self.add_state("accepted", default=zeros.clone(), dist_reduce_fx="sum")

    def update(
        self, accept_lengths: Tensor | Sequence[int], attempted_depths: Tensor | Sequence[int]
    ) -> None:
        """Per step: drafts accepted ([S]) and the deepest depth attempted ([S], >= accepted)."""
        device = self.attempts.device
        accepted = torch.as_tensor(accept_lengths, dtype=torch.long, device=device).reshape(-1, 1)
        attempted = torch.as_tensor(attempted_depths, dtype=torch.long, device=device).reshape(
            -1, 1
        )
        if bool((attempted < accepted).any()):
            raise ValueError("a step cannot accept more drafts than the depths it attempted")
        depths = torch.arange(1, self.max_depth + 1, device=device).unsqueeze(0)  # [1, D]
        self.attempts += (attempted >= depths).sum(dim=0).to(torch.float64)
        self.accepted += (accepted >= depths).sum(dim=0).to(torch.float64)

    def update_from_records(self, records: Sequence[Any]) -> None:
        """Add the steps of a `Generation.records` list."""
        if not records:
            return
        self.update(
            [int(record.accept_length) for record in records],
            [attempted_depth(record) for record in records],
        )

    def compute(self) -> Tensor:
        """[max_depth] alpha_j (NaN at depths never attempted)."""
        rates = self.accepted / self.attempts.clamp_min(1.0)
        return torch.where(self.attempts > 0, rates, torch.full_like(rates, float("nan")))
