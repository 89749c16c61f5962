"""EAGLE-3 supervised training with the training-time test (TTT); paper: EAGLE-3, Li et al. 2025.

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
"""

from __future__ import annotations

import contextvars
import hashlib
import logging
import math
import re
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch import LightningModule
from torch import Tensor

from lightning_spec.models.drafters.base import Drafter, DrafterOutput, load_drafter
from lightning_spec.models.drafters.eagle3 import Eagle3Drafter
from lightning_spec.models.target import TargetModel, load_target
from lightning_spec.models.vocab import draft_to_target_ids
from lightning_spec.objectives import losses

log = logging.getLogger(__name__)

__all__ = [
    "EagleSFT",
    "WarmupCosine",
    "cached_ttt_labels",
    "draft_token_counts",
    "eagle_ttt_losses",
    "ttt_attention_mask",
    "ttt_labels",
    "ttt_loss_masks",
    "ttt_unroll",
]


# --------------------------------------------------------------------------------------------
# Training-time test: the unroll, its attention pattern and its loss masks
# --------------------------------------------------------------------------------------------


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
            drafter.step(
                state,
                tokens,
                positions,
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


def _draft_ids(drafter: Drafter) -> Tensor | None:
    """Target ids of the draft vocabulary [V_draft], None when it is the target's."""
    if getattr(drafter, "draft_vocab_size", drafter.target_vocab_size) == drafter.target_vocab_size:
        return None
    return draft_to_target_ids(drafter.d2t)


def ttt_labels(drafter: Drafter, *, target_logits: Tensor) -> tuple[Tensor, Tensor]:
    """Soft labels [B, T-1, V_draft] and target argmax ids [B, T-1] of the drafter entries.

    target_logits [B, T, V] (full vocabulary); row j predicts x_{j+1}, the label of the entry
    at position j (entry j - 1). Callers drop the full logits afterwards: at T = 2048 and
    V = 49k they are 400 MB per sequence in float32.
    """
    rows = target_logits[:, 1:]  # [B, L, V]
    label_logits = losses.restrict_to_draft_vocab(target_logits=rows, draft_ids=_draft_ids(drafter))
    return torch.softmax(label_logits.float(), dim=-1), rows.argmax(dim=-1)


@torch.no_grad()
def cached_ttt_labels(
    drafter: Drafter, *, head: torch.nn.Module, last_hidden: Tensor, target_argmax: Tensor
) -> tuple[Tensor, Tensor]:
    """`ttt_labels` from cached target outputs without the full-vocabulary LM head.

    last_hidden [B, T, H] (the target's final hidden states), target_argmax [B, T] (its
    full-vocabulary argmax, cached with the features). Only the draft-vocabulary rows of the
    head are applied: on SmolLM2 with a 4k draft vocabulary that is 12x less work than the
    49k-row head, about a third of a cached training step otherwise.
    """
    draft_ids = _draft_ids(drafter)
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
) -> TTTResult:
    """The EAGLE-3 TTT objective on one batch, given the target's labels (`ttt_labels`).

    input_ids/loss_mask [B, T], features [B, T, F], target_probs [B, T-1, V_draft],
    target_argmax [B, T-1] (target ids).
    """
    draft_ids = _draft_ids(drafter)
    masks = ttt_loss_masks(loss_mask, steps=steps)  # [K, B, L]
    outputs = ttt_unroll(drafter, input_ids=input_ids, features=features, steps=steps)
    step_losses, step_accuracy = [], []
    for step, output in enumerate(outputs):
        step_losses.append(
            losses.soft_cross_entropy(
                logits=output.logits, target_probs=target_probs, mask=masks[step]
            )
        )
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


# --------------------------------------------------------------------------------------------
# Learning-rate schedule and draft vocabulary
# --------------------------------------------------------------------------------------------


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


def _slug(text: str) -> str:
    cleaned = re.sub(r"[^A-Za-z0-9._-]+", "_", text).strip("_")[-40:]
    digest = hashlib.sha256(text.encode()).hexdigest()[:8]
    return f"{cleaned}-{digest}"


def draft_token_counts(
    target: TargetModel,
    *,
    source: str,
    conversations: int,
    cache_dir: str | Path | None = None,
) -> Tensor:
    """Token frequencies [V] of the assistant turns of `conversations` conversations of `source`,
    rendered with the target's chat template; cached under the asset cache (`vocab/`).

    The draft vocabulary must cover what the target SAYS in the chat format it is served with,
    hence assistant tokens only and the real template.
    """
    from lightning_spec.data.assets import atomic_write, cache_root
    from lightning_spec.data.chat import render_conversation
    from lightning_spec.data.sources import load_source

    if target.tokenizer is None:
        raise ValueError(
            "counting draft-vocabulary tokens needs the target's tokenizer; this target has none "
            "(set draft_vocab_size to the target vocabulary or pass drafter_init)"
        )
    name = f"{_slug(target.name)}-v{target.vocab_size}-{_slug(source)}-{conversations}.pt"
    path = cache_root(cache_dir) / "vocab" / name
    if path.is_file():
        return torch.load(path, map_location="cpu")
    counts = torch.zeros(target.vocab_size, dtype=torch.long)
    seen = 0
    for conversation in load_source(source, cache_dir=cache_dir, limit=conversations):
        rendered = render_conversation(target.tokenizer, conversation.messages)
        ids = [t for t, m in zip(rendered.input_ids, rendered.loss_mask, strict=True) if m]
        if ids:
            counts += torch.bincount(torch.tensor(ids), minlength=target.vocab_size)[
                : target.vocab_size
            ]
        seen += 1
    if seen == 0:
        raise ValueError(f"data source {source!r} yielded no conversations")
    log.info("draft vocabulary: counted %d tokens over %d conversations", int(counts.sum()), seen)
    with atomic_write(path) as handle:
        torch.save(counts, handle)
    return counts


# --------------------------------------------------------------------------------------------
# The LightningModule
# --------------------------------------------------------------------------------------------

_PREBUILT: contextvars.ContextVar[tuple[TargetModel, Drafter] | None] = contextvars.ContextVar(
    "eagle_sft_prebuilt", default=None
)


@contextmanager
def _prebuilt(target: TargetModel, drafter: Drafter) -> Iterator[None]:
    token = _PREBUILT.set((target, drafter))
    try:
        yield
    finally:
        _PREBUILT.reset(token)


class EagleSFT(LightningModule):
    """EAGLE-3 drafter training against a frozen target with the training-time test."""

    def __init__(
        self,
        target: str = "smollm2",
        target_dtype: str = "float32",
        drafter_init: str | None = None,
        draft_vocab_size: int = 8192,
        vocab_source: str = "sharegpt",
        vocab_conversations: int = 2000,
        ttt_steps: int = 7,
        ttt_decay: float = 0.8,
        lr: float = 3e-4,
        weight_decay: float = 0.0,
        betas: tuple[float, float] = (0.9, 0.95),
        warmup_steps: int = 100,
        max_steps_for_schedule: int | None = None,
        intermediate_size: int | None = None,
        max_consecutive_nonfinite: int = 10,
        cache_dir: str | None = None,
    ) -> None:
        """
        Args:
            target: Target model: "smollm2" (the embedded default), a hub id, a local folder or a
                `.gguf` file.
            target_dtype: Dtype of the frozen target (float32, bfloat16, float16).
            drafter_init: A drafter folder (`save_pretrained`) to start from; None builds a fresh
                EAGLE-3 head from the target.
            draft_vocab_size: Size of the reduced draft vocabulary of a fresh drafter (the
                target's vocabulary size, or more, keeps the full vocabulary).
            vocab_source: Data source whose assistant turns give the token frequencies of the
                draft vocabulary (sharegpt, mtbench, humaneval or a .jsonl/.json path).
            vocab_conversations: How many conversations of `vocab_source` to count.
            ttt_steps: K, the number of training-time-test unroll steps (7 in EAGLE-3).
            ttt_decay: Weight decay**k of unroll step k in the total loss (0.8 in EAGLE-3).
            lr: Peak learning rate of AdamW.
            weight_decay: AdamW weight decay (not applied to norms).
            betas: AdamW betas.
            warmup_steps: Linear warmup steps of the learning rate.
            max_steps_for_schedule: Steps of the cosine decay to 10% of `lr`; None uses the
                trainer's estimated number of optimizer steps.
            intermediate_size: MLP width of a fresh drafter (None: the target's).
            max_consecutive_nonfinite: Raise after this many consecutive steps whose loss is
                NaN/inf (each such step is skipped and counted in `train/skipped_nonfinite`).
            cache_dir: Asset cache root (data and the draft-vocabulary counts); None uses
                $LIGHTNING_SPEC_CACHE or the user cache.
        """
        super().__init__()
        self.save_hyperparameters()
        prebuilt = _PREBUILT.get()
        if prebuilt is not None:
            target_model, drafter = prebuilt
        else:
            target_model = load_target(target, dtype=target_dtype)
            drafter = self._build_drafter(target_model)
        _check_pair(target_model, drafter)
        self.target = target_model.eval()  # frozen: TargetModel.train() keeps it in eval mode
        self.drafter = drafter.float()
        self.drafter.train()
        self._nonfinite_total = 0
        self._nonfinite_consecutive = 0
        self._skip_update = False
        self._tokens_seen = 0

    @classmethod
    def from_objects(cls, target: TargetModel, drafter: Drafter, **hparams: Any) -> EagleSFT:
        """Wrap an already built target and drafter (tests, notebooks); `hparams` as __init__."""
        hparams.setdefault("target", target.name)
        with _prebuilt(target, drafter):
            return cls(**hparams)

    def _build_drafter(self, target: TargetModel) -> Drafter:
        hp = self.hparams
        if hp.drafter_init:
            return load_drafter(hp.drafter_init, device=target.device)
        counts = None
        draft_vocab = min(int(hp.draft_vocab_size), target.vocab_size)
        if draft_vocab < target.vocab_size:
            counts = draft_token_counts(
                target,
                source=hp.vocab_source,
                conversations=hp.vocab_conversations,
                cache_dir=hp.cache_dir,
            )
        return Eagle3Drafter.from_target(
            target,
            draft_vocab_size=draft_vocab,
            token_counts=counts,
            intermediate_size=hp.intermediate_size,
        )

    # ---------------------------------------------------------------------------- steps
    def _target_outputs(self, batch: dict[str, Any]) -> tuple[Tensor, Tensor]:
        """Features [B, T, F] and full-vocabulary target logits [B, T, V] for the batch.

        Cached `features` plus the target's final hidden state `last_hidden` skip the target
        forward (logits = the target's LM head on `last_hidden`); otherwise the frozen target
        runs here, under no_grad, and cached features (if any) are still the ones used.
        """
        input_ids = batch["input_ids"]
        if "features" in batch and "last_hidden" in batch:
            head = self.target.model.get_output_embeddings()
            with torch.no_grad():
                logits = head(batch["last_hidden"].to(head.weight.dtype))
            return batch["features"], logits
        output = self.target(
            input_ids,
            attention_mask=batch.get("attention_mask"),
            use_cache=False,
            output_features="features" not in batch,
        )
        features = batch["features"] if "features" in batch else output.features
        return features, output.logits

    def _common_step(self, batch: dict[str, Any]) -> TTTResult:
        input_ids = batch["input_ids"]
        attention = batch.get("attention_mask")
        loss_mask = batch["loss_mask"]
        if attention is not None:
            if bool((attention[:, 1:] > attention[:, :-1]).any()):
                raise ValueError(
                    "EagleSFT expects right-padded batches (attention_mask 1...1 0...0)"
                )
            loss_mask = loss_mask * attention
        if {"features", "last_hidden", "target_argmax"} <= set(batch):
            features = batch["features"]
            target_probs, target_argmax = cached_ttt_labels(
                self.drafter,
                head=self.target.model.get_output_embeddings(),
                last_hidden=batch["last_hidden"],
                target_argmax=batch["target_argmax"],
            )
        else:
            features, target_logits = self._target_outputs(batch)
            target_probs, target_argmax = ttt_labels(self.drafter, target_logits=target_logits)
            del target_logits  # the full-vocabulary logits are the largest tensor of the step
        return eagle_ttt_losses(
            self.drafter,
            input_ids=input_ids,
            features=features,
            target_probs=target_probs,
            target_argmax=target_argmax,
            loss_mask=loss_mask,
            steps=int(self.hparams.ttt_steps),
            decay=float(self.hparams.ttt_decay),
        )

    def _log_steps(self, stage: str, result: TTTResult, **kwargs: Any) -> None:
        counts = result.step_counts.tolist()
        for step in range(result.step_losses.shape[0]):
            size = max(1, int(counts[step]))
            self.log(f"{stage}/loss_{step}", result.step_losses[step], batch_size=size, **kwargs)
            self.log(f"{stage}/acc_{step}", result.step_accuracy[step], batch_size=size, **kwargs)

    def training_step(self, batch: dict[str, Any], batch_idx: int) -> Tensor:
        result = self._common_step(batch)
        nonfinite = not bool(torch.isfinite(result.loss))
        nonfinite = self.trainer.strategy.reduce_boolean_decision(nonfinite, all=False)
        if nonfinite:
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
                    f"{self._nonfinite_consecutive} consecutive non-finite losses: stopping "
                    "(lower the learning rate, check the data, or use bf16-mixed not fp16)"
                )
            self._skip_update = True
            self.log("train/skipped_nonfinite", float(self._nonfinite_total))
            # A zero loss connected to every trainable parameter keeps DDP's gradient
            # all-reduce in step on all ranks; `optimizer_step` then drops the gradients.
            return sum(p.sum() for p in self.drafter.parameters() if p.requires_grad) * 0.0
        self._nonfinite_consecutive = 0
        tokens = torch.tensor(float(result.tokens), device=self.device)
        self._tokens_seen += int(self.trainer.strategy.reduce(tokens, reduce_op="sum").item())
        self.log("train/loss", result.loss.detach(), prog_bar=True)
        self._log_steps("train", result)
        self.log("train/tokens", float(self._tokens_seen))
        self.log("train/skipped_nonfinite", float(self._nonfinite_total))
        schedulers = self.lr_schedulers()
        if schedulers is not None:
            scheduler = schedulers[0] if isinstance(schedulers, list) else schedulers
            self.log("train/lr", float(scheduler.get_last_lr()[0]))
        return result.loss

    def validation_step(self, batch: dict[str, Any], batch_idx: int) -> None:
        result = self._common_step(batch)
        size = max(1, result.tokens)
        self.log("val/loss", result.loss, batch_size=size, sync_dist=True, prog_bar=True)
        self._log_steps("val", result, sync_dist=True)

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

    def configure_optimizers(self) -> dict[str, Any]:
        hp = self.hparams
        decay, no_decay = [], []
        for parameter in self.drafter.parameters():
            if not parameter.requires_grad:
                continue  # the embedding is shared with the target and frozen
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
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Leave the frozen target out: it is reloaded from `target`, not from checkpoints."""
        state = checkpoint.get("state_dict", {})
        for key in [k for k in state if k.startswith("target.")]:
            del state[key]
        checkpoint["eagle_sft"] = {
            "nonfinite_total": self._nonfinite_total,
            "tokens_seen": self._tokens_seen,
        }

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Put the live target's weights back so strict loading finds every key."""
        state = checkpoint.setdefault("state_dict", {})
        for key, value in self.target.state_dict(prefix="target.").items():
            state.setdefault(key, value)
        extra = checkpoint.get("eagle_sft", {})
        self._nonfinite_total = int(extra.get("nonfinite_total", 0))
        self._tokens_seen = int(extra.get("tokens_seen", 0))


def _check_pair(target: TargetModel, drafter: Drafter) -> None:
    """Fail early, with the reason, when a drafter was built for another target."""
    if drafter.target_vocab_size != target.vocab_size:
        raise ValueError(
            f"drafter maps onto {drafter.target_vocab_size} tokens, the target has "
            f"{target.vocab_size}: the drafter was built for another tokenizer"
        )
    fc = getattr(drafter, "fc", None)
    if fc is not None and fc.in_features != target.feature_size:
        raise ValueError(
            f"drafter reads features of width {fc.in_features}, the target gives "
            f"{target.feature_size} (layers {target.feature_layers}): wrong target?"
        )
