"""A Lightning checkpoint's drafter, written as a drafter folder: what a killed or stopped run
had learned at its last checkpoint, not only at its last validation."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from lightning_spec.callbacks.checkpoint import drafter_from_checkpoint
from lightning_spec.models.target import TargetModel
from lightning_spec.models.tiny import tiny_config
from tests.conftest import load_module

HELPERS = load_module(Path(__file__).parents[1] / "objectives" / "test_sft.py", "sft_helpers_ckpt")


def test_the_checkpoint_drafter_becomes_a_folder(tmp_path: Path) -> None:
    target = TargetModel.from_config(tiny_config("llama", num_layers=2), seed=1)
    start, trained = HELPERS._drafter(target), HELPERS._drafter(target, noise=0.3)
    start.save_pretrained(tmp_path / "like")  # the run's validation folder: config and vocabulary
    state = {f"drafter.{k}": v for k, v in trained.state_dict().items()}
    torch.save({"global_step": 77, "state_dict": state, "optimizer_states": []}, tmp_path / "last.ckpt")
    out = drafter_from_checkpoint(tmp_path / "last.ckpt", tmp_path / "like", tmp_path / "out")
    written = load_file(str(out / "model.safetensors"))
    expected = trained.export_state_dict()
    assert written.keys() == expected.keys()
    assert all(torch.equal(written[k], expected[k]) for k in expected)
    assert '"global_step": 77' in (out / "training_state.json").read_text()
    torch.save({"state_dict": {"other.weight": torch.ones(1)}}, tmp_path / "empty.ckpt")
    with pytest.raises(ValueError, match="no drafter weights"):
        drafter_from_checkpoint(tmp_path / "empty.ckpt", tmp_path / "like", tmp_path / "out2")
