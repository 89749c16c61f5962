"""KV-cache bookkeeping for tree verification, in one place.

After a tree is verified, only the accepted path may stay in the target's cache. The accepted
nodes are generally not contiguous (siblings sit between them), so `Cache.crop` is not enough:
we gather the kept positions in every layer's keys and values ourselves. transformers renamed
the cache keyword between 5.17 (`past_key_values`) and 5.24 (`cache`); `cache_kwarg` hides that.
"""

from __future__ import annotations

import inspect
from functools import lru_cache

import torch
from torch import Tensor


@lru_cache(maxsize=64)
def _cache_keyword(forward_cls: type) -> str:
    params = inspect.signature(forward_cls.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def cache_kwarg(model: torch.nn.Module, cache: object) -> dict[str, object]:
    """The keyword argument that passes `cache` to `model.forward` on this transformers version."""
    return {_cache_keyword(type(model)): cache}


def cache_length(cache: object) -> int:
    """Number of tokens held by the cache (0 for None)."""
    if cache is None:
        return 0
    return int(cache.get_seq_length())


def _layers(cache: object) -> list[object]:
    layers = getattr(cache, "layers", None)
    if layers is None:
        raise TypeError(
            f"unsupported cache type {type(cache).__name__}: expected a transformers Cache"
        )
    return list(layers)


def keep_cache_entries(cache: object, drop_last: int, keep: Tensor | list[int]) -> None:
    """Drop the last `drop_last` positions of every layer except the offsets in `keep`.

    `keep` holds offsets in `[0, drop_last)` counted from the start of that trailing block (for a
    verified tree block: 0 = the root token, 1 + i = draft node i), in increasing order.
    Works in place on `DynamicCache` layers, sliding-window layers included, as long as the
    sliding window did not already evict part of the block.
    """
    if drop_last <= 0:
        return
    keep_t = torch.as_tensor(keep, dtype=torch.long)
    if keep_t.numel() > 1 and bool((keep_t[1:] <= keep_t[:-1]).any()):
        raise ValueError("keep offsets must be strictly increasing")
    if keep_t.numel() and (int(keep_t.min()) < 0 or int(keep_t.max()) >= drop_last):
        raise ValueError(f"keep offsets must lie in [0, {drop_last})")
    for layer in _layers(cache):
        keys = getattr(layer, "keys", None)
        if keys is None or keys.numel() == 0:
            continue
        length = keys.shape[-2]
        if length < drop_last:
            raise RuntimeError(
                "the cache layer holds fewer positions than the block to compact: a sliding "
                "window evicted part of it; use a window larger than the context"
            )
        start = length - drop_last
        index = torch.cat([torch.arange(start, device=keys.device), start + keep_t.to(keys.device)])
        layer.keys = keys.index_select(-2, index)
        layer.values = layer.values.index_select(-2, index)
        if hasattr(layer, "cumulative_length"):
            layer.cumulative_length = int(layer.cumulative_length) - drop_last + int(keep_t.numel())


def truncate_cache(cache: object, length: int) -> None:
    """Keep only the first `length` positions (for rolling back rejected drafts)."""
    current = cache_length(cache)
    if length > current:
        raise ValueError(f"cannot truncate a cache of {current} positions to {length}")
    keep_cache_entries(cache, current - length, [])
