"""The training-time test (TTT) of EAGLE-3 (Li et al. 2025): the unroll, its attention pattern,
its loss masks, labels and losses.

The drafter learns to match the frozen target's next-token distribution, restricted to the draft
vocabulary, on assistant tokens. TTT unrolls K steps in which the drafter reads its own output
hidden states instead of the target's features, so that training sees what decoding feeds it.

Alignment (the one the decoder uses, see `decoding/engine.py`). For a sequence x_0 .. x_{T-1}
with target features f_0 .. f_{T-1} the drafter has L = T - 1 entries, entry i standing for
token x_j at position j = i + 1 (x_0 is never a drafter input: nothing precedes its feature).
Every step feeds the same tokens x_1 .. x_{T-1} at the same positions 1 .. T-1; only the
"previous feature" each entry reads, and what it attends to, change with the step k:

* step 0: entry j reads the TRUE target feature f_{j-1} and attends (causally) to the step-0
  entries at positions <= j. Its logits predict x_{j+1}. This is the decoder's committed entry
  for the root t_R = x_j: the root's logits propose the depth-1 draft.
* step k >= 1: entry j reads h^{k-1}_{j-1}, the step-(k-1) output hidden of the entry at
  position j - 1, and attends to
    - the step-0 entries at positions <= j - k  (the committed cache, root R = j - k), and
    - the step-s entry at position j - k + s for s = 1 .. k  (its chain of ancestors, itself
      last): a diagonal in each earlier step's block.
  This is exactly the decoder's draft node at depth k on a chain that starts at the root
  R = j - k and carries the ground-truth tokens x_{R+1} .. x_j: that node sits at position
  R + k = j, reads its parent's drafter hidden (depth k - 1 = the step-(k-1) entry at position
  j - 1; the root's own entry for k = 1), attends to the committed cache and its ancestors.
  Its logits predict x_{j+1}, the depth-(k+1) draft. Entries with j - k < 1 have no committed
  root (R = 0 is never absorbed); they read a zero hidden, attend only to their own chain, and
  are left out of the loss.

One `Drafter.step` call per unroll step over the whole sequence implements this: the drafter
cache keeps the keys/values of earlier steps (block s holds step s), and `ttt_attention_mask`
gives the pattern above. `tests/objectives/test_sft.py` checks, for every step and position,
that these logits equal the decoder proposer's logits for the same chain.

Targets and masks. The label of entry j at every step is the target distribution at position j
(target logits row j, which predicts x_{j+1}), restricted to the draft vocabulary and
renormalised (softmax over the draft-vocabulary subset of the target logits, as in EAGLE-3).
The loss mask of entry j is loss_mask[j + 1] (the predicted token is an assistant token);
loss_k = masked soft cross-entropy, total = sum_k decay**k * loss_k (decay 0.8 in EAGLE-3).
Top-1 accuracy compares the drafter's argmax with the target's argmax over the FULL target
vocabulary, so at step 0 it estimates the greedy acceptance rate of the first draft token.

Why its own file: every objective that trains a chain drafter (SFT and the objectives built on
it, `objectives/sft.py`) and OnlineSpec's losses (`online/losses.py`) reuse this unroll, these
masks and labels; none of it needs Lightning.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from lightning_spec.models.drafters.base import Drafter, DrafterOutput
from lightning_spec.models.vocab import draft_to_target_ids
from lightning_spec.objectives import losses

__all__ = [
    "TTTResult",
    "cached_ttt_labels",
    "draft_vocab_ids",
    "eagle_ttt_losses",
    "ttt_attention_mask",
    "ttt_loss_masks",
    "ttt_unroll",
]


def ttt_attention_mask(length: int, step: int, *, device: torch.device | None = None) -> Tensor:
    """Bool [1, L, (step + 1) * L] mask (True = attend) of TTT step `step` over L entries.

    Key block s holds the step-s entries. Query i (position i + 1) sees block 0 at entries
    <= i - step (the committed cache) and, for s = 1 .. step, block s at entry i - step + s
    (its chain of ancestors, itself last). Step 0 is the plain causal mask.
    """
    query = torch.arange(length, device=device).unsqueeze(1)  # [L, 1]
    key = torch.arange(length, device=device).unsqueeze(0)  # [1, L]
    blocks = [key <= query - step]
    blocks += [key == query - (step - s) for s in range(1, step + 1)]
    return torch.cat(blocks, dim=1).unsqueeze(0)


def ttt_unroll(
    drafter: Drafter, *, input_ids: Tensor, features: Tensor, steps: int
) -> list[DrafterOutput]:
    """Run `steps` TTT steps; output k holds logits [B, T-1, V_draft] and hidden [B, T-1, H].

    input_ids [B, T] right-padded, features [B, T, F] the target's fused features of the same
    tokens. Gradients flow through the fed-back hidden states and the cached keys/values, as in
    EAGLE-3. See the module docstring for the alignment.
    """
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    batch, total = input_ids.shape
    if total < 2:
        raise ValueError("TTT needs sequences of at least 2 tokens")
    length = total - 1
    device = input_ids.device
    tokens = input_ids[:, 1:]  # [B, L] x_1 .. x_{T-1}
    positions = torch.arange(1, total, device=device).expand(batch, -1)  # [B, L]
    state = drafter.new_state(batch)
    outputs = [
        drafter.step(
            state,
            tokens,
            positions,
            features=features[:, :-1],  # [B, L, F] f_0 .. f_{T-2}
            mask=ttt_attention_mask(length, 0, device=device),
        )
    ]
    for step in range(1, steps):
        previous = outputs[-1].hidden  # [B, L, H]
        hidden = torch.cat([torch.zeros_like(previous[:, :1]), previous[:, :-1]], dim=1)
        outputs.append(
            drafter.draft_step(  # the decoder's call for depth-`step` nodes (Hydra: head k)
                state,
                tokens,
                positions,
                depth=torch.full_like(tokens, step),
                hidden=hidden,
                mask=ttt_attention_mask(length, step, device=device),
            )
        )
    return outputs


def ttt_loss_masks(loss_mask: Tensor, *, steps: int) -> Tensor:
    """Float [K, B, T-1] loss masks: entry i (position j = i + 1) of step k counts iff
    loss_mask[j + 1] is set and the entry has a committed root (j - k >= 1)."""
    predicted = torch.zeros_like(loss_mask[:, 1:], dtype=torch.float32)  # [B, L]
    predicted[:, :-1] = loss_mask[:, 2:].float()
    length = predicted.shape[1]
    entry = torch.arange(length, device=loss_mask.device)
    has_root = torch.stack([entry >= step for step in range(steps)]).float()  # [K, L]
    return predicted.unsqueeze(0) * has_root.unsqueeze(1)


@dataclass(frozen=True)
class TTTResult:
    """What one EAGLE-SFT step computed (scalars are 0-d tensors, per-step values are [K])."""

    loss: Tensor
    step_losses: Tensor
    step_accuracy: Tensor
    step_counts: Tensor
    tokens: int


def draft_vocab_ids(drafter: Drafter) -> Tensor | None:
    """Target ids of the draft vocabulary [V_draft], None when it is the target's."""
    if getattr(drafter, "draft_vocab_size", drafter.target_vocab_size) == drafter.target_vocab_size:
        return None
    return draft_to_target_ids(drafter.d2t)


@torch.no_grad()
def cached_ttt_labels(
    drafter: Drafter, *, head: torch.nn.Module, last_hidden: Tensor, target_argmax: Tensor
) -> tuple[Tensor, Tensor]:
    """Soft labels [B, T-1, V_draft] and target argmax ids [B, T-1] of the drafter entries
    (row j of the target predicts x_{j+1}, the label of the entry at position j).

    last_hidden [B, T, H] (the target's final hidden states), target_argmax [B, T] (its
    full-vocabulary argmax: cached with the features, or `TargetModel.head_argmax`). Only the
    draft-vocabulary rows of the head are applied: on SmolLM2 with a 4k draft vocabulary that
    is 12x less work than the 49k-row head, and at a 262k vocabulary the [B, T, V] logits
    (4 GB at 4 x 1024 tokens) never exist.
    """
    draft_ids = draft_vocab_ids(drafter)
    weight = head.weight if draft_ids is None else head.weight.index_select(0, draft_ids)
    bias = getattr(head, "bias", None)
    if bias is not None and draft_ids is not None:
        bias = bias.index_select(0, draft_ids)
    hidden = last_hidden[:, 1:].to(weight.dtype)
    logits = torch.nn.functional.linear(hidden, weight, bias)
    return torch.softmax(logits.float(), dim=-1), target_argmax[:, 1:].long()


def eagle_ttt_losses(
    drafter: Drafter,
    *,
    input_ids: Tensor,
    features: Tensor,
    target_probs: Tensor,
    target_argmax: Tensor,
    loss_mask: Tensor,
    steps: int,
    decay: float,
    loss: str = "soft_ce",
    kl_scale: float = 1.0,
    kl_decay: float = 3.0,
) -> TTTResult:
    """The EAGLE-3 TTT objective on one batch, given the target's labels (`cached_ttt_labels`).

    input_ids/loss_mask [B, T], features [B, T, F], target_probs [B, T-1, V_draft],
    target_argmax [B, T-1] (target ids). `loss` (one of `losses.SFT_LOSSES`) is the
    per-position loss of every unroll step (masked mean, then the decay weighting); `kl_scale`
    and `kl_decay` are LK^lambda's.
    """
    if loss not in losses.SFT_LOSSES:
        raise ValueError(f"loss must be one of {losses.SFT_LOSSES}, got {loss!r}")
    draft_ids = draft_vocab_ids(drafter)
    masks = ttt_loss_masks(loss_mask, steps=steps)  # [K, B, L]
    outputs = ttt_unroll(drafter, input_ids=input_ids, features=features, steps=steps)
    step_losses, step_accuracy = [], []
    for step, output in enumerate(outputs):
        if loss == "soft_ce":  # the default, computed exactly as before the option existed
            step_loss = losses.soft_cross_entropy(
                logits=output.logits, target_probs=target_probs, mask=masks[step]
            )
        else:
            rows = losses.distribution_loss_rows(
                loss=loss,
                draft_logits=output.logits,
                target_probs=target_probs,
                kl_scale=kl_scale,
                kl_decay=kl_decay,
            )  # [B, L]
            step_loss = losses.masked_mean(values=rows, mask=masks[step])
        step_losses.append(step_loss)
        with torch.no_grad():
            matches = losses.top1_matches(
                draft_logits=output.logits, target_argmax=target_argmax, draft_ids=draft_ids
            )
            step_accuracy.append(losses.masked_mean(values=matches.float(), mask=masks[step]))
    stacked = torch.stack(step_losses)
    return TTTResult(
        loss=losses.ttt_total_loss(step_losses=stacked, decay=decay),
        step_losses=stacked.detach(),
        step_accuracy=torch.stack(step_accuracy),
        step_counts=masks.sum(dim=(1, 2)),
        tokens=int(masks[0].sum()),
    )
