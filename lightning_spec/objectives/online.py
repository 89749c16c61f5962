"""OnlineSpec (arXiv 2603.12617): the drafter keeps learning from what it serves.

Serving is online learning in rounds (ALGORITHMS.md section 4): serve a round of requests with
the current drafter (test first), then update from that round's verification feedback (train
second). The feedback is free: at T = 0 every committed token is the target's own greedy choice,
and the decoder already computed the target's features of every committed token
(`Generation.features`, kept with ``SpeculativeDecoder(keep_features=True)``), so the drafter's
own loss is built without a second target pass.

The loss (`feedback_batch` + `online_loss`): the EAGLE-3 training-time-test loss on the served
sequences, on the response positions only. ``labels: soft`` (the default, as the reference's
offline loss) is the cross-entropy to the target's own distribution over the draft vocabulary,
kept by the decoder while it served (`Generation.label_logprobs`: its top ``label_top_k``
log-probs per token, renormalised over those the draft vocabulary holds); ``labels: hard`` is the
cross-entropy to the committed next token (the target's argmax at T = 0; committed tokens outside
the draft vocabulary are masked).

Strategies share one interface (`OnlineStrategy`): `drafter` is what the next round serves,
`update(generations)` learns from a served round and returns its metrics, and `state_dict` /
`load_state_dict` make a killed stream resume at the round it stopped in.

* `FrozenStrategy`: no update (the baseline every other strategy is measured against).
* `OGDStrategy`: online gradient descent, a few optimizer steps per round on the round's loss.
* `OptimisticStrategy`: optimistic online gradient descent with the last round's gradient as the
  hint: w_hat <- w_hat - eta g_t, w_{t+1} = w_hat - eta g_t (two states); ``momentum > 0`` gives
  the persistent-momentum SGD the authors' code uses instead.
* `EnsembleStrategy`: base learners (OGD) on a geometric grid of learning rates; the served
  drafter is their parameter average under Hedge weights, p_i ~ exp(-epsilon * cumulative loss_i)
  (``weighting: hedge``) or softmax(-last loss_i / temperature) (``weighting: softmax``).
* `OSDStrategy`: the OSD baseline (online speculative decoding): distil the target only at the
  positions where the drafter's drafts were rejected, from a buffer of the last rounds.
* `DPOStrategy`: preference pairs at every tried-and-rejected draft (prefix = the committed
  sequence before its slot; chosen = the target's token there, rejected = the draft), trained
  with the DPO loss against the drafter as it was at the start of the round (beta = 0.1).

Positions: a tried draft at depth k of a step anchored at a sits at sequence position a + k;
its context is the committed prefix (its parent was the root or accepted), so the target's
choice there is the committed token at a + k, the hard label at T = 0.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Sequence
from typing import Any, Protocol

import torch
from torch import Tensor

from lightning_spec.decoding.engine import Generation
from lightning_spec.models.drafters.base import Drafter
from lightning_spec.objectives import losses
from lightning_spec.objectives.sft import _draft_ids, ttt_loss_masks, ttt_unroll

__all__ = [
    "DPOStrategy",
    "EnsembleStrategy",
    "FrozenStrategy",
    "OSDStrategy",
    "OGDStrategy",
    "OptimisticStrategy",
    "OnlineStrategy",
    "feedback_batch",
    "make_strategy",
    "online_loss",
    "online_metrics",
    "rejection_slots",
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
    draft = label_ids if _draft_ids(drafter) is None else drafter.target_to_draft_ids(label_ids)
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
    draft_ids = _draft_ids(drafter)
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
    if _draft_ids(drafter) is None:
        return 0.0
    ids = batch["input_ids"]
    served = (batch["loss_mask"] * batch["attention_mask"]).bool()
    if not bool(served.any()):
        return 0.0
    missing = drafter.target_to_draft_ids(ids.to(next(drafter.parameters()).device)).cpu() < 0
    return float((missing & served).sum()) / float(served.sum())


def _minibatches(batch: dict[str, Tensor], size: int, generator: torch.Generator) -> list[dict[str, Tensor]]:
    """The rows of `batch` in shuffled minibatches of `size` (the last may be smaller)."""
    order = torch.randperm(batch["input_ids"].shape[0], generator=generator)
    return [{k: v[order[i : i + size]] for k, v in batch.items()} for i in range(0, len(order), size)]


def _ttt_cross_entropy(
    log_qs: list[Tensor], ids: Tensor, probs: Tensor, masks: Tensor, decay: float
) -> Tensor:
    """The TTT loss: per step the masked mean of -sum_k p_k log q(id_k) ([B, T-1, k] targets:
    one-hot hard labels are k = 1 with p = 1)."""
    step_losses = [
        losses.masked_mean(values=-(probs * log_q.gather(-1, ids)).sum(-1), mask=masks[step])
        for step, log_q in enumerate(log_qs)
    ]
    return losses.ttt_total_loss(step_losses=torch.stack(step_losses), decay=decay)


def online_loss(
    drafter: Drafter, batch: dict[str, Tensor], *, ttt_steps: int = 2, decay: float = 0.8
) -> tuple[Tensor, int]:
    """(loss, label count): TTT cross-entropy to the target's kept distribution when the batch
    holds label rows (soft labels), else to the committed next tokens (module docstring)."""
    return _loss_from_terms(*_step_terms(drafter, batch, ttt_steps), decay)


def _loss_from_terms(
    log_qs: list[Tensor],
    labels: Tensor,
    masks: Tensor,
    soft: tuple[Tensor, Tensor, Tensor] | None,
    decay: float,
) -> tuple[Tensor, int]:
    """(loss, label count) from `_step_terms`: soft targets where the batch has them."""
    if soft is not None:
        ids, probs, soft_masks = soft
        return _ttt_cross_entropy(log_qs, ids, probs, soft_masks, decay), int(soft_masks[0].sum())
    ones = torch.ones_like(labels, dtype=log_qs[0].dtype).unsqueeze(-1)
    return _ttt_cross_entropy(log_qs, labels.unsqueeze(-1), ones, masks, decay), int(masks[0].sum())


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
) -> dict[str, float]:
    """The model's fit to a round, without an update: ``loss`` (as `online_loss`) and
    ``top1_k`` (share of labelled positions whose TTT step k argmax is the committed token;
    top1_0 is the first draft token's acceptance rate on a chain at T = 0); with ``top_k`` > 1
    also ``top{top_k}_k`` (the committed token among step k's top_k: the first level of a tree
    with top_k children at the root)."""
    if top_k < 1:
        raise ValueError(f"top_k must be >= 1, got {top_k}")
    log_qs, labels, masks, soft = _step_terms(drafter, batch, ttt_steps)
    metrics = {"loss": float(_loss_from_terms(log_qs, labels, masks, soft, decay)[0])}
    for step, log_q in enumerate(log_qs):
        for k in dict.fromkeys((1, top_k)):
            hits = topk_hits(log_q, labels, k)
            metrics[f"top{k}_{step}"] = float(losses.masked_mean(values=hits, mask=masks[step]))
    return metrics


class OnlineStrategy(Protocol):
    """One online algorithm (see the module docstring)."""

    name: str
    drafter: Drafter

    def update(self, generations: Sequence[Generation]) -> dict[str, float]: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


class FrozenStrategy:
    """Serve the starting drafter unchanged; still reports the round's online loss (what the
    regret proxy compares against)."""

    name = "frozen"

    def __init__(
        self, drafter: Drafter, *, ttt_steps: int = 2, labels: str = "soft", label_top_k: int = 32
    ) -> None:
        self.drafter = drafter.eval()
        self.ttt_steps = int(ttt_steps)
        self.label_top_k = kept_label_rows(labels, label_top_k)

    def update(self, generations: Sequence[Generation]) -> dict[str, float]:
        batch = feedback_batch(generations)
        if batch is None:
            return {"online_loss": float("nan"), "update_seconds": 0.0, "labels": 0.0}
        with torch.no_grad():
            loss, labels = online_loss(self.drafter, batch, ttt_steps=self.ttt_steps)
        return {"online_loss": float(loss), "update_seconds": 0.0, "labels": float(labels)}

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        del state


class OGDStrategy:
    """Online gradient descent: `steps_per_round` AdamW steps on each round's loss.

    ``buffer_rounds`` > 1 trains each step on the mean loss of the last that many rounds (a
    replay buffer: a round of a few requests is a noisy sample of its domain). By default each
    round is trained with the reference recipe (OnlineSPEC's pipelines): ``epochs`` passes over
    the round's (buffer's) sequences in shuffled minibatches of ``minibatch`` sequences, one
    optimizer step each, the optimizer's state kept across rounds; ``epochs: 0`` gives the
    earlier rule instead, ``steps_per_round`` full-batch steps. The reported
    ``online_loss`` is the loss of the model that SERVED the round on that round (before the
    update), the quantity dynamic regret is measured on.
    """

    name = "ogd"

    def __init__(
        self,
        drafter: Drafter,
        *,
        lr: float = 1e-4,
        steps_per_round: int = 2,
        ttt_steps: int = 2,
        grad_clip: float = 0.5,
        buffer_rounds: int = 1,
        betas: tuple[float, float] = (0.9, 0.95),
        epochs: int = 2,
        minibatch: int = 4,
        seed: int = 0,
        labels: str = "soft",
        label_top_k: int = 32,
    ) -> None:
        self.label_top_k = kept_label_rows(labels, label_top_k)
        if lr <= 0 or steps_per_round < 1 or buffer_rounds < 1:
            raise ValueError(f"{self.name} needs lr > 0, steps_per_round >= 1, buffer_rounds >= 1")
        if epochs < 0 or minibatch < 1:
            raise ValueError(f"{self.name} needs epochs >= 0 and minibatch >= 1")
        self.epochs, self.minibatch = int(epochs), int(minibatch)
        self._shuffle = torch.Generator().manual_seed(int(seed))
        self.drafter = copy.deepcopy(drafter).float()
        self.steps_per_round = int(steps_per_round)
        self.ttt_steps = int(ttt_steps)
        self.grad_clip = float(grad_clip)
        self.buffer_rounds = int(buffer_rounds)
        self.buffer: list[dict[str, Tensor]] = []
        parameters = [p for p in self.drafter.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(parameters, lr=lr, betas=betas, weight_decay=0.0)

    def round_batch(self, generations: Sequence[Generation]) -> dict[str, Tensor] | None:
        """The training tensors of a served round (the hook `OSDStrategy` narrows)."""
        return feedback_batch(generations)

    def update(self, generations: Sequence[Generation]) -> dict[str, float]:
        tic = time.perf_counter()
        batch = self.round_batch(generations)
        if batch is not None:
            self.buffer = (self.buffer + [batch])[-self.buffer_rounds :]
        if not self.buffer:
            return {"online_loss": float("nan"), "update_seconds": 0.0, "labels": 0.0}
        miss = draft_vocab_miss(self.drafter, batch) if batch is not None else float("nan")
        if self.epochs > 0:
            return self._epochs(batch, tic, miss)
        self.drafter.train()
        served_loss = float("nan")
        labels = 0
        for step in range(self.steps_per_round):
            total = torch.zeros(())
            for held in self.buffer:
                loss, count = online_loss(self.drafter, held, ttt_steps=self.ttt_steps)
                total = total + loss / len(self.buffer)
                if step == 0 and held is batch:
                    served_loss, labels = float(loss.detach()), count
            if not torch.isfinite(total):
                break  # a non-finite round changes nothing (logged by the caller as NaN)
            self._apply(total)
        self.drafter.eval()
        return self._report(served_loss, labels, tic, miss)

    def _apply(self, loss: Tensor) -> None:
        """One optimizer step on `loss`, its gradient clipped."""
        self.optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.drafter.parameters(), self.grad_clip)
        self.optimizer.step()

    def _report(
        self, served_loss: float, labels: int, tic: float, miss: float, **extra: float
    ) -> dict[str, float]:
        return {
            "online_loss": served_loss,
            "update_seconds": time.perf_counter() - tic,
            "labels": float(labels),
            "buffer_rounds": float(len(self.buffer)),
            "draft_vocab_miss": miss,
            **extra,
        }

    def _epochs(self, batch: dict[str, Tensor] | None, tic: float, miss: float) -> dict[str, float]:
        """The reference recipe: minibatch epochs over the buffered rounds' sequences."""
        served_loss, labels = float("nan"), 0
        if batch is not None:
            with torch.no_grad():
                loss, labels = online_loss(self.drafter, batch, ttt_steps=self.ttt_steps)
            served_loss = float(loss)
        self.drafter.train()
        steps = 0
        for _ in range(self.epochs):
            for held in self.buffer:
                for part in _minibatches(held, self.minibatch, self._shuffle):
                    loss, count = online_loss(self.drafter, part, ttt_steps=self.ttt_steps)
                    if count == 0 or not torch.isfinite(loss):
                        continue  # no label here, or a non-finite part: it changes nothing
                    self._apply(loss)
                    steps += 1
        self.drafter.eval()
        return self._report(served_loss, labels, tic, miss, optimizer_steps=float(steps))

    def state_dict(self) -> dict[str, Any]:
        return {"drafter": self.drafter.state_dict(), "optimizer": self.optimizer.state_dict(),
                "buffer": self.buffer, "shuffle": self._shuffle.get_state()}  # fmt: skip

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.drafter.load_state_dict(state["drafter"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.buffer = list(state.get("buffer", []))  # checkpoints before the buffer: empty
        if "shuffle" in state:
            self._shuffle.set_state(state["shuffle"])


def _trainable(drafter: Drafter) -> list[Tensor]:
    return [p for p in drafter.parameters() if p.requires_grad]


def _round_gradient(
    drafter: Drafter, batch: dict[str, Tensor], ttt_steps: int, clip: float
) -> tuple[float, int, list[Tensor] | None]:
    """(loss, labels, clipped gradient of the trainable parameters; None if non-finite)."""
    drafter.train()
    loss, labels = online_loss(drafter, batch, ttt_steps=ttt_steps)
    drafter.zero_grad()
    if not torch.isfinite(loss):
        drafter.eval()
        return float(loss.detach()), labels, None
    loss.backward()
    torch.nn.utils.clip_grad_norm_(drafter.parameters(), clip)
    grads = [torch.zeros_like(p) if p.grad is None else p.grad.detach().clone()
             for p in _trainable(drafter)]  # fmt: skip
    drafter.zero_grad()
    drafter.eval()
    return float(loss.detach()), labels, grads


class OptimisticStrategy:
    """Optimistic OGD with the last gradient as hint (see the module docstring)."""

    name = "optimistic"

    def __init__(
        self,
        drafter: Drafter,
        *,
        lr: float = 1e-4,
        momentum: float = 0.0,
        ttt_steps: int = 2,
        grad_clip: float = 0.5,
        labels: str = "soft",
        label_top_k: int = 32,
    ) -> None:
        self.label_top_k = kept_label_rows(labels, label_top_k)
        if lr <= 0 or not 0 <= momentum < 1:
            raise ValueError("optimistic needs lr > 0 and 0 <= momentum < 1")
        self.drafter = copy.deepcopy(drafter).float().eval()
        self.lr, self.momentum = float(lr), float(momentum)
        self.ttt_steps, self.grad_clip = int(ttt_steps), float(grad_clip)
        self.secondary = [p.detach().clone() for p in _trainable(self.drafter)]  # w_hat
        self.velocity = [torch.zeros_like(p) for p in self.secondary]

    def update(self, generations: Sequence[Generation]) -> dict[str, float]:
        batch = feedback_batch(generations)
        if batch is None:
            return {"online_loss": float("nan"), "update_seconds": 0.0, "labels": 0.0}
        tic = time.perf_counter()
        loss, labels, grads = _round_gradient(self.drafter, batch, self.ttt_steps, self.grad_clip)
        if grads is not None:
            with torch.no_grad():
                for param, hat, grad, velocity in zip(
                    _trainable(self.drafter), self.secondary, grads, self.velocity, strict=True
                ):
                    if self.momentum > 0:  # the authors' approximation: persistent momentum
                        velocity.mul_(self.momentum).add_(grad)
                        param.sub_(self.lr * velocity)
                        hat.copy_(param)
                    else:
                        hat.sub_(self.lr * grad)  # w_hat_{t+1} = w_hat_t - eta g_t
                        param.copy_(hat - self.lr * grad)  # hint h_{t+1} = g_t
        return {"online_loss": loss, "update_seconds": time.perf_counter() - tic,
                "labels": float(labels)}  # fmt: skip

    def state_dict(self) -> dict[str, Any]:
        return {"drafter": self.drafter.state_dict(), "secondary": self.secondary,
                "velocity": self.velocity}  # fmt: skip

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.drafter.load_state_dict(state["drafter"])
        self.secondary = [t.clone() for t in state["secondary"]]
        self.velocity = [t.clone() for t in state["velocity"]]


class EnsembleStrategy:
    """Hedge-weighted parameter average of OGD learners (see the module docstring)."""

    name = "ensemble"

    def __init__(
        self,
        drafter: Drafter,
        *,
        lr: float = 1e-4,
        learners: int = 3,
        ratio: float = 2.0,
        epsilon: float = 0.2,
        weighting: str = "hedge",
        temperature: float = 1.0,
        steps_per_round: int = 1,
        ttt_steps: int = 2,
        grad_clip: float = 0.5,
        buffer_rounds: int = 1,
        restart: bool = False,
        epochs: int = 2,
        minibatch: int = 4,
        labels: str = "soft",
        label_top_k: int = 32,
    ) -> None:
        self.label_top_k = kept_label_rows(labels, label_top_k)
        if learners < 1 or ratio <= 0 or epsilon <= 0 or temperature <= 0:
            raise ValueError("ensemble needs learners >= 1, ratio, epsilon, temperature > 0")
        if weighting not in ("hedge", "softmax"):
            raise ValueError(f"weighting must be hedge or softmax, got {weighting!r}")
        self.learners = [
            OGDStrategy(drafter, lr=lr * ratio**i, steps_per_round=steps_per_round,
                        ttt_steps=ttt_steps, grad_clip=grad_clip, buffer_rounds=buffer_rounds,
                        epochs=epochs, minibatch=minibatch, seed=i)
            for i in range(learners)
        ]  # fmt: skip
        # `pipeline_hedge`: every learner restarts from the weighted average each round
        self.restart = bool(restart)
        self.rates = [lr * ratio**i for i in range(learners)]
        self.epsilon, self.weighting, self.temperature = float(epsilon), weighting, temperature
        self.cumulative = torch.zeros(learners, dtype=torch.float64)
        self.last = torch.zeros(learners, dtype=torch.float64)
        self.drafter = copy.deepcopy(drafter).float().eval()
        self._average()

    def weights(self) -> Tensor:
        """[n] the Hedge (or softmax) weights of the base learners."""
        if self.weighting == "hedge":
            scores = -self.epsilon * self.cumulative
        else:
            scores = -self.last / self.temperature
        return torch.softmax(scores, dim=0)

    def _average(self) -> None:
        weights = self.weights().float()
        with torch.no_grad():
            served = _trainable(self.drafter)
            stacks = [_trainable(learner.drafter) for learner in self.learners]
            for index, param in enumerate(served):
                param.copy_(sum(w * stack[index] for w, stack in zip(weights, stacks, strict=True)))

    def update(self, generations: Sequence[Generation]) -> dict[str, float]:
        batch = feedback_batch(generations)
        if batch is None:
            return {"online_loss": float("nan"), "update_seconds": 0.0, "labels": 0.0}
        tic = time.perf_counter()
        with torch.no_grad():
            served, labels = online_loss(self.drafter, batch, ttt_steps=self.learners[0].ttt_steps)
        losses_now = torch.tensor(
            [learner.update(generations)["online_loss"] for learner in self.learners],
            dtype=torch.float64,
        )
        finite = torch.isfinite(losses_now)
        losses_now = torch.where(finite, losses_now, losses_now[finite].max() if finite.any()
                                 else torch.zeros_like(losses_now))  # fmt: skip
        self.cumulative += losses_now
        self.last = losses_now
        self._average()
        if self.restart:
            with torch.no_grad():
                for learner in self.learners:
                    for mine, mean in zip(_trainable(learner.drafter), _trainable(self.drafter), strict=True):
                        mine.copy_(mean)
        metrics = {"online_loss": float(served), "update_seconds": time.perf_counter() - tic,
                   "labels": float(labels)}  # fmt: skip
        for index, weight in enumerate(self.weights().tolist()):
            metrics[f"weight_{index}"] = weight
        return metrics

    def state_dict(self) -> dict[str, Any]:
        return {
            "learners": [learner.state_dict() for learner in self.learners],
            "cumulative": self.cumulative,
            "last": self.last,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for learner, saved in zip(self.learners, state["learners"], strict=True):
            learner.load_state_dict(saved)
        self.cumulative = state["cumulative"].clone()
        self.last = state["last"].clone()
        self._average()


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


def _rejection_batch(
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


class OSDStrategy(OGDStrategy):
    """OSD: distillation at rejected positions from a buffer of recent rounds (OGD whose round
    batch keeps only the positions of rejected drafts). ``first_rejected`` (OSD's own rule) keeps
    one position per verification step, the first wrong one, not every rejected tree sibling."""

    name = "osd"

    def __init__(
        self,
        drafter: Drafter,
        *,
        lr: float = 1e-4,
        buffer_rounds: int = 4,
        steps_per_round: int = 2,
        ttt_steps: int = 1,
        grad_clip: float = 0.5,
        first_rejected: bool = True,
        epochs: int = 0,
        minibatch: int = 4,
        labels: str = "soft",
        label_top_k: int = 32,
    ) -> None:
        super().__init__(drafter, lr=lr, steps_per_round=steps_per_round, ttt_steps=ttt_steps,
                         grad_clip=grad_clip, buffer_rounds=buffer_rounds, epochs=epochs,
                         minibatch=minibatch, labels=labels, label_top_k=label_top_k)  # fmt: skip
        self.first_rejected = bool(first_rejected)

    def round_batch(self, generations: Sequence[Generation]) -> dict[str, Tensor] | None:
        return _rejection_batch(generations, first_only=self.first_rejected)


def _pair_logprobs(
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


class DPOStrategy:
    """Preference updates at rejected drafts (see the module docstring)."""

    name = "dpo"

    def __init__(
        self,
        drafter: Drafter,
        *,
        lr: float = 1e-5,
        beta: float = 0.1,
        steps_per_round: int = 2,
        grad_clip: float = 0.5,
        ttt_steps: int = 1,
    ) -> None:
        if beta <= 0:
            raise ValueError("dpo needs beta > 0")
        self.learner = OGDStrategy(drafter, lr=lr, steps_per_round=steps_per_round,
                                   ttt_steps=ttt_steps, grad_clip=grad_clip)  # fmt: skip
        self.drafter = self.learner.drafter
        self.beta = float(beta)

    def pairs(self, generations: Sequence[Generation]) -> tuple[dict[str, Tensor] | None, list]:
        kept = [g for g in generations if g.features is not None and len(g.tokens) >= 2]
        batch = feedback_batch(kept)
        pairs = []
        for row, generation in enumerate(kept):
            sequence = generation.prompt + generation.tokens
            for position, token in rejection_slots(generation):
                chosen = sequence[position]
                if position >= 2 and token != chosen:
                    pairs.append((row, position, chosen, token))
        if batch is None or not pairs:
            return None, []
        ids = [self.drafter.target_to_draft_ids(torch.tensor([c, r])) for *_, c, r in pairs]
        usable = [p for p, d in zip(pairs, ids, strict=True) if bool((d >= 0).all())]
        return batch, usable

    def update(self, generations: Sequence[Generation]) -> dict[str, float]:
        tic = time.perf_counter()
        batch, pairs = self.pairs(generations)
        if batch is None or not pairs:
            return {"online_loss": float("nan"), "update_seconds": 0.0, "labels": 0.0}
        reference = copy.deepcopy(self.drafter).eval()  # the drafter that served this round
        with torch.no_grad():
            ref_chosen, ref_rejected = _pair_logprobs(reference, batch, pairs)
        served = float("nan")
        self.drafter.train()
        for step in range(self.learner.steps_per_round):
            chosen, rejected = _pair_logprobs(self.drafter, batch, pairs)
            loss = losses.dpo_loss(chosen=chosen, rejected=rejected, ref_chosen=ref_chosen,
                            ref_rejected=ref_rejected, beta=self.beta)  # fmt: skip
            if step == 0:
                served = float(loss.detach())
            if not torch.isfinite(loss):
                break
            self.learner.optimizer.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(self.drafter.parameters(), self.learner.grad_clip)
            self.learner.optimizer.step()
        self.drafter.eval()
        return {"online_loss": served, "update_seconds": time.perf_counter() - tic,
                "labels": float(len(pairs))}  # fmt: skip

    def state_dict(self) -> dict[str, Any]:
        return self.learner.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.learner.load_state_dict(state)


STRATEGIES = {
    "frozen": FrozenStrategy,
    "ogd": OGDStrategy,
    "optimistic": OptimisticStrategy,
    "ensemble": EnsembleStrategy,
    "osd": OSDStrategy,
    "dpo": DPOStrategy,
}


def make_strategy(name: str, drafter: Drafter, **options: Any) -> OnlineStrategy:
    """A strategy by name (`STRATEGIES`) with its options (unknown options: TypeError)."""
    if name not in STRATEGIES:
        raise ValueError(f"unknown online strategy {name!r}; available: {', '.join(STRATEGIES)}")
    if name == "frozen":
        return FrozenStrategy(
            drafter,
            ttt_steps=int(options.get("ttt_steps", 2)),
            labels=str(options.get("labels", "soft")),
            label_top_k=int(options.get("label_top_k", 32)),
        )
    return STRATEGIES[name](drafter, **options)
