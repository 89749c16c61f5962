"""TargetModel on tiny random configs of every supported family (no downloads)."""

from __future__ import annotations

import pytest
import torch

from lightning_spec.models.cache import cache_length, keep_cache_entries, truncate_cache
from lightning_spec.models.target import (
    TargetModel,
    default_feature_layers,
    resolve_dtype,
    tree_mask_to_additive,
)
from lightning_spec.models.tiny import FAMILIES, tiny_config


@pytest.fixture(scope="module", params=FAMILIES)
def target(request: pytest.FixtureRequest) -> TargetModel:
    return TargetModel.from_config(tiny_config(request.param), seed=1)


def test_frozen_and_features(target: TargetModel) -> None:
    assert not any(p.requires_grad for p in target.parameters())
    ids = torch.randint(3, 128, (2, 9))
    out = target(ids)
    assert out.logits.shape == (2, 9, 128)
    assert out.features.shape == (2, 9, 3 * target.hidden_size)
    assert out.last_hidden.shape == (2, 9, target.hidden_size)
    assert cache_length(out.cache) == 9
    # The features are the chosen hidden states, concatenated in order.
    hidden = target.model(ids, output_hidden_states=True).hidden_states
    first = hidden[target.feature_layers[0]]
    torch.testing.assert_close(out.features[..., : target.hidden_size], first)
    target.train()
    assert not target.model.training


def test_incremental_equals_full(target: TargetModel) -> None:
    ids = torch.randint(3, 128, (1, 12))
    full = target(ids).logits
    prefix = target(ids[:, :7])
    rest = target(ids[:, 7:], cache=prefix.cache)
    torch.testing.assert_close(rest.logits, full[:, 7:], atol=1e-5, rtol=1e-4)


def test_tree_mask_matches_each_branch_and_compaction(target: TargetModel) -> None:
    """Two sibling branches verified at once agree with decoding each branch alone."""
    ids = torch.randint(3, 128, (1, 10))
    branch_a = torch.tensor([11, 12])  # positions 10, 11
    branch_b = torch.tensor([13])  # position 10, sibling of 11
    seq_a = torch.cat([ids[0], branch_a]).unsqueeze(0)
    seq_b = torch.cat([ids[0], branch_b]).unsqueeze(0)
    logits_a = target(seq_a).logits[0, 10:]
    logits_b = target(seq_b).logits[0, 10:]
    prefix = target(ids)
    cache = prefix.cache
    tokens = torch.tensor([[11, 12, 13]])
    mask = torch.zeros(1, 3, 13, dtype=torch.bool)
    mask[:, :, :10] = True
    mask[0, 0, 10] = True
    mask[0, 1, [10, 11]] = True
    mask[0, 2, 12] = True
    out = target(tokens, cache=cache, tree_mask=mask, position_ids=torch.tensor([[10, 11, 10]]))
    torch.testing.assert_close(out.logits[0, :2], logits_a, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(out.logits[0, 2:], logits_b, atol=1e-5, rtol=1e-4)
    # Keep branch a only: the cache must then continue exactly like the plain sequence.
    keep_cache_entries(cache, 3, [0, 1])
    assert cache_length(cache) == 12
    nxt = torch.tensor([[7]])
    expected = target(torch.cat([seq_a, nxt], dim=1)).logits[0, -1]
    got = target(nxt, cache=cache).logits[0, -1]
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-4)
    truncate_cache(cache, 10)
    assert cache_length(cache) == 10


def test_bad_inputs() -> None:
    target = TargetModel.from_config(tiny_config("llama"))
    with pytest.raises(ValueError, match="batch, tokens"):
        target(torch.tensor([1, 2, 3]))
    with pytest.raises(ValueError, match="tree_mask must be"):
        target(torch.tensor([[1, 2]]), tree_mask=torch.ones(1, 2, 5, dtype=torch.bool))
    with pytest.raises(TypeError):
        tree_mask_to_additive(torch.ones(2, 2), torch.float32)
    with pytest.raises(ValueError, match="out of range"):
        TargetModel(target.model, feature_layers=[99])
    with pytest.raises(ValueError, match="unknown dtype"):
        resolve_dtype("int3")
    with pytest.raises(ValueError, match="unknown family"):
        tiny_config("gpt9")
    with pytest.raises(ValueError, match="strictly increasing"):
        keep_cache_entries(target(torch.tensor([[1, 2, 3]])).cache, 2, [1, 0])


def test_default_feature_layers() -> None:
    assert default_feature_layers(30) == [2, 15, 27]  # SmolLM2-135M
    assert default_feature_layers(32) == [2, 16, 29]  # Llama-3.1-8B, as SGLang/vLLM record


def test_bf16_forward() -> None:
    target = TargetModel.from_config(tiny_config("qwen3"), dtype="bf16")
    out = target(torch.randint(3, 128, (1, 5)))
    assert target.dtype == torch.bfloat16
    assert torch.isfinite(out.logits.float()).all()


@pytest.mark.slow
def test_smollm2_greedy_matches_hf_generate() -> None:
    """16 greedy tokens through TargetModel's own cache loop equal HF `generate`."""
    from lightning_spec.decoding.engine import autoregressive_generate

    target = TargetModel.from_pretrained("smollm2")
    messages = [{"role": "user", "content": "Name three primary colours."}]
    prompt = target.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    if isinstance(prompt, dict) or hasattr(prompt, "input_ids"):
        prompt = prompt["input_ids"]
    ours = autoregressive_generate(target, prompt, 16, stop_on_eos=False)
    hf = target.model.generate(
        torch.tensor([prompt]), max_new_tokens=16, do_sample=False, min_new_tokens=16
    )[0, len(prompt) :].tolist()
    assert ours == hf
    assert target.num_layers == 30 and target.hidden_size == 576 and target.vocab_size == 49152
