"""A byte-bounded, in-memory LRU of the frozen target's outputs over texts.

The target is frozen, so whatever it computes over a text (features, rows, final hidden
states) can be kept for as long as memory allows. Draft-OPD revisits every rollout several
times between refreshes, and replayed greedy rollouts (`decoding.replay`) bring the same texts
back under later drafters: keeping the target's side saves most of a revisit's cost, while the
drafter's side is always recomputed. Entries are keyed by the bytes that determine them, so a
changed text can never be served a stale entry; old ones age out by least-recent use.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Hashable, Sequence

from torch import Tensor

__all__ = ["TensorLRU", "tensor_key"]


def tensor_key(*tensors: Tensor) -> str:
    """A digest of the tensors' shapes, dtypes and values (CPU copies for hashing)."""
    digest = hashlib.blake2b(digest_size=16)
    for tensor in tensors:
        digest.update(f"{tuple(tensor.shape)}|{tensor.dtype}|".encode())
        digest.update(tensor.detach().contiguous().cpu().numpy().tobytes())
    return digest.hexdigest()


def _nbytes(value: Sequence[Tensor | None]) -> int:
    return sum(t.element_size() * t.nelement() for t in value if t is not None)


class TensorLRU:
    """Tuples of tensors (None allowed) under hashable keys, at most `max_bytes` in total.

    A value larger than the whole budget is not stored. `hits` and `misses` count `get`s.
    """

    def __init__(self, max_bytes: int) -> None:
        if max_bytes < 0:
            raise ValueError(f"max_bytes must be >= 0, got {max_bytes}")
        self.max_bytes = int(max_bytes)
        self.bytes = 0
        self.hits = 0
        self.misses = 0
        self._entries: OrderedDict[Hashable, tuple[Tensor | None, ...]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: Hashable) -> tuple[Tensor | None, ...] | None:
        value = self._entries.get(key)
        if value is None:
            self.misses += 1
            return None
        self._entries.move_to_end(key)
        self.hits += 1
        return value

    def put(self, key: Hashable, value: Sequence[Tensor | None]) -> None:
        stored = tuple(t.detach() if t is not None else None for t in value)
        size = _nbytes(stored)
        if size > self.max_bytes:
            return
        old = self._entries.pop(key, None)
        if old is not None:
            self.bytes -= _nbytes(old)
        while self._entries and self.bytes + size > self.max_bytes:
            _, evicted = self._entries.popitem(last=False)
            self.bytes -= _nbytes(evicted)
        self._entries[key] = stored
        self.bytes += size

    def clear(self) -> None:
        self._entries.clear()
        self.bytes = 0
