"""The training order: which items an epoch serves, in which batches, and where a resumed
run continues.

Batches come from a length-bucketed sampler whose order is a function of (seed, epoch) only;
`SamplerPosition` records how many batches of the current epoch were consumed, so that
``fit --ckpt_path last`` continues exactly where it stopped. Under DDP every rank takes its slice
of the global batches one process with the global batch size would cut (`epoch_batches`).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from torch.utils.data import BatchSampler, DataLoader

__all__ = [
    "EpochPlan",
    "EpochTracker",
    "LengthBucketBatchSampler",
    "ResumableDataLoader",
    "SamplerPosition",
]


@dataclass
class EpochTracker:
    """Holds the epoch (Lightning calls ``set_epoch`` on ``batch_sampler.sampler``) and this
    process's place among the ranks when Lightning does not inject a DistributedSampler."""

    num_replicas: int = 1
    rank: int = 0
    epoch: int = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = int(epoch)

    def __iter__(self) -> Iterator[int]:  # a Sampler shape; never iterated for indices
        return iter(())

    def __len__(self) -> int:
        return 0


@dataclass
class SamplerPosition:
    """Shared, mutable position of the training sampler: where the current epoch stands and
    where a restored run must continue. One object survives Lightning re-creating the sampler
    (its init arguments are kept by reference)."""

    epoch: int = 0
    drawn: int = 0
    resume_epoch: int | None = None
    resume_batches: int = 0

    def first_epoch(self, batches_per_epoch: int) -> int | None:
        """The epoch a restored run iterates first (None when nothing was restored): the saved
        one, or the next when the saved epoch had been fully consumed."""
        if self.resume_epoch is None:
            return None
        return self.resume_epoch + int(self.resume_batches >= batches_per_epoch)


class EpochPlan:
    """Which items an epoch serves: all of them, or, for a mixture, one version per group."""

    def __init__(
        self,
        num_items: int,
        groups: Sequence[tuple[int, int]] | None = None,
        regenerated_fraction: float = 0.5,
        seed: int = 0,
        vary_with_epoch: bool = True,
    ) -> None:
        self.num_items = num_items
        self.groups = np.asarray(groups, dtype=np.int64) if groups is not None else None
        self.fraction = float(regenerated_fraction)
        self.seed = int(seed)
        self.vary_with_epoch = vary_with_epoch

    def __len__(self) -> int:
        return self.num_items if self.groups is None else len(self.groups)

    def items(self, epoch: int) -> np.ndarray:
        """Item indices of ``epoch`` (unordered); groups are ``(dataset, regenerated)`` pairs
        with -1 where a version is missing. Validation plans draw once (epoch 0) so that
        validation losses stay comparable across epochs."""
        if self.groups is None:
            return np.arange(self.num_items)
        epoch = epoch if self.vary_with_epoch else 0
        rng = np.random.default_rng([self.seed, epoch, 0x6D6978])
        draw = rng.random(len(self.groups)) < self.fraction
        dataset, regenerated = self.groups[:, 0], self.groups[:, 1]
        use_regen = (draw & (regenerated >= 0)) | (dataset < 0)
        return np.where(use_regen, regenerated, dataset)


class LengthBucketBatchSampler(BatchSampler):
    """Batches of similar lengths whose order depends on (seed, epoch) only.

    Per epoch: shuffle the epoch's items with a generator seeded by (seed, epoch), cut them into
    chunks of ``batch_size * bucket_batches``, sort each chunk by length, cut it into batches and
    shuffle the batches. Without shuffling, batches are consecutive runs of the length-sorted
    items. Under DDP the epoch is cut into global batches of ``batch_size * W`` (as one process
    with that batch size would cut it) and rank r takes the r-th slice of each: every rank runs
    the same number of steps, and together they train on one process's global batches.

    ``sampler`` exists for Lightning, which re-creates a custom batch sampler with a
    DistributedSampler as ``sampler`` under DDP: only its ``rank``, ``num_replicas`` and
    ``epoch`` are read, its order is ignored.
    """

    def __init__(
        self,
        sampler: Any = None,
        batch_size: int = 4,
        drop_last: bool = False,
        *,
        lengths: Sequence[int] | np.ndarray,
        plan: EpochPlan | None = None,
        seed: int = 0,
        shuffle: bool = True,
        bucket_batches: int = 32,
        position: SamplerPosition | None = None,
    ) -> None:
        super().__init__(sampler if sampler is not None else EpochTracker(), batch_size, drop_last)
        self.lengths = np.asarray(lengths, dtype=np.int64)
        self.plan = plan if plan is not None else EpochPlan(len(self.lengths))
        self.seed = int(seed)
        self.shuffle = shuffle
        self.bucket_batches = max(1, int(bucket_batches))
        self.position = position if position is not None else SamplerPosition()
        # A resumed Lightning run creates its iterator *before* calling set_epoch, and loader
        # workers draw from the sampler at once: start on the restored epoch, not on 0.
        first = self.position.first_epoch(len(self))
        if first is not None and callable(getattr(self.sampler, "set_epoch", None)):
            self.sampler.set_epoch(first)

    @property
    def epoch(self) -> int:
        return int(getattr(self.sampler, "epoch", 0))

    @property
    def num_replicas(self) -> int:
        return int(getattr(self.sampler, "num_replicas", 1))

    @property
    def rank(self) -> int:
        return int(getattr(self.sampler, "rank", 0))

    def set_epoch(self, epoch: int) -> None:
        self.sampler.set_epoch(epoch)

    def _all_batches(self, epoch: int, batch_size: int | None = None) -> list[list[int]]:
        size = int(batch_size or self.batch_size)
        items = self.plan.items(epoch)
        if self.shuffle:
            rng = np.random.default_rng([self.seed, epoch])
            items = items[rng.permutation(len(items))]
            chunk = size * self.bucket_batches
        else:
            items = np.sort(items)
            chunk = max(len(items), 1)
        batches: list[list[int]] = []
        for lo in range(0, len(items), chunk):
            part = items[lo : lo + chunk]
            part = part[np.argsort(-self.lengths[part], kind="stable")]
            for b in range(0, len(part), size):
                batch = part[b : b + size]
                if len(batch) < size and self.drop_last:
                    continue
                batches.append([int(i) for i in batch])
        if self.shuffle:
            order = np.random.default_rng([self.seed, epoch, 1]).permutation(len(batches))
            batches = [batches[i] for i in order]
        return batches

    def epoch_batches(self, epoch: int) -> list[list[int]]:
        """This rank's batches of ``epoch``, in order.

        Under DDP the epoch is cut into global batches of ``batch_size * world`` exactly as one
        process with that batch size would cut it, and rank r takes slice r of each: a step of
        W ranks trains on the very records one process with the global batch would (tested:
        the same loss curve). A short last global batch is filled from the epoch's first
        records, so every rank has a full batch and the same step count."""
        world = self.num_replicas
        if world == 1:
            return self._all_batches(epoch)
        size = self.batch_size
        global_batches = self._all_batches(epoch, size * world)
        if not global_batches:
            return []
        head = [i for batch in global_batches for i in batch]
        last = global_batches[-1]
        if len(last) < size * world and not self.drop_last:
            fill = [head[k % len(head)] for k in range(size * world - len(last))]
            global_batches[-1] = last + fill
        return [batch[self.rank * size : (self.rank + 1) * size] for batch in global_batches]

    def __iter__(self) -> Iterator[list[int]]:
        epoch = self.epoch
        batches = self.epoch_batches(epoch)
        position = self.position
        skip = 0
        if position.resume_epoch == epoch:
            skip = min(position.resume_batches, len(batches))
        position.epoch, position.drawn = epoch, skip
        for batch in batches[skip:]:
            position.drawn += 1
            yield batch

    def __len__(self) -> int:
        full, rest = divmod(len(self.plan), self.batch_size * self.num_replicas)
        return full + (1 if rest and not self.drop_last else 0)


class ResumableDataLoader(DataLoader):
    """The training DataLoader, stateful for Lightning: its state is its owner's (the data
    module's position), so Lightning knows the loader resumes mid-epoch and does not warn that
    it cannot."""

    def __init__(self, *args: Any, owner: Any = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.owner = owner

    def state_dict(self) -> dict[str, Any]:
        return self.owner.state_dict() if self.owner is not None else {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if self.owner is not None and state_dict:
            self.owner.load_state_dict(state_dict)
