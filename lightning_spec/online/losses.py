"""OnlineSpec's feedback and losses: what a served round teaches, as tensors.

A served `Generation` already carries everything the online loss needs: the committed tokens,
the target's features of each (kept by the decoder while it verified) and, with soft labels, the
target's top-k log-probs of each. `feedback_batch` pads a round into one batch; `online_loss` is
the EAGLE-3 training-time-test loss on the response positions, to the target's kept distribution
(``labels: soft``) or to the committed token (``labels: hard``); `online_metrics` the served
drafter's loss and top-k agreement; `rejection_slots` / `rejection_batch` the positions OSD and
DPO learn from. The strategies that use them are in `online/strategies.py`.

Positions: a tried draft at depth k of a step anchored at a sits at sequence position a + k;
its context is the committed prefix (its parent was the root or accepted), so the target's
choice there is the committed token at a + k, the hard label at T = 0.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from lightning_spec.decoding.engine import Generation
from lightning_spec.models.drafters.base import Drafter
from lightning_spec.objectives import losses
from lightning_spec.objectives.ttt import draft_vocab_ids, ttt_loss_masks, ttt_unroll

__all__ = [
    "LABELS",
    "ONLINE_LOSSES",
    "OnlineLoss",
    "dense_targets",
    "draft_vocab_miss",
    "epoch_minibatches",
    "feedback_batch",
    "kept_label_rows",
    "minibatches",
    "online_loss",
    "online_metrics",
    "pair_logprobs",
    "rejection_batch",
    "rejection_slots",
    "soft_targets",
    "topk_hits",
]


def feedback_batch(generations: Sequence[Generation]) -> dict[str, Tensor] | None:
    """Right-padded training tensors from served generations (None if nothing usable).

    ``input_ids`` [B, T] prompt + served tokens, ``features`` [B, T, F] the target features the
    decoder kept (row j: the feature of token j; the last row, never read, is zero),
    ``loss_mask`` [B, T] 1 on served tokens, ``attention_mask`` [B, T]; when every generation
    kept its label rows, ``label_ids``/``label_logprobs`` [B, T, k] hold the target's top-k
    distribution each served token was chosen from (at its own position; -1 / -inf elsewhere).
    """
    rows = [g for g in generations if g.features is not None and len(g.tokens) >= 2]
    if not rows:
        return None
    sequences = [g.prompt + g.tokens for g in rows]
    width = max(len(s) for s in sequences)
    size = rows[0].features.shape[-1]
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    features = torch.zeros(len(rows), width, size)
    loss_mask = torch.zeros(len(rows), width, dtype=torch.long)
    attention = torch.zeros(len(rows), width, dtype=torch.long)
    for b, (generation, sequence) in enumerate(zip(rows, sequences, strict=True)):
        ids[b, : len(sequence)] = torch.tensor(sequence)
        kept = generation.features.float().cpu()
        features[b, : kept.shape[0]] = kept
        loss_mask[b, len(generation.prompt) : len(sequence)] = 1
        attention[b, : len(sequence)] = 1
    batch = {"input_ids": ids, "features": features, "loss_mask": loss_mask,
             "attention_mask": attention}  # fmt: skip
    if all(g.label_logprobs is not None for g in rows):
        k = max(int(g.label_logprobs.shape[-1]) for g in rows)
        label_ids = torch.full((len(rows), width, k), -1, dtype=torch.long)
        label_logprobs = torch.full((len(rows), width, k), float("-inf"))
        for b, generation in enumerate(rows):
            start, n = len(generation.prompt), int(generation.label_logprobs.shape[0])
            width_k = int(generation.label_logprobs.shape[-1])
            label_ids[b, start : start + n, :width_k] = generation.label_ids
            label_logprobs[b, start : start + n, :width_k] = generation.label_logprobs.float()
        batch["label_ids"], batch["label_logprobs"] = label_ids, label_logprobs
    return batch


def soft_targets(drafter: Drafter, label_ids: Tensor, label_logprobs: Tensor) -> tuple[Tensor, Tensor]:
    """(draft ids, probabilities) [..., k]: the target's top-k rows restricted to the drafter's
    draft vocabulary and renormalised there (ids outside it get probability 0; a row with no
    mass left is all zeros, and masked by the caller)."""
    draft = label_ids if draft_vocab_ids(drafter) is None else drafter.target_to_draft_ids(label_ids)
    valid = (label_ids >= 0) & (draft >= 0)
    logits = label_logprobs.masked_fill(~valid, float("-inf"))
    mass = torch.logsumexp(logits, dim=-1, keepdim=True)
    probs = torch.where(valid, torch.exp(logits - mass.clamp_min(-1e30)), torch.zeros_like(logits))
    return draft.clamp_min(0), torch.nan_to_num(probs, nan=0.0)


def _step_terms(
    drafter: Drafter, batch: dict[str, Tensor], ttt_steps: int
) -> tuple[list[Tensor], Tensor, Tensor, tuple[Tensor, Tensor, Tensor] | None]:
    """(per TTT step log-probs [B, T-1, V'], draft-vocabulary labels [B, T-1], masks
    [steps, B, T-1], and with the batch's label rows the soft targets (draft ids [B, T-1, k],
    probabilities [B, T-1, k], masks [steps, B, T-1])): the pieces `online_loss` and
    `online_metrics` read."""
    device = next(drafter.parameters()).device
    ids = batch["input_ids"].to(device)
    features = batch["features"].to(device)
    loss_mask = (batch["loss_mask"] * batch["attention_mask"]).to(device)
    outputs = ttt_unroll(drafter, input_ids=ids, features=features, steps=ttt_steps)
    # entry i (position i + 1) predicts token i + 2; the committed token is the target's argmax
    labels = torch.zeros_like(ids[:, 1:])
    labels[:, :-1] = ids[:, 2:]
    draft_ids = draft_vocab_ids(drafter)
    label_draft = labels if draft_ids is None else drafter.target_to_draft_ids(labels)
    in_vocab = (label_draft >= 0).long()
    masks = ttt_loss_masks(loss_mask, steps=ttt_steps) * in_vocab.unsqueeze(0).float()
    log_qs = [torch.log_softmax(output.logits.float(), dim=-1) for output in outputs]
    soft = None
    if "label_ids" in batch:  # entry i predicts token i + 2: its row sits at position i + 2
        ids_k = torch.full_like(batch["label_ids"][:, 1:], -1)
        logp_k = torch.full_like(batch["label_logprobs"][:, 1:], float("-inf"))
        ids_k[:, :-1], logp_k[:, :-1] = batch["label_ids"][:, 2:], batch["label_logprobs"][:, 2:]
        draft_k, probs = soft_targets(drafter, ids_k.to(device), logp_k.to(device))
        has_mass = (probs.sum(-1) > 0).float()
        soft = (draft_k, probs, ttt_loss_masks(loss_mask, steps=ttt_steps) * has_mass.unsqueeze(0))
    return log_qs, label_draft.clamp_min(0), masks, soft


def draft_vocab_miss(drafter: Drafter, batch: dict[str, Tensor]) -> float:
    """Share of the served (loss-mask) tokens the drafter cannot draft: outside its draft
    vocabulary, so never proposed and masked out of every loss (0 for a full vocabulary)."""
    if draft_vocab_ids(drafter) is None:
        return 0.0
    ids = batch["input_ids"]
    served = (batch["loss_mask"] * batch["attention_mask"]).bool()
    if not bool(served.any()):
        return 0.0
    missing = drafter.target_to_draft_ids(ids.to(next(drafter.parameters()).device)).cpu() < 0
    return float((missing & served).sum()) / float(served.sum())


def minibatches(batch: dict[str, Tensor], size: int, generator: torch.Generator) -> list[dict[str, Tensor]]:
    """The rows of `batch` in shuffled minibatches of `size` (the last may be smaller)."""
    order = torch.randperm(batch["input_ids"].shape[0], generator=generator)
    return [{k: v[order[i : i + size]] for k, v in batch.items()} for i in range(0, len(order), size)]


def epoch_minibatches(
    batches: Sequence[dict[str, Tensor]], epochs: int, size: int, generator: torch.Generator
) -> Iterator[dict[str, Tensor]]:
    """`epochs` passes over `batches`, each batch's rows in fresh shuffled minibatches of `size`
    (the reference's per-chunk training loop; shuffled lazily, epoch by epoch)."""
    for _ in range(epochs):
        for batch in batches:
            yield from minibatches(batch, size, generator)


ONLINE_LOSSES = ("soft_ce", "lk_alpha", "lk_lambda")
"""What an online update minimises per drafted position: cross-entropy to the target's kept
distribution (the reference's), or an LK loss (`objectives.losses`: -log of the acceptance rate
alpha = sum_v min(p_v, q_v), or its KL blend), which aims at the acceptance OnlineSpec counts."""


@dataclass(frozen=True)
class OnlineLoss:
    """Which `ONLINE_LOSSES` member, with the LK^lambda blend's constants."""

    kind: str = "soft_ce"
    kl_scale: float = 1.0
    kl_decay: float = 3.0

    def __post_init__(self) -> None:
        if self.kind not in ONLINE_LOSSES:
            raise ValueError(f"the online loss must be one of {ONLINE_LOSSES}, got {self.kind!r}")


def dense_targets(ids: Tensor, probs: Tensor, width: int) -> Tensor:
    """[..., width] probabilities from kept rows (ids [..., k], probs [..., k]); padded slots
    carry probability 0, so where they point does not matter."""
    dense = torch.zeros(*ids.shape[:-1], width, dtype=probs.dtype, device=probs.device)
    return dense.scatter_add_(-1, ids, probs)


def _ttt_loss(
    log_qs: list[Tensor], ids: Tensor, probs: Tensor, masks: Tensor, decay: float,
    loss: OnlineLoss = OnlineLoss(),
) -> Tensor:  # fmt: skip
    """The TTT loss over `log_qs` (per step [B, T-1, V']) against kept targets ([B, T-1, k]:
    one-hot hard labels are k = 1 with p = 1): per step the masked mean of the position loss,
    -sum_k p_k log q(id_k) for ``soft_ce``; the LK losses read the targets as a distribution
    over the draft vocabulary (`objectives.losses.distribution_loss_rows`, one definition)."""
    step_losses = []
    for step, log_q in enumerate(log_qs):
        if loss.kind == "soft_ce":
            rows = -(probs * log_q.gather(-1, ids)).sum(-1)
        else:
            rows = losses.distribution_loss_rows(
                loss=loss.kind, draft_logits=log_q,
                target_probs=dense_targets(ids, probs.to(log_q.dtype), log_q.shape[-1]),
                kl_scale=loss.kl_scale, kl_decay=loss.kl_decay,
            )  # fmt: skip
        step_losses.append(losses.masked_mean(values=rows, mask=masks[step]))
    return losses.ttt_total_loss(step_losses=torch.stack(step_losses), decay=decay)


def online_loss(
    drafter: Drafter, batch: dict[str, Tensor], *, ttt_steps: int = 2, decay: float = 0.8,
    loss: OnlineLoss = OnlineLoss(),
) -> tuple[Tensor, int]:  # fmt: skip
    """(loss, label count): the TTT loss (`loss`, cross-entropy by default) to the target's
    kept distribution when the batch holds label rows (soft labels), else to the committed next
    tokens (module docstring)."""
    return _loss_from_terms(*_step_terms(drafter, batch, ttt_steps), decay, loss)


def _loss_from_terms(
    log_qs: list[Tensor],
    labels: Tensor,
    masks: Tensor,
    soft: tuple[Tensor, Tensor, Tensor] | None,
    decay: float,
    loss: OnlineLoss = OnlineLoss(),
) -> tuple[Tensor, int]:
    """(loss, label count) from `_step_terms`: soft targets where the batch has them."""
    if soft is not None:
        ids, probs, soft_masks = soft
        return _ttt_loss(log_qs, ids, probs, soft_masks, decay, loss), int(soft_masks[0].sum())
    ones = torch.ones_like(labels, dtype=log_qs[0].dtype).unsqueeze(-1)
    return _ttt_loss(log_qs, labels.unsqueeze(-1), ones, masks, decay, loss), int(masks[0].sum())


LABELS = ("soft", "hard")


def kept_label_rows(labels: str, top_k: int) -> int:
    """How many target log-probs per served token the decoder must keep for `labels`."""
    if labels not in LABELS:
        raise ValueError(f"labels must be one of {LABELS}, got {labels!r}")
    if top_k < 1:
        raise ValueError(f"label_top_k must be >= 1, got {top_k}")
    return int(top_k) if labels == "soft" else 0


def topk_hits(log_q: Tensor, labels: Tensor, k: int) -> Tensor:
    """1.0 where the label is among the ``k`` most likely tokens of ``log_q`` [..., V] (k = 1:
    the argmax). A tree whose root has k children accepts the first token on such a hit, so
    top-k agreement, not the argmax alone, is what tau moves with."""
    top = log_q.topk(min(int(k), log_q.shape[-1]), dim=-1).indices
    return (top == labels.unsqueeze(-1)).any(-1).float()


@torch.no_grad()
def online_metrics(
    drafter: Drafter,
    batch: dict[str, Tensor],
    *,
    ttt_steps: int = 2,
    decay: float = 0.8,
    top_k: int = 1,
    loss: OnlineLoss = OnlineLoss(),
) -> dict[str, float]:
    """The model's fit to a round, without an update: ``loss`` (as `online_loss`) and
    ``top1_k`` (share of labelled positions whose TTT step k argmax is the committed token;
    top1_0 is the first draft token's acceptance rate on a chain at T = 0); with ``top_k`` > 1
    also ``top{top_k}_k`` (the committed token among step k's top_k: the first level of a tree
    with top_k children at the root)."""
    if top_k < 1:
        raise ValueError(f"top_k must be >= 1, got {top_k}")
    log_qs, labels, masks, soft = _step_terms(drafter, batch, ttt_steps)
    metrics = {"loss": float(_loss_from_terms(log_qs, labels, masks, soft, decay, loss)[0])}
    for step, log_q in enumerate(log_qs):
        for k in dict.fromkeys((1, top_k)):
            hits = topk_hits(log_q, labels, k)
            metrics[f"top{k}_{step}"] = float(losses.masked_mean(values=hits, mask=masks[step]))
    return metrics


def rejection_slots(generation: Generation, *, first_only: bool = False) -> list[tuple[int, int]]:
    """(position, rejected draft token) of every tried-and-rejected draft of `generation`
    (positions index prompt + tokens; see the module docstring). `first_only`: one slot per
    verification step, the position right after the accepted path (OSD's "wrong position":
    where the committed correction token differs from what was drafted), however many tree
    siblings were rejected there."""
    out = []
    length = len(generation.prompt) + len(generation.tokens)
    for record in generation.records:
        if record.rejected.numel() == 0:
            continue
        depth = record.tree.depth[record.rejected].tolist()
        tokens = record.tree.tokens[record.rejected].tolist()
        if first_only:
            first = len(record.accepted) + 1  # the depth of the first rejection
            pairs = [(k, t) for k, t in zip(depth, tokens, strict=True) if k == first][:1]
            depth, tokens = [k for k, _ in pairs], [t for _, t in pairs]
        for k, token in zip(depth, tokens, strict=True):
            position = int(record.anchor) + int(k)
            if position < length:
                out.append((position, int(token)))
    return out


def rejection_batch(
    generations: Sequence[Generation], *, first_only: bool = False
) -> dict[str, Tensor] | None:
    """`feedback_batch` whose loss mask holds only the positions of rejected drafts."""
    kept = [g for g in generations if g.features is not None and len(g.tokens) >= 2]
    batch = feedback_batch(kept)
    if batch is None:
        return None
    mask = torch.zeros_like(batch["loss_mask"])
    for row, generation in enumerate(kept):
        for position, _ in rejection_slots(generation, first_only=first_only):
            mask[row, position] = 1
    if not bool(mask.any()):
        return None
    batch["loss_mask"] = mask
    return batch


def pair_logprobs(
    drafter: Drafter, batch: dict[str, Tensor], pairs: list[tuple[int, int, int, int]]
) -> tuple[Tensor, Tensor]:
    """log q of the chosen and rejected token of each (row, position, chosen, rejected) pair,
    from the drafter's teacher-forced step-0 pass (entry position - 2 predicts `position`)."""
    device = next(drafter.parameters()).device
    output = ttt_unroll(drafter, input_ids=batch["input_ids"].to(device),
                        features=batch["features"].to(device), steps=1)[0]  # fmt: skip
    log_q = torch.log_softmax(output.logits.float(), dim=-1)
    rows = torch.tensor([p[0] for p in pairs], device=device)
    entries = torch.tensor([p[1] - 2 for p in pairs], device=device)
    chosen = drafter.target_to_draft_ids(torch.tensor([p[2] for p in pairs], device=device))
    rejected = drafter.target_to_draft_ids(torch.tensor([p[3] for p in pairs], device=device))
    picked = log_q[rows, entries]
    return picked.gather(1, chosen.unsqueeze(1)).squeeze(1), picked.gather(
        1, rejected.unsqueeze(1)
    ).squeeze(1)
