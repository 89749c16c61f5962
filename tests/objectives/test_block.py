"""Block SFT for DFlash drafters, and GTO / Draft-OPD with a DFlash student (two-step smokes)."""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch import Trainer

from lightning_spec.callbacks.acceptance import AcceptanceEval
from lightning_spec.callbacks.checkpoint import DrafterCheckpoint
from lightning_spec.decoding.build import parse_tree_spec
from lightning_spec.decoding.engine import SpeculativeDecoder
from lightning_spec.models.drafters.base import load_drafter
from lightning_spec.models.drafters.dflash import DFlashDrafter
from lightning_spec.models.target import TargetModel
from lightning_spec.models.tiny import tiny_config
from lightning_spec.objectives import losses
from lightning_spec.objectives.block import block_sft_losses, choose_anchors, default_gamma
from lightning_spec.objectives.sft import SFT

VOCAB = 128


def _sft_helpers():  # noqa: ANN202 - test_sft's builders, reused as plain functions
    path = Path(__file__).with_name("test_sft.py")
    spec = importlib.util.spec_from_file_location("sft_helpers_block", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


HELPERS = _sft_helpers()


@pytest.fixture(scope="module")
def target() -> TargetModel:
    return TargetModel.from_config(tiny_config("llama", num_layers=2), seed=1)


def _dflash(
    target: TargetModel, block_size: int = 4, anchor_feature: bool = False
) -> DFlashDrafter:
    return DFlashDrafter.from_target(
        target, block_size=block_size, draft_vocab_size=48, token_counts=torch.arange(VOCAB),
        intermediate_size=64, seed=2, anchor_feature=anchor_feature,
    )  # fmt: skip


def _two_steps(module: object, batch: dict, root: Path, callbacks: list | None = None) -> Trainer:
    """Two optimizer steps of `module` on `batch` in a real Lightning Trainer (validation only
    with callbacks, which read it)."""
    trainer = Trainer(
        accelerator="cpu", devices=1, max_steps=2, max_epochs=1, log_every_n_steps=1,
        num_sanity_val_steps=0, enable_progress_bar=False, enable_model_summary=False,
        enable_checkpointing=False, default_root_dir=str(root), logger=False,
        callbacks=callbacks or [], limit_val_batches=None if callbacks else 0,
    )  # fmt: skip
    trainer.fit(module, datamodule=HELPERS.TinyData(batch))
    return trainer


# ------------------------------------------------------------------------------ pure losses
def test_slot_decay_by_hand() -> None:
    weights = losses.block_slot_decay(slots=3, gamma=2.0)
    torch.testing.assert_close(weights, torch.tensor([1.0, math.exp(-0.5), math.exp(-1.0)]))
    assert default_gamma(16) == 7.0 and default_gamma(8) == 4.0 and default_gamma(6) == 3.0
    with pytest.raises(ValueError):
        losses.block_slot_decay(slots=0, gamma=1.0)


def test_expected_acceptance_weights_by_hand() -> None:
    p = torch.tensor([[[0.5, 0.5], [1.0, 0.0], [0.2, 0.8]]])  # [1, S=3, V=2]
    q_logits = torch.log(torch.tensor([[[0.5, 0.5], [0.0, 1.0], [0.2, 0.8]]]) + 1e-30)
    weights = losses.expected_acceptance_weights(draft_logits=q_logits, target_probs=p)
    # a_1 = 1 (q = p), a_2 = 0 (disjoint): reach slot 1 always, slot 2 surely, slot 3 never
    torch.testing.assert_close(weights, torch.tensor([[1.0, 1.0, 0.0]]), atol=1e-6, rtol=0)
    assert not weights.requires_grad


def test_block_cross_entropy_weights_are_relative_and_an_empty_mask_is_zero() -> None:
    logits = torch.zeros(2, 2, 3, requires_grad=True)  # uniform q: H = log 3 everywhere
    probs = torch.tensor([1.0, 0.0, 0.0]).expand(2, 2, 3)
    mask = torch.tensor([[True, True], [True, False]])
    total, per_slot = losses.block_cross_entropy(
        logits=logits, target_probs=probs, weights=torch.tensor([1.0, 0.5]), mask=mask
    )
    assert float(total) == pytest.approx(math.log(3))
    torch.testing.assert_close(per_slot, torch.full((2,), math.log(3)))
    empty, _ = losses.block_cross_entropy(
        logits=logits, target_probs=probs, weights=torch.ones(2), mask=torch.zeros(2, 2).bool()
    )
    assert float(empty) == 0.0
    total.backward()
    assert logits.grad is not None


def test_anchors_predict_assistant_tokens() -> None:
    mask = torch.tensor([0, 0, 0, 1, 1, 1, 0, 1])
    assert choose_anchors(mask, count=10).tolist() == [2, 3, 4, 6]  # a with mask[a + 1]
    picked = choose_anchors(mask, count=2, generator=torch.Generator().manual_seed(0))
    assert picked.numel() == 2 and picked.tolist() == sorted(picked.tolist())
    assert set(picked.tolist()) <= {2, 3, 4, 6}
    assert choose_anchors(torch.tensor([1, 1]), count=4).numel() == 0


# ------------------------------------------------------------------------------ alignment
def test_slot_k_of_anchor_a_is_trained_on_the_target_row_for_x_a_plus_k(
    target: TargetModel,
) -> None:
    """With one-hot labels of the true next token, the block loss equals the cross-entropy of
    the decoder's own block slots against x_{a+k}: the labels sit where verification looks."""
    drafter = _dflash(target)
    ids = torch.randint(3, VOCAB, (1, 12), generator=torch.Generator().manual_seed(3))
    loss_mask = torch.ones_like(ids)
    features = target(ids, output_features=True, use_cache=False).features
    draft_ids = drafter.target_to_draft_ids(ids[0])
    probs = torch.zeros(1, 11, 48)
    for index in range(10):  # index i = target row i + 1, predicting x_{i + 2}
        if draft_ids[index + 2] >= 0:
            probs[0, index, draft_ids[index + 2]] = 1.0
    argmax = ids[:, 2:].clone()
    argmax = torch.cat([argmax, torch.zeros(1, 1, dtype=torch.long)], dim=1)
    result = block_sft_losses(
        drafter, input_ids=ids, features=features, target_probs=probs, target_argmax=argmax,
        loss_mask=loss_mask, anchors=100, weighting="uniform",
    )  # fmt: skip
    anchors = torch.arange(1, 11)
    slots = drafter.sequence_proposer(ids, anchors, features=features).slot_logits
    expected, count = 0.0, 0
    for row, a in enumerate(anchors.tolist()):
        for k in range(1, 4):
            if a + k < 12:
                label = probs[0, a + k - 2]
                expected += float(-(label * F.log_softmax(slots[row, k - 1], -1)).sum())
                count += 1
    assert float(result.loss) == pytest.approx(expected / count, rel=1e-4)
    assert result.tokens == 10 and result.slot_counts.tolist() == [10.0, 9.0, 8.0]


# ------------------------------------------------------------------------------ training
@pytest.mark.parametrize("anchor_feature", [False, True])
def test_dflash_sft_two_steps_in_lightning(
    target: TargetModel, tmp_path: Path, anchor_feature: bool
) -> None:
    module = SFT.from_objects(
        target, _dflash(target, anchor_feature=anchor_feature), lr=1e-2, warmup_steps=1,
        max_steps_for_schedule=10, anchors_per_sequence=6, block_weighting="acceptance",
    )  # fmt: skip
    before = module.drafter.fc.weight.clone()
    fused = None if not anchor_feature else module.drafter.anchor_fc.weight.clone()
    callbacks = [AcceptanceEval(num_prompts=2, max_new_tokens=8, tree="chain:3"), DrafterCheckpoint()]
    trainer = _two_steps(module, HELPERS._batch(), tmp_path, callbacks=callbacks)
    assert trainer.global_step == 2
    assert not torch.equal(module.drafter.fc.weight, before)
    if fused is not None:  # the anchor fusion is trained too
        assert not torch.equal(module.drafter.anchor_fc.weight, fused)
    metrics = trainer.logged_metrics
    for key in ("train/loss", "train/loss_0", "train/acc_2", "val/loss", "val/tau"):
        assert key in metrics, key
    assert torch.isfinite(metrics["train/loss"])
    reloaded = load_drafter(tmp_path / "drafter" / "best")
    assert isinstance(reloaded, DFlashDrafter) and reloaded.anchor_feature == anchor_feature
    decoder = SpeculativeDecoder(target, reloaded, parse_tree_spec("chain:3"))  # binds it
    from lightning_spec.decoding.engine import autoregressive_generate

    prompt = [5, 9, 14, 3, 22]
    assert decoder.generate(prompt, 12, stop_on_eos=False).tokens == autoregressive_generate(
        target, prompt, 12, stop_on_eos=False
    )


def test_fresh_dflash_drafter_from_the_objective(target: TargetModel) -> None:
    with pytest.raises(ValueError, match="block_weighting"):
        SFT.from_objects(target, _dflash(target), block_weighting="linear")
    with pytest.raises(ValueError, match="num_layers"):
        SFT.from_objects(target, _dflash(target), num_layers=0)
    module = SFT.from_objects(target, _dflash(target), drafter_type="dflash",
                                   anchor_feature=True, block_size=6)  # fmt: skip
    fresh = module.build_drafter(target)  # what a config without drafter_init trains
    assert isinstance(fresh, DFlashDrafter) and fresh.anchor_feature and fresh.block_size == 6


def test_gto_with_a_dflash_student_two_steps(target: TargetModel, tmp_path: Path) -> None:
    from lightning_spec.objectives.gto import GTO

    module = GTO.from_objects(
        target, _dflash(target), tree="dynamic:3,3,8", group_size=4, groups=2, lr=1e-2,
        warmup_steps=1, max_steps_for_schedule=10, prepack_target=False,
    )  # fmt: skip
    before = module.drafter.fc.weight.clone()
    trainer = _two_steps(module, HELPERS._batch(length=40), tmp_path)
    assert trainer.global_step == 2
    assert not torch.equal(module.drafter.fc.weight, before)
    assert module.reference._target is module.drafter._target  # shared, not copied
    assert torch.isfinite(trainer.logged_metrics["train/loss_gto"])


def test_draft_opd_with_a_dflash_student_two_steps(target: TargetModel, tmp_path: Path) -> None:
    from lightning_spec.data.on_policy import collate_steps
    from lightning_spec.objectives.draft_opd import DraftOPD

    module = DraftOPD.from_objects(
        target, _dflash(target), lr=1e-2, warmup_steps=1, max_steps_for_schedule=10,
    )  # fmt: skip
    decoder = SpeculativeDecoder(target, module.drafter, parse_tree_spec("chain:2"))
    prompts = [[5, 9, 14, 3], [40, 41]]
    generations = [decoder.generate(p, 16, stop_on_eos=False) for p in prompts]
    sequences = [p + g.tokens for p, g in zip(prompts, generations, strict=True)]
    width = max(len(s) for s in sequences)
    ids = torch.zeros(2, width, dtype=torch.long)
    attention = torch.zeros_like(ids)
    loss_mask = torch.zeros_like(ids)
    for row, (prompt, sequence) in enumerate(zip(prompts, sequences, strict=True)):
        ids[row, : len(sequence)] = torch.tensor(sequence)
        attention[row, : len(sequence)] = 1
        loss_mask[row, len(prompt) : len(sequence)] = 1
    batch = {"input_ids": ids, "attention_mask": attention, "loss_mask": loss_mask}
    batch.update(collate_steps([{"steps": g.records} for g in generations]))
    before = module.drafter.fc.weight.clone()
    trainer = _two_steps(module, batch, tmp_path)
    assert trainer.global_step == 2
    assert not torch.equal(module.drafter.fc.weight, before)
    assert torch.isfinite(trainer.logged_metrics["train/loss"])
