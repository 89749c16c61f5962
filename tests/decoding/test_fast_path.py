"""Which path a tree forward takes once the target routes attention through the fast path, and
that both paths (Triton tree kernel, SDPA over the additive tree mask) give the stock target's
logits. On CPU the kernel runs under the Triton interpreter."""

from __future__ import annotations

import pytest
import torch

from lightning_spec.decoding.fast_path import enable_tree_attention, uses_tree_attention
from lightning_spec.kernels import TRITON_AVAILABLE
from lightning_spec.kernels.tree_attention import ancestor_mask
from lightning_spec.models import target as target_module
from lightning_spec.models.target import (
    KERNEL_MIN_CACHE_ON_GPU,
    TargetModel,
    kernel_takes_tree_forward,
)
from lightning_spec.models.tiny import tiny_config


def test_kernel_takes_long_caches_on_a_gpu_and_every_cache_under_the_interpreter() -> None:
    assert kernel_takes_tree_forward(KERNEL_MIN_CACHE_ON_GPU, on_gpu=True, cache_all_visible=True)
    assert not kernel_takes_tree_forward(
        KERNEL_MIN_CACHE_ON_GPU - 1, on_gpu=True, cache_all_visible=True
    )
    assert kernel_takes_tree_forward(0, on_gpu=False, cache_all_visible=True)
    # The kernel assumes every new token sees the whole cache (no padding inside it).
    assert not kernel_takes_tree_forward(4096, on_gpu=True, cache_all_visible=False)
    assert not kernel_takes_tree_forward(4096, on_gpu=False, cache_all_visible=False)


def _tree_logits(target: TargetModel, prompt: list[int], tokens: list[int], parents: list[int]):
    ids = torch.tensor([prompt])
    cache = target(ids).cache
    past = len(prompt)
    block = ancestor_mask(torch.tensor(parents))
    mask = torch.cat([torch.ones(len(tokens), past, dtype=torch.bool), block], dim=-1)
    depth = block.sum(-1) - 1
    out = target(
        torch.tensor([tokens]),
        position_ids=(past + depth).unsqueeze(0),
        tree_mask=mask.unsqueeze(0),
        cache=cache,
    )
    return out.logits[0]


@pytest.mark.parametrize("kernel", [True, False], ids=["kernel", "sdpa-additive-mask"])
def test_both_fast_path_branches_give_the_stock_targets_tree_logits(
    kernel: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    if kernel and not TRITON_AVAILABLE:
        pytest.skip("triton is not importable")
    prompt, tokens, parents = list(range(5, 14)), [3, 8, 9, 4, 2, 7], [-1, 0, 0, 1, -1, 4]
    stock = TargetModel.from_config(tiny_config("llama", num_layers=2), seed=4)
    expected = _tree_logits(stock, prompt, tokens, parents)

    fast = TargetModel.from_config(tiny_config("llama", num_layers=2), seed=4)
    enable_tree_attention(fast.model)
    assert uses_tree_attention(fast.model)
    taken: list[bool] = []

    def decide(past: int, on_gpu: bool, cache_all_visible: bool) -> bool:
        # Stands in for a GPU's threshold on this CPU: force the branch under test.
        assert cache_all_visible and past == len(prompt)
        taken.append(kernel)
        return kernel

    monkeypatch.setattr(target_module, "kernel_takes_tree_forward", decide)
    got = _tree_logits(fast, prompt, tokens, parents)
    assert taken == [kernel]
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
