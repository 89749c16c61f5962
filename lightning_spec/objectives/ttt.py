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

Why one file (~615 lines): the TTT unroll, masks and losses that every EAGLE-3 objective reuses,
and the SFT LightningModule that the other objectives subclass.
"""

from __future__ import annotations

import hashlib
import logging
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import torch
from torch import Tensor

from lightning_spec.models.drafters.base import Drafter, DrafterOutput
from lightning_spec.models.drafters.eagle3 import Eagle3Drafter
from lightning_spec.models.target import TargetModel
from lightning_spec.models.vocab import draft_to_target_ids
from lightning_spec.objectives import losses
from lightning_spec.objectives.base import Objective, WarmupCosine

log = logging.getLogger(__name__)

__all__ = [
    "EagleSFT",
    "WarmupCosine",
    "cached_ttt_labels",
    "draft_token_counts",
    "eagle_ttt_losses",
    "ttt_attention_mask",
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


def _draft_ids(drafter: Drafter) -> Tensor | None:
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
    """The EAGLE-3 TTT objective on one batch, given the target's labels (`cached_ttt_labels`).

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
# Draft vocabulary (the learning-rate schedule, `WarmupCosine`, is objectives/base.py's)
# --------------------------------------------------------------------------------------------


def _slug(text: str) -> str:
    cleaned = re.sub(r"[^A-Za-z0-9._-]+", "_", text).strip("_")[-40:]
    digest = hashlib.sha256(text.encode()).hexdigest()[:8]
    return f"{cleaned}-{digest}"


def _vocab_counts_key(target: TargetModel, source: str) -> str:
    """What the counts depend on, by content: the tokenizer's vocabulary and chat format (not
    the target's name or path), and the source (a file by its sha256, a packaged one by name)."""
    from lightning_spec.data.chat import text_format_of
    from lightning_spec.io import sha256_file
    from lightning_spec.models.fingerprint import tokenizer_vocab_fingerprint

    template = str(getattr(target.tokenizer, "chat_template", None) or "")
    tokenizer = hashlib.sha256(
        f"{tokenizer_vocab_fingerprint(target.tokenizer)}|{text_format_of(target.tokenizer)}|"
        f"{template}".encode()
    ).hexdigest()[:16]
    path = Path(source).expanduser()
    data = sha256_file(path)[:16] if path.is_file() else _slug(source.strip().lower())
    return f"v{target.vocab_size}-tok{tokenizer}-{data}"


VOCAB_FROM_DATA = "data"
"""`vocab_source` value: count the draft vocabulary over the training records' loss tokens (the
texts the drafter learns, e.g. the target's regenerated answers), once the data is set up."""


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
    from lightning_spec.data.assets import cache_root
    from lightning_spec.data.chat import render_conversation
    from lightning_spec.data.sources import load_source
    from lightning_spec.io import atomic_write

    if target.tokenizer is None:
        raise ValueError(
            "counting draft-vocabulary tokens needs the target's tokenizer; this target has none "
            "(set draft_vocab_size to the target vocabulary or pass drafter_init)"
        )
    name = f"{_vocab_counts_key(target, source)}-{conversations}.pt"
    path = cache_root(cache_dir) / "vocab" / name
    if path.is_file():
        counts = torch.load(path, map_location="cpu")
        if int(counts.sum()) > 0:
            return counts
        path.unlink()  # an empty count cached by an older version: count again (and fail)
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
    if int(counts.sum()) == 0:
        # A prompt-only stream has no assistant turns: every count would be 0 and the "most
        # frequent" ids would silently be ids 0..k-1 (a vocabulary that cannot draft the answers).
        raise ValueError(
            f"vocab_source {source!r} has no assistant turns to count (a prompt-only stream?): "
            f"set vocab_source: {VOCAB_FROM_DATA} to count the draft vocabulary over the texts "
            "the drafter trains on (in mode regenerated, the target's own answers)"
        )
    log.info("draft vocabulary: counted %d tokens over %d conversations", int(counts.sum()), seen)
    with atomic_write(path) as handle:
        torch.save(counts, handle)
    return counts


# --------------------------------------------------------------------------------------------
# The LightningModule
# --------------------------------------------------------------------------------------------


class EagleSFT(Objective):
    """EAGLE-3 drafter training against a frozen target with the training-time test.

    Target, drafter, optimizer, schedule, non-finite guard and checkpoints: `Objective`.
    """

    required_batch_keys: ClassVar[frozenset[str]] = frozenset({"input_ids", "loss_mask"})
    checkpoint_key: ClassVar[str] = "eagle_sft"

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
        drafter_type: str = "eagle3",
        num_heads: int = 4,
        block_size: int = 8,
        num_layers: int = 1,
        anchors_per_sequence: int = 16,
        block_weighting: str = "decay",
        block_gamma: float | None = None,
        seed: int = 0,
        feature_norm: bool = False,
        anchor_feature: bool = False,
        mask_token_id: int | str | None = None,
        prepack_target: bool = False,
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
                draft vocabulary (sharegpt, mtbench, humaneval or a .jsonl/.json path), or
                "data": the loss tokens of the training records themselves (what a prompt-only
                stream in mode regenerated needs: the target's own answers).
            vocab_conversations: How many conversations of `vocab_source` to count (with
                "data": all training records are counted).
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
            drafter_type: The fresh drafter to build: "eagle3" or "hydra" (sequentially
                dependent heads, `models/drafters/hydra.py`; the TTT unroll trains head k on
                depth k).
            num_heads: Heads of a fresh Hydra drafter.
            block_size: B of a fresh DFlash drafter (drafter_type "dflash"): the anchor plus
                B - 1 slots drafted in one forward.
            num_layers: Decoder layers of a fresh DFlash drafter (1 to 8).
            anchors_per_sequence: Block drafters: random anchors (blocks) per training sequence
                (`objectives/block.py`); the TTT settings above are then unused.
            block_weighting: Block drafters' slot weights: decay (the DFlash paper) |
                acceptance (the chance the chain reaches the slot) | uniform.
            block_gamma: The decay constant of ``decay`` (None: 7, 5, 4 for blocks of 16, 10,
                8, else B / 2).
            seed: Seed of the anchor choice.
            feature_norm: A fresh EAGLE-3 or Hydra drafter normalises each target layer's
                hidden state before the fusion layer (the EAGLE-3.1 variant).
            anchor_feature: A fresh DFlash drafter's anchor slot also reads the target feature
                paired with its token (f_{R-1} with t_R, as EAGLE fuses them), not only through
                attention to the context.
            mask_token_id: A fresh DFlash drafter's MASK input: None learns a vector (our
                layout only); a token id, or "auto" (a padded embedding row, else a spare
                special token), uses the target's embedding of that token: the layout vLLM and
                llama.cpp serve (docs/llamacpp.md, docs/vllm.md).
            prepack_target: CPU fp32: prepack the frozen target's linear weights for oneDNN
                (features within ~1e-6 of the unpacked target's, about twice the feature tokens
                a second on the CPUs measured; BENCHMARKS.md section 34). Where it cannot run
                (GPU, bf16) a warning says why and the target runs unpacked.
        """
        if drafter_type not in ("eagle3", "hydra", "dflash"):
            raise ValueError(f"drafter_type must be eagle3, hydra or dflash, got {drafter_type!r}")
        from lightning_spec.objectives.block import BLOCK_WEIGHTINGS

        if block_weighting not in BLOCK_WEIGHTINGS:
            raise ValueError(
                f"EagleSFT: block_weighting = {block_weighting!r}; choose one of {BLOCK_WEIGHTINGS}"
            )
        # checked before the target loads or any data is prepared, each field named
        for field, value, ok in (
            ("ttt_steps", ttt_steps, ttt_steps >= 1),
            ("ttt_decay", ttt_decay, 0 < ttt_decay <= 1),
            ("draft_vocab_size", draft_vocab_size, draft_vocab_size >= 1),
            ("vocab_conversations", vocab_conversations, vocab_conversations >= 1),
            ("num_heads", num_heads, num_heads >= 1),
            ("block_size", block_size, block_size >= 2),
            ("num_layers", num_layers, 1 <= num_layers <= 8),
            ("anchors_per_sequence", anchors_per_sequence, anchors_per_sequence >= 1),
            ("block_gamma", block_gamma, block_gamma is None or block_gamma > 0),
            ("mask_token_id", mask_token_id, mask_token_id in (None, "auto")
             or (isinstance(mask_token_id, int) and mask_token_id >= 0)),
        ):
            if not ok:
                raise ValueError(f"EagleSFT: {field} = {value!r} is out of range")
        super().__init__(
            target=target,
            target_dtype=target_dtype,
            drafter_init=drafter_init,
            lr=lr,
            weight_decay=weight_decay,
            betas=betas,
            warmup_steps=warmup_steps,
            max_steps_for_schedule=max_steps_for_schedule,
            max_consecutive_nonfinite=max_consecutive_nonfinite,
        )
        self._tokens_seen = 0
        self._anchor_generator = torch.Generator().manual_seed(int(seed))
        if prepack_target:
            self.prepack_target()

    def build_drafter(self, target: TargetModel, token_counts: Tensor | None = None) -> Drafter:
        """A fresh EAGLE-3 head with a draft vocabulary counted on `vocab_source` (or on
        `token_counts`). With `vocab_source: data` the counts exist only once the data is set up:
        the head built here is provisional and `setup` rebuilds it from the training records."""
        hp = self.hparams
        counts = token_counts
        draft_vocab = min(int(hp.draft_vocab_size), target.vocab_size)
        self._vocab_pending = (
            counts is None
            and draft_vocab < target.vocab_size
            and hp.vocab_source == VOCAB_FROM_DATA
        )
        if draft_vocab < target.vocab_size and counts is None and not self._vocab_pending:
            counts = draft_token_counts(
                target,
                source=hp.vocab_source,
                conversations=hp.vocab_conversations,
                cache_dir=hp.cache_dir,
            )
        if hp.get("drafter_type", "eagle3") == "dflash":
            from lightning_spec.models.drafters.dflash import DFlashDrafter

            return DFlashDrafter.from_target(
                target,
                block_size=int(hp.block_size),
                num_layers=int(hp.num_layers),
                draft_vocab_size=draft_vocab,
                token_counts=counts,
                intermediate_size=hp.intermediate_size,
                anchor_feature=bool(hp.get("anchor_feature", False)),
                mask_token_id=hp.get("mask_token_id"),
            )
        if hp.get("drafter_type", "eagle3") == "hydra":
            from lightning_spec.models.drafters.hydra import HydraDrafter

            return HydraDrafter.from_target(
                target,
                num_heads=int(hp.num_heads),
                draft_vocab_size=draft_vocab,
                token_counts=counts,
                intermediate_size=hp.intermediate_size,
                feature_norm=bool(hp.get("feature_norm", False)),
            )
        return Eagle3Drafter.from_target(
            target,
            draft_vocab_size=draft_vocab,
            token_counts=counts,
            intermediate_size=hp.intermediate_size,
            feature_norm=bool(hp.get("feature_norm", False)),
        )

    def setup(self, stage: str) -> None:
        """`vocab_source: data`: count the draft vocabulary over the training records' loss
        tokens and rebuild the fresh head with it, before the optimizer sees its parameters (a
        resumed run counts the same records and gets the same vocabulary)."""
        super().setup(stage)
        self._warn_if_emulated_bf16()
        if not getattr(self, "_vocab_pending", False) or stage != "fit":
            return
        datamodule = getattr(self.trainer, "datamodule", None)
        count = getattr(datamodule, "train_token_counts", None)
        if count is None:
            raise ValueError(
                f"vocab_source: {VOCAB_FROM_DATA} counts the training records of a "
                f"RolloutDataModule; this run's data is {type(datamodule).__name__}: name a "
                "source with assistant turns instead (e.g. vocab_source: sharegpt)"
            )
        counts = count(self.target.vocab_size)
        if int(counts.sum()) == 0:
            raise ValueError("vocab_source: data: the training records have no loss tokens")
        log.info(
            "draft vocabulary: counted %d loss tokens of the training records", int(counts.sum())
        )
        drafter = self.build_drafter(self.target, token_counts=counts).float()
        drafter.bind_target(self.target)
        self.drafter = drafter.train(self.training)

    def _warn_if_emulated_bf16(self) -> None:
        """bf16-mixed halves the drafter's step on a CPU with avx512_bf16 or AMX and slows it
        where bf16 is emulated (AVX2-only CPUs): say so rather than let a run crawl."""
        trainer = getattr(self, "_trainer", None)
        if trainer is None or "bf16" not in str(trainer.precision):
            return
        if self.device.type != "cpu":
            return
        from lightning_spec.bench.machine import cpu_flags, has_native_bf16

        if not has_native_bf16():
            log.warning(
                "precision %s on a CPU without avx512_bf16 or AMX (flags: %s): bf16 is emulated "
                "here and the drafter's step is slower than in fp32; use precision 32-true",
                trainer.precision,
                ", ".join(cpu_flags()) or "unknown",
            )

    # ---------------------------------------------------------------------------- steps
    def _target_outputs(self, batch: dict[str, Any]) -> tuple[Tensor, Tensor]:
        """Features [B, T, F] and the target's final hidden states [B, T, H] for the batch.

        Cached `features` plus `last_hidden` skip the target forward; otherwise the frozen
        target runs here, under no_grad, without its [B, T, V] logits (the labels apply the LM
        head's draft rows, the argmax comes in chunks), and cached features (if any) are still
        the ones used.
        """
        if "features" in batch and "last_hidden" in batch:
            return batch["features"], batch["last_hidden"]
        # The frozen target runs in its own dtype even under the trainer's bf16-mixed autocast
        # (which is for the drafter's step): its features stay those of `target_dtype`.
        with torch.autocast(batch["input_ids"].device.type, enabled=False):
            output = self.target(
                batch["input_ids"],
                attention_mask=batch.get("attention_mask"),
                use_cache=False,
                output_features="features" not in batch,
                logits_to_keep=1,
            )
        features = batch["features"] if "features" in batch else output.features
        return features, output.last_hidden

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
        features, last_hidden = self._target_outputs(batch)
        argmax = batch.get("target_argmax")
        if argmax is None or "last_hidden" not in batch:
            argmax = self.target.head_argmax(last_hidden)
        target_probs, target_argmax = cached_ttt_labels(
            self.drafter,
            head=self.target.model.get_output_embeddings(),
            last_hidden=last_hidden,
            target_argmax=argmax,
        )
        self._finite_inputs = {
            "target features": bool(torch.isfinite(features).all()),
            "target labels": bool(torch.isfinite(target_probs).all()),
        }
        if self.drafter.drafts_blocks:  # a block drafter (DFlash): block SFT
            return self._block_step(input_ids, features, target_probs, target_argmax, loss_mask)
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

    def describe_nonfinite(self) -> str:
        """Names what was non-finite in the last step: the target's features or labels (the
        data: e.g. activations past fp16's range), or neither (the drafter diverged)."""
        bad = [name for name, ok in getattr(self, "_finite_inputs", {}).items() if not ok]
        if bad:
            return (
                f"the {' and '.join(bad)} of the last batch are non-finite: the target or the "
                "data produced them (check the target dtype; float32 holds what fp16 cannot), "
                "so a lower learning rate will not help"
            )
        if getattr(self, "_finite_inputs", None):
            return (
                "the target's features and labels were finite, so the drafter's own forward or "
                "gradients diverged: lower the learning rate or the gradient clip, or use "
                "bf16-mixed rather than fp16"
            )
        return super().describe_nonfinite()

    def _block_step(
        self,
        input_ids: Tensor,
        features: Tensor,
        target_probs: Tensor,
        target_argmax: Tensor,
        loss_mask: Tensor,
    ) -> TTTResult:
        """Block SFT (`objectives/block.py`); slot k is reported as step k - 1 (depth k)."""
        from lightning_spec.objectives.block import block_sft_losses

        hp = self.hparams
        result = block_sft_losses(
            self.drafter,
            input_ids=input_ids,
            features=features,
            target_probs=target_probs,
            target_argmax=target_argmax,
            loss_mask=loss_mask,
            anchors=int(hp.get("anchors_per_sequence", 16)),
            weighting=str(hp.get("block_weighting", "decay")),
            gamma=hp.get("block_gamma"),
            generator=self._anchor_generator,
        )
        return TTTResult(
            loss=result.loss,
            step_losses=result.slot_losses,
            step_accuracy=result.slot_accuracy,
            step_counts=result.slot_counts,
            tokens=result.tokens,
        )

    def _log_steps(self, stage: str, result: TTTResult, **kwargs: Any) -> None:
        counts = result.step_counts.tolist()
        for step in range(result.step_losses.shape[0]):
            size = max(1, int(counts[step]))
            self.log(f"{stage}/loss_{step}", result.step_losses[step], batch_size=size, **kwargs)
            self.log(f"{stage}/acc_{step}", result.step_accuracy[step], batch_size=size, **kwargs)

    def training_step(self, batch: dict[str, Any], batch_idx: int) -> Tensor:
        result = self._common_step(batch)
        skipped = self.skip_nonfinite(result.loss)
        if skipped is not None:
            return skipped
        tokens = torch.tensor(float(result.tokens), device=self.device)
        self._tokens_seen += int(self.trainer.strategy.reduce(tokens, reduce_op="sum").item())
        self.log("train/loss", result.loss.detach(), prog_bar=True)
        self._log_steps("train", result)
        self.log("train/tokens", float(self._tokens_seen))
        self.log_lr()
        return result.loss

    def validation_step(self, batch: dict[str, Any], batch_idx: int) -> None:
        result = self._common_step(batch)
        size = max(1, result.tokens)
        self.log("val/loss", result.loss, batch_size=size, sync_dist=True, prog_bar=True)
        self._log_steps("val", result, sync_dist=True)

    # ---------------------------------------------------------------------------- checkpoints
    def checkpoint_state(self) -> dict[str, Any]:
        return {**super().checkpoint_state(), "tokens_seen": self._tokens_seen}

    def load_checkpoint_state(self, state: Mapping[str, Any]) -> None:
        super().load_checkpoint_state(state)
        self._tokens_seen = int(state.get("tokens_seen", 0))
