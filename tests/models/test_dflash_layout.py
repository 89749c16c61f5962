"""DFlash in the layout vLLM (`method: dflash`) and llama.cpp (`draft-dflash`) load: a mask
token's target row as the MASK input, an integer `mask_token_id`, no vocabulary maps for the
full vocabulary, a reduced vocabulary's own head; written, read back and lossless."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from lightning_spec.decoding.build import parse_tree_spec
from lightning_spec.decoding.engine import SpeculativeDecoder, autoregressive_generate
from lightning_spec.models.drafters import load_drafter
from lightning_spec.models.drafters.dflash import DFlashDrafter, unused_token_id
from lightning_spec.models.target import TargetModel
from lightning_spec.models.tiny import tiny_config, word_tokenizer


@pytest.fixture(scope="module")
def target() -> TargetModel:
    target = TargetModel.from_config(tiny_config("llama", num_layers=4), seed=3)
    with torch.no_grad():  # confident predictions, so some drafts are accepted
        for name, parameter in target.model.named_parameters():
            if "norm" not in name:
                parameter.mul_(4.0)
    return target


def _block(drafter: DFlashDrafter, target: TargetModel) -> torch.Tensor:
    ids = torch.arange(20, 30).unsqueeze(0)
    with torch.no_grad():
        features = target(ids, output_features=True, use_cache=False).features
        state = drafter.new_state(1)
        drafter.step(state, ids[:, 1:], torch.arange(1, 10).unsqueeze(0), features=features[:, :-1])
        return drafter.draft_block(state, torch.tensor([9]))


def test_the_mask_is_the_targets_row_of_the_mask_token(target: TargetModel) -> None:
    drafter = DFlashDrafter.from_target(target, block_size=4, mask_token_id=7, seed=1)
    assert drafter.mask_embedding is None and "mask_embedding" not in drafter.state_dict()
    torch.testing.assert_close(drafter.mask_vector(), target.input_embeddings().weight[7])
    assert drafter.engine_layout_problems() == []
    learned = DFlashDrafter.from_target(target, block_size=4, seed=1)
    assert "learned vector" in learned.engine_layout_problems()[0]
    with pytest.raises(ValueError, match="not a token"):
        DFlashDrafter.from_target(target, block_size=4, mask_token_id=128)


@pytest.mark.parametrize("spec", ["chain:3", "dynamic:3,3,8"])
def test_mask_token_drafter_is_lossless(target: TargetModel, spec: str) -> None:
    drafter = DFlashDrafter.from_target(target, block_size=4, num_layers=2, mask_token_id=7, seed=2)
    decoder = SpeculativeDecoder(target, drafter, parse_tree_spec(spec))
    prompt = list(range(30, 41))
    expected = autoregressive_generate(target, prompt, 24, stop_on_eos=False)
    assert decoder.generate(prompt, 24, stop_on_eos=False).tokens == expected


def test_full_vocabulary_folder_is_the_reference_layout(target: TargetModel, tmp_path) -> None:
    drafter = DFlashDrafter.from_target(target, block_size=4, num_layers=2, mask_token_id=7, seed=3)
    folder = drafter.save_pretrained(tmp_path / "dflash")
    config = json.loads((folder / "config.json").read_text())
    assert config["architectures"] == ["DFlashDraftModel"] and config["model_type"] == "qwen3"
    dflash = config["dflash_config"]
    assert dflash["mask_token_id"] == 7 and isinstance(dflash["mask_token_id"], int)
    assert dflash["block_size"] == 4
    assert dflash["target_layer_ids"] == [i - 1 for i in target.feature_layers]
    assert config["layer_types"] == ["full_attention"] * 2 and config["num_hidden_layers"] == 2
    assert config["vocab_size"] == 128
    tensors = load_file(str(folder / "model.safetensors"))
    # the engines' names (no `model.` prefix); no maps, no mask vector, no embeddings or head
    expected = {"fc.weight", "hidden_norm.weight", "norm.weight"} | {
        f"layers.{i}.{name}.weight"
        for i in range(2)
        for name in (
            "input_layernorm", "post_attention_layernorm", "self_attn.q_proj", "self_attn.k_proj",
            "self_attn.v_proj", "self_attn.o_proj", "self_attn.q_norm", "self_attn.k_norm",
            "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj",
        )  # fmt: skip
    }
    assert set(tensors) == expected
    hidden, features = config["hidden_size"], len(target.feature_layers)
    assert tuple(tensors["fc.weight"].shape) == (hidden, features * hidden)
    loaded = load_drafter(folder, target=target)
    assert loaded.mask_token_id == 7
    torch.testing.assert_close(_block(loaded, target), _block(drafter, target))


def test_reduced_vocabulary_folder_carries_its_head(target: TargetModel, tmp_path) -> None:
    drafter = DFlashDrafter.from_target(target, block_size=3, draft_vocab_size=64,
                                        token_counts=torch.arange(128), mask_token_id=7)  # fmt: skip
    folder = drafter.save_pretrained(tmp_path / "dflash")
    tensors = load_file(str(folder / "model.safetensors"))
    assert "t2d" not in tensors and tensors["d2t"].dtype == torch.long
    rows = torch.arange(64) + tensors["d2t"]  # the offset form vLLM reads
    torch.testing.assert_close(tensors["lm_head.weight"], target.model.get_output_embeddings().weight[rows])
    loaded = load_drafter(folder, target=target)
    assert torch.equal(loaded.t2d, drafter.t2d)
    torch.testing.assert_close(_block(loaded, target), _block(drafter, target))


def test_a_folder_written_by_the_reference_loads(target: TargetModel, tmp_path) -> None:
    """No `drafter_type`, only the reference's config keys: read as DFlash, layers renumbered."""
    drafter = DFlashDrafter.from_target(target, block_size=4, mask_token_id=9, seed=4)
    folder = tmp_path / "reference"
    folder.mkdir()
    keep = ("architectures", "model_type", "hidden_size", "intermediate_size", "num_attention_heads",
            "num_key_value_heads", "head_dim", "rms_norm_eps", "rope_theta", "vocab_size",
            "num_hidden_layers", "dflash_config", "block_size")  # fmt: skip
    config = {k: v for k, v in drafter.export_config().items() if k in keep}
    (folder / "config.json").write_text(json.dumps(config))
    save_file({k: v.contiguous() for k, v in drafter.export_state_dict().items()},
              str(folder / "model.safetensors"))  # fmt: skip
    loaded = load_drafter(folder, target=target)
    assert isinstance(loaded, DFlashDrafter) and loaded.mask_token_id == 9
    assert loaded.config["target_layer_ids"] == drafter.config["target_layer_ids"]
    torch.testing.assert_close(_block(loaded, target), _block(drafter, target))


def test_auto_mask_token_prefers_a_padded_row_then_a_spare_special(target: TargetModel) -> None:
    from tokenizers import AddedToken

    target.tokenizer = word_tokenizer(120)  # 120 tokens, 128 embedding rows: 8 padded
    try:
        assert unused_token_id(target) == 120
        target.tokenizer = word_tokenizer(127)
        target.tokenizer.add_tokens([AddedToken("<spare>", special=True)])  # id 127
        assert unused_token_id(target) == 127  # not a bos/eos/pad/unk token
        drafter = DFlashDrafter.from_target(target, block_size=3, mask_token_id="auto")
        assert drafter.mask_token_id == 127
        target.tokenizer = word_tokenizer(128)  # every row a word or a reserved special
        with pytest.raises(ValueError, match="no padded embedding row"):
            unused_token_id(target)
    finally:
        target.tokenizer = None
