"""Target fingerprints: a drafter trained for one target is refused for another, naming the
difference; the same weights in another dtype, prepacked or saved and reloaded, still match."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

from lightning_spec import specs
from lightning_spec.models.drafters.eagle3 import Eagle3Drafter
from lightning_spec.models.fingerprint import check_drafter_target, target_fingerprint
from lightning_spec.models.packed import prepack_linears
from lightning_spec.models.target import TargetModel
from lightning_spec.models.tiny import tiny_config
from lightning_spec.objectives.base import check_pair


def test_a_drafter_of_another_target_is_refused_with_the_difference(tmp_path: Path) -> None:
    target = TargetModel.from_config(tiny_config("llama", num_layers=2), seed=1)
    other = TargetModel.from_config(tiny_config("llama", num_layers=2), seed=2)  # same shapes
    drafter = Eagle3Drafter.from_target(target, draft_vocab_size=48, token_counts=torch.arange(128))
    check_drafter_target(drafter, target)
    check_pair(target, drafter)
    with pytest.raises(ValueError, match="weights: trained for"):
        check_pair(other, drafter)
    drafter.save_pretrained(tmp_path / "d")
    assert specs.resolve_drafter(str(tmp_path / "d"), target) is not None  # reload: same target
    with pytest.raises(ValueError, match="another target"):
        specs.resolve_drafter(str(tmp_path / "d"), other)


def test_the_same_weights_match_in_any_dtype_or_packing() -> None:
    target = TargetModel.from_config(tiny_config("llama", num_layers=2), seed=1)
    reference = target_fingerprint(target)
    half = copy.deepcopy(target)
    half.model.to(torch.bfloat16)
    assert target_fingerprint(half)["weights"] == reference["weights"]
    packed = copy.deepcopy(target)
    prepack_linears(packed.model)
    assert target_fingerprint(packed) == reference
    deeper = TargetModel.from_config(tiny_config("llama", num_layers=3), seed=1)
    assert target_fingerprint(deeper)["num_layers"] == 3 != reference["num_layers"]


def test_older_folders_without_a_fingerprint_still_load() -> None:
    target = TargetModel.from_config(tiny_config("llama", num_layers=2), seed=1)
    drafter = Eagle3Drafter.from_target(target)
    del drafter.config["target_fingerprint"]
    other = TargetModel.from_config(tiny_config("llama", num_layers=2), seed=2)
    check_drafter_target(drafter, other)  # nothing recorded, nothing to compare
