"""Drafters: incremental == teacher-forced, save/load round trips, the SGLang/vLLM layout."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from lightning_spec.models.drafters.base import load_drafter
from lightning_spec.models.drafters.eagle3 import Eagle3Drafter
from lightning_spec.models.drafters.standalone import StandaloneDrafter
from lightning_spec.models.target import TargetModel
from lightning_spec.models.tiny import tiny_config
from lightning_spec.models.vocab import draft_to_target_ids


@pytest.fixture(scope="module")
def target() -> TargetModel:
    return TargetModel.from_config(tiny_config("llama"), seed=3)


@pytest.fixture(scope="module")
def eagle(target: TargetModel) -> Eagle3Drafter:
    counts = torch.arange(128)  # higher ids are "more frequent"
    return Eagle3Drafter.from_target(target, draft_vocab_size=32, token_counts=counts)


def test_eagle_vocab_and_init(target: TargetModel, eagle: Eagle3Drafter) -> None:
    ids = draft_to_target_ids(eagle.d2t)
    # The 31 most frequent ids plus EOS (2), which is always kept.
    assert ids.tolist() == [2] + list(range(97, 128))
    assert int(eagle.t2d.sum()) == 32 and bool(eagle.t2d[2])
    # the target's embeddings are shared (the same storage), never a parameter or saved
    assert eagle._embedding.data_ptr() == target.input_embeddings().weight.data_ptr()
    assert not any("embed" in name for name in eagle.state_dict())
    torch.testing.assert_close(eagle.lm_head.weight, target.model.lm_head.weight[ids])
    assert eagle.config["target_layer_ids"] == target.feature_layers


def test_eagle_incremental_equals_forward(target: TargetModel, eagle: Eagle3Drafter) -> None:
    ids = torch.randint(3, 128, (2, 11))
    features = target(ids).features
    full = eagle(ids, features)
    state = eagle.new_state()
    positions = torch.arange(11).expand(2, -1)
    a = eagle.step(state, ids[:, :4], positions[:, :4], features=features[:, :4])
    b = eagle.step(state, ids[:, 4:], positions[:, 4:], features=features[:, 4:])
    torch.testing.assert_close(torch.cat([a.logits, b.logits], 1), full.logits)
    assert eagle.state_length(state) == 11
    eagle.truncate_state(state, 6)
    assert eagle.state_length(state) == 6
    # Re-running the tail after a rollback gives the same answer.
    c = eagle.step(state, ids[:, 6:], positions[:, 6:], features=features[:, 6:])
    torch.testing.assert_close(c.logits, full.logits[:, 6:])


def test_eagle_hidden_path_and_errors(eagle: Eagle3Drafter) -> None:
    ids = torch.randint(3, 128, (1, 3))
    hidden = torch.randn(1, 3, eagle.config["hidden_size"])
    out = eagle(ids, hidden=hidden)
    assert out.logits.shape == (1, 3, 32)
    with pytest.raises(ValueError, match="exactly one"):
        eagle(ids)
    with pytest.raises(ValueError, match="wrong target"):
        eagle(ids, torch.randn(1, 3, 5))


def test_to_target_and_back(eagle: Eagle3Drafter) -> None:
    logprobs = torch.log_softmax(torch.randn(4, 32), -1)
    full = eagle.to_target(logprobs)
    assert full.shape == (4, 128)
    assert torch.isinf(full[:, 3]).all()  # id 3 is outside the draft vocabulary
    torch.testing.assert_close(full.exp().sum(-1), torch.ones(4))
    back = eagle.target_to_draft_ids(torch.tensor([2, 97, 127, 50]))
    assert back.tolist() == [0, 1, 31, -1]


def test_eagle_save_load_sglang_layout(tmp_path, target: TargetModel, eagle: Eagle3Drafter) -> None:
    eagle.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"]
    # SGLang adds 1 to these ids (it counts decoder layers); vLLM reads the top-level ones as is
    decoder_layers = [i - 1 for i in target.feature_layers]
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == decoder_layers
    assert config["eagle_aux_hidden_state_layer_ids"] == target.feature_layers
    assert config["draft_vocab_size"] == 32 and config["vocab_size"] == 128
    keys = set(load_file(str(tmp_path / "model.safetensors")))
    assert {"fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d"} <= keys
    assert "midlayer.self_attn.q_proj.weight" in keys and "midlayer.hidden_norm.weight" in keys
    assert "embed_tokens.weight" not in keys  # the target's; loaders (vLLM, SGLang) share it
    ids = torch.randint(3, 128, (1, 6))
    features = target(ids).features
    with pytest.raises(RuntimeError, match="bind_target"):
        load_drafter(tmp_path)(ids, features)
    loaded = load_drafter(tmp_path, target=target)
    assert isinstance(loaded, Eagle3Drafter)
    torch.testing.assert_close(loaded(ids, features).logits, eagle(ids, features).logits)
    # A folder written before sharing holds its own copy: it loads and runs unbound.
    tensors = load_file(str(tmp_path / "model.safetensors"))
    tensors["embed_tokens.weight"] = target.input_embeddings().weight.detach().clone()
    save_file(tensors, str(tmp_path / "model.safetensors"))
    older = load_drafter(tmp_path)
    torch.testing.assert_close(older(ids, features).logits, eagle(ids, features).logits)
    # A folder without drafter_type but with the SGLang architecture still loads.
    del config["drafter_type"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert isinstance(load_drafter(tmp_path), Eagle3Drafter)


def test_standalone_roundtrip(tmp_path, target: TargetModel) -> None:
    drafter = StandaloneDrafter.from_model(target.model, target.name)
    ids = torch.randint(3, 128, (1, 7))
    torch.testing.assert_close(drafter(ids).logits, target(ids).logits)
    drafter.save_pretrained(tmp_path)
    loaded = load_drafter(tmp_path)
    assert isinstance(loaded, StandaloneDrafter)
    torch.testing.assert_close(loaded(ids).logits, target(ids).logits)
    small = StandaloneDrafter({"lm_config": tiny_config("qwen2", num_layers=1).to_dict()})
    assert small.target_vocab_size == 128


def test_load_errors(tmp_path) -> None:
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_drafter(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        load_drafter(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"drafter_type": "nope"}))
    with pytest.raises(ValueError, match="unknown drafter_type"):
        load_drafter(tmp_path)


def test_eagle31_feature_norms_make_each_layer_scale_free_and_round_trip(tmp_path) -> None:
    """With `feature_norm` each target layer's part of the fused features is normalised before
    `fc`: scaling one layer by 1e4 (activation outliers) changes nothing; the option survives
    a save and a reload; the plain EAGLE-3 head has no norms."""
    from lightning_spec.models.drafters.base import load_drafter
    from lightning_spec.models.drafters.eagle3 import Eagle3Drafter
    from lightning_spec.models.target import TargetModel
    from lightning_spec.models.tiny import tiny_config

    target = TargetModel.from_config(tiny_config("llama", num_layers=4), seed=0)
    drafter = Eagle3Drafter.from_target(target, feature_norm=True)
    assert Eagle3Drafter.from_target(target).feature_norms is None
    features = torch.randn(1, 5, target.feature_size)
    scaled = features.clone()
    width = target.hidden_size
    scaled[..., width : 2 * width] *= 1e4
    torch.testing.assert_close(drafter.fuse(scaled), drafter.fuse(features), rtol=1e-4, atol=1e-4)
    with torch.no_grad():
        drafter.feature_norms[1].weight.mul_(2.0)
    folder = drafter.save_pretrained(tmp_path / "d")
    loaded = load_drafter(folder)
    assert loaded.config["feature_norm"] is True
    torch.testing.assert_close(loaded.fuse(features), drafter.fuse(features))
