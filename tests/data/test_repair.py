"""Repair, not "delete the store": a damaged shard is set aside and only its contents redone."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import torch

from lightning_spec.data.records import RolloutRecord
from lightning_spec.data.rollouts import QUARANTINE, RolloutStore, verify_store

CONFIG = {"target": "tiny", "tokenizer": {"name": "t", "size": 10}, "max_length": 64}
FEATURES = {"target": "tiny"}


def _records(count: int, start: int = 0) -> list[RolloutRecord]:
    return [RolloutRecord(f"r{i}", [1, 2, 3, i % 7], [0, 1, 1, 1], "dataset", {})
            for i in range(start, start + count)]  # fmt: skip


def _features(records: list[RolloutRecord]) -> dict[str, torch.Tensor]:
    return {r.id: torch.randn(len(r), 4) for r in records}


def test_a_corrupted_token_shard_is_set_aside_and_reported_by_record(tmp_path: Path) -> None:
    store = RolloutStore(tmp_path, CONFIG)
    first, second = _records(3), _records(3, start=3)
    a, b = store.write_shard(first), store.write_shard(second)
    store.write_features(b.name, _features(second), feature_config=FEATURES, cap_bytes=10**6)
    store.mark_complete("all")
    path = tmp_path / b.name
    data = path.read_bytes()
    path.write_bytes(data.replace(b'"r3"', b'"x3"', 1))  # same size, other bytes
    report = store.repair()
    assert report == {"shards": {b.name: ("r3", "r4", "r5")}, "features": []}
    assert [s.name for s in store.shards()] == [a.name]  # the good shard stays
    assert store.done_ids() == {"r0", "r1", "r2"}  # the lost records will be made again
    assert store.completed() == {}  # so the next preparation runs
    assert store.feature_shards(FEATURES) == {}  # its features went with it
    assert len(list((tmp_path / QUARANTINE).iterdir())) == 2  # kept for inspection
    assert verify_store(tmp_path) == []
    assert store.repair() == {"shards": {}, "features": []}


def test_a_truncated_feature_shard_is_dropped_and_its_records_kept(tmp_path: Path) -> None:
    store = RolloutStore(tmp_path, CONFIG)
    records = _records(4)
    info = store.write_shard(records)
    store.write_features(info.name, _features(records), feature_config=FEATURES, cap_bytes=10**6)
    entry = store.feature_shards(FEATURES)[info.name]
    feature_file = tmp_path / entry["name"]
    feature_file.write_bytes(feature_file.read_bytes()[: entry["bytes"] // 2])
    assert store.repair() == {"shards": {}, "features": [info.name]}
    assert store.feature_shards(FEATURES) == {}
    assert store.done_ids() == {r.id for r in records}  # hours of answers are never lost
    assert store.write_features(  # and the features can be cached again
        info.name, _features(records), feature_config=FEATURES, cap_bytes=10**6
    )


def test_a_kill_during_a_feature_flush_leaves_the_store_consistent(tmp_path: Path) -> None:
    """A real process SIGKILLed while writing a feature shard: the manifest never names the
    half-written file, so the store verifies and the next writer caches the shard."""
    store = RolloutStore(tmp_path / "s", CONFIG)
    records = _records(3)
    info = store.write_shard(records)
    script = textwrap.dedent(
        f"""
        import os, signal, torch
        import lightning_spec.data.store_features as features_module
        from lightning_spec.data.rollouts import RolloutStore
        real = features_module.atomic_write

        class Dying:
            def __init__(self, path, mode="wb"):
                self.inner = real(path, mode)
            def __enter__(self):
                handle = self.inner.__enter__()
                class Half:
                    def write(self, data):
                        handle.write(data[: len(data) // 2])
                        handle.flush()
                        os.kill(os.getpid(), signal.SIGKILL)
                return Half()
            def __exit__(self, *exc):
                return self.inner.__exit__(*exc)

        features_module.atomic_write = Dying
        store = RolloutStore({str(tmp_path / "s")!r}, {CONFIG!r})
        features = {{r: torch.randn(4, 4) for r in ("r0", "r1", "r2")}}
        store.write_features({info.name!r}, features, feature_config={FEATURES!r}, cap_bytes=10**6)
        """
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert done.returncode == -9, done.stderr[-2000:]
    assert store.feature_shards(FEATURES) == {}
    assert verify_store(tmp_path / "s") == []
    assert store.repair() == {"shards": {}, "features": []}
    assert store.write_features(info.name, _features(records), feature_config=FEATURES,
                                cap_bytes=10**6)  # fmt: skip


def _module(assets: dict[str, str], tmp_path: Path):  # noqa: ANN202
    """A data module over the tiny target and chats, caching features, in `tmp_path/cache`."""
    from lightning_spec.data.datamodule import RolloutDataModule

    return RolloutDataModule(
        target=assets["model"], dataset=assets["chats"], cache_dir=str(tmp_path / "cache"),
        mode="dataset", max_length=64, records_per_shard=8, feature_cache_bytes=10**8,
        progress=False,
    )  # fmt: skip


def test_preparation_redoes_only_the_damaged_shard(tiny_cli_assets: dict[str, str], tmp_path: Path) -> None:
    """The data module repairs before preparing: a corrupted dataset shard is rendered again
    (only its conversations), a truncated feature shard is cached again (only its records)."""
    from lightning_spec.data.regenerate import feature_config

    first = _module(tiny_cli_assets, tmp_path)
    first.prepare_data()
    store = first.store("dataset")
    shards = store.shards()
    config = feature_config(first.target_model, first.stores.feature_target_id)
    def inodes() -> dict[str, int]:  # a file written again is a new inode
        return {k: (store.directory / v["name"]).stat().st_ino
                for k, v in store.feature_shards(config).items()}  # fmt: skip

    features_before = inodes()
    victim = shards[1]
    path = store.directory / victim.name
    path.write_bytes(path.read_bytes()[:-10])  # truncated
    other = shards[2]
    feature = store.directory / store.feature_shards(config)[other.name]["name"]
    feature.write_bytes(feature.read_bytes()[:100])

    second = _module(tiny_cli_assets, tmp_path)
    second.prepare_data()
    store = second.store("dataset")
    ids = [r.id for r in store.iter_records()]
    assert len(ids) == len(set(ids)) == 40
    now = {s.name for s in store.shards()}
    assert {s.name for s in shards} - now == {victim.name}  # only the damaged shard was redone
    assert len(now) == len(shards)
    cached = store.feature_shards(config)
    assert set(cached) == now and sum(e["records"] for e in cached.values()) == 40
    after = inodes()
    unchanged = [k for k, v in features_before.items() if after.get(k) == v]
    assert set(unchanged) == {s.name for s in shards} - {victim.name, other.name}
    manifest = json.loads((store.directory / "manifest.json").read_text())
    assert all("ids" in entry for entry in manifest["shards"])


def test_a_full_disk_under_the_feature_cache_costs_the_caching_not_the_run(
    tiny_cli_assets: dict[str, str], tmp_path: Path, monkeypatch, caplog
) -> None:
    """Feature shards after the first are written to `/dev/full` (a real ENOSPC from the
    kernel): preparation finishes with one shard cached and an error naming the folder, leaves
    no temporary file, and the next run, with space back, caches the rest."""
    import contextlib
    import logging

    import lightning_spec.data.store_features as features_module
    from lightning_spec.data.regenerate import feature_config

    real, written = features_module.atomic_write, []

    @contextlib.contextmanager
    def full_after_one(path, mode="wb"):
        feature = Path(path).name.startswith("features-")
        if not feature or not written:
            written.extend([path] if feature else [])
            with real(path, mode) as handle:
                yield handle
            return
        with open("/dev/full", mode) as handle:  # the write's flush raises ENOSPC
            yield handle
            handle.flush()

    monkeypatch.setattr(features_module, "atomic_write", full_after_one)
    first = _module(tiny_cli_assets, tmp_path)
    with caplog.at_level(logging.ERROR, logger="lightning_spec.data.store_features"):
        first.prepare_data()
    store = first.store("dataset")
    config = feature_config(first.target_model, first.stores.feature_target_id)
    assert len(store.feature_shards(config)) == 1 < len(store.shards())
    assert any("is full" in r.getMessage() and str(store.directory) in r.getMessage()
               for r in caplog.records)  # fmt: skip
    assert verify_store(store.directory) == []
    assert not [p for p in store.directory.iterdir() if ".tmp" in p.name]
    assert not store.feature_cache_full(config)  # not remembered as a cap: retried next run
    monkeypatch.setattr(features_module, "atomic_write", real)
    second = _module(tiny_cli_assets, tmp_path)
    second.prepare_data()
    cached = second.store("dataset").feature_shards(config)
    assert set(cached) == {s.name for s in store.shards()}
    assert sum(entry["records"] for entry in cached.values()) == 40
