"""DFlash for llama.cpp's `draft-dflash`: a folder in the engines' layout converts with
llama.cpp's own converter (its `DFlashModel`), and what it cannot run is refused first."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from lightning_spec.models.drafters.dflash import DFlashDrafter
from lightning_spec.models.target import TargetModel
from lightning_spec.models.tiny import tiny_config
from lightning_spec.tools.llamacpp import convert_dflash


@pytest.fixture(scope="module")
def tiny() -> TargetModel:
    return TargetModel.from_config(tiny_config("llama", num_layers=4), seed=3)


@pytest.mark.parametrize(
    ("options", "reason"),
    [
        ({}, "learned vector"),
        ({"mask_token_id": 7, "anchor_feature": True}, "anchor projection"),
        ({"mask_token_id": 7, "draft_vocab_size": 64, "token_counts": torch.arange(128)}, "maps no d2t"),
    ],
)
def test_what_llamacpp_cannot_run_is_refused(tiny: TargetModel, tmp_path: Path, options: dict, reason: str) -> None:
    folder = DFlashDrafter.from_target(tiny, block_size=4, **options).save_pretrained(tmp_path / "d")
    with pytest.raises(ValueError, match=reason):
        convert_dflash(folder, tmp_path, tmp_path / "d.gguf")
    assert not (tmp_path / "d.gguf").exists()


@pytest.mark.slow
def test_engine_layout_converts_for_draft_dflash(tmp_path: Path) -> None:
    """Slow: the real SmolLM2 folder (the converter reads its tokenizer) and llama.cpp's source."""
    import gguf

    from lightning_spec.export.gguf_package import export_gguf_package
    from lightning_spec.models.target import load_target

    target = load_target("smollm2")
    drafter = DFlashDrafter.from_target(target, block_size=8, mask_token_id="auto")
    drafter.save_pretrained(tmp_path / "drafter")
    manifest = export_gguf_package(tmp_path / "drafter", tmp_path / "gguf", target="smollm2")
    reader = gguf.GGUFReader(str(tmp_path / "gguf" / manifest["files"]["drafter"]["path"]))
    fields = {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}
    assert fields["general.architecture"] == "dflash"
    assert fields["dflash.block_size"] == 8
    assert fields["tokenizer.ggml.mask_token_id"] == 16  # SmolLM2's <empty_output>
    # llama.cpp taps layer inputs: decoder ids + 1, which are ours (HF hidden_states indices)
    assert fields["dflash.target_layers"] == list(target.feature_layers)
    names = {t.name: list(t.shape) for t in reader.tensors}
    hidden = target.hidden_size
    assert names["fc.weight"] == [3 * hidden, hidden]
    assert "token_embd.weight" not in names and "output.weight" not in names  # the target's
