"""Pure losses on hand-made tensors: closed forms written out, plus property checks."""

from __future__ import annotations

import math

import pytest
import torch

from lightning_spec.objectives import losses


def test_masked_mean_by_hand() -> None:
    values = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    mask = torch.tensor([[1, 0, 1], [0, 0, 1]])
    # (1 + 3 + 6) / 3
    assert losses.masked_mean(values=values, mask=mask).item() == pytest.approx(10.0 / 3.0)
    # A float mask weights positions: (0.5 * 2 + 1 * 4) / 1.5
    weights = torch.tensor([[0.0, 0.5, 0.0], [1.0, 0.0, 0.0]])
    assert losses.masked_mean(values=values, mask=weights).item() == pytest.approx(5.0 / 1.5)


def test_masked_mean_empty_mask_is_zero_and_differentiable() -> None:
    finite = torch.tensor([1.0, 2.0], requires_grad=True)
    out = losses.masked_mean(values=finite, mask=torch.zeros(2))
    assert out.item() == 0.0
    out.backward()
    assert finite.grad is not None and torch.equal(finite.grad, torch.zeros(2))


def test_soft_cross_entropy_by_hand() -> None:
    # q = softmax([0, ln 3]) = [1/4, 3/4]; p = [1/2, 1/2]
    logits = torch.tensor([[0.0, math.log(3.0)]])
    p = torch.tensor([[0.5, 0.5]])
    expected = -(0.5 * math.log(0.25) + 0.5 * math.log(0.75))
    loss = losses.soft_cross_entropy(logits=logits, target_probs=p, mask=torch.ones(1))
    assert loss.item() == pytest.approx(expected, rel=1e-6)
    # Forward KL = H(p, q) - H(p) = expected - ln 2
    kl = losses.kl_divergence(logits=logits, target_probs=p, mask=torch.ones(1))
    assert kl.item() == pytest.approx(expected - math.log(2.0), rel=1e-5)


def test_soft_cross_entropy_minimal_at_equality() -> None:
    generator = torch.Generator().manual_seed(0)
    target_logits = torch.randn(4, 6, generator=generator)
    p = torch.softmax(target_logits, dim=-1)
    mask = torch.ones(4)
    entropy = -(p * p.log()).sum(-1).mean()
    at_p = losses.soft_cross_entropy(logits=target_logits, target_probs=p, mask=mask)
    assert at_p.item() == pytest.approx(entropy.item(), rel=1e-6)
    assert losses.kl_divergence(
        logits=target_logits, target_probs=p, mask=mask
    ).item() == pytest.approx(0.0, abs=1e-6)
    for _ in range(5):
        other = target_logits + 0.5 * torch.randn(4, 6, generator=generator)
        assert losses.soft_cross_entropy(logits=other, target_probs=p, mask=mask) > at_p
    # The gradient at q = p is zero (softmax - p).
    logits = target_logits.clone().requires_grad_()
    losses.soft_cross_entropy(logits=logits, target_probs=p, mask=mask).backward()
    assert logits.grad.abs().max().item() < 1e-6


def test_masked_positions_have_no_effect() -> None:
    generator = torch.Generator().manual_seed(1)
    logits = torch.randn(2, 5, 7, generator=generator)
    p = torch.softmax(torch.randn(2, 5, 7, generator=generator), dim=-1)
    mask = torch.tensor([[1, 1, 0, 1, 0], [0, 1, 1, 0, 0]], dtype=torch.float32)
    base = losses.soft_cross_entropy(logits=logits, target_probs=p, mask=mask)
    changed_logits, changed_p = logits.clone(), p.clone()
    off = mask == 0
    changed_logits[off] = 100.0 * torch.randn(int(off.sum()), 7, generator=generator)
    changed_p[off] = torch.softmax(torch.randn(int(off.sum()), 7, generator=generator), dim=-1)
    again = losses.soft_cross_entropy(logits=changed_logits, target_probs=changed_p, mask=mask)
    torch.testing.assert_close(again, base)
    # And masked positions get no gradient.
    leaf = logits.clone().requires_grad_()
    losses.soft_cross_entropy(logits=leaf, target_probs=p, mask=mask).backward()
    assert leaf.grad[off].abs().max().item() == 0.0


def test_soft_cross_entropy_matches_naive_loop() -> None:
    generator = torch.Generator().manual_seed(2)
    logits = torch.randn(3, 4, 9, generator=generator)
    p = torch.softmax(2 * torch.randn(3, 4, 9, generator=generator), dim=-1)
    mask = (torch.rand(3, 4, generator=generator) > 0.4).float()
    total, count = 0.0, 0
    for b in range(3):
        for t in range(4):
            if mask[b, t]:
                row = logits[b, t].tolist()
                norm = math.log(sum(math.exp(v) for v in row))
                total += -sum(p[b, t, v].item() * (row[v] - norm) for v in range(9))
                count += 1
    expected = total / count
    got = losses.soft_cross_entropy(logits=logits, target_probs=p, mask=mask)
    assert got.item() == pytest.approx(expected, rel=1e-5)
    # bf16 logits are promoted to float32 inside.
    low = losses.soft_cross_entropy(logits=logits.bfloat16(), target_probs=p, mask=mask)
    assert low.dtype == torch.float32 and low.item() == pytest.approx(expected, rel=2e-2)


def test_restrict_to_draft_vocab_renormalises_the_subset() -> None:
    target_logits = torch.log(torch.tensor([[0.1, 0.2, 0.3, 0.4]]))
    draft_ids = torch.tensor([1, 3])  # draft id 0 -> target 1, draft id 1 -> target 3
    restricted = losses.restrict_to_draft_vocab(target_logits=target_logits, draft_ids=draft_ids)
    # softmax over {0.2, 0.4} = {1/3, 2/3}
    torch.testing.assert_close(torch.softmax(restricted, -1), torch.tensor([[1 / 3, 2 / 3]]))
    same = losses.restrict_to_draft_vocab(target_logits=target_logits, draft_ids=None)
    assert same is target_logits


def test_top1_matches_maps_draft_ids_to_target_ids() -> None:
    draft_logits = torch.tensor([[0.0, 5.0], [3.0, 1.0], [0.0, 1.0]])  # argmax: 1, 0, 1
    draft_ids = torch.tensor([4, 7])  # -> target ids 7, 4, 7
    target_argmax = torch.tensor([7, 7, 2])  # the last is outside the draft vocabulary
    matches = losses.top1_matches(
        draft_logits=draft_logits, target_argmax=target_argmax, draft_ids=draft_ids
    )
    assert matches.tolist() == [True, False, False]
    plain = losses.top1_matches(draft_logits=draft_logits, target_argmax=torch.tensor([1, 0, 0]))
    assert plain.tolist() == [True, True, False]


def test_ttt_weighting_by_hand() -> None:
    torch.testing.assert_close(
        losses.ttt_weights(steps=3, decay=0.8), torch.tensor([1.0, 0.8, 0.64])
    )
    step_losses = torch.tensor([2.0, 1.0, 0.5])
    # 2 + 0.8 * 1 + 0.64 * 0.5
    assert losses.ttt_total_loss(step_losses=step_losses, decay=0.8).item() == pytest.approx(3.12)
    with pytest.raises(ValueError):
        losses.ttt_weights(steps=0, decay=0.8)
