"""The maths of every training objective, as pure functions over tensors.

Objectives (`sft.py`, later `gto.py`, `draft_opd.py`, `online.py`) stay thin LightningModules;
what they optimise lives here so it can be tested on hand-made tensors without a trainer.
Every function takes keyword-only arguments and documents its shapes. Reductions are masked
means over "loss positions" (assistant tokens to be predicted) and never return NaN for an
empty mask, so a batch without loss tokens contributes 0 instead of poisoning the run.

Sections:
1. reductions (masked mean)
2. vocabularies (restriction of target logits to a reduced draft vocabulary)
3. distribution matching (soft cross-entropy, forward KL, top-1 agreement)
4. EAGLE-3 training-time test (per-step weighting); paper: EAGLE-3, Li et al. 2025
5. GTO: tree rewards, debiasing, group advantages, the clipped surrogate; arXiv 2509.22134
6. Draft-OPD: forward / reverse KL rows and their per-token estimators, block-position
   weights, the combined loss; arXiv 2605.29343
7. Online preference updates (OnlineSpec's DPO variant): the DPO loss
8. Block drafters (DFlash): slot weights (exponential decay, expected acceptance), the block loss
9. Acceptance-aligned losses: LK losses (arXiv 2602.23881) and D-PACE slot weights
   (arXiv 2605.18810)
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from lightning_spec.decoding.acceptance import branch_values_from_factors, tree_reward
from lightning_spec.decoding.tree import DraftTree

__all__ = [
    "SFT_LOSSES",
    "acceptance_rate_rows",
    "bernoulli_forward_kl",
    "block_cross_entropy",
    "block_position_weights",
    "block_slot_decay",
    "block_weighted_mean",
    "clipped_surrogate",
    "dpo_loss",
    "expected_acceptance_weights",
    "distribution_loss_rows",
    "dpace_weights",
    "draft_opd_loss",
    "forward_kl_rows",
    "k3_reverse_kl",
    "reverse_kl_rows",
    "debiased_rewards",
    "gto_tree_reward",
    "group_advantages",
    "kl_divergence",
    "kl_rows",
    "lk_alpha_loss",
    "lk_alpha_rows",
    "lk_lambda_loss",
    "lk_lambda_rows",
    "lk_lambda_weight",
    "masked_mean",
    "sequence_ratio",
    "restrict_to_draft_vocab",
    "soft_cross_entropy",
    "top1_matches",
    "ttt_total_loss",
    "ttt_weights",
]


# --------------------------------------------------------------------------------------------
# 1. Reductions
# --------------------------------------------------------------------------------------------


def masked_mean(*, values: Tensor, mask: Tensor) -> Tensor:
    """Mean of `values` [...] over positions where `mask` [...] is nonzero; 0 if none are.

    The mask may be bool or float (a float mask weights positions). An empty mask gives an
    exact 0 that still carries the graph of `values`, so backward works on every rank.
    """
    weights = mask.to(values.dtype)
    total = (values * weights).sum()
    count = weights.sum()
    return total / count.clamp_min(1.0)


# --------------------------------------------------------------------------------------------
# 2. Vocabularies
# --------------------------------------------------------------------------------------------


def restrict_to_draft_vocab(*, target_logits: Tensor, draft_ids: Tensor | None) -> Tensor:
    """Target logits [..., V] -> logits over the draft vocabulary [..., V_draft].

    `draft_ids` [V_draft] holds the target id of every draft id (`d + d2t[d]`); None means the
    draft vocabulary is the target's. A softmax over the result is the target distribution
    restricted to the draft vocabulary and renormalised, EAGLE-3's soft label.
    """
    if draft_ids is None:
        return target_logits
    return target_logits.index_select(-1, draft_ids.to(target_logits.device))


# --------------------------------------------------------------------------------------------
# 3. Distribution matching
# --------------------------------------------------------------------------------------------


def soft_cross_entropy(*, logits: Tensor, target_probs: Tensor, mask: Tensor) -> Tensor:
    """Masked mean of H(p, q) = -sum_v p(v) log q(v), q = softmax(`logits`).

    logits [..., V] (the drafter's), target_probs [..., V] (rows summing to 1), mask [...].
    Minimal (equal to the entropy of p) when q = p. Computed in float32 whatever the inputs.
    """
    log_q = F.log_softmax(logits.float(), dim=-1)  # [..., V]
    per_position = -(target_probs.float() * log_q).sum(dim=-1)  # [...]
    return masked_mean(values=per_position, mask=mask)


def kl_divergence(*, logits: Tensor, target_probs: Tensor, mask: Tensor) -> Tensor:
    """Masked mean of forward KL(p || q) = H(p, q) - H(p): soft cross-entropy shifted to 0 at
    q = p (same gradient with respect to `logits`; easier to read in logs and tests)."""
    p = target_probs.float()  # [..., V]
    log_q = F.log_softmax(logits.float(), dim=-1)
    log_p = torch.log(p.clamp_min(torch.finfo(torch.float32).tiny))
    per_position = (p * (log_p - log_q)).sum(dim=-1)  # [...]
    return masked_mean(values=per_position, mask=mask)


def top1_matches(
    *, draft_logits: Tensor, target_argmax: Tensor, draft_ids: Tensor | None = None
) -> Tensor:
    """Bool [...]: the drafter's argmax (mapped to a target id) equals the target's argmax.

    draft_logits [..., V_draft]; target_argmax [...] holds TARGET ids (argmax over the full
    target vocabulary), so a token the draft vocabulary lacks always counts as a miss, as it
    would at verification. At T = 0 the masked mean at TTT step 0 is the chance that the first
    draft is accepted.
    """
    guess = draft_logits.argmax(dim=-1)  # [...] draft ids
    if draft_ids is not None:
        guess = draft_ids.to(guess.device)[guess]  # [...] target ids
    return guess == target_argmax


# --------------------------------------------------------------------------------------------
# 4. EAGLE-3 training-time test
# --------------------------------------------------------------------------------------------


def ttt_weights(*, steps: int, decay: float) -> Tensor:
    """[steps] weights decay**k of TTT unroll step k (EAGLE-3: decay 0.8, 7 steps)."""
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    return torch.tensor([decay**k for k in range(steps)], dtype=torch.float32)


def ttt_total_loss(*, step_losses: Tensor, decay: float) -> Tensor:
    """sum_k decay**k * loss_k over the per-step losses [K] (a stacked 1-D tensor)."""
    weights = ttt_weights(steps=step_losses.shape[0], decay=decay).to(step_losses.device)
    return (weights * step_losses.float()).sum()


# --------------------------------------------------------------------------------------------
# 5. GTO (docs/methods/gto.md)
# --------------------------------------------------------------------------------------------


def gto_tree_reward(
    *, tree: DraftTree, factors: Tensor, aggregation: str = "lse", eta: float = 1.0
) -> Tensor:
    """The reward of one draft tree: an aggregation of its branch values (a 0-d tensor).

    `factors` [N] = p_T(node token | parent context) (e.g. `TreeScores.token_logprobs.exp()`).
    Branch value L_i = sum_{v on branch i} prod_{u on path(v)} p(u), the expected number of
    accepted tokens along root-to-leaf branch i (`decoding.acceptance`, the decoder's own
    definition). ``lse``: (1/eta) log sum_i exp(eta L_i), a smooth maximum with
    max_i L_i <= r <= max_i L_i + log(num_leaves) / eta; ``max``, ``mean``: ablations. A tree
    without nodes scores 0.
    """
    if factors.shape[0] == 0:
        return factors.new_zeros(())
    values = branch_values_from_factors(tree, factors)
    return tree_reward(values, aggregation, eta)  # type: ignore[arg-type]


def debiased_rewards(*, rewards: Tensor, reference_rewards: Tensor, enabled: bool = True) -> Tensor:
    """R = r - rbar: the tree reward of the current drafter minus the frozen reference's at the
    same prefix, so an advantage measures what training changed, not how easy the prefix is.
    `enabled=False` (the ablation) returns `rewards`."""
    if rewards.shape != reference_rewards.shape:
        raise ValueError(
            f"rewards {tuple(rewards.shape)} and reference {tuple(reference_rewards.shape)} differ"
        )
    return rewards - reference_rewards if enabled else rewards


def group_advantages(*, rewards: Tensor, delta: float = 1e-6) -> Tensor:
    """[G, m] group-standardised advantages (R - mean_group) / (std_group + delta).

    The standard deviation is the population one (over the m members). A group whose rewards
    are all equal carries no signal: its advantages are exactly 0. Groups of one (m = 1, the
    paper's no-grouping ablation) have nothing to standardise against: their advantage is the
    (debiased) reward itself.
    """
    if rewards.dim() != 2:
        raise ValueError(f"rewards must be [groups, m], got {tuple(rewards.shape)}")
    if rewards.shape[1] == 1:
        return rewards.clone()
    mean = rewards.mean(dim=1, keepdim=True)
    std = rewards.std(dim=1, correction=0, keepdim=True)
    return (rewards - mean) / (std + delta)


def sequence_ratio(*, logprobs: Tensor, reference_logprobs: Tensor, lengths: Tensor) -> Tensor:
    """[P] per-token geometric-mean ratio s = exp((log M(S) - log M0(S)) / max(l, 1)).

    `logprobs`, `reference_logprobs` [P, l] per-token log-probs of the longest accepted
    sequence S of each prefix under the current and the reference drafter (0 beyond `lengths`
    [P]). An empty S gives s = 1 (no gradient: nothing to reinforce or discourage).
    """
    width = logprobs.shape[1]
    valid = torch.arange(width, device=logprobs.device).unsqueeze(0) < lengths.unsqueeze(1)
    difference = torch.where(valid, logprobs - reference_logprobs, torch.zeros_like(logprobs))
    return torch.exp(difference.sum(dim=1) / lengths.clamp_min(1).to(logprobs.dtype))


def clipped_surrogate(
    *, ratio: Tensor, advantages: Tensor, eps: float = 0.2
) -> tuple[Tensor, Tensor]:
    """(L_GTO, clip fraction): -mean min(s A, clip(s, 1 - eps, 1 + eps) A) over prefixes.

    PPO's pessimistic bound: beyond the clip boundary in the direction the advantage pushes,
    the gradient is 0. The clip fraction counts prefixes where the clipped term is the active
    one (its share of the batch), a measure of how far the drafter has moved per step.
    """
    if ratio.shape != advantages.shape:
        raise ValueError(f"ratio {tuple(ratio.shape)} and advantages {tuple(advantages.shape)}")
    if ratio.numel() == 0:
        zero = ratio.sum() * 0.0
        return zero, zero.detach()
    clipped = ratio.clamp(1.0 - eps, 1.0 + eps)
    unclipped_term = ratio * advantages
    clipped_term = clipped * advantages
    loss = -torch.minimum(unclipped_term, clipped_term).mean()
    active = (clipped_term < unclipped_term).float().mean()
    return loss, active.detach()


# --------------------------------------------------------------------------------------------
# 6. Draft-OPD (docs/methods/draft-opd.md)
# --------------------------------------------------------------------------------------------
# Rows are log-probabilities over ONE vocabulary, the drafter's: `draft_logprobs` [..., V_d] are
# log q, `target_logprobs` [..., V_d] the target's log p at the same draft ids. Two conventions
# (a config field of the objective): "draft" renormalises p over the draft vocabulary (EAGLE-3's
# soft label, a true KL between two distributions), "full" keeps the target's full-vocabulary
# probabilities of those ids (sum <= 1): the mass on tokens the drafter cannot emit is a constant
# it cannot change, so it is left out of both sums.


def forward_kl_rows(*, target_logprobs: Tensor, draft_logprobs: Tensor) -> Tensor:
    """[...] sum_v p(v) (log p(v) - log q(v)): mass-covering, for tokens the target made."""
    log_p, log_q = target_logprobs.float(), draft_logprobs.float()
    p = log_p.exp()
    return torch.where(p > 0, p * (log_p - log_q), torch.zeros_like(p)).sum(dim=-1)


def reverse_kl_rows(*, target_logprobs: Tensor, draft_logprobs: Tensor) -> Tensor:
    """[...] sum_v q(v) (log q(v) - log p(v)): mode-seeking, pushes q off what p rejects."""
    log_p, log_q = target_logprobs.float(), draft_logprobs.float()
    q = log_q.exp()
    floor = torch.finfo(torch.float32).min / 4  # -inf log p (an off-support token) stays finite
    return torch.where(q > 0, q * (log_q - log_p.clamp_min(floor)), torch.zeros_like(q)).sum(-1)


def bernoulli_forward_kl(*, target_logprob: Tensor, draft_logprob: Tensor) -> Tensor:
    """[...] KL(Bern(p_x) || Bern(q_x)) on the realised token x: the per-token forward estimator
    (it sees only "x or not x", so it never exceeds the full forward KL)."""
    p = target_logprob.float().exp().clamp(1e-7, 1 - 1e-7)
    q = draft_logprob.float().exp().clamp(1e-7, 1 - 1e-7)
    return p * (torch.log(p) - torch.log(q)) + (1 - p) * (torch.log1p(-p) - torch.log1p(-q))


def k3_reverse_kl(*, target_logprob: Tensor, draft_logprob: Tensor, clamp: float = 10.0) -> Tensor:
    """[...] k3 = e^r - r - 1, r = log p(x) - log q(x), for x drawn from q: an unbiased,
    non-negative estimator of KL(q || p); r is clamped to [-clamp, clamp] so one token the
    target all but excludes cannot blow the step up."""
    r = (target_logprob.float() - draft_logprob.float()).clamp(-clamp, clamp)
    return torch.expm1(r) - r


def block_position_weights(*, depth: Tensor, gamma: float) -> Tensor:
    """[...] w_k = gamma^(k - 1) for a draft at position k >= 1 of its block: an error early in
    the block costs the whole rest of it, so it weighs most."""
    return torch.pow(torch.as_tensor(gamma, dtype=torch.float32), depth.float() - 1).clamp_max(1.0)


def draft_opd_loss(
    *,
    accepted_kl: Tensor,
    accepted_mask: Tensor,
    rejected_kl: Tensor,
    rejected_depth: Tensor,
    rejected_mask: Tensor,
    gamma: float = 0.8,
    lambda_accepted: float = 1.0,
    lambda_rejected: float = 1.0,
    normalization: str = "per_stream",
) -> tuple[Tensor, Tensor, Tensor]:
    """(L, L_acc, L_rej).

    ``per_stream``: L = (l_a L_acc + l_r L_rej) / (l_a + l_r) with L_acc the masked mean of the
    per-token forward KL over accepted tokens [...] and L_rej the masked mean of w_k * reverse
    KL over rejected tokens [...] (block positions `rejected_depth`, w_k = gamma^(k-1)).
    ``pooled`` (the reference code): every term in one weighted mean,
    L = (l_a sum_acc KL + l_r sum_rej w_k KL) / (l_a N_acc + l_r sum_rej w_k), so a block with
    many rejected slots weighs by its slots, not as much as all accepted tokens together.
    L_acc is the accepted stream's mean either way; L_rej its w-weighted mean when pooled (so
    L = (l_a N_acc L_acc + l_r sum w L_rej) / (l_a N_acc + l_r sum w)). A stream without tokens
    contributes 0. Lambdas of 0 give the all-forward / all-reverse ablations.
    """
    if lambda_accepted < 0 or lambda_rejected < 0 or lambda_accepted + lambda_rejected <= 0:
        raise ValueError("lambdas must be >= 0 and not both 0")
    if normalization not in ("per_stream", "pooled"):
        raise ValueError(f"normalization must be per_stream or pooled, got {normalization!r}")
    accepted = masked_mean(values=accepted_kl, mask=accepted_mask)
    weights = block_position_weights(depth=rejected_depth, gamma=gamma).to(rejected_kl.device)
    rejected = masked_mean(values=weights * rejected_kl, mask=rejected_mask)
    if normalization == "pooled":
        acc_mask, rej_mask = accepted_mask.float(), rejected_mask.float() * weights
        numerator = (
            lambda_accepted * (accepted_kl.float() * acc_mask).sum()
            + lambda_rejected * (rejected_kl.float() * rej_mask).sum()
        )
        denominator = lambda_accepted * acc_mask.sum() + lambda_rejected * rej_mask.sum()
        total = numerator / denominator.clamp_min(1e-12)
        # the rejected stream's own weighted mean, so total = (N_acc L_acc + sum w L_rej) / (...)
        rejected = (rejected_kl.float() * rej_mask).sum() / rej_mask.sum().clamp_min(1e-12)
        return total, accepted, rejected
    total = (lambda_accepted * accepted + lambda_rejected * rejected) / (
        lambda_accepted + lambda_rejected
    )
    return total, accepted, rejected


# --------------------------------------------------------------------------------------------
# 7. Preferences (docs/methods/onlinespec.md, the Online-LR variant)
# --------------------------------------------------------------------------------------------


def dpo_loss(
    *, chosen: Tensor, rejected: Tensor, ref_chosen: Tensor, ref_rejected: Tensor, beta: float
) -> Tensor:
    """Mean -log sigmoid(beta ((log pi(c) - log ref(c)) - (log pi(r) - log ref(r)))) over pairs
    [P] of log-probs: push the chosen (target) token up and the rejected draft down, relative to
    the reference, with beta bounding how far one round moves."""
    margin = (chosen - ref_chosen) - (rejected - ref_rejected)
    return -F.logsigmoid(beta * margin).mean()


# --------------------------------------------------------------------------------------------
# 8. Block drafters (DFlash: one forward drafts slots 1 .. S of a block)
# --------------------------------------------------------------------------------------------


def block_slot_decay(*, slots: int, gamma: float) -> Tensor:
    """[S] w_k = exp(-(k - 1) / gamma), k = 1 .. S: the DFlash paper's decay (gamma 7, 5, 4 for
    blocks of 16, 10, 8). A slot is only worth anything when every earlier slot was accepted."""
    if slots < 1 or gamma <= 0:
        raise ValueError(f"slots >= 1 and gamma > 0 required, got {slots}, {gamma}")
    return torch.exp(-torch.arange(slots, dtype=torch.float32) / gamma)


def expected_acceptance_weights(*, draft_logits: Tensor, target_probs: Tensor) -> Tensor:
    """[..., S] w_k = prod_{j < k} a_j with a_j = sum_v min(p_j(v), q_j(v)), no gradient.

    a_j is the chance that slot j's draft is accepted by sampling verification (1 - TV(p, q));
    w_k is then the chance the chain reaches slot k, i.e. how much slot k can add to the
    acceptance length. draft_logits [..., S, V], target_probs [..., S, V] (rows summing to 1).
    """
    with torch.no_grad():
        q = torch.softmax(draft_logits.float(), dim=-1)
        accept = torch.minimum(q, target_probs.float()).sum(dim=-1)  # [..., S]
        reach = torch.cumprod(accept, dim=-1)
        return torch.cat([torch.ones_like(reach[..., :1]), reach[..., :-1]], dim=-1)


def block_cross_entropy(
    *, logits: Tensor, target_probs: Tensor, weights: Tensor, mask: Tensor
) -> tuple[Tensor, Tensor]:
    """(weighted loss, per-slot losses [S]) of soft cross-entropy per block slot.

    logits/target_probs [A, S, V], weights [S] or [A, S], mask [A, S] (valid slots). The loss is
    sum(w * mask * H) / sum(w * mask): the weights only say how much each slot counts relative
    to the others; an empty mask gives 0. Per-slot losses are unweighted masked means.
    """
    log_q = F.log_softmax(logits.float(), dim=-1)
    per_slot = -(target_probs.float() * log_q).sum(dim=-1)  # [A, S]
    return block_weighted_mean(per_slot=per_slot, weights=weights, mask=mask)


def block_weighted_mean(
    *, per_slot: Tensor, weights: Tensor, mask: Tensor
) -> tuple[Tensor, Tensor]:
    """(weighted loss, per-slot losses [S]) of any per-slot loss rows `per_slot` [A, S].

    The loss is sum(w * mask * l) / sum(w * mask) with weights [S] or [A, S] and mask [A, S];
    an empty mask gives 0. Per-slot losses are unweighted masked means. `block_cross_entropy`
    is this reduction over soft cross-entropy rows; the LK losses reuse it unchanged.
    """
    valid = mask.float()
    weighted = weights.to(per_slot.device).float().expand_as(per_slot) * valid
    total = (weighted * per_slot).sum() / weighted.sum().clamp_min(1e-12)
    slots = torch.stack(
        [masked_mean(values=per_slot[:, k], mask=valid[:, k]) for k in range(per_slot.shape[1])]
    )
    return total, slots


# --------------------------------------------------------------------------------------------
# 9. Acceptance-aligned losses (docs/training.md, "Loss options")
# --------------------------------------------------------------------------------------------
# KL and cross-entropy are proxies: what speculative sampling rewards is the overlap
# alpha = sum_v min(p(v), q(v)) = 1 - TV(p, q), the chance a draft from q is accepted by the
# target p. The LK losses (Samarin et al., "LK Losses: Direct Acceptance Rate Optimization for
# Speculative Decoding", arXiv 2602.23881) optimise alpha itself. D-PACE (arXiv 2605.18810)
# instead reweights a block drafter's slots by how much each one can still add to the expected
# accepted length. p is always the target's distribution over the draft vocabulary, the soft
# label SFT already computes.

SFT_LOSSES = ("soft_ce", "kl", "lk_alpha", "lk_lambda")
"""Per-position losses of `SFT` (`loss:`): soft cross-entropy H(p, q) (the default, EAGLE-3's),
forward KL(p || q) (same gradient, 0 at q = p), LK^alpha = -log alpha, LK^lambda (a KL / TV
blend driven by alpha)."""

LK_EPS = 1e-6
"""Floor of alpha under the log of LK^alpha: disjoint supports give a finite loss."""


def _at_least_float32(tensor: Tensor) -> torch.dtype:
    """float32 for half-precision inputs, float64 kept (so gradcheck can run in float64)."""
    return torch.promote_types(tensor.dtype, torch.float32)


def acceptance_rate_rows(*, draft_logits: Tensor, target_probs: Tensor) -> Tensor:
    """[...] alpha = sum_v min(p(v), q(v)), q = softmax(`draft_logits` [..., V]), p =
    `target_probs` [..., V]: the chance that a token drafted from q passes speculative sampling
    against p (1 - total variation). Differentiable in the logits (unlike
    `expected_acceptance_weights`, which is a detached weight)."""
    q = torch.softmax(draft_logits.to(_at_least_float32(draft_logits)), dim=-1)  # [..., V]
    return torch.minimum(q, target_probs.to(q.dtype)).sum(dim=-1)


def kl_rows(*, draft_logits: Tensor, target_probs: Tensor) -> Tensor:
    """[...] forward KL(p || q) per position (0 where p = q; terms with p(v) = 0 are 0)."""
    log_q = F.log_softmax(draft_logits.to(_at_least_float32(draft_logits)), dim=-1)  # [..., V]
    p = target_probs.to(log_q.dtype)
    log_p = torch.log(p.clamp_min(torch.finfo(log_q.dtype).tiny))
    return torch.where(p > 0, p * (log_p - log_q), torch.zeros_like(p)).sum(dim=-1)


def lk_alpha_rows(*, draft_logits: Tensor, target_probs: Tensor, eps: float = LK_EPS) -> Tensor:
    """[...] LK^alpha = -log max(alpha, eps) per position. Its gradient is grad(TV) / alpha:
    the 1 / alpha factor keeps the signal strong when the overlap is small (a cold start),
    where 1 - alpha alone barely moves; for a one-hot p it is the cross-entropy."""
    alpha = acceptance_rate_rows(draft_logits=draft_logits, target_probs=target_probs)
    return -torch.log(alpha.clamp_min(eps))


def lk_lambda_weight(*, alpha: Tensor, kl_scale: float = 1.0, kl_decay: float = 3.0) -> Tensor:
    """[...] w = kl_scale * exp(-kl_decay * alpha), detached: the KL share of LK^lambda. Near 1
    at a small overlap (KL's strong gradient pulls the drafter in) and kl_scale * exp(-kl_decay)
    at alpha = 1 (mostly the acceptance term). kl_decay 3 is the paper's best setting (eta = 3)."""
    return kl_scale * torch.exp(-kl_decay * alpha.detach())


def lk_lambda_rows(
    *, draft_logits: Tensor, target_probs: Tensor, kl_scale: float = 1.0, kl_decay: float = 3.0
) -> Tensor:
    """[...] LK^lambda = w KL(p || q) + (1 - w) (1 - alpha) per position, w from
    `lk_lambda_weight` (a constant in the gradient). The blend is per position, as in vLLM
    speculators' version (SpecForge blends the batch means of KL and alpha instead). With
    kl_scale > 1, 1 - w is negative at small alpha: the blend is then no longer convex."""
    alpha = acceptance_rate_rows(draft_logits=draft_logits, target_probs=target_probs)
    weight = lk_lambda_weight(alpha=alpha, kl_scale=kl_scale, kl_decay=kl_decay)
    kl = kl_rows(draft_logits=draft_logits, target_probs=target_probs)
    return weight * kl + (1.0 - weight) * (1.0 - alpha)


def distribution_loss_rows(
    *,
    loss: str,
    draft_logits: Tensor,
    target_probs: Tensor,
    kl_scale: float = 1.0,
    kl_decay: float = 3.0,
) -> Tensor:
    """[...] the per-position loss `loss` (one of `SFT_LOSSES`) of draft logits [..., V]
    against the target's probabilities [..., V]; the objectives reduce it (masked mean per TTT
    step, weighted mean over block slots)."""
    if loss == "soft_ce":
        log_q = F.log_softmax(draft_logits.float(), dim=-1)
        return -(target_probs.float() * log_q).sum(dim=-1)
    if loss == "kl":
        return kl_rows(draft_logits=draft_logits, target_probs=target_probs)
    if loss == "lk_alpha":
        return lk_alpha_rows(draft_logits=draft_logits, target_probs=target_probs)
    if loss == "lk_lambda":
        return lk_lambda_rows(
            draft_logits=draft_logits,
            target_probs=target_probs,
            kl_scale=kl_scale,
            kl_decay=kl_decay,
        )
    raise ValueError(f"loss must be one of {SFT_LOSSES}, got {loss!r}")


def lk_alpha_loss(
    *, draft_logits: Tensor, target_probs: Tensor, mask: Tensor, eps: float = LK_EPS
) -> Tensor:
    """Masked mean of LK^alpha over positions [...] (`lk_alpha_rows`); 0 for an empty mask."""
    rows = lk_alpha_rows(draft_logits=draft_logits, target_probs=target_probs, eps=eps)
    return masked_mean(values=rows, mask=mask)


def lk_lambda_loss(
    *,
    draft_logits: Tensor,
    target_probs: Tensor,
    mask: Tensor,
    kl_scale: float = 1.0,
    kl_decay: float = 3.0,
) -> Tensor:
    """Masked mean of LK^lambda over positions [...] (`lk_lambda_rows`); 0 for an empty mask."""
    rows = lk_lambda_rows(
        draft_logits=draft_logits, target_probs=target_probs, kl_scale=kl_scale, kl_decay=kl_decay
    )
    return masked_mean(values=rows, mask=mask)


def dpace_weights(*, confidence: Tensor, mask: Tensor | None = None, alpha: float = 0.5) -> Tensor:
    """[..., S] D-PACE slot weights, no gradient (arXiv 2605.18810, Eqs. 7-8; SpecForge #578).

    confidence [..., S]: the drafter's confidence q_k in slot k's label, exp(-CE_k) (the
    paper's q_k = q(x_k) for a hard label; for our soft labels exp(-H(p_k, q_k))). Smoothed
    c_k = (1 - alpha) q_k + alpha (Eq. 7), then w_j = sum_{m >= j} prod_{i <= m} c_i (Eq. 8):
    the derivative of the expected accepted length sum_m prod_{i <= m} c_i with respect to
    log c_j, i.e. how much slot j can still add. Unlike the fixed decay, the weight moves to
    later slots as the early ones become reliable. Masked slots (`mask` [..., S] false: past
    the sequence, not an assistant token) pass through (c = 1) and add no term of their own,
    as SpecForge #578 treats them.

    Two differences from the paper and SpecForge, both ours: the confidence of a soft label is
    exp(-H(p, q)) (theirs: q of the data's next token, hard cross-entropy), and the block
    objective divides by the weight mass, sum(w * mask * loss) / sum(w * mask), as it does
    for every `block_weighting` (theirs: sum(w * mask * loss) over a sequence's blocks, so the
    loss scale grows as the drafter improves). The shape of the weights over the slots is the
    paper's; their overall scale is not.
    """
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"dpace alpha must be in [0, 1], got {alpha}")
    with torch.no_grad():
        smoothed = (1.0 - alpha) * confidence.float() + alpha  # [..., S]
        valid = torch.ones_like(smoothed) if mask is None else mask.to(smoothed.dtype)
        smoothed = torch.where(valid > 0, smoothed, torch.ones_like(smoothed))
        reach = torch.cumprod(smoothed, dim=-1) * valid  # prod_{i <= m} c_i, 0 where masked
        return reach.flip(-1).cumsum(dim=-1).flip(-1)
