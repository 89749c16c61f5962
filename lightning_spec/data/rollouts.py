"""Training records and the shard store that keeps them on disk.

A *record* is one training sequence: ``{"id", "input_ids", "loss_mask", "source", "meta"}``,
where ``source`` says where the assistant tokens came from (``"dataset"``: the dataset's own
answer, ``"regenerated"``: the target's answer to the dataset prompt, ``"rollout"``: an
on-policy decode with the current drafter). On-policy records also carry ``steps``: serialized
:class:`~lightning_spec.decoding.engine.StepRecord` s, the raw material of GTO, Draft-OPD and
OnlineSpec. The format is plain JSON so that a serving-engine adapter (SGLang, vLLM) can write
the same records for large targets without anything else changing (ARCHITECTURE.md, Scale).

A :class:`RolloutStore` is a directory of shards (N records each; JSONL, gzipped JSONL or
safetensors) plus ``manifest.json``: shard names, record and token counts, byte sizes, sha256
sums and the configuration (target, tokenizer, source, max_length, generation settings) whose
hash owns the directory. Every shard is written to a temporary file, fsynced and renamed, and
the manifest is rewritten the same way after each shard, under a file lock so that DDP ranks
can share one store. A shard only counts once the manifest lists it: a job killed mid-write
leaves at most an unlisted file that the next writer replaces, so resuming never duplicates a
record. Readers verify every shard's checksum and refuse a store made under another config.

Optional feature shards cache the target's fused EAGLE-3 features (fp16 ``[T, F]`` per record)
for the token shards, up to a byte cap (features are ~3.4 KB per token for SmolLM2, so an
unbounded cache would not fit a CI disk; beyond the cap, features are computed online).
"""

from __future__ import annotations

import contextlib
import gzip
import hashlib
import io
import json
import logging
import os
import re
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from lightning_spec.data.claims import WorkClaims
from lightning_spec.io import (
    atomic_write,
    atomic_write_json,
    file_lock,
    is_disk_full,
    remove_stale,
    sha256_file,
)

if TYPE_CHECKING:
    from lightning_spec.decoding.engine import Generation, StepRecord

log = logging.getLogger(__name__)

CACHED_FIELDS = ("features", "last_hidden", "target_argmax")
"""What a feature-cache shard file can hold per record (see ``RolloutStore.write_features``)."""

FORMAT_VERSION = 2
"""2: StepRecord v2 (bonus_committed, drafter_version; sparse target rows in a sidecar)."""
MANIFEST = "manifest.json"
QUARANTINE = "quarantine"
STORE_LOCK_TIMEOUT = 600.0
"""Seconds a store operation waits for the store lock before naming its holder."""
SHARD_FORMATS = ("jsonl", "jsonl.gz", "safetensors")
SOURCES = ("dataset", "regenerated", "rollout")
_SHARD_RE = re.compile(r"^(?P<prefix>[A-Za-z0-9_]+)-r(?P<rank>\d+)-(?P<seq>\d+)\.")


class StoreError(RuntimeError):
    """A rollout store cannot be used (corrupt shard, unreadable manifest)."""


class ConfigMismatchError(StoreError):
    """The store on disk was produced under another configuration."""


# --------------------------------------------------------------------------------------------
# Records
# --------------------------------------------------------------------------------------------


@dataclass
class RolloutRecord:
    """One training sequence; ``loss_mask[t] = 1`` marks an assistant token to be predicted."""

    id: str
    input_ids: list[int]
    loss_mask: list[int]
    source: str = "dataset"
    meta: dict[str, Any] = field(default_factory=dict)
    steps: list[dict[str, Any]] | None = None
    """Serialized StepRecords (:func:`step_record_to_dict`), on-policy records only."""

    def __post_init__(self) -> None:
        if len(self.input_ids) != len(self.loss_mask):
            raise ValueError(
                f"record {self.id!r}: {len(self.input_ids)} input ids but "
                f"{len(self.loss_mask)} loss-mask entries"
            )

    def __len__(self) -> int:
        return len(self.input_ids)

    @property
    def num_loss_tokens(self) -> int:
        return sum(self.loss_mask)

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "id": self.id,
            "input_ids": [int(t) for t in self.input_ids],
            "loss_mask": [int(m) for m in self.loss_mask],
            "source": self.source,
            "meta": self.meta,
        }
        if self.steps is not None:
            out["steps"] = self.steps
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> RolloutRecord:
        try:
            return cls(
                id=str(data["id"]),
                input_ids=list(data["input_ids"]),
                loss_mask=list(data["loss_mask"]),
                source=str(data.get("source", "dataset")),
                meta=dict(data.get("meta") or {}),
                steps=data.get("steps"),
            )
        except KeyError as exc:
            raise ValueError(f"a rollout record needs the key {exc.args[0]!r}") from None

    def truncated(self, max_length: int | None) -> RolloutRecord:
        """The first ``max_length`` tokens (the beginning is kept, as for the dataset).

        Steps beyond the cut are dropped and the step that straddles it is cut with its
        committed tokens (`StepRecord.cut`), so steps always describe the kept tokens.
        """
        if max_length is None or len(self) <= max_length:
            return self
        steps = None
        if self.steps is not None:
            steps = []
            for data in self.steps:
                room = max_length - 1 - int(data["anchor"])  # tokens after the root that fit
                if room < 1:
                    break
                if room < len(data["committed"]):
                    data = step_record_to_dict(step_record_from_dict(data).cut(room))
                steps.append(data)
        return RolloutRecord(
            self.id,
            self.input_ids[:max_length],
            self.loss_mask[:max_length],
            self.source,
            self.meta,
            steps,
        )

    def step_records(self) -> list[StepRecord]:
        """Deserialize ``steps`` into engine StepRecords (empty for non-rollout records)."""
        return [step_record_from_dict(s) for s in self.steps or []]


# --------------------------------------------------------------------------------------------
# StepRecord <-> dict
# --------------------------------------------------------------------------------------------


def _tensor_to_list(value: Tensor | None) -> list | None:
    return None if value is None else value.detach().cpu().tolist()


def step_record_to_dict(record: StepRecord, *, include_probs: bool = False) -> dict[str, Any]:
    """A JSON-ready dict of one verification step (tensors become lists).

    The ``[N + 1, V]`` draft/target distribution rows are skipped unless ``include_probs``:
    they are V floats per node (49k for SmolLM2), far bigger than the rest of the record.
    """
    tree = record.tree
    tree_dict: dict[str, Any] = {
        "tokens": _tensor_to_list(tree.tokens),
        "parents": _tensor_to_list(tree.parents),
        "logprobs": _tensor_to_list(tree.logprobs.float()),
        "iid_children": bool(tree.iid_children),
    }
    out: dict[str, Any] = {
        "version": FORMAT_VERSION,
        "anchor": int(record.anchor),
        "tree": tree_dict,
        "target_token_logprobs": _tensor_to_list(record.target_token_logprobs.float()),
        "target_argmax": _tensor_to_list(record.target_argmax),
        "accepted": _tensor_to_list(record.accepted),
        "committed": [int(t) for t in record.committed],
        "temperature": float(record.temperature),
        "timings": {k: float(v) for k, v in record.timings.items()},
        "bonus_committed": bool(record.bonus_committed),
        "drafter_version": record.drafter_version,
    }
    if include_probs:
        if tree.draft_probs is not None:
            tree_dict["draft_probs"] = _tensor_to_list(tree.draft_probs.float())
        if record.target_probs is not None:
            out["target_probs"] = _tensor_to_list(record.target_probs.float())
    return out


def step_record_from_dict(data: Mapping[str, Any]) -> StepRecord:
    """Inverse of :func:`step_record_to_dict` (tensors on the CPU)."""
    from lightning_spec.decoding.engine import StepRecord
    from lightning_spec.decoding.tree import DraftTree

    version = int(data.get("version", FORMAT_VERSION))
    if version > FORMAT_VERSION:
        raise ValueError(
            f"step record format {version} is newer than this reader ({FORMAT_VERSION})"
        )
    tree_data = data["tree"]
    draft_probs = tree_data.get("draft_probs")
    tree = DraftTree(
        tokens=torch.tensor(tree_data["tokens"], dtype=torch.long),
        parents=torch.tensor(tree_data["parents"], dtype=torch.long),
        logprobs=torch.tensor(tree_data["logprobs"], dtype=torch.float32),
        draft_probs=None if draft_probs is None else torch.tensor(draft_probs, dtype=torch.float32),
        iid_children=bool(tree_data.get("iid_children", False)),
    )
    target_probs = data.get("target_probs")
    return StepRecord(
        anchor=int(data["anchor"]),
        tree=tree,
        target_token_logprobs=torch.tensor(data["target_token_logprobs"], dtype=torch.float32),
        target_argmax=torch.tensor(data["target_argmax"], dtype=torch.long),
        accepted=torch.tensor(data["accepted"], dtype=torch.long),
        committed=[int(t) for t in data["committed"]],
        temperature=float(data.get("temperature", 0.0)),
        target_probs=None if target_probs is None else torch.tensor(target_probs),
        timings=dict(data.get("timings", {})),
        bonus_committed=bool(data.get("bonus_committed", True)),
        drafter_version=data.get("drafter_version"),
    )


def step_rows_tensors(records: Sequence[StepRecord]) -> dict[str, Tensor]:
    """The sparse target rows of `records` as flat tensors for a safetensors sidecar
    (``{i}.rows``, ``{i}.logprobs``, ``{i}.ids``, ``{i}.logsumexp`` for step i), not JSON
    float lists; steps without rows are absent."""
    out: dict[str, Tensor] = {}
    for index, record in enumerate(records):
        rows = record.target_rows
        if rows is None:
            continue
        out[f"{index}.rows"] = rows.rows.long().contiguous()
        out[f"{index}.logprobs"] = rows.logprobs.float().contiguous()
        out[f"{index}.ids"] = rows.ids.long().contiguous()
        out[f"{index}.logsumexp"] = rows.logsumexp.float().contiguous()
    return out


def attach_step_rows(records: Sequence[StepRecord], tensors: Mapping[str, Tensor]) -> None:
    """Inverse of :func:`step_rows_tensors`: set ``target_rows`` of the listed steps."""
    from lightning_spec.decoding.engine import SparseRows

    for index, record in enumerate(records):
        if f"{index}.rows" in tensors:
            record.target_rows = SparseRows(
                tensors[f"{index}.rows"],
                tensors[f"{index}.logprobs"],
                tensors[f"{index}.ids"],
                tensors[f"{index}.logsumexp"],
            )


def save_step_rows(path: str | Path, records: Sequence[StepRecord]) -> None:
    """Write the sparse target rows of `records` to a safetensors sidecar (atomically)."""
    from safetensors.torch import save

    with atomic_write(Path(path), "wb") as handle:
        handle.write(save(step_rows_tensors(records)))


def load_step_rows(path: str | Path, records: Sequence[StepRecord]) -> None:
    """Read a sidecar written by :func:`save_step_rows` into `records`."""
    from safetensors.torch import load_file

    attach_step_rows(records, load_file(str(path)))


def record_from_generation(
    record_id: str,
    generation: Generation,
    *,
    meta: Mapping[str, Any] | None = None,
    include_probs: bool = False,
) -> RolloutRecord:
    """An on-policy record from one ``SpeculativeDecoder.generate`` call: the prompt (no loss)
    then the generated tokens (loss), with every verification step attached."""
    prompt, tokens = list(generation.prompt), list(generation.tokens)
    return RolloutRecord(
        id=record_id,
        input_ids=prompt + tokens,
        loss_mask=[0] * len(prompt) + [1] * len(tokens),
        source="rollout",
        meta={**(meta or {}), "prompt_tokens": len(prompt), "tau": generation.tau},
        steps=[step_record_to_dict(r, include_probs=include_probs) for r in generation.records],
    )


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


def store_lock(directory: Path) -> contextlib.AbstractContextManager[None]:
    """The inter-process lock of the store in ``directory`` (its ``.lock`` file): every
    manifest read-modify-write, by the store or by `rekey_store`, holds it."""
    return file_lock(directory / ".lock", timeout=STORE_LOCK_TIMEOUT)


def rekey_store(directory: Path, old_hash: str, config: Mapping[str, Any]) -> bool:
    """Rewrite the owning configuration of the store in ``directory`` from ``old_hash`` to
    ``config``, in place and atomically, so a store adopted under a new cache key opens
    under it. Idempotent (already rekeyed: True); a store owned by anything else is left
    alone (False). Why: renaming a folder without its manifest left a store that refused
    itself as "made under another configuration"."""
    path = directory / MANIFEST
    new_hash = config_hash(config)
    with store_lock(directory):
        try:
            manifest = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return False
        if not isinstance(manifest, dict):
            return False
        if manifest.get("config_hash") == new_hash:
            return True
        if manifest.get("config_hash") != old_hash:
            return False
        manifest["config"], manifest["config_hash"] = dict(config), new_hash
        manifest.setdefault("rekeyed_from", old_hash)
        manifest["updated"] = _now()
        atomic_write_json(path, manifest)
    return True


def _diff_keys(old: Mapping[str, Any], new: Mapping[str, Any]) -> list[str]:
    keys = sorted(set(old) | set(new))
    return [k for k in keys if config_hash({"v": old.get(k)}) != config_hash({"v": new.get(k)})]


# --------------------------------------------------------------------------------------------
# Shard encoding
# --------------------------------------------------------------------------------------------


def _shard_format(name: str) -> str:
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
        header = json.loads(_safetensors_metadata(data).get("records", "[]"))
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


def _safetensors_metadata(data: bytes) -> dict[str, str]:
    """The ``__metadata__`` of a safetensors blob (8-byte little-endian header size, JSON)."""
    size = int.from_bytes(data[:8], "little")
    return json.loads(data[8 : 8 + size]).get("__metadata__") or {}


# --------------------------------------------------------------------------------------------
# The store
# --------------------------------------------------------------------------------------------


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
        return _shard_format(self.name)

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


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


class RolloutStore:
    """A directory of record shards owned by one configuration (see the module docstring).

    Opening a directory whose manifest carries another config hash raises
    :class:`ConfigMismatchError`; an absent manifest is created (claiming the directory).
    """

    def __init__(
        self,
        directory: str | Path,
        config: Mapping[str, Any],
        *,
        shard_format: str = "jsonl",
        prefix: str = "shard",
    ) -> None:
        if shard_format not in SHARD_FORMATS:
            raise ValueError(
                f"unknown shard format {shard_format!r}; choose one of {SHARD_FORMATS}"
            )
        if not re.fullmatch(r"[A-Za-z0-9_]+", prefix):
            raise ValueError(f"shard prefix {prefix!r} must be alphanumeric/underscore")
        self.directory = Path(directory).expanduser().resolve()
        self.config = json.loads(json.dumps(dict(config), sort_keys=True, default=str))
        self.config_hash = config_hash(self.config)
        self.shard_format = shard_format
        self.prefix = prefix
        self.directory.mkdir(parents=True, exist_ok=True)
        self.claims = WorkClaims(self.directory, self._locked)
        with self._locked():
            manifest = self._read_manifest()
            if manifest is None:
                atomic_write_json(self.directory / MANIFEST, self._new_manifest())
            else:
                self._check_config(manifest)

    # ------------------------------------------------------------------ manifest
    def _new_manifest(self) -> dict[str, Any]:
        return {
            "format_version": FORMAT_VERSION,
            "config_hash": self.config_hash,
            "config": self.config,
            "created": _now(),
            "updated": _now(),
            "shards": [],
            "complete": {},
        }

    def _read_manifest(self) -> dict[str, Any] | None:
        path = self.directory / MANIFEST
        if not path.exists():
            return None
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            raise StoreError(
                f"{path} is unreadable ({exc}); delete {self.directory} or use another cache dir"
            ) from exc
        if not isinstance(data, dict) or not isinstance(data.get("shards"), list):
            raise StoreError(
                f"{path} is not a rollout manifest; delete {self.directory} or use another "
                "cache dir"
            )
        return data

    def _check_config(self, manifest: Mapping[str, Any]) -> None:
        if int(manifest.get("format_version", 0)) > FORMAT_VERSION:
            raise StoreError(
                f"{self.directory} was written by a newer lightning-spec (format "
                f"{manifest.get('format_version')}); delete it or use another cache dir"
            )
        found = manifest.get("config_hash")
        if found != self.config_hash:
            differs = _diff_keys(manifest.get("config") or {}, self.config)
            raise ConfigMismatchError(
                f"{self.directory} holds rollouts made under another configuration (config hash "
                f"{found}, requested {self.config_hash}; differs in: "
                f"{', '.join(differs) or 'unknown'}). Delete {self.directory} or use another "
                "cache dir."
            )

    def manifest(self) -> dict[str, Any]:
        """The manifest as it is on disk now (other ranks may have added shards)."""
        manifest = self._read_manifest()
        if manifest is None:
            raise StoreError(f"{self.directory / MANIFEST} disappeared while in use")
        self._check_config(manifest)
        return manifest

    def _locked(self) -> contextlib.AbstractContextManager[None]:
        """Exclusive inter-process lock for read-modify-write of the manifest (``.lock``).

        Held for milliseconds (a manifest update, one shard write), so a wait of
        `STORE_LOCK_TIMEOUT` means a hung holder: the error names it."""
        return store_lock(self.directory)

    def _update(self, change: Any) -> dict[str, Any]:
        """Apply ``change(manifest)`` under the lock and rewrite the manifest atomically."""
        with self._locked():
            manifest = self.manifest()
            change(manifest)
            manifest["updated"] = _now()
            atomic_write_json(self.directory / MANIFEST, manifest)
            return manifest

    # ------------------------------------------------------------------ shards
    def shards(self) -> list[ShardInfo]:
        return [ShardInfo.from_dict(s) for s in self.manifest()["shards"]]

    @property
    def num_records(self) -> int:
        return sum(s.records for s in self.shards())

    def _clean_stale(self, rank: int) -> None:
        """Remove temp files a killed writer of ``rank`` left (never another rank's)."""
        remove_stale(self.directory, contains=f"-r{rank:03d}-")

    def write_shard(self, records: Sequence[RolloutRecord], *, rank: int = 0) -> ShardInfo | None:
        """Write ``records`` as the next shard of ``rank`` and list it in the manifest.

        The shard is complete on disk (fsynced, renamed) before the manifest names it, so a
        kill at any point leaves either the old manifest or the new one, never a listed half.
        Naming, writing and listing happen under the store lock, and the records' claims are
        marked done in the same step (`data.claims`): two processes sharing a store never pick
        one name, and records another writer has already listed are dropped (None when none is
        left).
        """
        if not records:
            raise ValueError("refusing to write an empty shard")
        for record in records:
            if record.source not in SOURCES:
                raise ValueError(f"record {record.id!r}: unknown source {record.source!r}")
        with self._locked():
            manifest = self.manifest()
            claims = self.claims.read()
            fresh = [
                r
                for r in records
                if not (
                    claims.get(r.id, {}).get("done") and claims[r.id].get("by") != self.claims.owner
                )
            ]
            if len(fresh) < len(records):
                log.info(
                    "%s: %d records were already written by another process; not written again",
                    self.directory,
                    len(records) - len(fresh),
                )
            if not fresh:
                return None
            seq = 1 + max(
                (
                    int(m["seq"])
                    for s in manifest["shards"]
                    if (m := _SHARD_RE.match(s["name"])) and int(m["rank"]) == rank
                ),
                default=0,
            )
            name = f"{self.prefix}-r{rank:03d}-{seq:06d}.{self.shard_format}"
            data = encode_shard(fresh, self.shard_format)
            self._clean_stale(rank)
            with atomic_write(self.directory / name, "wb") as fh:
                fh.write(data)
            info = ShardInfo(
                name=name,
                records=len(fresh),
                tokens=sum(len(r) for r in fresh),
                loss_tokens=sum(r.num_loss_tokens for r in fresh),
                bytes=len(data),
                sha256=hashlib.sha256(data).hexdigest(),
                rank=rank,
                ids=tuple(r.id for r in fresh),
            )
            manifest["shards"].append(info.to_dict())
            manifest["updated"] = _now()
            atomic_write_json(self.directory / MANIFEST, manifest)
            self.claims.mark_done(claims, [r.id for r in fresh])
            self.claims.write(claims)
        return info

    def read_shard(self, shard: ShardInfo | str, *, verify: bool = True) -> list[RolloutRecord]:
        """Records of one listed shard, after checking its size and sha256."""
        info = shard if isinstance(shard, ShardInfo) else self._find(shard)
        path = self.directory / info.name
        try:
            data = path.read_bytes()
        except OSError as exc:
            raise StoreError(
                f"{path} is listed in the manifest but unreadable ({exc}); delete "
                f"{self.directory} or use another cache dir"
            ) from exc
        if verify and (len(data) != info.bytes or hashlib.sha256(data).hexdigest() != info.sha256):
            raise StoreError(
                f"{path} fails its size/sha256 check against the manifest; delete "
                f"{self.directory} or use another cache dir"
            )
        return decode_shard(data, info.format)

    def _find(self, name: str) -> ShardInfo:
        for info in self.shards():
            if info.name == name:
                return info
        raise KeyError(f"{name} is not listed in {self.directory / MANIFEST}")

    def iter_records(self, *, verify: bool = True) -> Iterator[RolloutRecord]:
        """Every record of every listed shard, in manifest order."""
        for info in self.shards():
            yield from self.read_shard(info, verify=verify)

    def done_ids(self) -> set[str]:
        """Ids of the records already stored (what a resumed writer must skip)."""
        return {r.id for r in self.iter_records()}

    # ------------------------------------------------------------------ repair
    def _quarantine_file(self, name: str) -> None:
        """Move a damaged file aside (kept for inspection, never read again)."""
        source = self.directory / name
        if source.exists():
            target = self.directory / QUARANTINE / f"{name}.{int(datetime.now().timestamp())}"
            target.parent.mkdir(exist_ok=True)
            os.replace(source, target)

    def quarantine_shard(self, name: str, reason: str) -> tuple[str, ...] | None:
        """Unlist a damaged token shard (and its feature shards), move its file aside, clear
        the completion marks and its records' claims, so the next preparation makes exactly
        its records again. Returns their ids (None when an older manifest did not list them).
        """
        with self._locked():
            manifest = self.manifest()
            entry = next((e for e in manifest["shards"] if e["name"] == name), None)
            if entry is None:
                return None
            manifest["shards"] = [e for e in manifest["shards"] if e["name"] != name]
            for section in _feature_sections(manifest):
                feature = section.get("shards", {}).pop(name, None)
                if feature is not None:
                    section["bytes"] = max(0, int(section.get("bytes", 0)) - int(feature["bytes"]))
                    section.pop("full", None)
                    self._quarantine_file(feature["name"])
            manifest["complete"] = {}
            manifest["updated"] = _now()
            self._quarantine_file(name)
            atomic_write_json(self.directory / MANIFEST, manifest)
            ids = tuple(entry["ids"]) if entry.get("ids") is not None else None
            claims = self.claims.read()
            for record_id in ids or ():
                claims.pop(record_id, None)
            self.claims.write(claims)
        log.warning(
            "%s: shard %s is damaged (%s): moved to %s/ and unlisted; %s will be made again "
            "by the next preparation, nothing else",
            self.directory, name, reason, QUARANTINE,
            f"its {len(ids)} records ({', '.join(ids[:5])}{', ...' if len(ids) > 5 else ''})"
            if ids else "its records",
        )  # fmt: skip
        return ids

    def drop_feature_shard(self, shard: str, reason: str) -> None:
        """Forget a damaged feature shard of token shard `shard` (every feature config): its
        features are recomputed by the next caching pass or online; the records stay."""
        with self._locked():
            manifest = self.manifest()
            dropped = False
            for section in _feature_sections(manifest):
                feature = section.get("shards", {}).pop(shard, None)
                if feature is not None:
                    section["bytes"] = max(0, int(section.get("bytes", 0)) - int(feature["bytes"]))
                    section.pop("full", None)
                    self._quarantine_file(feature["name"])
                    dropped = True
            if dropped:
                manifest["updated"] = _now()
                atomic_write_json(self.directory / MANIFEST, manifest)
            claims = self.claims.read()  # its caching pass is done no more: it may run again
            stale = [k for k in claims if k.startswith("features:") and f":{shard}:" in k]
            for key in stale:
                del claims[key]
            if stale:
                self.claims.write(claims)
        log.warning(
            "%s: the cached features of %s are damaged (%s): dropped, they are computed again; "
            "its records are kept", self.directory, shard, reason,
        )  # fmt: skip

    def repair(self) -> dict[str, Any]:
        """Check every listed file (token shards by size and sha256, feature shards by size)
        and set aside what is damaged: `quarantine_shard` / `drop_feature_shard`. Returns
        ``{"shards": {name: ids or None}, "features": [shard, ...]}`` of what was set aside."""
        report: dict[str, Any] = {"shards": {}, "features": []}
        manifest = self.manifest()
        for entry in manifest["shards"]:
            path = self.directory / entry["name"]
            problem = None
            if not path.is_file():
                problem = "missing"
            elif path.stat().st_size != int(entry["bytes"]):
                problem = f"{path.stat().st_size} bytes, {entry['bytes']} listed (truncated?)"
            elif sha256_file(path) != entry["sha256"]:
                problem = "sha256 mismatch"
            if problem:
                report["shards"][entry["name"]] = self.quarantine_shard(entry["name"], problem)
        manifest = self.manifest()
        for section in _feature_sections(manifest):
            for shard, feature in list(section.get("shards", {}).items()):
                path = self.directory / feature["name"]
                if not path.is_file() or path.stat().st_size != int(feature["bytes"]):
                    self.drop_feature_shard(shard, "missing or truncated")
                    report["features"].append(shard)
        return report

    # ------------------------------------------------------------------ completion marks
    def mark_complete(self, key: str, **info: Any) -> None:
        """Record that the pass ``key`` (e.g. ``"first:1000"``) finished, so a later run can
        skip re-reading the source."""

        def add(manifest: dict[str, Any]) -> None:
            manifest.setdefault("complete", {})[key] = {"at": _now(), **info}

        self._update(add)

    def completed(self) -> dict[str, Any]:
        return dict(self.manifest().get("complete") or {})

    # ------------------------------------------------------------------ feature cache
    def _feature_section(
        self, manifest: dict[str, Any], feature_config: Mapping[str, Any], *, replace: bool = False
    ) -> dict[str, Any]:
        """The manifest's feature-cache section for ``feature_config``.

        Cached features are derived data: a cache made under another configuration (another
        target, dtype or cached fields) reads as empty, and the first write under the new
        configuration replaces it (``replace=True``, with the manifest lock held), deleting the
        old feature files but never the token shards.
        """
        wanted = config_hash(feature_config)
        fresh = {
            "config_hash": wanted,
            "config": dict(feature_config),
            "bytes": 0,
            "full": False,
            "shards": {},
        }
        section = manifest.get("features")
        if section is None:
            manifest["features"] = section = fresh
        elif section.get("config_hash") != wanted:
            if not replace:
                return fresh
            differs = _diff_keys(section.get("config") or {}, feature_config)
            log.warning(
                "the feature cache in %s was made under another configuration (differs in: "
                "%s): replacing it",
                self.directory,
                ", ".join(differs) or "unknown",
            )
            for entry in (section.get("shards") or {}).values():
                (self.directory / entry["name"]).unlink(missing_ok=True)
            manifest["features"] = section = fresh
        return section

    def feature_shards(self, feature_config: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
        """``{token shard name: feature shard entry}`` for the cached features."""
        manifest = self.manifest()
        return dict(self._feature_section(manifest, feature_config)["shards"])

    def feature_cache_full(self, feature_config: Mapping[str, Any]) -> bool:
        return bool(self._feature_section(self.manifest(), feature_config).get("full"))

    def write_features(
        self,
        shard: str,
        features: Mapping[str, Tensor],
        *,
        feature_config: Mapping[str, Any],
        cap_bytes: int,
        last_hidden: Mapping[str, Tensor] | None = None,
        target_argmax: Mapping[str, Tensor] | None = None,
    ) -> bool:
        """Cache ``{record id: [T, F]}`` features (stored fp16, rows past fp16's range with a
        per-row scale: `_flatten_rows`) for token shard ``shard``, and
        optionally the target's final hidden states ``{record id: [T, H]}`` (with both, an
        objective can skip the target forward: logits = LM head of the last hidden state).

        Returns False, writes nothing and marks the cache full when the shard would take the
        cache past ``cap_bytes`` (later shards are then served without features).
        """
        from safetensors.torch import save

        ids = list(features)
        tensors: dict[str, Tensor] = {}
        layers = list(feature_config.get("feature_layers") or [])
        _put_rows(tensors, "features", [features[i] for i in ids], layers=layers)
        if last_hidden is not None:
            if any(last_hidden[i].shape[0] != features[i].shape[0] for i in ids):
                raise ValueError("last_hidden and features must cover the same tokens")
            _put_rows(tensors, "last_hidden", [last_hidden[i] for i in ids])
        if target_argmax is not None:
            # The target's full-vocabulary argmax per token: the exact label of acceptance
            # metrics, which the LM head on `last_hidden` would otherwise recompute in full.
            if any(target_argmax[i].shape != features[i].shape[:1] for i in ids):
                raise ValueError("target_argmax and features must cover the same tokens")
            tensors["target_argmax"] = (
                torch.cat([target_argmax[i].reshape(-1).to("cpu", torch.int32) for i in ids])
                if ids
                else torch.zeros(0, dtype=torch.int32)
            )
        offsets = torch.zeros(len(ids) + 1, dtype=torch.int64)
        offsets[1:] = torch.tensor([features[i].shape[0] for i in ids], dtype=torch.int64).cumsum(0)
        tensors["offsets"] = offsets
        data = save(tensors, metadata={"ids": json.dumps(ids), "shard": shard})
        with self._locked():
            manifest = self.manifest()
            section = self._feature_section(manifest, feature_config, replace=True)
            previous = section["shards"].get(shard)  # replaced by a superset of its records
            used = section["bytes"] - (int(previous["bytes"]) if previous else 0)
            if section.get("full") or used + len(data) > cap_bytes:
                if not section.get("full"):
                    log.info(
                        "feature cache in %s reached its cap (%d of %d bytes used; next shard "
                        "needs %d): remaining shards get features online",
                        self.directory,
                        used,
                        cap_bytes,
                        len(data),
                    )
                    section["full"] = True
                    manifest["updated"] = _now()
                    atomic_write_json(self.directory / MANIFEST, manifest)
                return False
            name = f"features-{shard.split('.')[0]}.safetensors"
            try:
                with atomic_write(self.directory / name, "wb") as fh:
                    fh.write(data)
            except OSError as error:
                if not is_disk_full(error):
                    raise
                # Features are derived data: a full disk costs this pass its caching, not the
                # run. Not recorded as "full", so the next run caches once space is back.
                log.error(
                    "the disk holding %s is full (%s) writing %s (%d bytes): training goes on "
                    "with features computed online for the shards not cached; free space and "
                    "the next run caches them",
                    self.directory, os.strerror(error.errno or 0), name, len(data),
                )  # fmt: skip
                return False
            section["shards"][shard] = {
                "name": name,
                "records": len(ids),
                "bytes": len(data),
                "sha256": hashlib.sha256(data).hexdigest(),
            }
            section["bytes"] = used + len(data)
            manifest["updated"] = _now()
            atomic_write_json(self.directory / MANIFEST, manifest)
        return True

    def read_features(
        self,
        shard: str,
        *,
        feature_config: Mapping[str, Any],
        verify: bool = True,
        key: str = "features",
    ) -> dict[str, Tensor]:
        """``{record id: [T, F]}`` cached for token shard ``shard`` (fp16; float32 for records
        stored with a per-row scale; empty if none);
        ``key="last_hidden"`` gives the cached final hidden states instead."""
        return self.read_cached(shard, feature_config=feature_config, verify=verify)[key]

    def read_cached(
        self, shard: str, *, feature_config: Mapping[str, Any], verify: bool = True
    ) -> dict[str, dict[str, Tensor]]:
        """Every cached field of token shard ``shard`` from one read of its file:
        ``{"features" | "last_hidden" | "target_argmax": {record id: tensor}}`` (empty dicts
        for what is not cached)."""
        from safetensors.torch import load

        out: dict[str, dict[str, Tensor]] = {k: {} for k in CACHED_FIELDS}
        entry = self.feature_shards(feature_config).get(shard)
        if entry is None:
            return out
        path = self.directory / entry["name"]
        data = path.read_bytes()
        if verify and (
            len(data) != entry["bytes"] or hashlib.sha256(data).hexdigest() != entry["sha256"]
        ):
            raise StoreError(
                f"{path} fails its sha256 check; delete {self.directory} or use another cache dir"
            )
        tensors = load(data)
        ids = json.loads(_safetensors_metadata(data)["ids"])
        offsets = tensors["offsets"].tolist()
        for key in CACHED_FIELDS:
            if key in tensors:
                flat = tensors[key]
                scale = tensors.get(f"{key}{SCALE_SUFFIX}")
                if scale is not None:  # rows past fp16's range, stored divided by a scale
                    flat = flat.float() * scale.unsqueeze(-1)
                out[key] = {rid: flat[offsets[i] : offsets[i + 1]] for i, rid in enumerate(ids)}
        return out


FLOAT16_MAX = 65504.0
SCALE_SUFFIX = "_scale"


def _feature_sections(manifest: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The manifest's feature-cache sections (one, under ``features``, or none)."""
    section = manifest.get("features")
    return [section] if isinstance(section, dict) else []


def _put_rows(
    tensors: dict[str, Tensor], name: str, rows: Sequence[Tensor], layers: Sequence[int] = ()
) -> None:
    """``tensors[name]`` (fp16 rows) and, when some row needed one, ``tensors[name_scale]``."""
    flat, scale = _flatten_rows(rows, name, layers)
    tensors[name] = flat
    if scale is not None:
        tensors[f"{name}{SCALE_SUFFIX}"] = scale


#: Rows whose largest magnitude passes this are stored divided by a per-row scale (see below).
FLOAT16_SAFE = 32768.0


def _where_non_finite(row: Tensor, name: str, index: int, layers: Sequence[int]) -> str:
    """Where in record ``index`` the first non-finite value sits, and how large the finite ones
    grew: overflow (a huge finite peak) and a broken target (NaN at unit scale) read apart."""
    finite = torch.isfinite(row)
    token, column = (int(v) for v in (~finite).nonzero()[0])
    where = f"record {index}, token {token}, column {column}"
    if layers and row.shape[-1] % len(layers) == 0:
        width = row.shape[-1] // len(layers)
        where += (
            f" (hidden unit {column % width} of target layer {layers[column // width]}, "
            "a hidden_states index)"
        )
    elif name == "last_hidden":
        where += " (the target's final hidden state)"
    peak = float(row[finite].abs().max()) if bool(finite.any()) else float("nan")
    cause = (
        "activations this large overflow a 16-bit target dtype: load the target in float32"
        if peak > FLOAT16_MAX / 4
        else "at ordinary magnitudes, so the target itself computes NaN: check its weights"
    )
    return (
        f"cached {name}: the target produced non-finite values (NaN/inf) in {where}; the "
        f"largest finite magnitude in that record is {peak:.3g} ({cause})"
    )


def _flatten_rows(
    rows: Sequence[Tensor], name: str, layers: Sequence[int] = ()
) -> tuple[Tensor, Tensor | None]:
    """Concatenate ``[T_i, D]`` rows into one fp16 ``[sum T_i, D]`` tensor on the CPU, and the
    per-row scales it must be multiplied by (None when every scale is 1).

    Some targets' hidden states reach 1e5 (activation outliers), past fp16's 65,504. Such rows
    are stored as fp16(row / s) with s = max|row| / 32768, so every element keeps fp16's 11-bit
    precision relative to its row: finer than bf16 (8 bits) at the same size, plus 4 bytes a
    row, and rows within range are stored exactly as before (no scale tensor, old caches read
    unchanged). Non-finite values are refused with the record and column named: a drafter
    trained on inf features learns nothing but NaN, and the store would serve them to every
    later run."""
    if any(r.dim() != 2 for r in rows) or len({int(r.shape[-1]) for r in rows}) > 1:
        raise ValueError(f"{name} must be [T, D] with one D for every record")
    scaled: list[Tensor] = []
    scales: list[Tensor] = []
    for index, row in enumerate(rows):
        row = row.detach().to("cpu", torch.float32)
        finite = torch.isfinite(row)
        if not bool(finite.all()):
            raise ValueError(_where_non_finite(row, name, index, layers))
        peak = row.abs().amax(dim=-1) if row.numel() else row.new_zeros(row.shape[0])
        scale = (peak / FLOAT16_SAFE).clamp_min(1.0)  # [T]
        scaled.append((row / scale.unsqueeze(-1)).to(torch.float16))
        scales.append(scale)
    if not rows:
        return torch.zeros(0, 0, dtype=torch.float16), None
    scale = torch.cat(scales)
    return torch.cat(scaled).contiguous(), None if bool((scale == 1).all()) else scale


def verify_store(directory: str | Path) -> list[str]:
    """Problems found by re-hashing every listed file of a store (empty list: all good)."""
    directory = Path(directory)
    manifest = json.loads((directory / MANIFEST).read_text(encoding="utf-8"))
    problems = []
    entries: Iterable[Mapping[str, Any]] = list(manifest.get("shards", []))
    entries = [*entries, *(manifest.get("features") or {}).get("shards", {}).values()]
    for entry in entries:
        path = directory / entry["name"]
        if not path.exists():
            problems.append(f"{entry['name']} is missing")
        elif os.path.getsize(path) != entry["bytes"] or sha256_file(path) != entry["sha256"]:
            problems.append(f"{entry['name']} fails its sha256 check")
    return problems
