"""The one definition of acceptance length (tau) and per-depth acceptance (alpha_j).

Used by the bench, the acceptance callbacks and the objectives, on the decoder's StepRecords
(only `tree.parents`, `accepted` and `committed` are read, so records from a serving engine
work unchanged).

* tau = tokens committed per target verification (accepted drafts + the bonus/correction
  token), pooled over verification steps: sum of committed tokens / number of steps, the
  convention of EAGLE, GTO and Draft-OPD (docs/benchmarking.md). A step whose output was cut by EOS or
  the token limit counts the tokens it actually committed, as `Generation.tau` does.
* alpha_j = P(draft at depth j accepted | drafts 1 .. j-1 accepted). A step *attempts* depth j
  when its accepted path reached depth j - 1 AND the tree has at least one child of that
  accepted node (of the root for j = 1) at depth j (`attempted_depth`). A chain always offers
  one up to its length; a dynamic or static tree may end a branch early, and a step whose
  accepted path ends on such a leaf did not attempt the next depth: it is not a rejection
  there. (Bounding the attempt by the tree's overall depth instead counts it as one, which
  underestimates alpha on trees; that was `stats.per_depth_acceptance` of tree depths.) A
  step cut by EOS or the token limit attempted nothing past the cut.

Pure functions over records (`tau_from_records`, `attempted_depth`, `alpha_from_records`,
`per_depth_acceptance`, `depth_counts`) and torchmetrics `Metric`s with summed states
(`AcceptanceLength`, `PerDepthAcceptance`, `dist_reduce_fx="sum"`), so `compute()` after
sharding prompts over DDP ranks gives the same numbers as one process decoding every prompt.
Undefined values are `None` from the functions (JSON null) and NaN from the Metrics.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch import Tensor
from torchmetrics import Metric

__all__ = [
    "AcceptanceLength",
    "PerDepthAcceptance",
    "accepted_length",
    "alpha_from_records",
    "attempted_depth",
    "committed_per_step",
    "depth_counts",
    "per_depth_acceptance",
    "tau_from_records",
]


# ---------------------------------------------------------------------------- record level
def accepted_length(record: Any) -> int:
    """Drafts a step accepted (its accepted path, depth 1 first)."""
    return len(record.accepted)


def committed_per_step(records: Iterable[Any]) -> list[int]:
    """Tokens committed by each verification step (accepted drafts + bonus, cut at EOS/limit)."""
    return [len(record.committed) for record in records]


def tau_from_records(records: Iterable[Any]) -> float | None:
    """Tokens committed per verification, pooled over `records` (None without a step)."""
    committed = committed_per_step(records)
    return sum(committed) / len(committed) if committed else None


def attempted_depth(record: Any) -> int:
    """Deepest draft depth a step attempted: its accepted length, plus one when the tree has a
    child of the last accepted node (of the root when nothing was accepted).

    A step cut by EOS or the token limit (it committed no bonus token: `committed` is no longer
    than `accepted`, both cut together) attempted nothing beyond the cut: what lies past it is
    not part of the record (`StepRecord.cut`).
    """
    parents = torch.as_tensor(record.tree.parents)
    accepted = accepted_length(record)
    if len(record.committed) <= accepted:
        return accepted
    last = int(record.accepted[-1]) if accepted else -1  # -1: the root
    return accepted + int(bool((parents == last).any()))


def depth_counts(
    accept_lengths: Tensor | Sequence[int],
    attempted_depths: Tensor | Sequence[int],
    *,
    max_depth: int,
    device: torch.device | str | None = None,
) -> tuple[Tensor, Tensor]:
    """float64 [max_depth] (attempts, acceptances) at depths j = 1 .. max_depth.

    Per step: drafts accepted `a` ([S]) and the deepest depth attempted `d` ([S], a <= d).
    Depth j is attempted when j <= d and a >= j - 1, and accepted when a >= j. With `d` from
    `attempted_depth` the second condition always holds (d <= a + 1); a plain tree depth as
    `d` is exact only for chains and trees whose leaves all sit at that depth.
    """
    accepted = torch.as_tensor(accept_lengths, dtype=torch.long, device=device).reshape(-1, 1)
    attempted = torch.as_tensor(attempted_depths, dtype=torch.long, device=device).reshape(-1, 1)
    if accepted.shape != attempted.shape:
        raise ValueError("need one attempted depth per step")
    if bool((attempted < accepted).any()):
        raise ValueError("a step cannot accept more drafts than the depths it attempted")
    depths = torch.arange(1, max_depth + 1, device=accepted.device).unsqueeze(0)  # [1, D]
    at_risk = (attempted >= depths) & (accepted >= depths - 1)  # [S, D]
    return (
        at_risk.sum(dim=0).to(torch.float64),
        (accepted >= depths).sum(dim=0).to(torch.float64),
    )


def per_depth_acceptance(
    accept_lengths: Sequence[int], depths: Sequence[int] | int
) -> list[float | None]:
    """alpha_j for j = 1 .. max(depths), None where no step attempted depth j.

    `depths`: the deepest depth each step attempted (`attempted_depth`), or one number for all
    steps (a chain's length). See `depth_counts`.
    """
    if isinstance(depths, int):
        depths = [depths] * len(accept_lengths)
    if len(depths) != len(accept_lengths):
        raise ValueError("need one attempted depth per step")
    max_depth = max(depths, default=0)
    attempts, accepted = depth_counts(accept_lengths, depths, max_depth=max_depth)
    return [
        float(hits / tries) if tries > 0 else None
        for hits, tries in zip(accepted.tolist(), attempts.tolist(), strict=True)
    ]


def alpha_from_records(records: Iterable[Any]) -> list[float | None]:
    """`per_depth_acceptance` of decoder step records (accepted lengths, attempted depths)."""
    records = list(records)
    return per_depth_acceptance(
        [accepted_length(record) for record in records],
        [attempted_depth(record) for record in records],
    )


# --------------------------------------------------------------------------------- Metrics
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
        self.update(committed_per_step(records))

    def compute(self) -> Tensor:
        """tau (NaN before any step)."""
        if self.steps == 0:
            return torch.tensor(float("nan"), dtype=torch.float64, device=self.steps.device)
        return self.committed / self.steps


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
        attempts, accepted = depth_counts(
            accept_lengths, attempted_depths, max_depth=self.max_depth, device=self.attempts.device
        )
        self.attempts += attempts
        self.accepted += accepted

    def update_from_records(self, records: Sequence[Any]) -> None:
        """Add the steps of a `Generation.records` list."""
        if not records:
            return
        self.update(
            [accepted_length(record) for record in records],
            [attempted_depth(record) for record in records],
        )

    def compute(self) -> Tensor:
        """[max_depth] alpha_j (NaN at depths never attempted)."""
        rates = self.accepted / self.attempts.clamp_min(1.0)
        return torch.where(self.attempts > 0, rates, torch.full_like(rates, float("nan")))
