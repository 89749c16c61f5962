"""The acceptance-aligned losses on hand-made tensors: LK^alpha and LK^lambda (arXiv
2602.23881), D-PACE slot weights (arXiv 2605.18810), and their wiring into the TTT and block
objectives (the default soft cross-entropy unchanged, every option trains)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from lightning_spec.objectives import losses


def _logits(probs: list[list[float]]) -> torch.Tensor:
    """Logits whose softmax is `probs` (0 becomes a probability of about 1e-30)."""
    return torch.log(torch.tensor(probs, dtype=torch.float64) + 1e-30)


# ------------------------------------------------------------------------------ alpha
def test_alpha_of_identical_distributions_is_one_and_of_disjoint_ones_zero() -> None:
    p = torch.tensor([[0.2, 0.3, 0.5], [1.0, 0.0, 0.0]], dtype=torch.float64)
    same = losses.acceptance_rate_rows(draft_logits=torch.log(p + 1e-30), target_probs=p)
    torch.testing.assert_close(same, torch.ones(2, dtype=torch.float64), atol=1e-12, rtol=0)
    disjoint = losses.acceptance_rate_rows(
        draft_logits=_logits([[0.0, 0.0, 1.0]]), target_probs=torch.tensor([[0.5, 0.5, 0.0]])
    )
    assert float(disjoint) == pytest.approx(0.0, abs=1e-12)


def test_alpha_is_one_minus_total_variation_by_hand() -> None:
    p = torch.tensor([0.5, 0.3, 0.2], dtype=torch.float64)
    q = torch.tensor([0.2, 0.2, 0.6], dtype=torch.float64)
    # min: 0.2 + 0.2 + 0.2 = 0.6; TV = (0.3 + 0.1 + 0.4) / 2 = 0.4
    alpha = losses.acceptance_rate_rows(draft_logits=torch.log(q), target_probs=p)
    assert float(alpha) == pytest.approx(0.6, abs=1e-9)
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(5, 7, generator=generator, dtype=torch.float64)
    target = torch.softmax(torch.randn(5, 7, generator=generator, dtype=torch.float64), -1)
    tv = 0.5 * (torch.softmax(logits, -1) - target).abs().sum(-1)
    rows = losses.acceptance_rate_rows(draft_logits=logits, target_probs=target)
    torch.testing.assert_close(rows, (1 - tv).to(rows.dtype))


# ------------------------------------------------------------------------------ LK^alpha
def test_lk_alpha_by_hand_and_its_floor() -> None:
    p = torch.tensor([0.5, 0.3, 0.2], dtype=torch.float64)
    q = torch.tensor([0.2, 0.2, 0.6], dtype=torch.float64)
    rows = losses.lk_alpha_rows(draft_logits=torch.log(q), target_probs=p)
    assert float(rows) == pytest.approx(-math.log(0.6), abs=1e-9)
    same = losses.lk_alpha_rows(draft_logits=torch.log(p), target_probs=p)
    assert float(same) == pytest.approx(0.0, abs=1e-9)
    disjoint = losses.lk_alpha_rows(
        draft_logits=_logits([[0.0, 1.0]]), target_probs=torch.tensor([[1.0, 0.0]])
    )
    assert float(disjoint) == pytest.approx(-math.log(losses.LK_EPS), rel=1e-6)


def test_lk_alpha_of_a_one_hot_target_is_the_cross_entropy() -> None:
    logits = torch.tensor([[0.3, -1.0, 2.0]], dtype=torch.float64)
    onehot = torch.tensor([[0.0, 1.0, 0.0]], dtype=torch.float64)
    rows = losses.lk_alpha_rows(draft_logits=logits, target_probs=onehot)
    expected = F.cross_entropy(logits, torch.tensor([1]), reduction="none")
    torch.testing.assert_close(rows, expected)


def test_lk_alpha_gradient_matches_finite_differences() -> None:
    generator = torch.Generator().manual_seed(3)
    logits = torch.randn(3, 5, generator=generator, dtype=torch.float64, requires_grad=True)
    target = torch.softmax(torch.randn(3, 5, generator=generator, dtype=torch.float64), -1)
    q = torch.softmax(logits.detach(), -1)
    assert float((q - target).abs().min()) > 1e-3  # no ties: min() is differentiable here

    def loss(x: torch.Tensor) -> torch.Tensor:
        return losses.lk_alpha_rows(draft_logits=x, target_probs=target)

    assert torch.autograd.gradcheck(loss, (logits,), eps=1e-6, atol=1e-6)


# ------------------------------------------------------------------------------ LK^lambda
def test_lk_lambda_weight_as_defined() -> None:
    alpha = torch.tensor([0.0, 0.5, 1.0])
    weight = losses.lk_lambda_weight(alpha=alpha, kl_scale=2.0, kl_decay=3.0)
    torch.testing.assert_close(weight, 2.0 * torch.exp(-3.0 * alpha))
    assert float(weight[-1]) == pytest.approx(2.0 * math.exp(-3.0))
    grad_alpha = alpha.clone().requires_grad_(True)
    assert not losses.lk_lambda_weight(alpha=grad_alpha).requires_grad  # a constant


def test_lk_lambda_by_hand_and_with_a_detached_weight() -> None:
    p = torch.tensor([0.5, 0.3, 0.2], dtype=torch.float64)
    q = torch.tensor([0.2, 0.2, 0.6], dtype=torch.float64)
    logits = torch.log(q).requires_grad_(True)
    rows = losses.lk_lambda_rows(draft_logits=logits, target_probs=p, kl_scale=1.0, kl_decay=3.0)
    kl = float((p * (p / q).log()).sum())
    weight = math.exp(-3.0 * 0.6)
    assert float(rows.detach()) == pytest.approx(weight * kl + (1 - weight) * 0.4, abs=1e-9)
    # the gradient is w grad KL + (1 - w) grad(1 - alpha), w held fixed
    rows.backward()
    kl_logits = torch.log(q).requires_grad_(True)
    (weight * losses.kl_rows(draft_logits=kl_logits, target_probs=p)).backward()
    tv_logits = torch.log(q).requires_grad_(True)
    (
        (1 - weight) * (1 - losses.acceptance_rate_rows(draft_logits=tv_logits, target_probs=p))
    ).backward()
    torch.testing.assert_close(logits.grad, (kl_logits.grad + tv_logits.grad).to(logits.grad.dtype))


def test_lk_lambda_of_identical_distributions_is_zero() -> None:
    p = torch.tensor([[0.1, 0.6, 0.3]], dtype=torch.float64)
    rows = losses.lk_lambda_rows(draft_logits=torch.log(p), target_probs=p)
    assert float(rows) == pytest.approx(0.0, abs=1e-9)


# ------------------------------------------------------------------------------ reductions
@pytest.mark.parametrize("loss", losses.SFT_LOSSES)
def test_masked_positions_contribute_nothing(loss: str) -> None:
    generator = torch.Generator().manual_seed(5)
    logits = torch.randn(2, 3, 6, generator=generator, requires_grad=True)
    target = torch.softmax(torch.randn(2, 3, 6, generator=generator), -1)
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    rows = losses.distribution_loss_rows(loss=loss, draft_logits=logits, target_probs=target)
    value = losses.masked_mean(values=rows, mask=mask)
    garbage = logits.detach().clone()
    garbage[mask == 0] = 50.0 * torch.randn(3, 6, generator=generator)
    garbage.requires_grad_(True)
    rows_g = losses.distribution_loss_rows(loss=loss, draft_logits=garbage, target_probs=target)
    torch.testing.assert_close(losses.masked_mean(values=rows_g, mask=mask), value)
    value.backward()
    assert float(logits.grad[mask == 0].abs().max()) == 0.0


def test_the_wrappers_are_masked_means_and_unknown_losses_fail() -> None:
    generator = torch.Generator().manual_seed(6)
    logits = torch.randn(4, 5, generator=generator)
    target = torch.softmax(torch.randn(4, 5, generator=generator), -1)
    mask = torch.tensor([1.0, 0.0, 1.0, 1.0])
    alpha_rows = losses.lk_alpha_rows(draft_logits=logits, target_probs=target)
    torch.testing.assert_close(
        losses.lk_alpha_loss(draft_logits=logits, target_probs=target, mask=mask),
        alpha_rows[mask > 0].mean(),
    )
    lambda_rows = losses.lk_lambda_rows(draft_logits=logits, target_probs=target)
    torch.testing.assert_close(
        losses.lk_lambda_loss(draft_logits=logits, target_probs=target, mask=mask),
        lambda_rows[mask > 0].mean(),
    )
    empty = losses.lk_alpha_loss(draft_logits=logits, target_probs=target, mask=torch.zeros(4))
    assert float(empty) == 0.0
    soft = losses.distribution_loss_rows(loss="soft_ce", draft_logits=logits, target_probs=target)
    torch.testing.assert_close(
        losses.masked_mean(values=soft, mask=mask),
        losses.soft_cross_entropy(logits=logits, target_probs=target, mask=mask),
    )
    kl = losses.distribution_loss_rows(loss="kl", draft_logits=logits, target_probs=target)
    torch.testing.assert_close(
        losses.masked_mean(values=kl, mask=mask),
        losses.kl_divergence(logits=logits, target_probs=target, mask=mask),
    )
    with pytest.raises(ValueError, match="loss must be one of"):
        losses.distribution_loss_rows(loss="tv", draft_logits=logits, target_probs=target)


# ------------------------------------------------------------------------------ D-PACE
def test_dpace_weights_closed_form() -> None:
    confidence = torch.tensor([[0.8, 0.4, 0.6]])
    weights = losses.dpace_weights(confidence=confidence, alpha=0.5)
    c1, c2, c3 = 0.9, 0.7, 0.8  # (1 - 0.5) q + 0.5
    r1, r2, r3 = c1, c1 * c2, c1 * c2 * c3  # prefix products: reaching and passing slot m
    expected = torch.tensor([[r1 + r2 + r3, r2 + r3, r3]])
    torch.testing.assert_close(weights, expected)
    unsmoothed = losses.dpace_weights(confidence=confidence, alpha=0.0)
    torch.testing.assert_close(
        unsmoothed, torch.tensor([[0.8 + 0.32 + 0.192, 0.32 + 0.192, 0.192]])
    )
    flat = losses.dpace_weights(confidence=confidence, alpha=1.0)  # no confidence: S, S-1, ...
    torch.testing.assert_close(flat, torch.tensor([[3.0, 2.0, 1.0]]))
    with pytest.raises(ValueError, match="alpha"):
        losses.dpace_weights(confidence=confidence, alpha=1.5)


def test_dpace_weights_are_detached_non_increasing_and_skip_masked_slots() -> None:
    confidence = torch.tensor([[0.8, 0.4, 0.6, 0.9]], requires_grad=True)
    weights = losses.dpace_weights(confidence=confidence, alpha=0.5)
    assert not weights.requires_grad
    assert bool((weights[:, :-1] >= weights[:, 1:]).all())
    mask = torch.tensor([[True, True, False, False]])  # a block cut by the sequence end
    cut = losses.dpace_weights(confidence=confidence, mask=mask, alpha=0.5)
    torch.testing.assert_close(cut, torch.tensor([[0.9 + 0.63, 0.63, 0.0, 0.0]]))
    middle = torch.tensor([[True, False, True, True]])  # slot 2 passes through, adds nothing
    held = losses.dpace_weights(confidence=confidence, mask=middle, alpha=0.5)
    r1, r3, r4 = 0.9, 0.9 * 0.8, 0.9 * 0.8 * 0.95
    torch.testing.assert_close(held, torch.tensor([[r1 + r3 + r4, r3 + r4, r3 + r4, r4]]))


def test_block_weighted_mean_equals_block_cross_entropy() -> None:
    generator = torch.Generator().manual_seed(7)
    logits = torch.randn(3, 4, 5, generator=generator)
    target = torch.softmax(torch.randn(3, 4, 5, generator=generator), -1)
    mask = torch.rand(3, 4, generator=generator) > 0.3
    weights = torch.rand(3, 4, generator=generator)
    expected = losses.block_cross_entropy(
        logits=logits, target_probs=target, weights=weights, mask=mask
    )
    rows = losses.distribution_loss_rows(loss="soft_ce", draft_logits=logits, target_probs=target)
    got = losses.block_weighted_mean(per_slot=rows, weights=weights, mask=mask)
    torch.testing.assert_close(got[0], expected[0], rtol=0, atol=0)
    torch.testing.assert_close(got[1], expected[1], rtol=0, atol=0)


# ------------------------------------------------------------------------------ objectives
@pytest.fixture(scope="module")
def target():  # noqa: ANN201 - a TargetModel
    from lightning_spec.models.target import TargetModel
    from lightning_spec.models.tiny import tiny_config

    return TargetModel.from_config(tiny_config("llama", num_layers=2), seed=1)


def _drafter(target, kind: str):  # noqa: ANN001, ANN202
    from lightning_spec.models.drafters.dflash import DFlashDrafter
    from lightning_spec.models.drafters.eagle3 import Eagle3Drafter

    counts = torch.arange(target.vocab_size)
    if kind == "dflash":
        return DFlashDrafter.from_target(
            target, block_size=4, draft_vocab_size=48, token_counts=counts, intermediate_size=64,
            seed=2,
        )  # fmt: skip
    return Eagle3Drafter.from_target(
        target, draft_vocab_size=48, token_counts=counts, intermediate_size=64
    )


def _labels(target, drafter, batch: dict):  # noqa: ANN001, ANN202
    from lightning_spec.objectives.ttt import cached_ttt_labels

    with torch.no_grad():
        output = target(batch["input_ids"], use_cache=False, output_features=True)
    probs, argmax = cached_ttt_labels(
        drafter,
        head=target.model.get_output_embeddings(),
        last_hidden=output.last_hidden,
        target_argmax=target.head_argmax(output.last_hidden),
    )
    return output.features, probs, argmax


def _batch() -> dict:
    generator = torch.Generator().manual_seed(0)
    input_ids = torch.randint(3, 128, (2, 16), generator=generator)
    loss_mask = torch.zeros(2, 16, dtype=torch.long)
    loss_mask[:, 5:] = 1
    return {
        "input_ids": input_ids,
        "attention_mask": torch.ones(2, 16, dtype=torch.long),
        "loss_mask": loss_mask,
        "source": ["a", "b"],
    }


def test_ttt_default_loss_is_the_soft_cross_entropy_bit_for_bit(target) -> None:  # noqa: ANN001
    from lightning_spec.objectives.ttt import eagle_ttt_losses, ttt_loss_masks, ttt_unroll

    drafter = _drafter(target, "eagle3")
    batch = _batch()
    features, probs, argmax = _labels(target, drafter, batch)
    common = dict(
        input_ids=batch["input_ids"], features=features, target_probs=probs,
        target_argmax=argmax, loss_mask=batch["loss_mask"], steps=3, decay=0.8,
    )  # fmt: skip
    default = eagle_ttt_losses(drafter, **common)
    masks = ttt_loss_masks(batch["loss_mask"], steps=3)
    outputs = ttt_unroll(drafter, input_ids=batch["input_ids"], features=features, steps=3)
    by_hand = torch.stack(
        [
            losses.soft_cross_entropy(logits=out.logits, target_probs=probs, mask=masks[k])
            for k, out in enumerate(outputs)
        ]
    )
    assert torch.equal(default.step_losses, by_hand)
    assert torch.equal(default.loss, losses.ttt_total_loss(step_losses=by_hand, decay=0.8))
    lk = eagle_ttt_losses(drafter, **common, loss="lk_alpha")
    expected = torch.stack(
        [
            losses.lk_alpha_loss(draft_logits=out.logits, target_probs=probs, mask=masks[k])
            for k, out in enumerate(outputs)
        ]
    )
    torch.testing.assert_close(lk.step_losses, expected)
    with pytest.raises(ValueError, match="loss must be one of"):
        eagle_ttt_losses(drafter, **common, loss="hard_ce")


def test_block_default_loss_is_unchanged_and_dpace_weights_the_slots(target) -> None:  # noqa: ANN001
    from lightning_spec.objectives.block import block_sft_losses

    drafter = _drafter(target, "dflash")
    batch = _batch()
    features, probs, argmax = _labels(target, drafter, batch)

    def run(**options: object):  # noqa: ANN202
        return block_sft_losses(
            drafter, input_ids=batch["input_ids"], features=features, target_probs=probs,
            target_argmax=argmax, loss_mask=batch["loss_mask"], anchors=4,
            generator=torch.Generator().manual_seed(3), **options,
        )  # fmt: skip

    default = run()
    explicit = run(loss="soft_ce", weighting="decay")
    assert torch.equal(default.loss, explicit.loss)
    dpace = run(weighting="dpace")
    uniform = run(weighting="uniform")
    assert torch.equal(dpace.slot_losses, uniform.slot_losses)  # same rows, other weights
    assert not torch.equal(dpace.loss, uniform.loss)
    for loss in ("kl", "lk_alpha", "lk_lambda"):
        assert torch.isfinite(run(loss=loss, weighting="dpace").loss)


def test_sft_rejects_unknown_losses_and_bad_constants(target) -> None:  # noqa: ANN001
    from lightning_spec.objectives.sft import SFT

    with pytest.raises(ValueError, match="loss = 'tv'"):
        SFT.from_objects(target, _drafter(target, "eagle3"), loss="tv")
    with pytest.raises(ValueError, match="dpace_alpha"):
        SFT.from_objects(target, _drafter(target, "dflash"), dpace_alpha=2.0)
    with pytest.raises(ValueError, match="block_weighting"):
        SFT.from_objects(target, _drafter(target, "dflash"), block_weighting="d-pace")


@pytest.mark.parametrize(
    ("kind", "loss", "weighting"),
    [
        ("eagle3", "kl", "decay"),
        ("eagle3", "lk_alpha", "decay"),
        ("eagle3", "lk_lambda", "decay"),
        ("dflash", "lk_alpha", "dpace"),
        ("dflash", "lk_lambda", "decay"),
        ("dflash", "soft_ce", "dpace"),
    ],
)
def test_every_loss_trains_two_steps_in_lightning(
    target,
    kind: str,
    loss: str,
    weighting: str,
    tmp_path,  # noqa: ANN001
) -> None:
    from lightning.pytorch import LightningDataModule, Trainer
    from torch.utils.data import DataLoader

    from lightning_spec.objectives.sft import SFT

    class Data(LightningDataModule):
        def train_dataloader(self) -> DataLoader:
            return DataLoader([_batch(), _batch()], batch_size=None)

    module = SFT.from_objects(
        target, _drafter(target, kind), ttt_steps=3, lr=1e-2, warmup_steps=1,
        max_steps_for_schedule=10, anchors_per_sequence=4, loss=loss, block_weighting=weighting,
    )  # fmt: skip
    before = module.drafter.fc.weight.clone()
    trainer = Trainer(
        accelerator="cpu", devices=1, max_steps=2, max_epochs=1, log_every_n_steps=1,
        num_sanity_val_steps=0, enable_progress_bar=False, enable_model_summary=False,
        enable_checkpointing=False, default_root_dir=str(tmp_path), logger=False,
        limit_val_batches=0,
    )  # fmt: skip
    trainer.fit(module, datamodule=Data())
    assert trainer.global_step == 2
    assert torch.isfinite(trainer.logged_metrics["train/loss"])
    assert not torch.equal(module.drafter.fc.weight, before)
    assert module.hparams.loss == loss
