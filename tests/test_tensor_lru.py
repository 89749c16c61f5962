"""The byte-bounded LRU behind Draft-OPD's target cache, on hand-made tensors."""

from __future__ import annotations

import pytest
import torch

from lightning_spec.tensor_lru import TensorLRU, tensor_key


def test_keys_depend_on_values_shapes_and_dtypes() -> None:
    a = torch.arange(6)
    assert tensor_key(a) == tensor_key(torch.arange(6))
    assert tensor_key(a) != tensor_key(a.view(2, 3))
    assert tensor_key(a) != tensor_key(a.to(torch.int32))
    assert tensor_key(a, a) != tensor_key(a)
    assert tensor_key(a) != tensor_key(a + 1)


def test_least_recently_used_entries_are_evicted_to_stay_in_budget() -> None:
    block = torch.zeros(10)  # 40 bytes
    cache = TensorLRU(max_bytes=100)
    cache.put("a", (block, None))
    cache.put("b", (block.clone(),))
    assert cache.bytes == 80 and len(cache) == 2
    assert cache.get("a") is not None  # "b" is now the least recent
    cache.put("c", (block.clone(),))
    assert cache.get("b") is None and cache.get("a") is not None and cache.get("c") is not None
    assert cache.bytes == 80 and (cache.hits, cache.misses) == (3, 1)
    cache.put("a", (torch.zeros(5),))  # replacing an entry frees its old bytes
    assert cache.bytes == 60
    cache.put("huge", (torch.zeros(100),))  # larger than the whole budget: not stored
    assert cache.get("huge") is None and cache.bytes == 60
    cache.clear()
    assert len(cache) == 0 and cache.bytes == 0


def test_stored_values_are_detached_and_the_budget_is_checked() -> None:
    weight = torch.ones(3, requires_grad=True)
    cache = TensorLRU(max_bytes=1000)
    cache.put("k", (weight * 2,))
    (value,) = cache.get("k")
    assert not value.requires_grad
    with pytest.raises(ValueError, match="max_bytes"):
        TensorLRU(max_bytes=-1)
