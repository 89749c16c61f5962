"""The shard store that keeps training records on disk (records: `data.records`).

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
import hashlib
import json
import logging
import os
import re
from collections.abc import Iterable, Iterator, Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

from lightning_spec.data.claims import WorkClaims
from lightning_spec.data.records import FORMAT_VERSION, SOURCES, RolloutRecord
from lightning_spec.data.shards import (
    SHARD_FORMATS,
    SHARD_NAME,
    ConfigMismatchError,
    ShardInfo,
    StoreError,
    config_hash,
    decode_shard,
    diff_keys,
    encode_shard,
    now,
)
from lightning_spec.data.store_features import FeatureCache, feature_sections
from lightning_spec.io import atomic_write, atomic_write_json, file_lock, remove_stale, sha256_file

__all__ = ["MANIFEST", "QUARANTINE", "RolloutStore", "rekey_store", "store_lock", "verify_store"]

log = logging.getLogger(__name__)

MANIFEST = "manifest.json"
QUARANTINE = "quarantine"
STORE_LOCK_TIMEOUT = 600.0
"""Seconds a store operation waits for the store lock before naming its holder."""


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
        manifest["updated"] = now()
        atomic_write_json(path, manifest)
    return True


class RolloutStore(FeatureCache):
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
            "created": now(),
            "updated": now(),
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
            differs = diff_keys(manifest.get("config") or {}, self.config)
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
            manifest["updated"] = now()
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
                    if (m := SHARD_NAME.match(s["name"])) and int(m["rank"]) == rank
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
            manifest["updated"] = now()
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
            for section in feature_sections(manifest):
                feature = section.get("shards", {}).pop(name, None)
                if feature is not None:
                    section["bytes"] = max(0, int(section.get("bytes", 0)) - int(feature["bytes"]))
                    section.pop("full", None)
                    self._quarantine_file(feature["name"])
            manifest["complete"] = {}
            manifest["updated"] = now()
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
        for section in feature_sections(manifest):
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
            manifest.setdefault("complete", {})[key] = {"at": now(), **info}

        self._update(add)

    def completed(self) -> dict[str, Any]:
        return dict(self.manifest().get("complete") or {})


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
