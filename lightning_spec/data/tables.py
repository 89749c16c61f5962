"""The records a run trains on, held in memory, and how rows become a batch.

The train/validation split hashes the conversation id (`split_ids`), so it is the same in every
run, mode and seed. `RecordTable` keeps the records as flat numpy arrays (cheap to fork into
loader workers) beside their cached target tensors; `collate_records` right-pads rows into the
batch contract the objectives rely on (`data.datamodule`'s docstring), and `BatchCollate` adds
the on-policy parts (collated verification steps, dataset companions).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from torch import Tensor
from torch.utils.data import Dataset

from lightning_spec.data.on_policy import collate_steps
from lightning_spec.data.records import RolloutRecord

__all__ = [
    "BatchCollate",
    "Entry",
    "RecordTable",
    "collate_records",
    "id_unit",
    "prompt_of",
    "split_ids",
]

Entry = tuple[RolloutRecord, Tensor | None, Tensor | None, Tensor | None]
"""A record with its cached features [T, F], final hidden states [T, H] and target argmax [T]
(None if absent)."""


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

    def loss_token_counts(self, vocab_size: int) -> Tensor:
        """Frequencies [vocab_size] of the tokens the records train on (loss mask 1): what a
        draft vocabulary must cover."""
        ids = torch.from_numpy(self.input_ids[self.loss_mask.astype(bool)])
        if ids.numel() and int(ids.max()) >= vocab_size:
            raise ValueError(f"token id {int(ids.max())} out of a vocabulary of {vocab_size}")
        return torch.bincount(ids, minlength=vocab_size)

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


class BatchCollate:
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


def prompt_of(table: RecordTable, index: int) -> list[int]:
    """The tokens before a record's first loss token (its prompt), [] if it has none."""
    row = table[index]
    mask = row["loss_mask"]
    first = int(mask.nonzero()[0, 0]) if bool(mask.any()) else 0
    return row["input_ids"][:first].tolist()
