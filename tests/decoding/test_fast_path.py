"""The GPU short-cache dispatch of the tree-attention fast path: SDPA over the dense mask that
`_dense_tree_mask` builds computes what the tree kernel's reference computes."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from lightning_spec.decoding.fast_path import _dense_tree_mask
from lightning_spec.kernels.tree_attention import ancestor_mask, tree_attention_reference


@pytest.mark.parametrize("past", [0, 7])
@pytest.mark.parametrize("batched_mask", [False, True])
def test_sdpa_over_the_dense_tree_mask_equals_tree_attention(past: int, batched_mask: bool) -> None:
    generator = torch.Generator().manual_seed(3)
    batch, q_heads, kv_heads, nodes, dim = 2, 4, 2, 6, 8
    parents = torch.tensor([-1, 0, 0, 1, -1, 4])
    block = ancestor_mask(parents)
    if batched_mask:
        block = torch.stack([block, ancestor_mask(torch.arange(nodes) - 1)])
    q = torch.randn(batch, q_heads, nodes, dim, generator=generator)
    keys = torch.randn(batch, kv_heads, past + nodes, dim, generator=generator)
    values = torch.randn(batch, kv_heads, past + nodes, dim, generator=generator)
    expected = tree_attention_reference(
        q, keys[:, :, :past], values[:, :, :past], keys[:, :, past:], values[:, :, past:], block
    )
    mask = _dense_tree_mask(block if batched_mask else block.unsqueeze(0), past)
    assert mask.shape == (batch if batched_mask else 1, 1, nodes, past + nodes)
    assert bool(mask[..., :past].all())
    group = q_heads // kv_heads
    out = F.scaled_dot_product_attention(
        q,
        keys.repeat_interleave(group, dim=1),
        values.repeat_interleave(group, dim=1),
        attn_mask=mask,
    )
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
