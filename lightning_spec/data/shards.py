"""How a store's shards are named, keyed and encoded: the format, not the directory.

A shard holds N records as JSONL, gzipped JSONL or safetensors (`encode_shard` /
`decode_shard`); `ShardInfo` is its manifest entry (counts, bytes, sha256, record ids). A store
is owned by the hash of a JSON configuration (`config_hash`), whose tokenizer part identifies a
tokenizer by its vocabulary's content (`tokenizer_fingerprint`), not by a path.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

import torch

from lightning_spec.data.records import RolloutRecord

__all__ = [
    "SHARD_FORMATS",
    "ConfigMismatchError",
    "ShardInfo",
    "StoreError",
    "config_hash",
    "decode_shard",
    "encode_shard",
    "tokenizer_fingerprint",
]

SHARD_FORMATS = ("jsonl", "jsonl.gz", "safetensors")
SHARD_NAME = re.compile(r"^(?P<prefix>[A-Za-z0-9_]+)-r(?P<rank>\d+)-(?P<seq>\d+)\.")
"""``<prefix>-r<rank>-<seq>.<format>``: each rank numbers its own shards."""


class StoreError(RuntimeError):
    """A rollout store cannot be used (corrupt shard, unreadable manifest)."""


class ConfigMismatchError(StoreError):
    """The store on disk was produced under another configuration."""


def now() -> str:
    """The manifests' timestamp format (UTC, seconds)."""
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


# --------------------------------------------------------------------------------------------
# Config hashing
# --------------------------------------------------------------------------------------------


def config_hash(config: Mapping[str, Any]) -> str:
    """Stable 16-hex-digit hash of a JSON-able config (key order does not matter)."""
    text = json.dumps(config, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def tokenizer_fingerprint(tokenizer: Any, *, legacy: bool = False) -> dict[str, Any]:
    """What identifies a tokenizer for caching: its vocabulary's content hash, size, specials
    and chat template, so a tokenizer reached through another path (moved, symlinked, mounted
    elsewhere) keys the same caches and one changed in place keys new ones. ``legacy`` gives
    the key of earlier versions (the tokenizer's name or path instead of its vocabulary), which
    `RolloutDataModule.store_dir` uses to adopt stores made by them for the embedded default."""
    from lightning_spec.models.fingerprint import tokenizer_vocab_fingerprint

    template = getattr(tokenizer, "chat_template", None) or ""
    if isinstance(template, dict):
        template = json.dumps(template, sort_keys=True)
    identity = (
        {"name": str(getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__)}
        if legacy
        else {"vocab_sha256": tokenizer_vocab_fingerprint(tokenizer)}
    )
    fingerprint = {
        **identity,
        "size": len(tokenizer),
        "eos": getattr(tokenizer, "eos_token", None),
        "pad": getattr(tokenizer, "pad_token", None),
        "bos": getattr(tokenizer, "bos_token", None),
        "chat_template_sha256": hashlib.sha256(str(template).encode()).hexdigest()[:16],
    }
    from lightning_spec.data.chat import text_format_of

    text_format = text_format_of(tokenizer)
    if text_format != "template":  # stores rendered with the template keep their old keys
        fingerprint["text_format"] = text_format
    return fingerprint


def diff_keys(old: Mapping[str, Any], new: Mapping[str, Any]) -> list[str]:
    keys = sorted(set(old) | set(new))
    return [k for k in keys if config_hash({"v": old.get(k)}) != config_hash({"v": new.get(k)})]


# --------------------------------------------------------------------------------------------
# Shard encoding
# --------------------------------------------------------------------------------------------


def shard_format(name: str) -> str:
    for fmt in sorted(SHARD_FORMATS, key=len, reverse=True):
        if name.endswith("." + fmt):
            return fmt
    raise StoreError(f"{name}: unknown shard format (expected one of {SHARD_FORMATS})")


def _encode_jsonl(records: Sequence[RolloutRecord]) -> bytes:
    lines = [json.dumps(r.to_dict(), separators=(",", ":")) for r in records]
    return ("\n".join(lines) + "\n").encode()


def _encode_safetensors(records: Sequence[RolloutRecord]) -> bytes:
    from safetensors.torch import save

    lengths = [len(r) for r in records]
    offsets = torch.zeros(len(records) + 1, dtype=torch.int64)
    offsets[1:] = torch.tensor(lengths, dtype=torch.int64).cumsum(0)
    ids = [t for r in records for t in r.input_ids]
    mask = [m for r in records for m in r.loss_mask]
    tensors = {
        "input_ids": torch.tensor(ids, dtype=torch.int64),
        "loss_mask": torch.tensor(mask, dtype=torch.uint8),
        "offsets": offsets,
    }
    headers = [
        {"id": r.id, "source": r.source, "meta": r.meta}
        | ({"steps": r.steps} if r.steps is not None else {})
        for r in records
    ]
    return save(tensors, metadata={"records": json.dumps(headers, separators=(",", ":"))})


def encode_shard(records: Sequence[RolloutRecord], fmt: str) -> bytes:
    """Serialize records in one of :data:`SHARD_FORMATS` (gzip output is byte-reproducible)."""
    if fmt == "jsonl":
        return _encode_jsonl(records)
    if fmt == "jsonl.gz":
        buffer = io.BytesIO()
        with gzip.GzipFile(fileobj=buffer, mode="wb", mtime=0) as fh:
            fh.write(_encode_jsonl(records))
        return buffer.getvalue()
    if fmt == "safetensors":
        return _encode_safetensors(records)
    raise ValueError(f"unknown shard format {fmt!r}; choose one of {SHARD_FORMATS}")


def decode_shard(data: bytes, fmt: str) -> list[RolloutRecord]:
    """Inverse of :func:`encode_shard`."""
    if fmt == "jsonl.gz":
        data, fmt = gzip.decompress(data), "jsonl"
    if fmt == "jsonl":
        return [
            RolloutRecord.from_dict(json.loads(line)) for line in data.splitlines() if line.strip()
        ]
    if fmt == "safetensors":
        from safetensors.torch import load

        tensors = load(data)
        header = json.loads(safetensors_metadata(data).get("records", "[]"))
        offsets = tensors["offsets"].tolist()
        ids, mask = tensors["input_ids"].tolist(), tensors["loss_mask"].tolist()
        return [
            RolloutRecord(
                id=str(h["id"]),
                input_ids=ids[offsets[i] : offsets[i + 1]],
                loss_mask=mask[offsets[i] : offsets[i + 1]],
                source=str(h.get("source", "dataset")),
                meta=dict(h.get("meta") or {}),
                steps=h.get("steps"),
            )
            for i, h in enumerate(header)
        ]
    raise ValueError(f"unknown shard format {fmt!r}; choose one of {SHARD_FORMATS}")


def safetensors_metadata(data: bytes) -> dict[str, str]:
    """The ``__metadata__`` of a safetensors blob (8-byte little-endian header size, JSON)."""
    size = int.from_bytes(data[:8], "little")
    return json.loads(data[8 : 8 + size]).get("__metadata__") or {}


@dataclass(frozen=True)
class ShardInfo:
    """One manifest entry."""

    name: str
    records: int
    tokens: int
    loss_tokens: int
    bytes: int
    sha256: str
    rank: int = 0
    ids: tuple[str, ...] | None = None
    """The record ids of the shard (listed since format 2.1), so a shard that is lost can be
    reported by record and only its records made again."""

    @property
    def format(self) -> str:
        return shard_format(self.name)

    def to_dict(self) -> dict[str, Any]:
        data = {
            "name": self.name,
            "records": self.records,
            "tokens": self.tokens,
            "loss_tokens": self.loss_tokens,
            "bytes": self.bytes,
            "sha256": self.sha256,
            "rank": self.rank,
        }
        if self.ids is not None:
            data["ids"] = list(self.ids)
        return data

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ShardInfo:
        return cls(
            name=str(data["name"]),
            records=int(data["records"]),
            tokens=int(data.get("tokens", 0)),
            loss_tokens=int(data.get("loss_tokens", 0)),
            bytes=int(data["bytes"]),
            sha256=str(data["sha256"]),
            rank=int(data.get("rank", 0)),
            ids=tuple(data["ids"]) if data.get("ids") is not None else None,
        )
