"""What every drafter-training objective shares: the LightningModule around its loss step.

An objective (EAGLE SFT, GTO, Draft-OPD, OnlineSpec; docs/architecture.md) trains a drafter against
a frozen target. Everything except its loss step is the same for all of them, and lives here:

* the frozen target, loaded from a spec string (`models.target.load_target`) or handed in
  prebuilt (`from_objects`), and the drafter, loaded from a `save_pretrained` folder
  (`drafter_init`) or built by the subclass (`build_drafter`), checked to belong together;
* AdamW (no weight decay on vectors; frozen parameters left out) with a linear warm-up and a
  cosine decay to 10% (`WarmupCosine`, step-wise; `RunBudget` may re-size its `total`);
* the non-finite-step guard: a step whose loss is NaN/inf on any rank changes no weight, and
  `max_consecutive_nonfinite` of them in a row stop the run (`skip_nonfinite`);
* Lightning checkpoints without the frozen target (it is reloaded from `target`), with the
  objective's counters under `checkpoint_key`;
* the batch keys a step needs (`required_batch_keys`), checked before every train and
  validation step with an error that names the missing ones.

Subclasses write `training_step` / `validation_step` around their own pure losses
(`objectives/losses.py`), returning `skip_nonfinite(loss)` when it is not None.
"""

from __future__ import annotations

import contextvars
import logging
import math
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, ClassVar, TypeVar

import torch
from lightning.pytorch import LightningModule
from torch import Tensor

from lightning_spec.models.drafters.base import Drafter, load_drafter
from lightning_spec.models.fingerprint import check_drafter_target
from lightning_spec.models.target import TargetModel, load_target

log = logging.getLogger(__name__)

__all__ = ["BatchKeyError", "Objective", "WarmupCosine", "check_pair"]

ObjectiveT = TypeVar("ObjectiveT", bound="Objective")


@dataclass
class WarmupCosine:
    """LambdaLR factor: linear warmup to 1, then cosine decay to `floor` at `total` steps.

    A plain callable object (not a closure) so LambdaLR can save and restore it.
    """

    warmup: int
    total: float
    floor: float = 0.1

    def __call__(self, step: int) -> float:
        if step < self.warmup:
            return (step + 1) / self.warmup
        if not math.isfinite(self.total) or self.total <= self.warmup:
            return 1.0
        progress = min(1.0, (step - self.warmup) / (self.total - self.warmup))
        return self.floor + (1.0 - self.floor) * 0.5 * (1.0 + math.cos(math.pi * progress))


def check_pair(target: TargetModel, drafter: Drafter) -> None:
    """Fail early, with the reason, when a drafter was built for another target."""
    if drafter.target_vocab_size != target.vocab_size:
        raise ValueError(
            f"drafter maps onto {drafter.target_vocab_size} tokens, the target has "
            f"{target.vocab_size}: the drafter was built for another tokenizer"
        )
    check_drafter_target(drafter, target)
    fc = getattr(drafter, "fc", None)
    if fc is not None and fc.in_features != target.feature_size:
        raise ValueError(
            f"drafter reads features of width {fc.in_features}, the target gives "
            f"{target.feature_size} (layers {target.feature_layers}): wrong target?"
        )


class BatchKeyError(KeyError):
    """A batch lacks keys an objective's step needs (a KeyError whose message reads plainly)."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


_PREBUILT: contextvars.ContextVar[tuple[TargetModel, Drafter] | None] = contextvars.ContextVar(
    "objective_prebuilt", default=None
)


@contextmanager
def _prebuilt(target: TargetModel, drafter: Drafter) -> Iterator[None]:
    token = _PREBUILT.set((target, drafter))
    try:
        yield
    finally:
        _PREBUILT.reset(token)


class Objective(LightningModule):
    """Base class of the objectives: a frozen target, a trainable drafter, shared plumbing.

    The attribute contract the callbacks rely on (`AcceptanceEval` decodes with both,
    `DrafterCheckpoint` saves `drafter.save_pretrained`, `RegisterDrafter` measures and
    promotes against `target`):

    * `target`: the frozen `TargetModel` (eval mode whatever Lightning does, no gradients,
      on the module's device). Never in checkpoints.
    * `drafter`: the trainable `Drafter` (float32 master weights); the only thing the
      optimizer updates and the thing every drafter folder holds.

    Subclasses set `required_batch_keys` (checked before each train/validation step),
    optionally `checkpoint_key` (where their counters live in a Lightning checkpoint),
    implement `build_drafter` when they can start from scratch, and write their steps. Their
    `__init__` takes the arguments below as keywords and passes them on, so LightningCLI reads
    one signature with its docstring.
    """

    required_batch_keys: ClassVar[frozenset[str]] = frozenset({"input_ids"})
    """Keys every batch must have for a train or validation step."""
    checkpoint_key: ClassVar[str] = "objective"
    """Key of `checkpoint_state()` in a Lightning checkpoint."""

    def __init__(
        self,
        target: str = "smollm2",
        target_dtype: str = "float32",
        drafter_init: str | None = None,
        lr: float = 3e-4,
        weight_decay: float = 0.0,
        betas: tuple[float, float] = (0.9, 0.95),
        warmup_steps: int = 100,
        max_steps_for_schedule: int | None = None,
        max_consecutive_nonfinite: int = 10,
    ) -> None:
        """
        Args:
            target: Target model: "smollm2" (the embedded default), a hub id, a local folder or a
                `.gguf` file.
            target_dtype: Dtype of the frozen target (float32, bfloat16, float16).
            drafter_init: A drafter folder (`save_pretrained`) to start from; None builds a fresh
                drafter (`build_drafter`).
            lr: Peak learning rate of AdamW.
            weight_decay: AdamW weight decay (not applied to norms and biases).
            betas: AdamW betas.
            warmup_steps: Linear warmup steps of the learning rate.
            max_steps_for_schedule: Steps of the cosine decay to 10% of `lr`; None uses the
                trainer's estimated number of optimizer steps.
            max_consecutive_nonfinite: Raise after this many consecutive steps whose loss is
                NaN/inf (each such step is skipped and counted in `train/skipped_nonfinite`).
        """
        for field, value, ok in (
            ("lr", lr, lr > 0),
            ("weight_decay", weight_decay, weight_decay >= 0),
            ("warmup_steps", warmup_steps, warmup_steps >= 0),
            ("betas", betas, len(betas) == 2 and all(0 <= b < 1 for b in betas)),
            (
                "max_consecutive_nonfinite",
                max_consecutive_nonfinite,
                max_consecutive_nonfinite >= 1,
            ),
        ):
            if not ok:
                raise ValueError(f"{type(self).__name__}: {field} = {value!r} is out of range")
        super().__init__()
        # Collects the arguments of every __init__ up the class chain (the subclass's too).
        self.save_hyperparameters()
        prebuilt = _PREBUILT.get()
        if prebuilt is not None:
            target_model, drafter = prebuilt
        else:
            target_model = load_target(target, dtype=target_dtype)
            if drafter_init:
                drafter = load_drafter(drafter_init, device=target_model.device)
            else:
                drafter = self.build_drafter(target_model)
        check_pair(target_model, drafter)
        target_model.requires_grad_(False)
        self.target = target_model.eval()  # frozen: TargetModel.train() keeps it in eval mode
        self.drafter = drafter.float()
        self.drafter.bind_target(target_model)  # weights shared with the target (DFlash)
        self.drafter.train()
        self._nonfinite_total = 0
        self._nonfinite_consecutive = 0
        self._skip_update = False

    @classmethod
    def from_objects(
        cls: type[ObjectiveT], target: TargetModel, drafter: Drafter, **hparams: Any
    ) -> ObjectiveT:
        """Wrap an already built target and drafter (tests, notebooks); `hparams` as __init__."""
        hparams.setdefault("target", target.name)
        with _prebuilt(target, drafter):
            return cls(**hparams)

    def build_drafter(self, target: TargetModel) -> Drafter:
        """A fresh drafter for `target` (when no `drafter_init` folder is given)."""
        raise NotImplementedError(
            f"{type(self).__name__} cannot build a drafter from scratch; pass drafter_init"
        )

    # ---------------------------------------------------------------------------- batches
    def check_batch(self, batch: Any) -> None:
        """Raise, naming them, when `batch` lacks keys in `required_batch_keys`."""
        if not isinstance(batch, Mapping):
            raise TypeError(
                f"{type(self).__name__} expects dict batches with keys "
                f"{sorted(self.required_batch_keys)}, got {type(batch).__name__}"
            )
        missing = self.required_batch_keys - set(batch)
        if missing:
            raise BatchKeyError(
                f"{type(self).__name__} needs batch keys {sorted(missing)} that this batch "
                f"lacks (it has {sorted(map(str, batch))}); check the data module's mode"
            )

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        self.check_batch(batch)

    def on_validation_batch_start(
        self, batch: Any, batch_idx: int, dataloader_idx: int = 0
    ) -> None:
        self.check_batch(batch)

    # ---------------------------------------------------------------------------- guard
    def skip_nonfinite(self, loss: Tensor) -> Tensor | None:
        """None when `loss` is finite on every rank. Otherwise count the step, raise after
        `max_consecutive_nonfinite` in a row, and return the loss the step must return instead:
        zero, connected to every trainable parameter so DDP's gradient all-reduce stays in step
        on all ranks; `optimizer_step` then drops the gradients. Logs
        `train/skipped_nonfinite` either way."""
        nonfinite = not bool(torch.isfinite(loss))
        nonfinite = self.trainer.strategy.reduce_boolean_decision(nonfinite, all=False)
        if not nonfinite:
            self._nonfinite_consecutive = 0
            self.log("train/skipped_nonfinite", float(self._nonfinite_total))
            return None
        self._nonfinite_total += 1
        self._nonfinite_consecutive += 1
        log.warning(
            "non-finite loss at step %d: skipping the update (%d in a row, %d in all)",
            self.global_step,
            self._nonfinite_consecutive,
            self._nonfinite_total,
        )
        if self._nonfinite_consecutive >= int(self.hparams.max_consecutive_nonfinite):
            raise FloatingPointError(
                f"{self._nonfinite_consecutive} consecutive non-finite losses: stopping; "
                f"{self.describe_nonfinite()}"
            )
        self._skip_update = True
        self.log("train/skipped_nonfinite", float(self._nonfinite_total))
        return sum(p.sum() for p in self.drafter.parameters() if p.requires_grad) * 0.0

    def describe_nonfinite(self) -> str:
        """What the last step found non-finite, for the stopping message (objectives that
        check their inputs override it: `SFT` names features, labels or the drafter)."""
        return "lower the learning rate, check the data, or use bf16-mixed not fp16"

    def optimizer_step(
        self, epoch: int, batch_idx: int, optimizer: Any, optimizer_closure: Any = None
    ) -> None:
        """The default step, except that a step whose loss was non-finite changes nothing."""

        def closure() -> Any:
            result = optimizer_closure()
            if self._skip_update:
                for group in optimizer.param_groups:
                    for parameter in group["params"]:
                        parameter.grad = None
            return result

        optimizer.step(closure=closure)
        self._skip_update = False

    # ---------------------------------------------------------------------------- helpers
    def log_lr(self) -> None:
        """Log the current learning rate as ``train/lr`` (every objective's training step)."""
        schedulers = self.lr_schedulers()
        if schedulers is not None:
            scheduler = schedulers[0] if isinstance(schedulers, list) else schedulers
            self.log("train/lr", float(scheduler.get_last_lr()[0]))

    def prepack_target(self) -> None:
        """CPU fp32: prepack the frozen target's linears (faster scoring, same maths to ~1e-6);
        where that cannot run (GPU, bf16) say why and go on unpacked."""
        from lightning_spec.models.packed import prepack_linears, prepack_unavailable_reason

        reason = prepack_unavailable_reason(self.target.model)
        if reason is None:
            prepack_linears(self.target.model)
        else:
            log.warning("prepack_target skipped: %s", reason)

    # ---------------------------------------------------------------------------- optimizer
    def configure_optimizers(self) -> dict[str, Any]:
        hp = self.hparams
        decay, no_decay = [], []
        for parameter in self.drafter.parameters():
            if not parameter.requires_grad:
                continue  # e.g. an embedding shared with the target and frozen
            (no_decay if parameter.dim() < 2 else decay).append(parameter)
        optimizer = torch.optim.AdamW(
            [
                {"params": decay, "weight_decay": float(hp.weight_decay)},
                {"params": no_decay, "weight_decay": 0.0},
            ],
            lr=float(hp.lr),
            betas=tuple(float(b) for b in hp.betas),
        )
        total = hp.max_steps_for_schedule
        if total is None:
            total = float(self.trainer.estimated_stepping_batches)
            if not math.isfinite(total):
                log.warning("unknown number of training steps: constant learning rate after warmup")
        scheduler = torch.optim.lr_scheduler.LambdaLR(
            optimizer, WarmupCosine(warmup=max(1, int(hp.warmup_steps)), total=float(total))
        )
        return {
            "optimizer": optimizer,
            "lr_scheduler": {"scheduler": scheduler, "interval": "step", "frequency": 1},
        }

    # ---------------------------------------------------------------------------- checkpoints
    def checkpoint_state(self) -> dict[str, Any]:
        """The objective's counters saved in Lightning checkpoints (extend in subclasses)."""
        return {"nonfinite_total": self._nonfinite_total}

    def load_checkpoint_state(self, state: Mapping[str, Any]) -> None:
        self._nonfinite_total = int(state.get("nonfinite_total", 0))

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Leave the frozen target out: it is reloaded from `target`, not from checkpoints."""
        state = checkpoint.get("state_dict", {})
        for key in [k for k in state if k.startswith("target.")]:
            del state[key]
        checkpoint[self.checkpoint_key] = self.checkpoint_state()

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Put the live target's weights back so strict loading finds every key."""
        state = checkpoint.setdefault("state_dict", {})
        for key, value in self.target.state_dict(prefix="target.").items():
            state.setdefault(key, value)
        own = set(self.state_dict())
        for key in [k for k in state if k.endswith("embed_tokens.weight") and k not in own]:
            del state[key]  # older checkpoints held the drafter's own copy of the embeddings
        self.load_checkpoint_state(checkpoint.get(self.checkpoint_key, {}))
