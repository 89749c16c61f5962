"""Supervised training of a drafter against a frozen target (SFT); paper: EAGLE-3, Li et al. 2025.

`SFT` trains every drafter type: EAGLE-3 and Hydra through the training-time test (TTT,
`objectives/ttt.py`: K unroll steps in which the drafter reads its own output hidden states, as
decoding feeds it), DFlash through block SFT (`objectives/block.py`). Labels are the target's
next-token distribution restricted to the draft vocabulary, on assistant tokens; the loss is
sum_k decay**k * loss_k over the unroll steps (or the block's slots). The draft vocabulary of a
fresh drafter is counted here (`draft_token_counts`) on the assistant turns of a data source, or
on the training records themselves.

Why one file: the SFT LightningModule and the draft-vocabulary counts it builds a fresh drafter
from; GTO and Draft-OPD subclass `SFT` and add their losses to its step.
"""

from __future__ import annotations

import hashlib
import logging
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any, ClassVar

import torch
from torch import Tensor

from lightning_spec.deprecation import renamed
from lightning_spec.models.drafters.base import Drafter
from lightning_spec.models.drafters.eagle3 import Eagle3Drafter
from lightning_spec.models.target import TargetModel
from lightning_spec.objectives import ttt
from lightning_spec.objectives.base import Objective, WarmupCosine
from lightning_spec.objectives.ttt import TTTResult, cached_ttt_labels, eagle_ttt_losses

log = logging.getLogger(__name__)

__all__ = [
    "SFT",
    "VOCAB_FROM_DATA",
    "WarmupCosine",
    "draft_token_counts",
]


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


class SFT(Objective):
    """A drafter trained against a frozen target: the training-time test for chain drafters
    (EAGLE-3, Hydra), block SFT for block drafters (DFlash), chosen by ``drafter_type``.

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
        loss: str = "soft_ce",
        lk_kl_scale: float = 1.0,
        lk_kl_decay: float = 3.0,
        dpace_alpha: float = 0.5,
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
                acceptance (the chance the chain reaches the slot) | uniform | dpace (D-PACE,
                arXiv 2605.18810: weights from the drafter's own per-slot confidence, moving to
                later slots as the early ones become reliable; `losses.dpace_weights`).
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
                a second on the CPUs measured; RESULTS.md, costs and pace). Where it cannot run
                (GPU, bf16) a warning says why and the target runs unpacked.
            loss: Per-position loss against the target's distribution p over the draft
                vocabulary, at every TTT step (EAGLE-3, Hydra) or block slot (DFlash):
                soft_ce (H(p, q), EAGLE-3's, the default) | kl (KL(p || q): the same gradient,
                0 at q = p) | lk_alpha (-log alpha, alpha = sum_v min(p, q) the expected
                acceptance rate; LK losses, arXiv 2602.23881) | lk_lambda (w KL + (1 - w)
                (1 - alpha), w = lk_kl_scale * exp(-lk_kl_decay * alpha), detached).
            lk_kl_scale: LK^lambda's KL weight at alpha = 0.
            lk_kl_decay: LK^lambda's decay of the KL weight with alpha (3, the paper's best).
            dpace_alpha: Confidence smoothing of ``block_weighting: dpace`` in [0, 1]
                (the paper's 0.5).
        """
        if drafter_type not in ("eagle3", "hydra", "dflash"):
            raise ValueError(f"drafter_type must be eagle3, hydra or dflash, got {drafter_type!r}")
        from lightning_spec.objectives.block import BLOCK_WEIGHTINGS

        if block_weighting not in BLOCK_WEIGHTINGS:
            raise ValueError(
                f"SFT: block_weighting = {block_weighting!r}; choose one of {BLOCK_WEIGHTINGS}"
            )
        from lightning_spec.objectives.losses import SFT_LOSSES

        if loss not in SFT_LOSSES:
            raise ValueError(f"SFT: loss = {loss!r}; choose one of {SFT_LOSSES}")
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
            ("lk_kl_scale", lk_kl_scale, lk_kl_scale >= 0),
            ("lk_kl_decay", lk_kl_decay, lk_kl_decay >= 0),
            ("dpace_alpha", dpace_alpha, 0 <= dpace_alpha <= 1),
            ("mask_token_id", mask_token_id, mask_token_id in (None, "auto")
             or (isinstance(mask_token_id, int) and mask_token_id >= 0)),
        ):
            if not ok:
                raise ValueError(f"SFT: {field} = {value!r} is out of range")
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
                    "SFT expects right-padded batches (attention_mask 1...1 0...0)"
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
            **self._loss_options(),
        )

    def _loss_options(self) -> dict[str, Any]:
        """The per-position loss and its LK^lambda constants (hparams of older checkpoints
        lack them: the defaults, soft cross-entropy)."""
        hp = self.hparams
        return {
            "loss": str(hp.get("loss", "soft_ce")),
            "kl_scale": float(hp.get("lk_kl_scale", 1.0)),
            "kl_decay": float(hp.get("lk_kl_decay", 3.0)),
        }

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
            dpace_alpha=float(hp.get("dpace_alpha", 0.5)),
            **self._loss_options(),
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


# Old names, kept for one release: configs and checkpoints saved before the rename name
# `lightning_spec.objectives.sft.EagleSFT`, and the TTT core lived here.
_RENAMED = {"EagleSFT": "SFT"}
_MOVED_TO_TTT = {
    "_draft_ids": "draft_vocab_ids",
    "ttt_attention_mask": "ttt_attention_mask",
    "ttt_loss_masks": "ttt_loss_masks",
    "ttt_unroll": "ttt_unroll",
}


def __getattr__(name: str) -> Any:
    if name in _RENAMED:
        renamed(f"{__name__}.{name}", f"{__name__}.{_RENAMED[name]}")
        return globals()[_RENAMED[name]]
    if name in _MOVED_TO_TTT:
        renamed(f"{__name__}.{name}", f"{ttt.__name__}.{_MOVED_TO_TTT[name]}")
        return getattr(ttt, _MOVED_TO_TTT[name])
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
