"""Draft-OPD (arXiv 2605.29343): on-policy distillation of the drafter at its own errors.

Continued SFT on fixed target text stops raising acceptance: the drafter is trained on states
the target made and judged on states it made itself. Draft-OPD trains on its own drafts
(docs/methods/draft-opd.md).

The default, ``rejected_stream: suffix``, is the reference's objective (`opd_suffix`): on each
greedy text of the batch (the regenerated store's cached greedy answers, or greedy rollouts) the
decoder's exact replay gives the CURRENT drafter's chain blocks (anchors, drafts d_1 .. d_K,
accept length n); the accepted stream is slots 1 .. n + 1 (the accepted drafts and the
correction) under forward KL towards the target's rows along the text; the rejected stream is
every drafted slot n + 1 .. K under reverse KL weighted gamma^(k-1), the teacher at slot k > n + 1
being the target conditioned on the drafter's own prefix d_1 .. d_{k-1} (one tree-block target
pass per text, through the decoder's `score_trees_target`). Pooled normalisation
(`losses.draft_opd_loss`). With the store's cached features and final hidden states, that pass
over the suffixes is the only target compute of a step (configs/improve/draft_opd_eagle3_cpu.yaml; its
control: experiments/gto-draft-opd/configs/control_sft_same_texts.yaml).

The earlier form, ``rejected_stream: tried``, trains on stored rollouts (StepRecord v2):

1. Rollouts: real speculative decoding with the current drafter, through the `RolloutSource`
   seam of `RolloutDataModule(mode="on_policy")`, refreshed every N optimizer steps by the
   `RefreshRollouts` callback (which logs rollout tau and throughput). Each verification step
   records its anchor a (the root, the last committed token), its accept length n and its
   tried-and-rejected drafts with their block positions k.
2. Replay at the anchors, batched: per step, the committed chain x_{a+1} .. x_{a+n} is fed to
   the drafter from the anchor through the decoder's own drafting seam
   (`Drafter.sequence_proposer` + `path_rows`, one teacher-forced pass per sequence serves
   all anchors), giving the drafter's rows at block slots k = 1 .. n + 1; the target's rows at
   the same slots come from the shared tree-scoring module (`score_trees_target` over the
   committed text from the first anchor on, one chain). That side depends on the text alone
   and is cached per text (`target_cache_bytes`).
3. Loss: forward KL(p || q) at the slots of accepted tokens (and the correction); reverse
   KL(q || p) at the slots where tried drafts (tree siblings included) were rejected, whose
   parents lie on committed text: at T = 0 every such state lies on the target's own text.

Both forms: ``kl="exact"`` (default) compares whole rows; ``kl="estimator"`` uses the per-token
forms of the authors' code (Bernoulli forward KL on the realised token, clamped k3 on each
drafted token).

Ablations are config fields: ``gamma: 1``, ``lambda_rejected: 0`` (all forward),
``lambda_accepted: 0`` (all reverse), ``correction: false``, ``anchors: random`` (blocks of the
same lengths at random response positions instead of the drafter's error positions; in the
suffix form only the accepted stream moves, as in the reference code),
``rejected_stream: tried``. The paper's negative control, SFT on the same texts without replay,
is `SFT` on the same store (experiments/gto-draft-opd/configs/control_sft_same_texts.yaml; for stored rollouts
experiments/gto-draft-opd/configs/control_sft_same_rollouts.yaml). Our extension for budgets where rollouts are scarce:
``lambda_sft`` > 0 adds the EAGLE-3 token loss on dataset rows that ride along with the
rollouts (`RolloutDataModule(rollout_sft_mix=True)`). Validation reports the EAGLE-3 token loss on held-out
dataset answers (inherited from `SFT`) beside the acceptance callbacks' tau.

Why one file (~670 lines): one objective. The block replay (`replay_blocks`) exists only to feed
this loss, and its slots, weights and teacher rows are read together with the loss terms; the
pure maths it shares with other objectives is in `losses.py`.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import Tensor

from lightning_spec.decoding.replay import ReplayMismatch, TextPass, greedy_prefix
from lightning_spec.decoding.score import score_trees_target
from lightning_spec.decoding.tree import DraftTree
from lightning_spec.models.drafters.base import Drafter
from lightning_spec.models.drafters.proposer import absorbed_offset
from lightning_spec.models.target import TargetModel
from lightning_spec.objectives import losses, opd_suffix
from lightning_spec.objectives.base import BatchKeyError
from lightning_spec.objectives.sft import SFT
from lightning_spec.objectives.ttt import draft_vocab_ids
from lightning_spec.tensor_lru import TensorLRU, tensor_key

__all__ = ["DraftOPD", "ReplayBlocks", "replay_blocks"]

STEP_BATCH_KEYS = frozenset(
    {"step_mask", "step_anchor", "step_accept_length", "rejected_mask", "rejected_depth"}
)


@dataclass
class ReplayBlocks:
    """The blocks of one sequence to replay: anchors [S], chains [S, n_max] (committed tokens
    after each anchor, 0-padded), lengths [S] (accepted n, clipped to the sequence), and the
    rejected drafts per block (depth [S, R], tokens [S, R], mask [S, R])."""

    anchors: Tensor
    chains: Tensor
    lengths: Tensor
    rejected_depth: Tensor
    rejected_tokens: Tensor
    rejected_mask: Tensor
    corrections: Tensor | None = None  # [S] the committed token after the chain (-1: none)


def replay_blocks(
    ids: Tensor,
    *,
    step_mask: Tensor,
    anchors: Tensor,
    accept_lengths: Tensor,
    rejected_mask: Tensor,
    rejected_depth: Tensor,
    rejected_tokens: Tensor,
    offset: int,
    random_anchors: bool = False,
    generator: torch.Generator | None = None,
) -> ReplayBlocks | None:
    """The replay blocks of one rollout (ids [L]; step tensors [S], [S, R] as collated).

    Steps whose anchor the drafter has no entry for (< offset) or that lie beyond the
    (truncated) sequence are dropped; a block's chain is clipped to the sequence. With
    `random_anchors` every block keeps its length and rejected depths but moves to a uniformly
    drawn position of the response (the ablation: train away from the drafter's errors).
    """
    length = int(ids.shape[0])
    keep = step_mask.bool() & (anchors >= offset) & (anchors <= length - 2)
    if not bool(keep.any()):
        return None
    anchors = anchors[keep].clone()
    accepted = accept_lengths[keep]
    depth, tokens, mask = rejected_depth[keep], rejected_tokens[keep], rejected_mask[keep].bool()
    if random_anchors:
        low, high = int(anchors.min()), length - 2
        anchors = torch.randint(low, high + 1, anchors.shape, generator=generator)
    lengths = torch.minimum(accepted, length - 1 - anchors).clamp_min(0)
    width = max(1, int(lengths.max()))
    offsets = torch.arange(1, width + 1).unsqueeze(0)  # [1, n_max]
    index = (anchors.unsqueeze(1) + offsets).clamp(max=length - 1)
    chains = torch.where(offsets <= lengths.unsqueeze(1), ids[index], torch.zeros_like(index))
    # a rejected draft sits at block slot k <= n + 1 (a sibling of the accepted path or a child
    # of its last node); slots beyond the clipped chain cannot be replayed
    mask = mask & (depth >= 1) & (depth <= lengths.unsqueeze(1) + 1)
    after = anchors + lengths + 1  # the target's correction token (or the bonus) of each block
    corrections = torch.where(after < length, ids[after.clamp(max=length - 1)], torch.full_like(after, -1))
    return ReplayBlocks(anchors, chains, lengths, depth, tokens, mask, corrections)


class DraftOPD(SFT):
    """Draft-OPD training on on-policy rollouts (see the module docstring)."""

    checkpoint_key: ClassVar[str] = "draft_opd"

    def __init__(
        self,
        target: str = "smollm2",
        target_dtype: str = "float32",
        drafter_init: str | None = None,
        gamma: float = 0.8,
        lambda_accepted: float = 1.0,
        lambda_rejected: float = 1.0,
        kl: str = "exact",
        vocabulary: str = "draft",
        anchors: str = "errors",
        rejected_stream: str = "suffix",
        chain: int = 0,
        correction: bool = True,
        normalization: str = "pooled",
        lambda_sft: float = 0.0,
        k3_clamp: float = 10.0,
        score_max_tokens: int = 512,
        prepack_target: bool = False,
        target_cache_bytes: int = 1_000_000_000,
        ttt_steps: int = 3,
        ttt_decay: float = 0.8,
        lr: float = 3e-4,
        weight_decay: float = 0.0,
        betas: tuple[float, float] = (0.9, 0.95),
        warmup_steps: int = 10,
        max_steps_for_schedule: int | None = None,
        max_consecutive_nonfinite: int = 10,
        seed: int = 0,
        cache_dir: str | None = None,
    ) -> None:
        """
        Args:
            target: Target model: "smollm2", a hub id, a local folder or a `.gguf` file.
            target_dtype: Dtype of the frozen target.
            drafter_init: The trained drafter folder Draft-OPD starts from (required).
            gamma: Block-position decay of the reverse-KL weights gamma^(k-1) (paper: 0.8;
                1 = the ablation).
            lambda_accepted: Weight of the forward KL on accepted tokens (0 = all reverse).
            lambda_rejected: Weight of the reverse KL on rejected tokens (0 = all forward).
            kl: "exact" (full-distribution KLs, our default) or "estimator" (Bernoulli forward
                KL on the committed token, clamped k3 on each rejected token).
            vocabulary: "draft" (the target distribution restricted to the draft vocabulary and
                renormalised, EAGLE-3's label) or "full" (the target's full-vocabulary
                probabilities of the draft ids; off-vocabulary mass left out as a constant).
            anchors: "errors" (the rollout's own blocks) or "random" (the ablation: with
                the suffix stream, as in the reference, only the accepted stream moves to
                random response positions; with the tried form both do).
            rejected_stream: "suffix" (the reference, the default): the current drafter's
                chain is replayed on each greedy text (`opd_suffix`) and the rejected stream is
                every drafted slot from the first rejection on, the teacher conditioned on the
                drafter's own prefix; the batch needs only greedy texts (the regenerated store,
                or greedy rollouts). "tried": the earlier form, the rollout's tried-and-rejected
                nodes (parents on committed text), tree siblings included.
            chain: Drafts per block in the suffix stream (0: a DFlash drafter's block - 1, else
                6; the reference: DFlash blocks of 16).
            correction: Put the block's correction token (the committed token after the
                accepted drafts, slot n + 1) in the forward-KL stream, as the reference does;
                False = the earlier form (accepted drafts only; the slot then gets the reverse
                terms of its rejected drafts alone).
            normalization: "pooled" (the reference: one weighted mean over both streams,
                (sum acc + sum w_k rej) / (N_acc + sum w_k)) or "per_stream" (the mean of the
                two stream means, the earlier form; `losses.draft_opd_loss`).
            lambda_sft: Weight of the EAGLE-3 token loss on dataset rows (the batch's ``sft``
                rows, `RolloutDataModule(rollout_sft_mix=True)`) added to the Draft-OPD loss:
                where rollouts are expensive (CPU) they are few, and the token loss on the
                dataset keeps the drafter from fitting them alone; 0 = Draft-OPD as published.
            k3_clamp: Clamp of r = log p - log q in the k3 estimator.
            score_max_tokens: Block rows per target scoring forward (bounds memory).
            prepack_target: CPU fp32: prepack the frozen target's linear weights (faster).
            target_cache_bytes: Keep the target's part of each replay (its rows and features,
                which depend only on the rollout's text) in memory up to this many bytes, so
                revisits of a text cost only the drafter; 0 = off.
            ttt_steps: Unroll steps of the validation token loss (EAGLE-3 TTT).
            ttt_decay: Weight decay**k of unroll step k of that loss.
            lr: Peak learning rate of AdamW (paper: 3e-4).
            weight_decay: AdamW weight decay.
            betas: AdamW betas.
            warmup_steps: Linear warmup steps (paper: 5% of the run).
            max_steps_for_schedule: Steps of the cosine decay; None: the trainer's estimate.
            max_consecutive_nonfinite: Raise after this many consecutive non-finite losses.
            seed: Seed of the random-anchor ablation.
            cache_dir: Asset cache root.
        """
        if kl not in ("exact", "estimator"):
            raise ValueError(f"kl must be exact or estimator, got {kl!r}")
        if vocabulary not in ("draft", "full"):
            raise ValueError(f"vocabulary must be draft or full, got {vocabulary!r}")
        if anchors not in ("errors", "random"):
            raise ValueError(f"anchors must be errors or random, got {anchors!r}")
        if rejected_stream not in ("suffix", "tried"):
            raise ValueError(f"rejected_stream must be suffix or tried, got {rejected_stream!r}")
        if chain < 0:
            raise ValueError(f"chain must be >= 0 (0: the drafter's default), got {chain}")
        if not 0 < gamma <= 1:
            raise ValueError(f"gamma must be in (0, 1], got {gamma}")
        if target_cache_bytes < 0:
            raise ValueError(f"target_cache_bytes must be >= 0, got {target_cache_bytes}")
        if not lambda_sft >= 0:
            raise ValueError(f"lambda_sft must be >= 0, got {lambda_sft}")
        super().__init__(
            target=target,
            target_dtype=target_dtype,
            drafter_init=drafter_init,
            ttt_steps=ttt_steps,
            ttt_decay=ttt_decay,
            lr=lr,
            weight_decay=weight_decay,
            betas=betas,
            warmup_steps=warmup_steps,
            max_steps_for_schedule=max_steps_for_schedule,
            max_consecutive_nonfinite=max_consecutive_nonfinite,
            cache_dir=cache_dir,
            prepack_target=prepack_target,
        )
        losses.draft_opd_loss(  # fail on bad lambdas now, not at the first step
            accepted_kl=torch.zeros(1),
            accepted_mask=torch.zeros(1),
            rejected_kl=torch.zeros(1),
            rejected_depth=torch.ones(1),
            rejected_mask=torch.zeros(1),
            lambda_accepted=lambda_accepted,
            lambda_rejected=lambda_rejected,
            normalization=normalization,
        )
        self._generator = torch.Generator().manual_seed(int(seed))
        # random anchors move every visit: nothing would ever be served from the cache
        self._target_cache = (
            TensorLRU(target_cache_bytes) if target_cache_bytes and anchors == "errors" else None
        )
        self._accepted_seen = 0
        self._rejected_seen = 0
        self._not_greedy = 0  # texts (or their tails) skipped: not the target's greedy text

    def build_drafter(self, target: TargetModel) -> Drafter:
        raise ValueError(
            "Draft-OPD starts from a trained drafter: set model.init_args.drafter_init to a "
            "drafter folder (e.g. the output of configs/train/eagle3_2h_cpu.yaml)"
        )

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        super().on_train_batch_start(batch, batch_idx)
        missing = STEP_BATCH_KEYS - set(batch)
        if missing and self.hparams.rejected_stream == "tried":
            raise BatchKeyError(
                f"DraftOPD trains on rollouts: the batch lacks {sorted(missing)}; use "
                "RolloutDataModule(mode='on_policy') with the RefreshRollouts callback"
            )
        if self.hparams.lambda_sft > 0 and "sft" not in batch:
            raise BatchKeyError(
                "DraftOPD(lambda_sft > 0) adds a token loss on dataset rows: the batch has no "
                "'sft' rows; set the data module's rollout_sft_mix: true"
            )

    # ---------------------------------------------------------------------------- the loss
    def opd_loss(self, batch: Mapping[str, Any]) -> dict[str, Tensor | float]:
        """The Draft-OPD loss of a batch of rollouts and its parts (see the module doc)."""
        hp = self.hparams
        tic = time.perf_counter()
        input_ids, attention = batch["input_ids"], batch.get("attention_mask")
        parts: list[dict[str, Tensor]] = []
        for row in range(input_ids.shape[0]):
            length = int(attention[row].sum()) if attention is not None else input_ids.shape[1]
            if hp.rejected_stream == "suffix":
                part = self._replay_suffix(batch, row, length)
                if part is not None:
                    parts.append(part)
                continue
            blocks = replay_blocks(
                input_ids[row, :length].cpu(),
                step_mask=batch["step_mask"][row].cpu(),
                anchors=batch["step_anchor"][row].cpu(),
                accept_lengths=batch["step_accept_length"][row].cpu(),
                rejected_mask=batch["rejected_mask"][row].cpu(),
                rejected_depth=batch["rejected_depth"][row].cpu(),
                rejected_tokens=batch["rejected_tokens"][row].cpu(),
                offset=absorbed_offset(self.drafter),
                random_anchors=hp.anchors == "random",
                generator=self._generator,
            )
            if blocks is not None:
                parts.append(self._replay(input_ids[row : row + 1, :length], blocks))
        zero = sum(p.sum() for p in self.drafter.parameters() if p.requires_grad) * 0.0
        if not parts:
            return {"loss": zero, "loss_accepted": 0.0, "loss_rejected": 0.0, "accepted": 0.0,
                    "rejected": 0.0, "seconds": time.perf_counter() - tic}  # fmt: skip
        joined = {key: torch.cat([p[key] for p in parts]) for key in parts[0]}
        loss, accepted, rejected = losses.draft_opd_loss(
            accepted_kl=joined["accepted_kl"],
            accepted_mask=joined["accepted_mask"],
            rejected_kl=joined["rejected_kl"],
            rejected_depth=joined["rejected_depth"],
            rejected_mask=joined["rejected_mask"],
            gamma=float(hp.gamma),
            lambda_accepted=float(hp.lambda_accepted),
            lambda_rejected=float(hp.lambda_rejected),
            normalization=str(hp.normalization),
        )
        return {
            "loss": zero + loss,
            "loss_accepted": float(accepted.detach()),
            "loss_rejected": float(rejected.detach()),
            "accepted": float(joined["accepted_mask"].sum()),
            "rejected": float(joined["rejected_mask"].sum()),
            "seconds": time.perf_counter() - tic,
        }

    def _replay_suffix(
        self, batch: Mapping[str, Any], row: int, length: int
    ) -> dict[str, Tensor] | None:
        """The reference's terms of one greedy text (`opd_suffix`): the current drafter's chain
        blocks, both streams over every drafted slot; None when nothing can be trained on
        (no response, or a continuation that is not the target's greedy one). With random
        anchors the accepted stream comes from the moved blocks, the rejected stream stays
        (the reference's ablation)."""
        rows = self.suffix_rows(batch, row, length)
        if rows is None:
            return None
        forward, accepted_mask, reverse, rejected_mask = self._stream_terms(*rows.real)
        if rows.moved is not None:
            forward, accepted_mask, _, _ = self._stream_terms(*rows.moved)
        device = reverse.device
        depth = (torch.arange(reverse.shape[1], device=device) + 1).expand_as(rejected_mask)
        return {
            "accepted_kl": forward[accepted_mask],
            "accepted_mask": torch.ones(int(accepted_mask.sum()), device=device),
            "rejected_kl": reverse[rejected_mask],
            "rejected_depth": depth[rejected_mask],
            "rejected_mask": torch.ones(int(rejected_mask.sum()), device=device),
        }

    def _stream_terms(
        self, blocks: opd_suffix.ChainBlocks, teacher: Tensor, draft: Tensor
    ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """(forward KL, accepted mask, reverse KL, rejected mask), each [S, K], in the
        configured KL form."""
        device = draft.device
        masks = opd_suffix.stream_masks(blocks, correction=bool(self.hparams.correction))
        accepted_mask, rejected_mask = (m.to(device) for m in masks)
        if self.hparams.kl == "exact":
            forward = losses.forward_kl_rows(target_logprobs=teacher, draft_logprobs=draft)
            reverse = losses.reverse_kl_rows(target_logprobs=teacher, draft_logprobs=draft)
            return forward, accepted_mask, reverse, rejected_mask

        def picked(rows: Tensor, tokens: Tensor) -> tuple[Tensor, Tensor]:
            draft_ids = self.drafter.target_to_draft_ids(tokens.to(device))
            values = rows.gather(2, draft_ids.clamp_min(0).unsqueeze(-1)).squeeze(-1)
            return values, draft_ids >= 0

        realised = opd_suffix.realised_tokens(blocks)
        p_acc, ok_acc = picked(teacher, realised)
        q_acc, _ = picked(draft, realised)
        p_rej, ok_rej = picked(teacher, blocks.drafts)
        q_rej, _ = picked(draft, blocks.drafts)
        forward = losses.bernoulli_forward_kl(target_logprob=p_acc, draft_logprob=q_acc)
        reverse = losses.k3_reverse_kl(
            target_logprob=p_rej, draft_logprob=q_rej, clamp=float(self.hparams.k3_clamp)
        )
        return forward, accepted_mask & ok_acc, reverse, rejected_mask & ok_rej

    def suffix_rows(
        self, batch: Mapping[str, Any], row: int, length: int
    ) -> opd_suffix.SuffixRows | None:
        """(blocks, teacher rows, drafter rows) of row `row` of a batch of greedy texts: the
        drafter's rows [S, K, V_draft] carry gradients; the teacher's are log-probs in the same
        vocabulary convention, each under the prefix its slot was drafted from (and, with
        ``anchors: random``, the same for the blocks moved to random response positions).

        The response starts at the first loss-mask position and is cut to the target's greedy
        prefix. With the store's cached features and final hidden states no target pass over
        the text is run but the one that fills the cache the post-rejection suffixes attend to.
        """
        ids = batch["input_ids"][row : row + 1, :length]
        mask = batch.get("loss_mask")
        on = (mask[row, :length] > 0).nonzero().flatten() if mask is not None else None
        if on is None or on.numel() == 0:
            return None
        start = max(int(on[0]), absorbed_offset(self.drafter), 1)
        end = int(on[-1]) + 1
        ids = ids[:, :end]
        if end - 1 <= start:
            return None
        needs = self.drafter.needs_features
        cache = None
        with torch.no_grad():
            if "last_hidden" in batch and (not needs or "features" in batch):
                features = batch["features"][row : row + 1, :end] if needs else None
                text = TextPass(features, batch["last_hidden"][row, start - 1 : end])
            else:
                output = self.target(ids, output_features=needs, use_cache=True)
                text = TextPass(output.features, output.last_hidden[0, start - 1 :])
                cache = output.cache
            argmax = batch.get("target_argmax")
            continuation = ids[0, start:].tolist()
            if argmax is not None:
                wrong = (ids[0, start:] != argmax[row, start - 1 : end - 1]).nonzero().flatten()
                keep = int(wrong[0]) if wrong.numel() else len(continuation)
            else:
                keep = greedy_prefix(self.target, text, continuation)
            if keep < len(continuation):
                self._not_greedy += 1
                ids, text = ids[:, : start + keep], text.prefix(start, keep)
            chain = int(self.hparams.chain) or opd_suffix.default_chain(self.drafter)
            try:
                blocks = opd_suffix.chain_blocks(
                    self.target, self.drafter, ids[0], start, chain=chain, text=text
                )
            except ReplayMismatch:
                self._not_greedy += 1
                return None
            if blocks is None:
                return None
            if cache is None and bool(blocks.rejected.any()):
                roots = blocks.anchors + blocks.accepted
                cache = self.target(
                    ids[:, : int(roots[blocks.rejected].max()) + 1], output_features=False,
                    use_cache=True, logits_to_keep=1,
                ).cache  # fmt: skip
            text_logits = self.target.head_logits(text.last_hidden).float()
            teacher = opd_suffix.teacher_rows(
                self.target, cache, ids[0], blocks, text_logits, text_start=start - 1,
                max_tokens=int(self.hparams.score_max_tokens),
            )  # fmt: skip
            moved = None
            if self.hparams.anchors == "random":
                moved = opd_suffix.moved_blocks(blocks, ids[0], start, self._generator)
                moved_teacher = opd_suffix.teacher_rows(
                    self.target, None, ids[0], moved, text_logits, text_start=start - 1,
                    suffix=False,
                )  # fmt: skip
        real = (blocks, self._draft_vocab_logprobs(teacher), self._chain_rows(ids, blocks, text))
        if moved is None:
            return opd_suffix.SuffixRows(real)
        moved_rows = self._chain_rows(ids, moved, text)
        return opd_suffix.SuffixRows(
            real, (moved, self._draft_vocab_logprobs(moved_teacher), moved_rows)
        )

    def _chain_rows(self, ids: Tensor, blocks: opd_suffix.ChainBlocks, text: TextPass) -> Tensor:
        """The drafter's rows [S, K, V_draft] along each block's chain (with gradients)."""
        anchors = blocks.anchors.to(ids.device)
        prefix = ids[:, : int(anchors.max()) + 1]
        features = None if text.features is None else text.features[:, : prefix.shape[1]]
        proposer = self.drafter.sequence_proposer(prefix, anchors, features=features)
        return proposer.path_rows(blocks.drafts[:, :-1].to(ids.device), draft_space=True)

    def replay_rows(self, ids: Tensor, blocks: ReplayBlocks) -> tuple[Tensor, Tensor]:
        """(target rows, drafter rows) [S, W + 1, V_draft] of log-probs at block slots 1..W+1
        of every block (W = longest chain), in the configured vocabulary convention; the
        drafter's rows carry gradients when they are enabled.

        Every slot's context is committed text, so the target's side is its rows along the
        text from the first anchor on (one chain through the shared scoring module) and the
        text's features: a function of the text alone, cached per text, so a rollout replayed
        for a later drafter (same text, other anchors) is served from the cache too."""
        device = ids.device
        anchors, lengths = blocks.anchors.to(device), blocks.lengths.to(device)
        first = int(anchors.min())
        text = ids[:, : int((anchors + lengths).max()) + 1]
        cache, key, side = self._target_cache, None, None
        if cache is not None:  # (an empty cache is falsy: it has a length)
            key = tensor_key(text, torch.tensor([first]))
            side = cache.get(key)
        if side is None:
            side = self._target_text(text, first)
            if cache is not None:
                cache.put(key, side)
        text_rows, features = side
        # slot j of a block of n accepted tokens reads the row at anchor + min(j, n) (slots past
        # n + 1 are masked by the loss; they repeat the last real row)
        slots = torch.arange(blocks.chains.shape[1] + 1, device=device).unsqueeze(0)
        index = (anchors - first).unsqueeze(1) + torch.minimum(slots, lengths.unsqueeze(1))
        prefix = ids[:, : int(anchors.max()) + 1]
        if features is not None:
            features = features[:, : prefix.shape[1]]
        return text_rows[index], self._draft_rows(prefix, anchors, blocks, features)

    def _target_text(self, text: Tensor, first: int) -> tuple[Tensor, Tensor | None]:
        """The target's side of a replay: its rows after positions first .. end of `text`
        [1, end + 1] (drafter vocabulary convention) and the text's features [1, end + 1, F]
        (None when the drafter reads none); independent of the drafter."""
        device = text.device
        needs = self.drafter.needs_features
        with torch.no_grad():
            output = self.target(text[:, :first], output_features=needs)
            nodes = text[0, first + 1 :]
            chain = DraftTree(
                nodes,
                torch.arange(nodes.shape[0], device=device) - 1,
                torch.zeros(nodes.shape[0], device=device),
            )
            score = score_trees_target(
                self.target,
                output.cache,
                [chain],
                text[0, first : first + 1],
                torch.tensor([first], device=device),
                outputs=("rows", "features") if needs else ("rows",),
                max_tokens=max(int(self.hparams.score_max_tokens), nodes.shape[0] + 1),
            )[0]
            features = None
            if needs:
                features = torch.cat([output.features[0], score.features]).unsqueeze(0)
        return self._draft_vocab_logprobs(score.rows.float()), features

    def _draft_rows(
        self, prefix: Tensor, anchors: Tensor, blocks: ReplayBlocks, features: Tensor | None
    ) -> Tensor:
        """The drafter's rows at every block slot, through the decoding seam (with grads)."""
        proposer = self.drafter.sequence_proposer(prefix, anchors, features=features)
        return proposer.path_rows(blocks.chains.to(prefix.device), draft_space=True)

    def _replay(self, ids: Tensor, blocks: ReplayBlocks) -> dict[str, Tensor]:
        """Per-slot KL terms and masks of one sequence (flattened over blocks and slots)."""
        hp = self.hparams
        device = ids.device
        target_rows, draft_rows = self.replay_rows(ids, blocks)
        slots = torch.arange(draft_rows.shape[1], device=device).unsqueeze(0)  # [1, W + 1]
        lengths = blocks.lengths.to(device).unsqueeze(1)
        accepted_mask = slots < lengths  # slot j holds block position j + 1
        corrections = blocks.corrections
        if hp.correction and corrections is not None:  # slot n: the target's correction token
            has = (corrections.to(device) >= 0).unsqueeze(1)
            accepted_mask = accepted_mask | ((slots == lengths) & has)
        # one reverse term per slot where something was rejected (exact) or per rejected token
        rejected_depth = blocks.rejected_depth.to(device)
        rejected_mask = blocks.rejected_mask.to(device)
        if hp.kl == "exact":
            accepted_kl = losses.forward_kl_rows(
                target_logprobs=target_rows, draft_logprobs=draft_rows
            )
            slot_rejected = torch.zeros_like(accepted_mask)
            rows = torch.arange(slot_rejected.shape[0], device=device).unsqueeze(1)
            slot_rejected[rows.expand_as(rejected_depth)[rejected_mask],
                          (rejected_depth - 1)[rejected_mask]] = True  # fmt: skip
            reverse = losses.reverse_kl_rows(target_logprobs=target_rows, draft_logprobs=draft_rows)
            return {
                "accepted_kl": accepted_kl[accepted_mask],
                "accepted_mask": torch.ones(int(accepted_mask.sum()), device=device),
                "rejected_kl": reverse[slot_rejected],
                "rejected_depth": (slots.expand_as(slot_rejected) + 1)[slot_rejected],
                "rejected_mask": torch.ones(int(slot_rejected.sum()), device=device),
            }
        # per-token estimators: the realised token of slot j is the chain's token j + 1, and at
        # slot n the correction token
        realised = torch.cat([blocks.chains.to(device), torch.zeros_like(lengths)], dim=1)
        if corrections is not None:
            at_n = slots.expand_as(realised) == lengths
            realised = torch.where(at_n, corrections.to(device).clamp_min(0).unsqueeze(1), realised)
        draft_ids = self.drafter.target_to_draft_ids(realised)
        accepted_mask = accepted_mask & (draft_ids >= 0)  # a token the drafter cannot emit
        draft_ids = draft_ids.clamp_min(0)
        picked_q = draft_rows.gather(2, draft_ids.unsqueeze(-1)).squeeze(-1)
        picked_p = target_rows.gather(2, draft_ids.unsqueeze(-1)).squeeze(-1)
        forward = losses.bernoulli_forward_kl(target_logprob=picked_p, draft_logprob=picked_q)
        rejected_ids = self.drafter.target_to_draft_ids(
            blocks.rejected_tokens.to(device).clamp_min(0)
        )
        usable = rejected_mask & (rejected_ids >= 0)
        slot = (rejected_depth - 1).clamp(0, draft_rows.shape[1] - 1)
        q_rows = draft_rows.gather(1, slot.unsqueeze(-1).expand(-1, -1, draft_rows.shape[-1]))
        p_rows = target_rows.gather(1, slot.unsqueeze(-1).expand(-1, -1, target_rows.shape[-1]))
        ids_ = rejected_ids.clamp_min(0).unsqueeze(-1)
        k3 = losses.k3_reverse_kl(
            target_logprob=p_rows.gather(2, ids_).squeeze(-1),
            draft_logprob=q_rows.gather(2, ids_).squeeze(-1),
            clamp=float(hp.k3_clamp),
        )
        valid = accepted_mask
        return {
            "accepted_kl": forward[valid],
            "accepted_mask": torch.ones(int(valid.sum()), device=device),
            "rejected_kl": k3[usable],
            "rejected_depth": rejected_depth[usable],
            "rejected_mask": torch.ones(int(usable.sum()), device=device),
        }

    def _draft_vocab_logprobs(self, rows: Tensor) -> Tensor:
        """Target logits [n, V] as log-probs [n, V_draft] in the drafter's vocabulary
        convention (``vocabulary``: renormalised over the draft ids, or the full softmax)."""
        draft_ids = draft_vocab_ids(self.drafter)
        if self.hparams.vocabulary == "draft":
            restricted = losses.restrict_to_draft_vocab(target_logits=rows, draft_ids=draft_ids)
            return torch.log_softmax(restricted, dim=-1)
        full = torch.log_softmax(rows, dim=-1)
        return losses.restrict_to_draft_vocab(target_logits=full, draft_ids=draft_ids)

    # ---------------------------------------------------------------------------- steps
    def training_step(self, batch: dict[str, Any], batch_idx: int) -> Tensor:
        result = self.opd_loss(batch)
        loss = result["loss"]
        assert isinstance(loss, Tensor)
        weight = float(self.hparams.lambda_sft)
        if weight > 0:
            token = self._common_step(batch["sft"])
            self.log("train/sft_loss", token.loss.detach())
            loss = loss + weight * token.loss
        skipped = self.skip_nonfinite(loss)
        if skipped is not None:
            return skipped
        self._accepted_seen += int(result["accepted"])
        self._rejected_seen += int(result["rejected"])
        self.log("train/loss", loss.detach(), prog_bar=True)
        for key in ("loss_accepted", "loss_rejected", "accepted", "rejected", "seconds"):
            name = {"accepted": "accepted_slots", "rejected": "rejected_slots"}.get(key, key)
            self.log(f"train/{name}", float(result[key]))
        self.log("train/accepted_seen", float(self._accepted_seen))
        self.log("train/rejected_seen", float(self._rejected_seen))
        if self.hparams.rejected_stream == "suffix":
            self.log("train/not_greedy_texts", float(self._not_greedy))
        if self._target_cache is not None:
            looked_up = self._target_cache.hits + self._target_cache.misses
            self.log("train/target_cache_hit_rate", self._target_cache.hits / max(1, looked_up))
        self.log_lr()
        return loss

    # ---------------------------------------------------------------------------- checkpoints
    def checkpoint_state(self) -> dict[str, Any]:
        return {
            **super().checkpoint_state(),
            "accepted_seen": self._accepted_seen,
            "rejected_seen": self._rejected_seen,
            "generator": self._generator.get_state(),
        }

    def load_checkpoint_state(self, state: Mapping[str, Any]) -> None:
        super().load_checkpoint_state(state)
        self._accepted_seen = int(state.get("accepted_seen", 0))
        self._rejected_seen = int(state.get("rejected_seen", 0))
        if "generator" in state:
            self._generator.set_state(state["generator"])
