"""``RolloutDataModule``: the training data of every drafter objective, over one record format.

Modes (ARCHITECTURE.md, Data):

* ``dataset``: the dataset's own assistant answers, rendered with the target's chat template;
  features and soft labels come from the frozen target inside the training step (or from the
  feature cache). This mode was once also called ``online``; that name now belongs to
  OnlineSpec's online learning and is refused here.
* ``regenerated``: the target's own answers to the dataset prompts (first user turn),
  regenerated once with batched ``generate`` and cached as token shards; optional cached
  features (``feature_cache_bytes``).
* ``mixture``: each training conversation is served once per epoch, as its regenerated
  version with probability ``regenerated_fraction`` (drawn per epoch from the seed) and as
  the dataset version otherwise, so the data budget equals the other modes'.
* ``on_policy``: rollouts of the *current* drafter under real verification (a
  `RolloutSource`, by default our `SpeculativeDecoder`), for ``rollout_prompts`` training
  prompts, kept in a checkpointed buffer and refreshed every N optimizer steps by the
  `RefreshRollouts` callback (``data/on_policy.py``); batches also carry the collated steps.

Rendered dataset records are cached as shards too (rendering ShareGPT costs ~25 ms per
conversation on a busy CPU core), so every mode reads a :class:`RolloutStore`. The
train/validation split hashes the conversation id, so it is the same in every run, mode and
seed. Training batches come from a length-bucketed sampler whose order is a function of
(seed, epoch) only; the data module's ``state_dict`` records how many batches of the current
epoch were consumed so that ``fit --ckpt_path last`` continues exactly where it stopped.

Batch (the contract the objectives rely on): ``input_ids``, ``attention_mask``, ``loss_mask``
(LongTensor [B, T], right-padded), optional ``features`` (FloatTensor [B, T, F], only when
every row has cached features) and ``last_hidden`` (FloatTensor [B, T, H], the target's final
hidden state, cached with the features), ``source`` (list[str]) and ``ids`` (list[str]).
"""

from __future__ import annotations

import hashlib
import logging
import time
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import numpy as np
import torch
from torch import Tensor
from torch.utils.data import BatchSampler, DataLoader, Dataset

from lightning_spec.data.on_policy import OnPolicyBuffer, OnPolicyTable, collate_steps
from lightning_spec.data.rollouts import (
    RolloutRecord,
    RolloutStore,
    StoreError,
    tokenizer_fingerprint,
)

log = logging.getLogger(__name__)

MODES = ("dataset", "regenerated", "mixture", "on_policy")
Entry = tuple[RolloutRecord, Tensor | None, Tensor | None, Tensor | None]
"""A record with its cached features [T, F], final hidden states [T, H] and target argmax [T]
(None if absent)."""
DEFAULT_RECORDS_PER_SHARD = 256
#: Target specs naming the embedded default (SmolLM2-135M-Instruct from its pinned asset).
EMBEDDED_TARGETS = ("smollm2", "default")


# --------------------------------------------------------------------------------------------
# Split, tables, datasets
# --------------------------------------------------------------------------------------------


def id_unit(conversation_id: str) -> float:
    """A uniform number in [0, 1) from the id alone (sha256): the same in every run and mode."""
    digest = hashlib.sha256(conversation_id.encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2.0**64


def split_ids(ids: Sequence[str], val_fraction: float) -> tuple[set[str], set[str]]:
    """Train and validation ids: validation holds the ids whose :func:`id_unit` falls below
    ``val_fraction`` (at least one id when ``val_fraction > 0`` and there are two or more)."""
    unique = sorted(set(ids))
    val = {i for i in unique if id_unit(i) < val_fraction}
    if val_fraction > 0 and not val and len(unique) > 1:
        val = {min(unique, key=id_unit)}
    return set(unique) - val, val


class RecordTable(Dataset):
    """Records held as flat numpy arrays (cheap to fork into loader workers), one item each.

    ``features[i]`` is the cached fp16 ``[T_i, F]`` target features of item i, or None, and
    ``last_hidden[i]`` its cached ``[T_i, H]`` final hidden states, or None.
    """

    def __init__(
        self,
        records: Sequence[RolloutRecord],
        features: Sequence[Tensor | None] = (),
        last_hidden: Sequence[Tensor | None] = (),
        target_argmax: Sequence[Tensor | None] = (),
    ) -> None:
        self.ids = [r.id for r in records]
        self.sources = [r.source for r in records]
        self.lengths = np.array([len(r) for r in records], dtype=np.int64)
        self.offsets = np.zeros(len(records) + 1, dtype=np.int64)
        np.cumsum(self.lengths, out=self.offsets[1:])
        total = int(self.offsets[-1])
        self.input_ids = np.fromiter(
            (t for r in records for t in r.input_ids), dtype=np.int64, count=total
        )
        self.loss_mask = np.fromiter(
            (m for r in records for m in r.loss_mask), dtype=np.uint8, count=total
        )
        self.features = list(features) if features else [None] * len(records)
        self.last_hidden = list(last_hidden) if last_hidden else [None] * len(records)
        self.target_argmax = list(target_argmax) if target_argmax else [None] * len(records)
        if {len(self.features), len(self.last_hidden), len(self.target_argmax)} != {len(records)}:
            raise ValueError(
                "one features, last_hidden and target_argmax entry (or None) per record"
            )

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, index: int) -> dict[str, Any]:
        lo, hi = int(self.offsets[index]), int(self.offsets[index + 1])
        return {
            "id": self.ids[index],
            "source": self.sources[index],
            "input_ids": torch.from_numpy(self.input_ids[lo:hi].copy()),
            "loss_mask": torch.from_numpy(self.loss_mask[lo:hi].astype(np.int64)),
            "features": self.features[index],
            "last_hidden": self.last_hidden[index],
            "target_argmax": self.target_argmax[index],
        }


def collate_records(rows: Sequence[dict[str, Any]], pad_id: int = 0) -> dict[str, Any]:
    """Right-pad rows into the batch contract (see the module docstring)."""
    if not rows:
        raise ValueError("cannot collate an empty batch")
    width = max(int(r["input_ids"].shape[0]) for r in rows)
    batch_size = len(rows)
    input_ids = torch.full((batch_size, width), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((batch_size, width), dtype=torch.long)
    loss_mask = torch.zeros((batch_size, width), dtype=torch.long)
    for row, item in enumerate(rows):
        length = int(item["input_ids"].shape[0])
        input_ids[row, :length] = item["input_ids"]
        attention_mask[row, :length] = 1
        loss_mask[row, :length] = item["loss_mask"]
    batch: dict[str, Any] = {
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        "loss_mask": loss_mask,
    }
    features = _stack_cached(rows, "features", width)
    if features is not None:
        batch["features"] = features
        last_hidden = _stack_cached(rows, "last_hidden", width)
        if last_hidden is not None:
            batch["last_hidden"] = last_hidden
            argmax = [r.get("target_argmax") for r in rows]
            if all(a is not None for a in argmax):
                ids = torch.zeros((batch_size, width), dtype=torch.long)
                for row, values in enumerate(argmax):
                    length = min(int(values.shape[0]), width)
                    ids[row, :length] = values[:length].long()
                batch["target_argmax"] = ids
    batch["source"] = [str(r["source"]) for r in rows]
    batch["ids"] = [str(r["id"]) for r in rows]
    return batch


def _stack_cached(rows: Sequence[dict[str, Any]], key: str, width: int) -> Tensor | None:
    """Zero-padded float32 ``[B, width, D]`` of a cached per-token tensor, or None unless every
    row has it (a batch is all offline or all online; mixed rows go online)."""
    cached = [r.get(key) for r in rows]
    if not cached or any(c is None for c in cached):
        return None
    out = torch.zeros((len(rows), width, int(cached[0].shape[-1])), dtype=torch.float32)
    for row, values in enumerate(cached):
        length = min(int(values.shape[0]), int(rows[row]["input_ids"].shape[0]))
        out[row, :length] = values[:length].float()
    return out


# --------------------------------------------------------------------------------------------
# Sampling
# --------------------------------------------------------------------------------------------


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


# --------------------------------------------------------------------------------------------
# The data module
# --------------------------------------------------------------------------------------------


def resolve_target_source(target: str) -> tuple[str, str | None]:
    """``(folder or hub id, gguf file name or None)`` for a target spec, as TargetModel does."""
    source = str(target)
    if source in {"smollm2", "default"}:
        from lightning_spec.data.assets import default_target_path

        source = str(default_target_path())
    if source.endswith(".gguf"):
        path = Path(source)
        return str(path.parent), path.name
    return source, None


class RolloutDataModule(pl.LightningDataModule):
    """Drafter training data: dataset answers, target-regenerated answers or a mixture.

    Args:
        target: The target model (``"smollm2"`` = the embedded default, a hub id, a local folder
            or a ``.gguf`` file); its tokenizer renders the data and it regenerates answers.
        dataset: Training conversations: ``sharegpt``, ``mtbench``, ``humaneval`` or a
            ``.jsonl``/``.json`` path (anything ``load_source`` accepts).
        mode: ``dataset`` (the dataset's answers, features computed in the training step or
            cached), ``regenerated`` (the target's own answers, cached as shards), ``mixture``
            (both, see ``regenerated_fraction``) or ``on_policy`` (the current drafter's
            rollouts, refreshed by the ``RefreshRollouts`` callback).
        regenerated_fraction: In ``mixture`` mode, the probability that a conversation is served
            in its regenerated version in a given epoch (else its dataset version).
        cache_dir: Where shards go (``<cache_dir>/dataset``, ``<cache_dir>/regenerated``).
            Default: ``<asset cache>/rollouts/<kind>-<config hash>``. An explicit directory made
            under another configuration is refused.
        max_length: Tokens per sequence; longer ones keep their beginning.
        max_conversations: Use the first N conversations of the dataset (None = all).
        val_fraction: Share of conversations held out for validation, chosen by a hash of the
            conversation id (the same in every run, mode and seed).
        batch_size: Sequences per batch (per device).
        num_workers: DataLoader worker processes.
        seed: Seed of the data order (a function of seed and epoch) and of the mixture draws.
        regenerate_max_new_tokens: Longest regenerated answer, in tokens.
        regenerate_batch_size: Prompts per ``generate`` call when regenerating.
        regenerate_temperature: 0 = greedy regeneration, > 0 = sampled at this temperature.
        feature_cache_bytes: Cache the target's features for up to this many bytes of fp16
            shards (0 = no cache: the objective computes features online).
        prompts_for_eval: Held-out prompts for the acceptance-eval callback (``eval_prompts``).
        target_dtype: dtype the target regenerates and computes cached features in (match the
            objective's so the process-shared target is loaded once).
        shard_format: ``jsonl``, ``jsonl.gz`` or ``safetensors``.
        records_per_shard: Records per shard file (the resume granularity).
        bucket_batches: Batches per length bucket (larger = less padding, less randomness).
        progress: Show progress bars while rendering and regenerating.
        rollout_prompts: ``on_policy``: training prompts rolled out per refresh (the buffer
            size; prompts rotate through the training split, sharded over ranks).
        rollout_max_new_tokens: ``on_policy``: tokens decoded per rollout.
        rollout_tree: ``on_policy``: tree policy of the rollouts (``chain:4``, ``dynamic:...``).
        rollout_temperature: ``on_policy``: 0 = greedy rollouts, > 0 = sampled.
        rollout_target_rows: ``on_policy``: top-k target log-probs kept per tried row (0 = none).
        rollout_pool: ``on_policy``: rotate through only the first N training prompts (0 = all),
            so prompts come back under later drafters.
        rollout_replay: ``on_policy``, greedy: decode each prompt once and rebuild its later
            rollouts exactly from the remembered continuation (`ReplayingRolloutSource`; no
            target loop), which makes revisits (``rollout_pool``) cheap.
        rollout_decode_batch: with ``rollout_replay``, > 0: new prompts are answered by the
            target's batched greedy generation, this many at a time, and replayed at once (each
            cut to its exact greedy prefix); 0 = the real decoder, one prompt at a time.
        rollout_sft_mix: ``on_policy``: each rollout row also carries a training row of the
            dataset (with its cached features when ``feature_cache_bytes`` > 0), new rows with
            every refresh, under the batch key ``sft``: for an objective's token loss on dataset
            text beside its on-policy loss (`DraftOPD`'s ``lambda_sft``).
        text_format: ``auto`` (the chat template; plain-text continuation for a tokenizer
            without one, i.e. a base model), ``chat`` (the template, or a made-up role format
            without one) or ``plain`` (plain text even with a template); see `data.chat`.
    """

    def __init__(
        self,
        target: str = "smollm2",
        dataset: str = "sharegpt",
        mode: str = "dataset",
        regenerated_fraction: float = 0.5,
        cache_dir: str | None = None,
        max_length: int = 512,
        max_conversations: int | None = None,
        val_fraction: float = 0.02,
        batch_size: int = 4,
        num_workers: int = 0,
        seed: int = 0,
        regenerate_max_new_tokens: int = 256,
        regenerate_batch_size: int = 8,
        regenerate_temperature: float = 0.0,
        feature_cache_bytes: int = 0,
        prompts_for_eval: str = "mtbench",
        target_dtype: str = "float32",
        shard_format: str = "jsonl",
        records_per_shard: int = DEFAULT_RECORDS_PER_SHARD,
        bucket_batches: int = 32,
        progress: bool = True,
        rollout_prompts: int = 32,
        rollout_max_new_tokens: int = 64,
        rollout_tree: str = "chain:4",
        rollout_temperature: float = 0.0,
        rollout_target_rows: int = 0,
        rollout_pool: int = 0,
        rollout_replay: bool = False,
        rollout_decode_batch: int = 0,
        rollout_sft_mix: bool = False,
        text_format: str = "auto",
    ) -> None:
        super().__init__()
        from lightning_spec.data.chat import TEXT_FORMATS

        if text_format not in TEXT_FORMATS:
            raise ValueError(f"text_format must be one of {TEXT_FORMATS}, got {text_format!r}")
        self.text_format = text_format
        if mode == "online":
            raise ValueError(
                "mode 'online' was renamed 'dataset' (the dataset's answers, target features "
                "computed in the training step); 'online' now means OnlineSpec's online learning"
            )
        if mode not in MODES:
            raise ValueError(f"unknown mode {mode!r}; choose one of {', '.join(MODES)}")
        if rollout_prompts < 1 or rollout_max_new_tokens < 1:
            raise ValueError("rollout_prompts and rollout_max_new_tokens must be >= 1")
        if rollout_pool < 0:
            raise ValueError(
                f"rollout_pool must be >= 0 (0 = every training prompt), got {rollout_pool}"
            )
        if rollout_replay and (rollout_temperature > 0 or rollout_target_rows > 0):
            raise ValueError(
                "rollout_replay rebuilds greedy rollouts only: it needs rollout_temperature 0 "
                "(a sampled rollout depends on the drafter) and rollout_target_rows 0"
            )
        if rollout_decode_batch < 0 or (rollout_decode_batch and not rollout_replay):
            raise ValueError(
                "rollout_decode_batch must be >= 0 and needs rollout_replay (batched greedy "
                f"answers are replayed), got {rollout_decode_batch}"
            )
        if not 0.0 <= regenerated_fraction <= 1.0:
            raise ValueError("regenerated_fraction must be in [0, 1]")
        if not 0.0 <= val_fraction < 1.0:
            raise ValueError("val_fraction must be in [0, 1)")
        if max_length <= 1 or batch_size <= 0:
            raise ValueError("max_length must be > 1 and batch_size > 0")
        if max_conversations is not None and max_conversations <= 0:
            raise ValueError("max_conversations must be positive (or None for all)")
        if mode == "on_policy":
            from lightning_spec.decoding.build import parse_tree_spec
            from lightning_spec.decoding.lookup import require_drafter_policy

            try:
                require_drafter_policy(parse_tree_spec(rollout_tree), "rollout_tree")
            except ValueError as error:
                raise ValueError(f"rollout_tree {rollout_tree!r}: {error}") from error
        self.save_hyperparameters()
        self.target = target
        self.dataset = dataset
        self.mode = mode
        self.regenerated_fraction = regenerated_fraction
        self.cache_dir = cache_dir
        self.max_length = max_length
        self.max_conversations = max_conversations
        self.val_fraction = val_fraction
        self.batch_size = batch_size
        self.num_workers = num_workers
        self.seed = seed
        self.regenerate_max_new_tokens = regenerate_max_new_tokens
        self.regenerate_batch_size = regenerate_batch_size
        self.regenerate_temperature = regenerate_temperature
        self.feature_cache_bytes = feature_cache_bytes
        self.prompts_for_eval = prompts_for_eval
        self.target_dtype = target_dtype
        self.shard_format = shard_format
        self.records_per_shard = records_per_shard
        self.bucket_batches = bucket_batches
        self.progress = progress
        self.rollout_prompts = rollout_prompts
        self.rollout_max_new_tokens = rollout_max_new_tokens
        self.rollout_tree = rollout_tree
        self.rollout_temperature = rollout_temperature
        self.rollout_target_rows = rollout_target_rows
        self.rollout_pool = rollout_pool
        self.rollout_replay = rollout_replay
        self.rollout_decode_batch = rollout_decode_batch
        self.rollout_sft_mix = rollout_sft_mix
        self._source_state: dict[str, Any] | None = None  # restored before the source exists
        self.buffer = OnPolicyBuffer(rollout_prompts)
        self.rollout_source: Any = None
        self._prompts: list[list[int]] = []
        self._tokenizer: Any = None
        self._target_model: Any = None
        self._target_spec = str(target)
        self._target_key: str | None = None
        self._source_sha256: str | None = None
        self._conversations: list[tuple[int, Any]] | None = None
        self._source_count = 0
        self._stores: dict[str, RolloutStore] = {}
        self._train: RecordTable | None = None
        self._val: RecordTable | None = None
        self._train_plan: EpochPlan | None = None
        self._val_plan: EpochPlan | None = None
        self._position = SamplerPosition()
        self._eval_prompts: dict[int | None, list[list[int]]] = {}

    @classmethod
    def from_objects(
        cls, *, tokenizer: Any = None, target_model: Any = None, **kwargs: Any
    ) -> RolloutDataModule:
        """A data module over an already built tokenizer and/or TargetModel (tests, notebooks).

        ``kwargs`` are the ``__init__`` arguments; ``target`` defaults to the model's name and
        only identifies the cache.
        """
        if tokenizer is None and target_model is not None:
            tokenizer = getattr(target_model, "tokenizer", None)
        if tokenizer is None:
            raise ValueError("from_objects needs a tokenizer (or a target_model that has one)")
        if "target" not in kwargs:
            name = getattr(target_model, "name", None) or getattr(tokenizer, "name_or_path", "")
            kwargs["target"] = str(name or "objects")
        module = cls(**kwargs)
        module._tokenizer = tokenizer
        module._target_model = target_model
        if module.text_format != "auto":
            from lightning_spec.data.chat import set_text_format

            set_text_format(tokenizer, module.text_format)
        return module

    # ------------------------------------------------------------------ resources
    @property
    def tokenizer(self) -> Any:
        """The target's tokenizer (loaded on first use; shared with a loaded target)."""
        if self._tokenizer is None:
            if self._target_model is not None or self._needs_target():
                self._tokenizer = self.target_model.tokenizer
            else:
                from transformers import AutoTokenizer

                source, gguf_file = resolve_target_source(self.target)
                kwargs = {"gguf_file": gguf_file} if gguf_file else {}
                self._tokenizer = AutoTokenizer.from_pretrained(source, **kwargs)
            from lightning_spec.data.chat import set_text_format

            set_text_format(self._tokenizer, self.text_format)
        return self._tokenizer

    @property
    def target_model(self) -> Any:
        """The frozen TargetModel (process-shared through ``load_target``)."""
        if self._target_model is None:
            from lightning_spec.models.target import load_target

            self._target_model = load_target(self.target, dtype=self.target_dtype)
        return self._target_model

    @property
    def pad_id(self) -> int:
        pad = getattr(self.tokenizer, "pad_token_id", None)
        return int(pad) if isinstance(pad, int) else 0

    def _needs_target(self) -> bool:
        return self.mode in ("regenerated", "mixture", "on_policy") or self.feature_cache_bytes > 0

    def _kinds(self) -> list[str]:
        """The stores a mode reads (on_policy: the rendered dataset, for its prompts)."""
        return {
            "dataset": ["dataset"],
            "regenerated": ["regenerated"],
            "on_policy": ["dataset"],
        }.get(self.mode, ["dataset", "regenerated"])

    def _world(self) -> tuple[int, int]:
        """(global rank, world size) from the attached trainer, else (0, 1)."""
        trainer = getattr(self, "trainer", None)
        if trainer is None:
            return 0, 1
        return int(trainer.global_rank), int(trainer.world_size)

    def _target_on_device(self) -> Any:
        """The target on this process's training device (a GPU under a GPU trainer): it is the
        same process-shared object the objective trains against, which Lightning would move
        there anyway, so generation does not run on the CPU while a GPU waits."""
        target = self.target_model
        trainer = getattr(self, "trainer", None)
        device = getattr(getattr(trainer, "strategy", None), "root_device", None)
        if device is not None and target.device != device:
            target.to(device)
        return target

    def _on_every_rank(self, what: str, work: Any) -> None:
        """Run `work` on this rank, then agree with every rank on whether any failed (one
        collective, which is also the barrier); on a failure every rank raises."""
        failure: BaseException | None = None
        try:
            work()
        except Exception as error:  # noqa: BLE001 - re-raised below, after the agreement
            failure = error
        trainer = getattr(self, "trainer", None)
        failed = failure is not None
        if trainer is not None:
            failed = bool(trainer.strategy.reduce_boolean_decision(failed, all=False))
        if failure is not None:
            raise failure
        if failed:
            rank, world_size = self._world()
            raise RuntimeError(
                f"rank {rank} of {world_size}: another rank failed while {what} (its log says "
                "why); stopping here too rather than waiting for it at a barrier"
            )

    # ------------------------------------------------------------------ stores
    def _source_identity(self, legacy: bool = False) -> dict[str, Any]:
        """A data file by its content (sha256), so a moved or edited file keys the right store;
        a packaged source (``sharegpt``, ...) by its name: its content is pinned by the asset
        manifest's sha256."""
        path = Path(self.dataset).expanduser()
        if path.is_file():
            if legacy:
                return {"spec": str(path.resolve()), "bytes": path.stat().st_size}
            if self._source_sha256 is None:
                from lightning_spec.io import sha256_file

                self._source_sha256 = sha256_file(path)
            return {"sha256": self._source_sha256}
        return {"spec": self.dataset.strip().lower()}

    @property
    def _target_id(self) -> str:
        """The target as cache keys name it: the embedded default by name (its weights are
        pinned by the asset manifest's sha256), any other by a fingerprint of its weights, so
        a target retrained in place never reuses stale answers or features."""
        if self._target_spec in EMBEDDED_TARGETS:
            return "smollm2"
        if self._target_key is None:
            from lightning_spec.models.fingerprint import cached_target_fingerprint

            self._target_key = f"weights:{cached_target_fingerprint(self.target_model)['weights']}"
        return self._target_key

    def store_config(self, kind: str, *, legacy: bool = False) -> dict[str, Any]:
        """What owns the shards of ``kind``; its hash names the default cache directory."""
        config: dict[str, Any] = {
            "kind": kind,
            "tokenizer": tokenizer_fingerprint(self.tokenizer, legacy=legacy),
            "source": self._source_identity(legacy=legacy),
            "max_length": self.max_length,
        }
        if kind == "regenerated":
            config["target"] = self._target_spec if legacy else self._target_id
            config["target_dtype"] = self.target_dtype
            config["generation"] = self._generation_settings().as_config()
        return config

    def store_dir(self, kind: str) -> Path:
        if self.cache_dir:
            return Path(self.cache_dir).expanduser() / kind
        from lightning_spec.data.assets import cache_root
        from lightning_spec.data.rollouts import config_hash

        root = cache_root() / "rollouts"
        config = self.store_config(kind)
        folder = root / f"{kind}-{config_hash(config)}"
        if self._adopts_legacy_stores():
            self._adopt_legacy_store(kind, root, folder, config)
        return folder

    def _adopt_legacy_store(
        self, kind: str, root: Path, folder: Path, config: dict[str, Any]
    ) -> None:
        """Stores made before the content-keyed names, for the embedded default target and a
        packaged source: their content is what the new key names, so they are rekeyed and
        renamed, not recomputed (hours of cached features on a CPU). The manifest is rekeyed
        before the rename, so a kill in between leaves a store the next run finishes adopting;
        a folder renamed by an earlier version without its manifest is rekeyed in place."""
        from lightning_spec.data.rollouts import config_hash, rekey_store

        old_hash = config_hash(self.store_config(kind, legacy=True))
        if folder.is_dir():
            # a no-op unless an earlier version renamed it without its manifest
            rekey_store(folder, old_hash, config)
            return
        legacy = root / f"{kind}-{old_hash}"
        if not legacy.is_dir():
            return
        try:
            if not rekey_store(legacy, old_hash, config):
                log.warning("%s is not a store of this configuration: left as it is", legacy)
                return
            legacy.rename(folder)
            log.info("%s store adopted under its content-keyed name: %s", kind, folder)
        except OSError as error:  # another process adopted it first, or no rights
            if not folder.exists():
                log.warning("could not adopt %s (%s): it is rebuilt", legacy, error)

    def _adopts_legacy_stores(self) -> bool:
        return (
            self._target_spec in EMBEDDED_TARGETS and not Path(self.dataset).expanduser().exists()
        )

    def store(self, kind: str) -> RolloutStore:
        """The shard store of ``kind`` (``dataset`` or ``regenerated``)."""
        if kind not in self._stores:
            self._stores[kind] = RolloutStore(
                self.store_dir(kind),
                self.store_config(kind),
                shard_format=self.shard_format,
                prefix=kind,
            )
        return self._stores[kind]

    def _generation_settings(self) -> Any:
        from lightning_spec.data.regenerate import GenerationSettings

        return GenerationSettings(
            max_new_tokens=self.regenerate_max_new_tokens,
            temperature=self.regenerate_temperature,
            seed=self.seed,
        )

    def _complete_key(self) -> str:
        """The completion mark of a full pass over the selected conversations."""
        self._load_conversations()
        exhausted = self.max_conversations is None or self._source_count < self.max_conversations
        return "all" if exhausted else f"first:{self.max_conversations}"

    def _is_complete(self, store: RolloutStore) -> bool:
        marks = store.completed()
        if "all" in marks:
            return True
        if self.max_conversations is None:
            return False
        counts = [int(k.split(":", 1)[1]) for k in marks if k.startswith("first:")]
        return any(c >= self.max_conversations for c in counts)

    def _load_conversations(self) -> list[tuple[int, Any]]:
        """(order, conversation) of the first ``max_conversations``, ids made unique."""
        if self._conversations is None:
            from lightning_spec.data.sources import load_source

            source = load_source(self.dataset, limit=self.max_conversations)
            seen: set[str] = set()
            conversations = []
            duplicates = 0
            for order, conversation in enumerate(source):
                if conversation.id in seen:
                    duplicates += 1
                    continue
                seen.add(conversation.id)
                conversations.append((order, conversation))
            if duplicates:
                log.warning("%s: %d duplicate conversation ids skipped", self.dataset, duplicates)
            self._source_count = len(conversations) + duplicates
            self._conversations = conversations
        return self._conversations

    # ------------------------------------------------------------------ preparation
    def _render_dataset(self) -> None:
        """Render the dataset's conversations into the ``dataset`` store (resumable)."""
        from lightning_spec.data.chat import render_conversation
        from lightning_spec.progress import progress_bar

        store = self.store("dataset")
        if self._is_complete(store):
            return
        from lightning_spec.data.claims import claimed_batches

        done = store.done_ids()
        todo = [(o, c) for o, c in self._load_conversations() if c.id not in done]
        failed = tokens = 0
        start = time.perf_counter()
        enabled = self.progress and bool(todo)
        with progress_bar("rendering", enabled=enabled, unit="tok/s") as bar:
            task = bar.add_task("conversations", total=len(todo), rate=0.0)
            # claimed a shard at a time: a second process on the same store renders the rest
            for chunk in claimed_batches(
                store.claims, todo, lambda item: item[1].id, size=self.records_per_shard,
                what=f"rendering {self.dataset}",
            ):  # fmt: skip
                buffer: list[RolloutRecord] = []
                unusable: list[str] = []
                for order, conversation in chunk:
                    try:
                        rendered = render_conversation(
                            self.tokenizer, conversation.messages, self.max_length
                        )
                    except Exception as exc:  # a template may reject a conversation's shape
                        failed += 1
                        unusable.append(conversation.id)
                        log.debug("cannot render %s: %s", conversation.id, exc)
                        continue
                    buffer.append(
                        RolloutRecord(
                            conversation.id,
                            rendered.input_ids,
                            rendered.loss_mask,
                            "dataset",
                            {**conversation.meta, "order": order},
                        )
                    )
                    tokens += len(rendered)
                if buffer:
                    store.write_shard(buffer)
                if unusable:
                    store.claims.finish(unusable)
                rate = tokens / max(time.perf_counter() - start, 1e-9)
                bar.update(task, advance=len(chunk), rate=rate)
        store.claims.release()
        if failed:
            log.warning("%s: %d conversations could not be rendered", self.dataset, failed)
        store.mark_complete(self._complete_key(), failed=failed)

    def _regenerate(self, rank: int, world_size: int) -> None:
        """This rank's share of the regeneration (resumable)."""
        from lightning_spec.data.regenerate import PromptItem, regenerate

        store = self.store("regenerated")
        if self._is_complete(store):
            return
        prompts = []
        for order, conversation in self._load_conversations():
            try:
                messages = conversation.prompt()
            except ValueError:
                continue
            meta = {**conversation.meta, "order": order}
            prompts.append(PromptItem(conversation.id, messages=messages, meta=meta))
        regenerate(
            self._target_on_device(),
            self.tokenizer,
            prompts,
            store,
            settings=self._generation_settings(),
            batch_size=self.regenerate_batch_size,
            max_length=self.max_length,
            records_per_shard=min(self.records_per_shard, 64),
            rank=rank,
            world_size=world_size,
            progress=self.progress,
        )

    def _mark_regenerated(self) -> None:
        self.store("regenerated").mark_complete(self._complete_key())

    def _cache_features(self) -> None:
        from lightning_spec.data.regenerate import cache_features

        for kind in self._kinds():
            cache_features(
                self._target_on_device(),
                self.store(kind),
                cap_bytes=self.feature_cache_bytes,
                batch_size=self.regenerate_batch_size,
                max_length=self.max_length,
                target_id=f"{self._target_id}|{self.target_dtype}",
                progress=self.progress,
                select=self._selected,
            )

    def _selected(self, record: RolloutRecord) -> bool:
        """Whether a stored record belongs to this run (``max_conversations`` of the source)."""
        if self.max_conversations is None:
            return True
        order = record.meta.get("order")
        return order is not None and int(order) < self.max_conversations

    def prepare_data(self) -> None:
        """Render the dataset and, on a single process, regenerate and cache features.

        Lightning calls this on one process per node; under DDP the regeneration is shared by
        all ranks in :meth:`setup` instead (rank r takes prompts i % world_size == r).
        """
        _, world_size = self._world()
        for kind in self._kinds():  # damaged files set aside, so only their contents are redone
            report = self.store(kind).repair()
            if report["shards"] or report["features"]:
                log.warning("%s store repaired: %s", kind, report)
        if "dataset" in self._kinds():
            self._render_dataset()
        if "regenerated" in self._kinds() and world_size == 1:
            store = self.store("regenerated")
            if not self._is_complete(store):
                self._regenerate(0, 1)
                self._mark_regenerated()
        if self.feature_cache_bytes > 0 and world_size == 1:
            self._cache_features()

    # ------------------------------------------------------------------ setup
    def setup(self, stage: str | None = None) -> None:
        """Finish the shared preparation under DDP, then load the train/val records."""
        if self._train is not None:
            return
        rank, world_size = self._world()
        if world_size > 1:
            # Every phase ends in a collective that also says whether some rank failed: a rank
            # that fails makes all of them stop with the reason, none waits at a barrier for a
            # rank that is gone (30 minutes by default, then an unrelated timeout error).
            if "regenerated" in self._kinds() and not self._is_complete(self.store("regenerated")):
                self._on_every_rank("regenerating", lambda: self._regenerate(rank, world_size))
                self._on_every_rank("marking the regeneration complete",
                                    lambda: rank == 0 and self._mark_regenerated())  # fmt: skip
            if self.feature_cache_bytes > 0:
                # shared: every rank claims feature shards of its own (`data.claims`)
                self._on_every_rank("caching features", self._cache_features)
        for kind in self._kinds():
            if not self._is_complete(self.store(kind)):
                if world_size > 1:
                    raise RuntimeError(
                        f"the {kind} shards in {self.store(kind).directory} are incomplete; "
                        "prepare_data() must run before setup()"
                    )
                self.prepare_data()
        self._build_tables()

    def _read_kind(self, kind: str) -> list[Entry]:
        """The selected records of one store with their cached features (or None)."""
        from lightning_spec.data.regenerate import feature_config

        store = self.store(kind)
        config = None
        if self.feature_cache_bytes > 0:
            config = feature_config(self.target_model, f"{self._target_id}|{self.target_dtype}")
        entries: list[Entry] = []
        dropped = 0
        for info in store.shards():
            features, last_hidden, argmax = {}, {}, {}
            if config is not None:
                try:
                    cached = store.read_cached(info.name, feature_config=config)
                except StoreError as error:  # derived data: drop it, compute it online
                    store.drop_feature_shard(info.name, str(error))
                    cached = {"features": {}, "last_hidden": {}, "target_argmax": {}}
                features = cached["features"]
                last_hidden = cached["last_hidden"]
                argmax = cached["target_argmax"]
            try:
                records = store.read_shard(info)
            except StoreError as error:
                ids = store.quarantine_shard(info.name, str(error))
                raise StoreError(
                    f"{kind} shard {info.name} was damaged after preparation and is set aside "
                    f"({len(ids) if ids else info.records} records); run again: only those "
                    "records are made again"
                ) from error
            for record in records:
                if not self._selected(record):
                    continue
                record = record.truncated(self.max_length)
                if record.num_loss_tokens == 0:
                    dropped += 1
                    continue
                entries.append(
                    (
                        record,
                        features.get(record.id),
                        last_hidden.get(record.id),
                        argmax.get(record.id),
                    )
                )
        if dropped:
            log.info("%s: %d records without loss tokens after truncation dropped", kind, dropped)
        return entries

    def _build_tables(self) -> None:
        by_kind = {kind: self._read_kind(kind) for kind in self._kinds()}
        all_ids = [entry[0].id for entries in by_kind.values() for entry in entries]
        train_ids, val_ids = split_ids(all_ids, self.val_fraction)
        self._train, self._train_plan = self._table(by_kind, train_ids, train=True)
        self._val, self._val_plan = self._table(by_kind, val_ids, train=False)
        if self.mode == "on_policy":
            # train prompts (the text before each first assistant token), this rank's share;
            # the dataset answers themselves are not trained on, the rollouts are
            rank, world_size = self._world()
            prompts = [_prompt_of(self._train, i) for i in range(len(self._train))]
            self._prompts = [p for i, p in enumerate(prompts) if p and i % world_size == rank]
            if not self._prompts:
                raise RuntimeError(
                    f"no training prompts for on-policy rollouts in {self.dataset!r}"
                )
            companion = self._train if self.rollout_sft_mix else None
            self._train = OnPolicyTable(self.buffer, companion, self.seed)  # type: ignore[assignment]
            self._train_plan = EpochPlan(len(self._train))
        if len(self._train) == 0:
            raise RuntimeError(
                f"no training records for mode={self.mode!r} from {self.dataset!r} "
                f"(max_conversations={self.max_conversations}, max_length={self.max_length})"
            )
        log.info(
            "RolloutDataModule(mode=%s): %d train / %d val items (%d / %d conversations)",
            self.mode,
            len(self._train),
            len(self._val),
            len(self._train_plan),
            len(self._val_plan),
        )

    def _table(
        self, by_kind: dict[str, list[Entry]], keep: set[str], train: bool
    ) -> tuple[RecordTable, EpochPlan]:
        kept: list[Entry] = []
        index: dict[tuple[str, str], int] = {}
        for kind, entries in by_kind.items():
            for entry in entries:
                if entry[0].id in keep:
                    index[(kind, entry[0].id)] = len(kept)
                    kept.append(entry)
        table = RecordTable(
            [e[0] for e in kept], [e[1] for e in kept], [e[2] for e in kept], [e[3] for e in kept]
        )
        if self.mode != "mixture":
            return table, EpochPlan(len(table))
        ids = sorted({entry[0].id for entry in kept})
        groups = [(index.get(("dataset", i), -1), index.get(("regenerated", i), -1)) for i in ids]
        return table, EpochPlan(
            len(table), groups, self.regenerated_fraction, self.seed, vary_with_epoch=train
        )

    # ------------------------------------------------------------------ loaders
    def _loader(self, table: RecordTable, plan: EpochPlan, train: bool) -> DataLoader:
        rank, world_size = self._world()
        sampler = LengthBucketBatchSampler(
            EpochTracker(num_replicas=world_size, rank=rank),
            self.batch_size,
            False,
            lengths=table.lengths,
            plan=plan,
            seed=self.seed,
            shuffle=train,
            bucket_batches=self.bucket_batches,
            position=self._position if train else SamplerPosition(),
        )
        kwargs: dict[str, Any] = {
            "batch_sampler": sampler,
            "num_workers": self.num_workers,
            "collate_fn": _Collate(self.pad_id),
        }
        if train:
            return ResumableDataLoader(table, owner=self, **kwargs)
        return DataLoader(table, **kwargs)

    # ------------------------------------------------------------------ on-policy rollouts
    def refresh_rollouts(self, drafter: Any, *, step: int = 0, version: str | None = None) -> None:
        """Replace the on-policy buffer with rollouts of `drafter` (refresh number r takes the
        next `rollout_prompts` training prompts, cycling). Called by `RefreshRollouts`."""
        if self.mode != "on_policy":
            raise RuntimeError(f"refresh_rollouts needs mode='on_policy', not {self.mode!r}")
        if self._train is None:
            self.setup("fit")
        if self.rollout_source is None:
            self.rollout_source = self._build_rollout_source()
        start = self.buffer.refreshes * self.rollout_prompts
        pool = min(self.rollout_pool or len(self._prompts), len(self._prompts))
        prompts = [self._prompts[(start + i) % pool] for i in range(self.rollout_prompts)]
        version = version or f"step-{step}"
        generations = self.rollout_source.generate(drafter, prompts, version=version)
        self.buffer.replace(generations, version=version, step=step, max_length=self.max_length)

    def _build_rollout_source(self) -> Any:
        from lightning_spec.decoding.source import DecoderRolloutSource, ReplayingRolloutSource

        if self.rollout_replay:
            source: Any = ReplayingRolloutSource(
                self.target_model,
                tree=self.rollout_tree,
                max_new_tokens=self.rollout_max_new_tokens,
                seed=self.seed,
                decode_batch_size=self.rollout_decode_batch,
            )
            if self._source_state is not None:
                source.load_state_dict(self._source_state)
            return source
        return DecoderRolloutSource(
            self.target_model,
            tree=self.rollout_tree,
            max_new_tokens=self.rollout_max_new_tokens,
            temperature=self.rollout_temperature,
            seed=self.seed,
            keep_target_rows=self.rollout_target_rows,
        )

    def train_dataloader(self) -> DataLoader:
        if self._train is None:
            self.setup("fit")
        assert self._train is not None and self._train_plan is not None
        return self._loader(self._train, self._train_plan, train=True)

    def val_dataloader(self) -> DataLoader | list:
        if self._val is None:
            self.setup("validate")
        assert self._val is not None and self._val_plan is not None
        if len(self._val) == 0:
            return []
        return self._loader(self._val, self._val_plan, train=False)

    # ------------------------------------------------------------------ eval prompts
    def train_prompts(self, limit: int) -> list[list[int]]:
        """Token ids of the first `limit` training prompts (the text before each record's first
        loss token; on-policy: the rollout prompts): for callbacks that measure what training
        changed on its own data (`ReplayAcceptance`'s error-fix rate). Needs ``setup``."""
        if self.mode == "on_policy":
            return [list(p) for p in self._prompts[:limit]]
        if self._train is None:
            raise RuntimeError("train_prompts needs the data set up: call setup('fit') first")
        prompts: list[list[int]] = []
        for index in range(len(self._train)):
            if len(prompts) >= limit:
                break
            prompt = _prompt_of(self._train, index)
            if prompt:
                prompts.append(prompt)
        return prompts

    def eval_prompts(self, limit: int | None = None) -> list[list[int]]:
        """Token ids of held-out prompts (``prompts_for_eval``), rendered with the chat template
        and ending with the assistant header: what the acceptance-eval callback decodes from."""
        if limit not in self._eval_prompts:
            from lightning_spec.data.chat import render_prompt
            from lightning_spec.data.sources import load_source

            with warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)
                source = load_source(self.prompts_for_eval, limit=limit)
            prompts = [render_prompt(self.tokenizer, messages) for messages in source.prompts()]
            self._eval_prompts[limit] = prompts[:limit] if limit is not None else prompts
        return [list(p) for p in self._eval_prompts[limit]]

    # ------------------------------------------------------------------ resume
    def _train_position(self) -> tuple[int, int]:
        """(epoch, batches of it already trained on), from the trainer's progress if fitting."""
        trainer = getattr(self, "trainer", None)
        fit_loop = getattr(trainer, "fit_loop", None) if trainer is not None else None
        if fit_loop is not None and getattr(trainer.state, "fn", None) == "fit":
            epoch = int(fit_loop.epoch_progress.current.processed)
            batches = int(fit_loop.epoch_loop.batch_progress.current.processed)
            return epoch, batches
        return self._position.epoch, self._position.drawn

    def state_dict(self) -> dict[str, Any]:
        """Where training stands in the data order (saved in Lightning checkpoints)."""
        epoch, batches = self._train_position()
        state = {"epoch": epoch, "batches_consumed": batches, "seed": self.seed, "mode": self.mode}
        if self.mode == "on_policy":
            state["on_policy"] = self.buffer.state_dict()
            source_state = getattr(self.rollout_source, "state_dict", None)
            if source_state is not None:
                state["rollout_source"] = source_state()
            elif self._source_state is not None:  # restored, not yet rebuilt
                state["rollout_source"] = self._source_state
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Continue the saved epoch after its consumed batches (no replay, no skip)."""
        if int(state_dict.get("seed", self.seed)) != self.seed:
            log.warning(
                "restoring data position saved with seed %s under seed %s: the data order differs",
                state_dict.get("seed"),
                self.seed,
            )
        self._position.resume_epoch = int(state_dict.get("epoch", 0))
        self._position.resume_batches = int(state_dict.get("batches_consumed", 0))
        self._position.epoch = self._position.resume_epoch
        self._position.drawn = self._position.resume_batches
        if self.mode == "on_policy" and "on_policy" in state_dict:
            self.buffer.load_state_dict(state_dict["on_policy"])
        if self.mode == "on_policy" and "rollout_source" in state_dict:
            self._source_state = state_dict["rollout_source"]
            load = getattr(self.rollout_source, "load_state_dict", None)
            if load is not None:
                load(self._source_state)


class ResumableDataLoader(DataLoader):
    """The training DataLoader, stateful for Lightning: its state is the data module's position
    (so Lightning knows the loader resumes mid-epoch and does not warn that it cannot)."""

    def __init__(self, *args: Any, owner: RolloutDataModule | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.owner = owner

    def state_dict(self) -> dict[str, Any]:
        return self.owner.state_dict() if self.owner is not None else {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if self.owner is not None and state_dict:
            self.owner.load_state_dict(state_dict)


class _Collate:
    """Picklable collate function bound to the pad id (loader workers pickle it)."""

    def __init__(self, pad_id: int) -> None:
        self.pad_id = pad_id

    def __call__(self, rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
        batch = collate_records(rows, self.pad_id)
        if any("steps" in row for row in rows):
            batch.update(collate_steps(rows))
        if all("sft" in row for row in rows) and rows:  # on-policy rows with dataset companions
            batch["sft"] = self([row["sft"] for row in rows])
        return batch


def _prompt_of(table: RecordTable, index: int) -> list[int]:
    """The tokens before a record's first loss token (its prompt), [] if it has none."""
    row = table[index]
    mask = row["loss_mask"]
    first = int(mask.nonzero()[0, 0]) if bool(mask.any()) else 0
    return row["input_ids"][:first].tolist()
