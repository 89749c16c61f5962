"""The feature cache of a rollout store: the target's tensors beside the token shards.

Optional feature shards cache, per record, the target's fused EAGLE-3 features (fp16
``[T, F]``), its final hidden states ``[T, H]`` and its argmax ``[T]``, up to a byte cap
(features are ~3.4 KB per token for SmolLM2, so an unbounded cache would not fit a CI disk;
beyond the cap, features are computed online). They are derived data: a cache made under
another configuration reads as empty and is replaced by the first write, a damaged file is
dropped and recomputed, and the token shards are never touched. Rows past fp16's range are
stored with a per-row scale (`flatten_rows`).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from lightning_spec.data.shards import (
    StoreError,
    config_hash,
    diff_keys,
    now,
    safetensors_metadata,
)
from lightning_spec.io import atomic_write, atomic_write_json, is_disk_full

__all__ = ["CACHED_FIELDS", "FeatureCache", "feature_sections", "flatten_rows"]

log = logging.getLogger(__name__)

CACHED_FIELDS = ("features", "last_hidden", "target_argmax")
"""What a feature-cache shard file can hold per record (see ``FeatureCache.write_features``)."""
MANIFEST = "manifest.json"


class FeatureCache:
    """The feature-cache half of `RolloutStore` (a mixin: it reads the store's ``directory``,
    ``manifest()``, ``_locked()``, ``claims`` and ``_quarantine_file``)."""

    directory: Path
    claims: Any

    def manifest(self) -> dict[str, Any]:  # provided by the store
        raise NotImplementedError

    def _locked(self) -> Any:  # provided by the store
        raise NotImplementedError

    def _quarantine_file(self, name: str) -> None:  # provided by the store
        raise NotImplementedError

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
            differs = diff_keys(section.get("config") or {}, feature_config)
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
        per-row scale: `flatten_rows`) for token shard ``shard``, and
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
                    manifest["updated"] = now()
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
            manifest["updated"] = now()
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
        ids = json.loads(safetensors_metadata(data)["ids"])
        offsets = tensors["offsets"].tolist()
        for key in CACHED_FIELDS:
            if key in tensors:
                flat = tensors[key]
                scale = tensors.get(f"{key}{SCALE_SUFFIX}")
                if scale is not None:  # rows past fp16's range, stored divided by a scale
                    flat = flat.float() * scale.unsqueeze(-1)
                out[key] = {rid: flat[offsets[i] : offsets[i + 1]] for i, rid in enumerate(ids)}
        return out

    def drop_feature_shard(self, shard: str, reason: str) -> None:
        """Forget a damaged feature shard of token shard `shard` (every feature config): its
        features are recomputed by the next caching pass or online; the records stay."""
        with self._locked():
            manifest = self.manifest()
            dropped = False
            for section in feature_sections(manifest):
                feature = section.get("shards", {}).pop(shard, None)
                if feature is not None:
                    section["bytes"] = max(0, int(section.get("bytes", 0)) - int(feature["bytes"]))
                    section.pop("full", None)
                    self._quarantine_file(feature["name"])
                    dropped = True
            if dropped:
                manifest["updated"] = now()
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


FLOAT16_MAX = 65504.0
SCALE_SUFFIX = "_scale"


def feature_sections(manifest: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The manifest's feature-cache sections (one, under ``features``, or none)."""
    section = manifest.get("features")
    return [section] if isinstance(section, dict) else []


def _put_rows(
    tensors: dict[str, Tensor], name: str, rows: Sequence[Tensor], layers: Sequence[int] = ()
) -> None:
    """``tensors[name]`` (fp16 rows) and, when some row needed one, ``tensors[name_scale]``."""
    flat, scale = flatten_rows(rows, name, layers)
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


def flatten_rows(
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
