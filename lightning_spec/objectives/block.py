"""Block SFT for DFlash drafters: random anchors, one block forward per anchor, slot losses.

A block anchored at position a of a training sequence x_0 .. x_{T-1} is what the decoder drafts
when x_a is the root: [x_a, MASK x S] at positions a .. a + S over the context x_0 .. x_{a-1}
(the target's features of those tokens). Slot k predicts x_{a+k}; its label is the target's
distribution at row a + k - 1 (given the true prefix: what verification compares the draft
with once slots 1 .. k - 1 are accepted), restricted to the draft vocabulary. The blocks of a
sequence come from `Drafter.sequence_proposer` (one absorbing pass, one block forward for all
anchors), the very code the decoder drafts with.

Anchors are drawn per sequence among positions whose first predicted token is an assistant
token (as in DFlash training, random anchors rather than every position: blocks overlap, and
a few per sequence cover it). Slots past the sequence or on non-assistant tokens are masked.
Slot weights: ``decay`` (exp(-(k - 1) / gamma), the DFlash paper), ``acceptance`` (the chance
the chain reaches slot k under the current drafter, `losses.expected_acceptance_weights`),
``uniform`` or ``dpace`` (D-PACE, arXiv 2605.18810: the suffix sums of the smoothed
confidence prefix products, `losses.dpace_weights`). The per-slot loss is soft cross-entropy
by default, or any of `losses.SFT_LOSSES` (the LK losses optimise the acceptance rate itself).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from lightning_spec.models.vocab import draft_to_target_ids
from lightning_spec.objectives import losses

__all__ = ["BLOCK_WEIGHTINGS", "BlockLosses", "block_sft_losses", "choose_anchors", "default_gamma"]

BLOCK_WEIGHTINGS = ("decay", "acceptance", "uniform", "dpace")


def default_gamma(block_size: int) -> float:
    """The DFlash paper's decay constant for a block size (7, 5, 4 for 16, 10, 8)."""
    return {16: 7.0, 10: 5.0, 8: 4.0}.get(int(block_size), max(1.0, block_size / 2))


@dataclass(frozen=True)
class BlockLosses:
    """One batch: the weighted loss and, per slot [S], loss, top-1 agreement and counts."""

    loss: Tensor
    slot_losses: Tensor
    slot_accuracy: Tensor
    slot_counts: Tensor
    tokens: int


def choose_anchors(
    loss_mask: Tensor, *, count: int, generator: torch.Generator | None = None
) -> Tensor:
    """Up to `count` anchor positions a (ascending) of one sequence's loss_mask [T]: a >= 1
    (x_0 has no feature before it) and x_{a+1} is an assistant token."""
    length = int(loss_mask.shape[0])
    if length < 3:
        return torch.zeros(0, dtype=torch.long)
    candidates = (loss_mask[2:].cpu() > 0).nonzero().flatten() + 1  # a with mask[a + 1]
    if candidates.numel() > count:
        pick = torch.randperm(candidates.numel(), generator=generator)[:count]
        candidates = candidates[pick.sort().values]
    return candidates


def block_sft_losses(
    drafter: object,
    *,
    input_ids: Tensor,
    features: Tensor,
    target_probs: Tensor,
    target_argmax: Tensor,
    loss_mask: Tensor,
    anchors: int,
    weighting: str = "decay",
    gamma: float | None = None,
    generator: torch.Generator | None = None,
    loss: str = "soft_ce",
    kl_scale: float = 1.0,
    kl_decay: float = 3.0,
    dpace_alpha: float = 0.5,
) -> BlockLosses:
    """The block objective on a right-padded batch (see the module docstring).

    input_ids/loss_mask [B, T] (loss_mask already zero on padding), features [B, T, F];
    target_probs [B, T-1, V_draft] and target_argmax [B, T-1] (target ids) as `cached_ttt_labels`
    gives them: index i holds the target's row i + 1. `loss` is the per-slot loss (one of
    `losses.SFT_LOSSES`; `kl_scale`, `kl_decay`: LK^lambda's), `dpace_alpha` the confidence
    smoothing of ``dpace`` weighting.
    """
    if weighting not in BLOCK_WEIGHTINGS:
        raise ValueError(f"weighting must be one of {BLOCK_WEIGHTINGS}, got {weighting!r}")
    if loss not in losses.SFT_LOSSES:
        raise ValueError(f"loss must be one of {losses.SFT_LOSSES}, got {loss!r}")
    slots = int(drafter.block_size) - 1  # type: ignore[attr-defined]
    gamma = default_gamma(slots + 1) if gamma is None else float(gamma)
    device = input_ids.device
    draft_ids = None
    if drafter.draft_vocab_size < drafter.target_vocab_size:  # type: ignore[attr-defined]
        draft_ids = draft_to_target_ids(drafter.d2t)  # type: ignore[attr-defined]
    parts: list[tuple[Tensor, Tensor, Tensor, Tensor]] = []  # logits, probs, argmax, mask
    for row in range(input_ids.shape[0]):
        valid = loss_mask[row] > 0
        length = int(valid.nonzero().max()) + 1 if bool(valid.any()) else 0
        roots = choose_anchors(loss_mask[row, :length], count=anchors, generator=generator)
        if roots.numel() == 0:
            continue
        roots = roots.to(device)
        proposer = drafter.sequence_proposer(  # type: ignore[attr-defined]
            input_ids[row : row + 1, :length], roots, features=features[row : row + 1, :length]
        )
        offsets = torch.arange(1, slots + 1, device=device)
        predicted = roots.unsqueeze(1) + offsets  # [A, S] positions of x_{a+k}
        inside = predicted < length
        index = (predicted - 2).clamp(0, length - 2)  # label index of target row a + k - 1
        mask = inside & (loss_mask[row].index_select(0, predicted.clamp(max=length - 1).flatten())
                         .reshape(predicted.shape) > 0)  # fmt: skip
        parts.append(
            (
                proposer.slot_logits,
                target_probs[row, index],
                target_argmax[row, index],
                mask,
            )
        )
    if not parts:
        zero = sum(p.sum() for p in drafter.parameters() if p.requires_grad) * 0.0  # type: ignore[attr-defined]
        empty = torch.zeros(slots, device=device)
        return BlockLosses(zero, empty, empty, empty, 0)
    logits, probs, argmax, mask = (torch.cat(items) for items in zip(*parts, strict=True))
    if weighting == "decay":
        weights = losses.block_slot_decay(slots=slots, gamma=gamma).to(device)
    elif weighting == "acceptance":
        weights = losses.expected_acceptance_weights(draft_logits=logits, target_probs=probs)
    elif weighting == "dpace":
        with torch.no_grad():  # confidence exp(-CE) of each slot in its (soft) label
            cross_entropy = losses.distribution_loss_rows(
                loss="soft_ce", draft_logits=logits, target_probs=probs
            )  # [A, S]
        weights = losses.dpace_weights(
            confidence=torch.exp(-cross_entropy), mask=mask, alpha=dpace_alpha
        )
    else:
        weights = torch.ones(slots, device=device)
    if loss == "soft_ce":  # the default, computed exactly as before the option existed
        total, per_slot = losses.block_cross_entropy(
            logits=logits, target_probs=probs, weights=weights, mask=mask
        )
    else:
        rows = losses.distribution_loss_rows(
            loss=loss, draft_logits=logits, target_probs=probs, kl_scale=kl_scale, kl_decay=kl_decay
        )  # [A, S]
        total, per_slot = losses.block_weighted_mean(per_slot=rows, weights=weights, mask=mask)
    with torch.no_grad():
        matches = losses.top1_matches(
            draft_logits=logits, target_argmax=argmax, draft_ids=draft_ids
        )
        accuracy = torch.stack(
            [
                losses.masked_mean(values=matches[:, k].float(), mask=mask[:, k].float())
                for k in range(slots)
            ]
        )
    counts = mask.float().sum(dim=0)
    return BlockLosses(total, per_slot.detach(), accuracy, counts, int(mask[:, 0].sum()))
