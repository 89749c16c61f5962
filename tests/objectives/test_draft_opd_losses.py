"""Draft-OPD's pure functions (objectives/losses.py section 6) on hand-made tensors."""

from __future__ import annotations

import math

import pytest
import torch

from lightning_spec.objectives import losses


def _log(values: list[float]) -> torch.Tensor:
    return torch.log(torch.tensor(values))


def test_kl_directions_and_values_by_hand() -> None:
    p, q = [0.5, 0.25, 0.25], [0.25, 0.5, 0.25]
    forward = 0.5 * math.log(2) + 0.25 * math.log(0.5)
    reverse = 0.25 * math.log(0.5) + 0.5 * math.log(2)
    got_forward = losses.forward_kl_rows(target_logprobs=_log(p), draft_logprobs=_log(q))
    got_reverse = losses.reverse_kl_rows(target_logprobs=_log(p), draft_logprobs=_log(q))
    assert float(got_forward) == pytest.approx(forward)
    assert float(got_reverse) == pytest.approx(reverse)
    # asymmetric on a skewed pair: forward punishes q missing p's mass, reverse the opposite
    p2, q2 = [0.9, 0.1], [0.5, 0.5]
    f2 = float(losses.forward_kl_rows(target_logprobs=_log(p2), draft_logprobs=_log(q2)))
    r2 = float(losses.reverse_kl_rows(target_logprobs=_log(p2), draft_logprobs=_log(q2)))
    assert f2 == pytest.approx(0.9 * math.log(1.8) + 0.1 * math.log(0.2))
    assert r2 == pytest.approx(0.5 * math.log(0.5 / 0.9) + 0.5 * math.log(5.0))
    assert f2 != pytest.approx(r2)
    same = losses.forward_kl_rows(target_logprobs=_log(p), draft_logprobs=_log(p))
    assert float(same) == pytest.approx(0.0, abs=1e-7)


def test_zero_probabilities_and_the_full_vocabulary_convention() -> None:
    # p puts no mass on token 2: its term is 0 in the forward KL (0 log 0 = 0)
    p = torch.tensor([0.5, 0.5, 0.0]).log()
    q = _log([0.4, 0.4, 0.2])
    assert float(losses.forward_kl_rows(target_logprobs=p, draft_logprobs=q)) == pytest.approx(
        math.log(1.25)
    )
    # reverse KL with p = 0 where q > 0 is huge but finite (no NaN in a training step)
    reverse = losses.reverse_kl_rows(target_logprobs=p, draft_logprobs=q)
    assert torch.isfinite(reverse) and float(reverse) > 1e30
    # "full" convention: p sums to < 1 over the draft ids; the off-vocabulary mass is left out
    full = _log([0.3, 0.2])  # 0.5 of the target's mass lies outside the draft vocabulary
    got = losses.forward_kl_rows(target_logprobs=full, draft_logprobs=_log([0.6, 0.4]))
    assert float(got) == pytest.approx(0.3 * math.log(0.5) + 0.2 * math.log(0.5))


def test_position_weights() -> None:
    depth = torch.tensor([1, 2, 3, 5])
    weights = losses.block_position_weights(depth=depth, gamma=0.8)
    torch.testing.assert_close(weights, torch.tensor([1.0, 0.8, 0.64, 0.8**4]))
    flat = losses.block_position_weights(depth=depth, gamma=1.0)
    assert torch.equal(flat, torch.ones(4))


def test_combined_loss_masks_weights_and_lambdas() -> None:
    accepted_kl = torch.tensor([[0.2, 0.4, 9.0]])
    accepted_mask = torch.tensor([[1, 1, 0]])
    rejected_kl = torch.tensor([[1.0, 2.0, 7.0]])
    rejected_depth = torch.tensor([[1, 3, 2]])
    rejected_mask = torch.tensor([[1, 1, 0]])
    total, acc, rej = losses.draft_opd_loss(
        accepted_kl=accepted_kl,
        accepted_mask=accepted_mask,
        rejected_kl=rejected_kl,
        rejected_depth=rejected_depth,
        rejected_mask=rejected_mask,
        gamma=0.5,
    )
    assert float(acc) == pytest.approx(0.3)
    assert float(rej) == pytest.approx((1.0 * 1.0 + 0.25 * 2.0) / 2)
    assert float(total) == pytest.approx((0.3 + 0.75) / 2)
    forward_only, _, _ = losses.draft_opd_loss(
        accepted_kl=accepted_kl,
        accepted_mask=accepted_mask,
        rejected_kl=rejected_kl,
        rejected_depth=rejected_depth,
        rejected_mask=rejected_mask,
        lambda_rejected=0.0,
    )
    assert float(forward_only) == pytest.approx(0.3)
    empty, _, empty_rej = losses.draft_opd_loss(
        accepted_kl=accepted_kl,
        accepted_mask=accepted_mask,
        rejected_kl=rejected_kl,
        rejected_depth=rejected_depth,
        rejected_mask=torch.zeros_like(rejected_mask),
    )
    assert float(empty_rej) == 0.0 and float(empty) == pytest.approx(0.15)
    with pytest.raises(ValueError, match="lambdas"):
        losses.draft_opd_loss(
            accepted_kl=accepted_kl,
            accepted_mask=accepted_mask,
            rejected_kl=rejected_kl,
            rejected_depth=rejected_depth,
            rejected_mask=rejected_mask,
            lambda_accepted=0.0,
            lambda_rejected=0.0,
        )


def test_k3_is_an_unbiased_estimate_of_the_reverse_kl() -> None:
    """E_{x ~ q}[k3(x)] = KL(q || p), by sampling; k3 >= 0 everywhere."""
    generator = torch.Generator().manual_seed(0)
    for _ in range(5):
        p = torch.softmax(torch.randn(12, generator=generator), -1)
        q = torch.softmax(torch.randn(12, generator=generator), -1)
        draws = torch.multinomial(q, 200_000, replacement=True, generator=generator)
        estimates = losses.k3_reverse_kl(
            target_logprob=p.log()[draws], draft_logprob=q.log()[draws], clamp=50.0
        )
        exact = float(losses.reverse_kl_rows(target_logprobs=p.log(), draft_logprobs=q.log()))
        error = 4 * float(estimates.std()) / math.sqrt(draws.numel())
        assert float(estimates.mean()) == pytest.approx(exact, abs=error)
        assert float(estimates.min()) >= 0.0


def test_bernoulli_forward_estimator_is_a_lower_bound_of_the_forward_kl() -> None:
    """Coarse-graining to {x, not x} never increases a KL: the per-token estimator is <= the
    exact forward KL for every realised token, and 0 when the token's two probabilities agree."""
    generator = torch.Generator().manual_seed(1)
    for _ in range(5):
        p = torch.softmax(torch.randn(10, generator=generator) * 2, -1)
        q = torch.softmax(torch.randn(10, generator=generator) * 2, -1)
        exact = float(losses.forward_kl_rows(target_logprobs=p.log(), draft_logprobs=q.log()))
        per_token = losses.bernoulli_forward_kl(target_logprob=p.log(), draft_logprob=q.log())
        assert bool((per_token <= exact + 1e-6).all()) and bool((per_token >= -1e-7).all())
    equal = losses.bernoulli_forward_kl(
        target_logprob=torch.tensor(0.3).log(), draft_logprob=torch.tensor(0.3).log()
    )
    assert float(equal) == pytest.approx(0.0, abs=1e-6)


def test_k3_clamp_bounds_a_token_the_target_excludes() -> None:
    bounded = losses.k3_reverse_kl(
        target_logprob=torch.tensor(-80.0), draft_logprob=torch.tensor(-0.1), clamp=10.0
    )
    assert float(bounded) == pytest.approx(math.exp(-10.0) + 10.0 - 1.0)


def test_pooled_normalisation_weighs_every_term_once() -> None:
    """The reference's (sum_acc KL + sum_rej w KL) / (N_acc + sum_rej w) on hand-made terms."""
    total, acc, rej = losses.draft_opd_loss(
        accepted_kl=torch.tensor([0.2, 0.4, 9.0]),
        accepted_mask=torch.tensor([1, 1, 0]),
        rejected_kl=torch.tensor([1.0, 2.0, 7.0]),
        rejected_depth=torch.tensor([1, 3, 2]),
        rejected_mask=torch.tensor([1, 1, 0]),
        gamma=0.5,
        normalization="pooled",
    )
    assert float(total) == pytest.approx((0.2 + 0.4 + 1.0 * 1.0 + 0.25 * 2.0) / (2 + 1.0 + 0.25))
    assert float(acc) == pytest.approx(0.3)
    assert float(rej) == pytest.approx((1.0 * 1.0 + 0.25 * 2.0) / 1.25)  # its weighted mean
    only_forward, _, _ = losses.draft_opd_loss(
        accepted_kl=torch.tensor([0.2, 0.4]), accepted_mask=torch.ones(2),
        rejected_kl=torch.tensor([5.0]), rejected_depth=torch.tensor([1]),
        rejected_mask=torch.ones(1), lambda_rejected=0.0, normalization="pooled",
    )
    assert float(only_forward) == pytest.approx(0.3)
    with pytest.raises(ValueError, match="normalization"):
        losses.draft_opd_loss(
            accepted_kl=torch.zeros(1), accepted_mask=torch.zeros(1), rejected_kl=torch.zeros(1),
            rejected_depth=torch.ones(1), rejected_mask=torch.zeros(1), normalization="mean",
        )
