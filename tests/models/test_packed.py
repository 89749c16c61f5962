"""Prepacked linear weights (CPU fp32): same outputs as nn.Linear to float rounding, greedy
decoding unchanged, speculative decoding on the packed target lossless against itself."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from lightning_spec.decoding.build import parse_tree_spec
from lightning_spec.decoding.engine import SpeculativeDecoder, autoregressive_generate
from lightning_spec.models.drafters.eagle3 import Eagle3Drafter
from lightning_spec.models.packed import (
    PackedLinear,
    is_prepacked,
    packing,
    prepack_linears,
    prepack_unavailable_reason,
)
from lightning_spec.models.target import TargetModel
from lightning_spec.models.tiny import tiny_config

pytestmark = pytest.mark.skipif(
    prepack_unavailable_reason(nn.Linear(2, 2)) is not None,
    reason=f"no oneDNN prepacking here: {prepack_unavailable_reason(nn.Linear(2, 2))}",
)


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("shape", [(1,), (5,), (2, 7), (3, 1, 4)])
def test_packed_linear_matches_linear(bias: bool, shape: tuple[int, ...]) -> None:
    torch.manual_seed(0)
    linear = nn.Linear(48, 80, bias=bias)
    packed = PackedLinear(linear)
    x = torch.randn(*shape, 48)
    torch.testing.assert_close(packed(x), linear(x), atol=1e-5, rtol=1e-5)
    assert packed(x).shape == (*shape, 80)
    non_contiguous = torch.randn(48, 6).t()
    torch.testing.assert_close(packed(non_contiguous), linear(non_contiguous), atol=1e-5, rtol=1e-5)


def test_packed_target_decodes_like_the_target() -> None:
    target = TargetModel.from_config(tiny_config("llama"), seed=4)
    packed = copy.deepcopy(target)
    count = prepack_linears(packed.model)
    assert count == sum(isinstance(m, PackedLinear) for m in packed.model.modules()) > 0
    ids = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(
        packed(ids, use_cache=False).logits,
        target(ids, use_cache=False).logits,
        atol=1e-4,
        rtol=1e-4,
    )
    prompt = list(range(3, 15))
    assert autoregressive_generate(packed, prompt, 24) == autoregressive_generate(
        target, prompt, 24
    )
    drafter = Eagle3Drafter.from_target(packed, draft_vocab_size=64, token_counts=torch.arange(128))
    prepack_linears(drafter)
    decoder = SpeculativeDecoder(packed, drafter, parse_tree_spec("dynamic:3,3,8"))
    assert decoder.generate(prompt, 24).tokens == autoregressive_generate(packed, prompt, 24)


def test_packing_switches_back_to_the_default_path_and_restores() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8))
    x = torch.randn(3, 16)
    expected = model(x)
    assert not is_prepacked(model)
    prepack_linears(model)
    assert is_prepacked(model)

    with packing(model, False):
        assert all(not m.enabled for m in model.modules() if isinstance(m, PackedLinear))
        # bit-identical to the unpacked model: the same F.linear on the same weights
        assert torch.equal(model(x), expected)
    assert all(m.enabled for m in model.modules() if isinstance(m, PackedLinear))
    torch.testing.assert_close(model(x), expected, atol=1e-5, rtol=1e-5)
    with pytest.raises(RuntimeError), packing(model, False):
        raise RuntimeError("restored even on error")
    assert all(m.enabled for m in model.modules() if isinstance(m, PackedLinear))


def test_prepack_refuses_what_it_cannot_keep_exact() -> None:
    half = nn.Linear(4, 4).to(torch.bfloat16)
    assert "fp32" in prepack_unavailable_reason(half)
    with pytest.raises(ValueError, match="cannot prepack"):
        prepack_linears(half)
