"""DFlash -> ONNX: both graphs against the PyTorch drafter through onnxruntime."""

from __future__ import annotations

from pathlib import Path

import onnx
import pytest
import torch

from lightning_spec.export import dflash_onnx
from lightning_spec.models.drafters.dflash import DFlashDrafter
from lightning_spec.models.target import TargetModel
from lightning_spec.models.tiny import tiny_config


@pytest.fixture(scope="module")
def target() -> TargetModel:
    return TargetModel.from_config(tiny_config("llama", num_layers=4), seed=3)


@pytest.mark.parametrize("anchor_feature", [False, True])
def test_graphs_match_the_drafter(target: TargetModel, tmp_path: Path, anchor_feature: bool) -> None:
    drafter = DFlashDrafter.from_target(
        target, block_size=5, num_layers=2, draft_vocab_size=64,
        token_counts=torch.arange(128), anchor_feature=anchor_feature, seed=2,
    )  # fmt: skip
    if anchor_feature:  # move anchor_fc off its identity init, so the paired row matters
        with torch.no_grad():
            drafter.anchor_fc.weight.add_(0.05 * torch.randn_like(drafter.anchor_fc.weight))
    specs = dflash_onnx.export_dflash(drafter, tmp_path)
    for spec in specs.values():
        onnx.checker.check_model(str(tmp_path / spec.file), full_check=True)
    block_inputs = [t.name for t in specs["dflash_block"].inputs]
    assert block_inputs[:5] == list(dflash_onnx.BLOCK_INPUTS)
    assert ("anchor_context" in block_inputs) == anchor_feature
    logits = {t.name: t.shape for t in specs["dflash_block"].outputs}["logits"]
    assert logits[1:] == [4, 64]  # block - 1 slots over the draft vocabulary

    random = dflash_onnx.random_parity(drafter, tmp_path)
    assert [(c["batch"], c["past"]) for c in random["cases"]] == list(dflash_onnx.BLOCK_CASES)
    assert random["max_abs_diff"] < 1e-4 and random["argmax_agreement"] == 1.0

    sequence = dflash_onnx.sequence_parity(drafter, tmp_path)
    assert sequence["max_abs_diff"] < 1e-4 and sequence["argmax_agreement"] == 1.0
    assert len(sequence["cases"][0]["roots"]) >= 4


def test_sequence_parity_on_real_target_features(target: TargetModel, tmp_path: Path) -> None:
    drafter = DFlashDrafter.from_target(target, block_size=4, num_layers=1, seed=4)
    dflash_onnx.export_dflash(drafter, tmp_path)
    ids = torch.randint(3, 128, (1, 20), generator=torch.Generator().manual_seed(0))
    features = target(ids, use_cache=False).features
    result = dflash_onnx.sequence_parity(
        drafter, tmp_path, features=features[:, :-1], absorbed_ids=ids[:, 1:]
    )
    assert result["max_abs_diff"] < 1e-4 and result["argmax_agreement"] == 1.0
    assert result["cases"][0]["absorbed"] == 19
