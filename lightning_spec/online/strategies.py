"""OnlineSpec (arXiv 2603.12617): the drafter keeps learning from what it serves.

Serving is online learning in rounds (docs/methods/onlinespec.md): serve a round of requests with
the current drafter (test first), then update from that round's verification feedback (train
second). The feedback is free: at T = 0 every committed token is the target's own greedy choice,
and the decoder already computed the target's features of every committed token
(`Generation.features`, kept with ``SpeculativeDecoder(keep_features=True)``), so the drafter's
own loss is built without a second target pass.

The loss (`online/losses.py`): the EAGLE-3 training-time-test loss on the served
sequences' response positions, to the target's own distribution kept by the decoder while it
served (``labels: soft``, the default, as the reference's offline loss) or to the committed token
(``labels: hard``).

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
  (``weighting: hedge``, the loss of each learner on the round before it learns from it) or
  softmax(-train loss_i / temperature) (``weighting: softmax``, each learner's mean training
  loss over the round, as the reference's trainer reports it; temperature 0.2 as its script).
* `OSDStrategy`: the OSD baseline (online speculative decoding): distil the target only at the
  positions where the drafter's drafts were rejected, from a buffer of the last rounds.
* `DPOStrategy`: preference pairs at every tried-and-rejected draft (prefix = the committed
  sequence before its slot; chosen = the target's token there, rejected = the draft), trained
  with the DPO loss against the drafter as it was at the start of the round (beta = 0.1).

Why one file (~650 lines): the strategies are one family behind one protocol, compared row by
row in one table (experiments/onlinespec/LOG.md); their shared pieces (the round's gradient, the served loss)
sit beside them, the loss itself in `losses.py` and the serving loop in `loop.py`.
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
from lightning_spec.online.losses import (
    OnlineLoss,
    draft_vocab_miss,
    epoch_minibatches,
    feedback_batch,
    kept_label_rows,
    online_loss,
    pair_logprobs,
    rejection_batch,
    rejection_slots,
)
from lightning_spec.online.vocab import VocabGrowth, supports_vocab_swap

__all__ = [
    "DPOStrategy",
    "EnsembleStrategy",
    "FrozenStrategy",
    "OSDStrategy",
    "OGDStrategy",
    "OptimisticStrategy",
    "OnlineStrategy",
    "make_strategy",
]


class OnlineStrategy(Protocol):
    """One online algorithm (see the module docstring)."""

    name: str
    drafter: Drafter
    label_top_k: int
    """How many of the target's top log-probs per served token the decoder keeps for `update`
    (soft labels; 0: none)."""
    reads_records: bool
    """Whether `update` reads the generations' verification records (the rejected drafts), not
    only the committed text, its features and labels: without them a round's feedback does not
    depend on the drafter that served it, and a hindsight fit computes it once."""

    def update(self, generations: Sequence[Generation]) -> dict[str, float]: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


class FrozenStrategy:
    """Serve the starting drafter unchanged; still reports the round's online loss (what the
    regret proxy compares against)."""

    name = "frozen"
    reads_records = False

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
        loss, labels, diagnostic = timed_served_loss(self.drafter, batch, self.ttt_steps)
        return {"online_loss": loss, "update_seconds": 0.0, "labels": float(labels),
                "diagnostic_seconds": diagnostic}  # fmt: skip

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
    update), the quantity dynamic regret is measured on. ``vocab_swap: n`` lets the draft
    vocabulary follow the stream: up to n slots a round go from the tokens the stream uses least
    to those it uses most that the drafter could not draft (`online/vocab.py`). ``autocast``
    (true, false or ``auto``) runs the update's forward and backward under bf16 autocast
    (`bf16_autocast_wanted`). ``served_loss: false`` skips the diagnostic ``online_loss`` (a
    no-grad pass over the round before the update), which a learner charged to serving pays for.
    ``loss`` is what each position minimises (`online.losses.ONLINE_LOSSES`): the reference's
    cross-entropy to the target's kept distribution, or an LK loss on the acceptance rate
    (``lk_alpha``; ``lk_lambda`` with ``lk_kl_scale`` and ``lk_kl_decay``).
    """

    name = "ogd"
    reads_records = False

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
        vocab_swap: int = 0,
        vocab_min_count: int = 2,
        protected_ids: Sequence[int] = (),
        autocast: bool | str = False,
        served_loss: bool = True,
        loss: str = "soft_ce",
        lk_kl_scale: float = 1.0,
        lk_kl_decay: float = 3.0,
    ) -> None:
        self.loss = OnlineLoss(loss, kl_scale=lk_kl_scale, kl_decay=lk_kl_decay)
        self.label_top_k = kept_label_rows(labels, label_top_k)
        self.bf16 = bf16_autocast_wanted(autocast)
        self.served_loss = bool(served_loss)
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
        self.growth: VocabGrowth | None = None
        if vocab_swap:
            if not supports_vocab_swap(self.drafter):
                raise ValueError(
                    f"{self.name}: vocab_swap needs a drafter with its own head over a reduced "
                    f"draft vocabulary (EAGLE-3); {type(self.drafter).__name__} has none"
                )
            self.growth = VocabGrowth(self.drafter.target_vocab_size, swaps=int(vocab_swap),
                                      min_count=vocab_min_count, protected=protected_ids)  # fmt: skip

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
            # before any swap; a learner in series skips this diagnostic (its seconds are real)
            served = timed_served_loss(self.drafter, batch if self.served_loss else None,
                                       self.ttt_steps, self.loss)  # fmt: skip
            swapped = self._grow(generations)
            return self._epochs(served, tic, miss, swapped)
        self._grow(generations)
        self.drafter.train()
        served_loss, trained = float("nan"), float("nan")
        labels = 0
        for step in range(self.steps_per_round):
            total = torch.zeros(())
            for held in self.buffer:
                loss, count = online_loss(self.drafter, held, ttt_steps=self.ttt_steps, loss=self.loss)
                total = total + loss / len(self.buffer)
                if step == 0 and held is batch:
                    served_loss, labels = float(loss.detach()), count
            if not torch.isfinite(total):
                break  # a non-finite round changes nothing (logged by the caller as NaN)
            self._apply(total)
            trained = float(total.detach())
        self.drafter.eval()
        return self._report(served_loss, labels, tic, miss, train_loss=trained)

    def _apply(self, loss: Tensor) -> None:
        """One optimizer step on `loss`, its gradient clipped."""
        self.optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.drafter.parameters(), self.grad_clip)
        self.optimizer.step()

    def _report(
        self, served_loss: float, labels: int, tic: float, miss: float, **extra: float
    ) -> dict[str, float]:
        """The round's log; ``diagnostic_seconds`` in `extra` are not charged to the update."""
        return {
            "online_loss": served_loss,
            "update_seconds": time.perf_counter() - tic - extra.get("diagnostic_seconds", 0.0),
            "labels": float(labels),
            "buffer_rounds": float(len(self.buffer)),
            "draft_vocab_miss": miss,
            **extra,
        }

    def _grow(self, generations: Sequence[Generation]) -> int:
        """With ``vocab_swap``: count the round's tokens and swap draft slots (`VocabGrowth`)."""
        if self.growth is None:
            return 0
        return self.growth.step(self.drafter, generations, self.optimizer)

    def _epochs(
        self, served: tuple[float, int, float], tic: float, miss: float, swapped: int
    ) -> dict[str, float]:
        """The reference recipe: minibatch epochs over the buffered rounds' sequences
        (`served`: `timed_served_loss` of the drafter that served the round)."""
        served_loss, labels, diagnostic = served
        self.drafter.train()
        steps, trained = 0, 0.0
        for part in epoch_minibatches(self.buffer, self.epochs, self.minibatch, self._shuffle):
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=self.bf16):
                loss, count = online_loss(self.drafter, part, ttt_steps=self.ttt_steps, loss=self.loss)
            if count == 0 or not torch.isfinite(loss):
                continue  # no label here, or a non-finite part: it changes nothing
            self._apply(loss)
            steps += 1
            trained += float(loss.detach())
        self.drafter.eval()
        # `train_loss`: the mean minibatch loss over the round's epochs (the reference trainer's
        # `total_loss`, which `pipeline_hedge` weighs its learners by)
        extra = {"optimizer_steps": float(steps), "diagnostic_seconds": diagnostic,
                 "train_loss": trained / steps if steps else float("nan")}  # fmt: skip
        if self.growth is not None:
            extra["vocab_swapped"] = float(swapped)
        return self._report(served_loss, labels, tic, miss, **extra)

    def state_dict(self) -> dict[str, Any]:
        state = {"drafter": self.drafter.state_dict(), "optimizer": self.optimizer.state_dict(),
                 "buffer": self.buffer, "shuffle": self._shuffle.get_state()}  # fmt: skip
        if self.growth is not None:
            state["vocab_growth"] = self.growth.state_dict()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.drafter.load_state_dict(state["drafter"])  # d2t/t2d too: a grown vocabulary
        self.optimizer.load_state_dict(state["optimizer"])
        self.buffer = list(state.get("buffer", []))  # checkpoints before the buffer: empty
        if "shuffle" in state:
            self._shuffle.set_state(state["shuffle"])
        if self.growth is not None and "vocab_growth" in state:
            self.growth.load_state_dict(state["vocab_growth"])


def bf16_autocast_wanted(autocast: bool | str) -> bool:
    """Whether the drafter's update runs under bf16 autocast (its weights and AdamW state stay
    fp32). ``"auto"``: where this CPU has native bf16 (avx512_bf16 or AMX), which about halves
    the drafter's step; emulated bf16 elsewhere (Zen 3) is slower than fp32."""
    if autocast == "auto":
        from lightning_spec.bench.machine import has_native_bf16

        return has_native_bf16()
    if not isinstance(autocast, bool):
        raise ValueError(f"autocast must be true, false or auto, not {autocast!r}")
    return autocast


def timed_served_loss(
    drafter: Drafter, batch: dict[str, Tensor] | None, ttt_steps: int,
    loss: OnlineLoss = OnlineLoss(),
) -> tuple[float, int, float]:  # fmt: skip
    """(loss, labels, seconds) of the drafter as it served `batch` (NaN, 0, 0 without one).

    The served loss is a diagnostic (the quantity dynamic regret is measured on), not learning:
    a frozen drafter computes it too, uncharged, so its seconds are logged apart from the update's.
    """
    if batch is None:
        return float("nan"), 0, 0.0
    tic = time.perf_counter()
    with torch.no_grad():
        value, labels = online_loss(drafter, batch, ttt_steps=ttt_steps, loss=loss)
    return float(value), labels, time.perf_counter() - tic


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
    reads_records = False

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
        epochs: int = 0,
        minibatch: int = 4,
        seed: int = 0,
    ) -> None:
        self.label_top_k = kept_label_rows(labels, label_top_k)
        if lr <= 0 or not 0 <= momentum < 1:
            raise ValueError("optimistic needs lr > 0 and 0 <= momentum < 1")
        if epochs < 0 or minibatch < 1:
            raise ValueError("optimistic needs epochs >= 0 and minibatch >= 1")
        self.drafter = copy.deepcopy(drafter).float().eval()
        self.lr, self.momentum = float(lr), float(momentum)
        self.ttt_steps, self.grad_clip = int(ttt_steps), float(grad_clip)
        self.epochs, self.minibatch = int(epochs), int(minibatch)
        self._shuffle = torch.Generator().manual_seed(int(seed))
        self.secondary = [p.detach().clone() for p in _trainable(self.drafter)]  # w_hat
        self.velocity = [torch.zeros_like(p) for p in self.secondary]

    def update(self, generations: Sequence[Generation]) -> dict[str, float]:
        """One optimistic step on the round's gradient (``epochs: 0``), or, as the reference's
        Hydra pipeline trains each chunk, one per shuffled minibatch over ``epochs`` passes."""
        batch = feedback_batch(generations)
        if batch is None:
            return {"online_loss": float("nan"), "update_seconds": 0.0, "labels": 0.0}
        tic = time.perf_counter()
        if self.epochs == 0:
            loss, labels, grads = _round_gradient(
                self.drafter, batch, self.ttt_steps, self.grad_clip
            )
            if grads is not None:
                self._step(grads)
            return {"online_loss": loss, "update_seconds": time.perf_counter() - tic,
                    "labels": float(labels)}  # fmt: skip
        served, labels, diagnostic = timed_served_loss(self.drafter, batch, self.ttt_steps)
        steps = 0
        for part in epoch_minibatches([batch], self.epochs, self.minibatch, self._shuffle):
            _, count, grads = _round_gradient(self.drafter, part, self.ttt_steps, self.grad_clip)
            if count and grads is not None:
                self._step(grads)
                steps += 1
        return {"online_loss": served, "labels": float(labels),
                "update_seconds": time.perf_counter() - tic - diagnostic,
                "diagnostic_seconds": diagnostic, "optimizer_steps": float(steps)}  # fmt: skip

    def _step(self, grads: list[Tensor]) -> None:
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

    def state_dict(self) -> dict[str, Any]:
        return {"drafter": self.drafter.state_dict(), "secondary": self.secondary,
                "velocity": self.velocity, "shuffle": self._shuffle.get_state()}  # fmt: skip

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.drafter.load_state_dict(state["drafter"])
        self.secondary = [t.clone() for t in state["secondary"]]
        self.velocity = [t.clone() for t in state["velocity"]]
        if "shuffle" in state:
            self._shuffle.set_state(state["shuffle"])


class EnsembleStrategy:
    """Hedge-weighted parameter average of OGD learners (see the module docstring)."""

    name = "ensemble"
    reads_records = False

    def __init__(
        self,
        drafter: Drafter,
        *,
        lr: float = 1e-4,
        learners: int = 3,
        ratio: float = 2.0,
        epsilon: float = 0.2,
        weighting: str = "hedge",
        temperature: float = 0.2,
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
        # Hedge (`pipeline_ens`) scores each learner by its loss on the round before learning
        # from it, f_t(w_i^t); softmax (`pipeline_hedge`) by its training loss over the round, as
        # the reference does: with `restart` every learner serves the same average, so the
        # losses before learning are all equal and could not tell the learners apart
        self.signal = "online_loss" if weighting == "hedge" else "train_loss"
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
        # the served average's loss is a diagnostic; the learners' own losses (the weights'
        # input) are part of the update and charged
        ttt = self.learners[0].ttt_steps
        served, labels, diagnostic = timed_served_loss(self.drafter, batch, ttt)
        results = [learner.update(generations) for learner in self.learners]
        losses_now = torch.tensor([r[self.signal] for r in results], dtype=torch.float64)
        if self.signal == "train_loss":  # the learners' served losses are not the weights' input
            diagnostic += sum(r.get("diagnostic_seconds", 0.0) for r in results)
        finite = torch.isfinite(losses_now)
        losses_now = torch.where(finite, losses_now, losses_now[finite].max() if finite.any()
                                 else torch.zeros_like(losses_now))  # fmt: skip
        self.cumulative += losses_now
        self.last = losses_now
        self._average()
        if self.restart:  # and with a fresh optimizer: the reference's learners start each
            # round's trainer from the merged weights alone (no optimizer.pt beside them)
            with torch.no_grad():
                for learner in self.learners:
                    for mine, mean in zip(
                        _trainable(learner.drafter), _trainable(self.drafter), strict=True
                    ):
                        mine.copy_(mean)
                    learner.optimizer.state.clear()
        metrics = {"online_loss": served, "labels": float(labels),
                   "update_seconds": time.perf_counter() - tic - diagnostic,
                   "diagnostic_seconds": diagnostic}  # fmt: skip
        for index, weight in enumerate(self.weights().tolist()):
            metrics[f"weight_{index}"] = weight
            metrics[f"learner_loss_{index}"] = float(losses_now[index])
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


class OSDStrategy(OGDStrategy):
    """OSD: distillation at rejected positions from a buffer of recent rounds (OGD whose round
    batch keeps only the positions of rejected drafts). ``first_rejected`` (OSD's own rule) keeps
    one position per verification step, the first wrong one, not every rejected tree sibling."""

    name = "osd"
    reads_records = True

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
        vocab_swap: int = 0,
        vocab_min_count: int = 2,
        protected_ids: Sequence[int] = (),
    ) -> None:
        super().__init__(drafter, lr=lr, steps_per_round=steps_per_round, ttt_steps=ttt_steps,
                         grad_clip=grad_clip, buffer_rounds=buffer_rounds, epochs=epochs,
                         minibatch=minibatch, labels=labels, label_top_k=label_top_k,
                         vocab_swap=vocab_swap, vocab_min_count=vocab_min_count,
                         protected_ids=protected_ids)  # fmt: skip
        self.first_rejected = bool(first_rejected)

    def round_batch(self, generations: Sequence[Generation]) -> dict[str, Tensor] | None:
        return rejection_batch(generations, first_only=self.first_rejected)


class DPOStrategy:
    """Preference updates at rejected drafts (see the module docstring)."""

    name = "dpo"
    reads_records = True
    label_top_k = 0  # learns from (chosen, rejected) token pairs, not from distributions

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
            ref_chosen, ref_rejected = pair_logprobs(reference, batch, pairs)
        served = float("nan")
        self.drafter.train()
        for step in range(self.learner.steps_per_round):
            chosen, rejected = pair_logprobs(self.drafter, batch, pairs)
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
