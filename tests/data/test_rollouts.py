"""Record format, StepRecord serialization and the shard store (atomic writes, manifest,
checksums, config ownership, feature cache cap)."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest
import torch

from lightning_spec.data.records import (
    RolloutRecord,
    record_from_generation,
    step_record_from_dict,
    step_record_to_dict,
)
from lightning_spec.data.rollouts import MANIFEST, RolloutStore, verify_store
from lightning_spec.data.shards import (
    SHARD_FORMATS,
    ConfigMismatchError,
    StoreError,
    config_hash,
    decode_shard,
    encode_shard,
)
from lightning_spec.decoding.engine import Generation, StepRecord
from lightning_spec.decoding.tree import DraftTree

CONFIG = {"target": "tiny", "tokenizer": {"name": "t", "size": 10}, "max_length": 64}


def _records(count: int, start: int = 0, source: str = "dataset") -> list[RolloutRecord]:
    return [
        RolloutRecord(
            id=f"r{i}",
            input_ids=list(range(i % 7 + 3)),
            loss_mask=[0, 0] + [1] * (i % 7 + 1),
            source=source,
            meta={"order": i, "note": "é"},
        )
        for i in range(start, start + count)
    ]


def _step(num_nodes: int = 4, probs: bool = False, vocab: int = 6) -> StepRecord:
    generator = torch.Generator().manual_seed(num_nodes)
    tree = DraftTree(
        tokens=torch.randint(0, vocab, (num_nodes,), generator=generator),
        parents=torch.tensor([-1, 0, 0, 1][:num_nodes]),
        logprobs=-torch.rand(num_nodes, generator=generator),
        draft_probs=torch.rand(num_nodes + 1, vocab, generator=generator) if probs else None,
        iid_children=probs,
    )
    return StepRecord(
        anchor=11,
        tree=tree,
        target_token_logprobs=-torch.rand(num_nodes, generator=generator),
        target_argmax=torch.randint(0, vocab, (num_nodes + 1,), generator=generator),
        accepted=torch.tensor([0, 1]),
        committed=[5, 3, 2],
        temperature=0.7 if probs else 0.0,
        target_probs=torch.rand(num_nodes + 1, vocab, generator=generator) if probs else None,
        timings={"draft": 0.01, "verify": 0.02},
    )


def _assert_steps_equal(a: StepRecord, b: StepRecord, probs: bool) -> None:
    assert a.anchor == b.anchor and a.committed == b.committed
    assert a.temperature == pytest.approx(b.temperature)
    for name in ("tokens", "parents"):
        assert torch.equal(getattr(a.tree, name), getattr(b.tree, name))
    assert torch.allclose(a.tree.logprobs, b.tree.logprobs)
    assert a.tree.iid_children == b.tree.iid_children
    assert torch.allclose(a.target_token_logprobs, b.target_token_logprobs)
    assert torch.equal(a.target_argmax, b.target_argmax)
    assert torch.equal(a.accepted, b.accepted)
    assert a.rejected.tolist() == b.rejected.tolist()
    if probs:
        assert torch.allclose(a.tree.draft_probs, b.tree.draft_probs)
        assert torch.allclose(a.target_probs, b.target_probs)
    else:
        assert b.tree.draft_probs is None and b.target_probs is None


# --------------------------------------------------------------------------------------------
# Records and StepRecords
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("probs", [False, True])
def test_step_record_round_trip_through_json(probs: bool) -> None:
    step = _step(probs=probs)
    data = json.loads(json.dumps(step_record_to_dict(step, include_probs=probs)))
    assert set(data["tree"]) >= {"tokens", "parents", "logprobs", "iid_children"}
    back = step_record_from_dict(data)
    back.tree.validate()
    _assert_steps_equal(step, back, probs)


def test_big_distribution_rows_are_skipped_unless_asked() -> None:
    data = step_record_to_dict(_step(probs=True))
    assert "draft_probs" not in data["tree"] and "target_probs" not in data
    back = step_record_from_dict(data)
    assert back.tree.draft_probs is None and back.target_probs is None


def test_empty_tree_step_round_trips() -> None:
    step = StepRecord(
        anchor=0,
        tree=DraftTree.empty(),
        target_token_logprobs=torch.zeros(0),
        target_argmax=torch.tensor([4]),
        accepted=torch.zeros(0, dtype=torch.long),
        committed=[4],
    )
    back = step_record_from_dict(step_record_to_dict(step))
    assert back.tree.num_nodes == 0 and back.committed == [4] and back.accept_length == 0


def test_record_from_generation_masks_the_prompt_and_keeps_steps() -> None:
    generation = Generation(prompt=[1, 2, 3], tokens=[7, 8, 9, 2], records=[_step(), _step(2)])
    record = record_from_generation("g0", generation, meta={"prompt_id": "p"})
    assert record.source == "rollout"
    assert record.input_ids == [1, 2, 3, 7, 8, 9, 2]
    assert record.loss_mask == [0, 0, 0, 1, 1, 1, 1]
    assert record.meta["prompt_id"] == "p" and record.meta["prompt_tokens"] == 3
    steps = RolloutRecord.from_dict(json.loads(json.dumps(record.to_dict()))).step_records()
    assert len(steps) == 2
    _assert_steps_equal(generation.records[0], steps[0], probs=False)


def test_record_validation_and_truncation() -> None:
    with pytest.raises(ValueError, match="loss-mask"):
        RolloutRecord("x", [1, 2], [0])
    with pytest.raises(ValueError, match="input_ids"):
        RolloutRecord.from_dict({"id": "x", "loss_mask": []})
    record = RolloutRecord("x", [1, 2, 3, 4], [0, 1, 1, 1])
    assert record.truncated(2).input_ids == [1, 2] and record.truncated(2).loss_mask == [0, 1]
    assert record.truncated(None) is record and record.truncated(10) is record


@pytest.mark.parametrize("fmt", SHARD_FORMATS)
def test_shard_encoding_round_trips(fmt: str) -> None:
    records = _records(5)
    records[1].steps = [step_record_to_dict(_step())]
    back = decode_shard(encode_shard(records, fmt), fmt)
    assert [r.to_dict() for r in back] == [r.to_dict() for r in records]
    # Reproducible bytes (gzip without a timestamp): identical data gives identical checksums.
    assert encode_shard(records, fmt) == encode_shard(records, fmt)


# --------------------------------------------------------------------------------------------
# The store
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", SHARD_FORMATS)
def test_store_writes_shards_and_manifest(tmp_path: Path, fmt: str) -> None:
    store = RolloutStore(tmp_path / "s", CONFIG, shard_format=fmt)
    first = store.write_shard(_records(4))
    second = store.write_shard(_records(3, start=4), rank=1)
    assert first.name == f"shard-r000-000001.{fmt}" and second.name == f"shard-r001-000001.{fmt}"
    manifest = json.loads((tmp_path / "s" / MANIFEST).read_text())
    assert manifest["config_hash"] == config_hash(CONFIG) == store.config_hash
    assert manifest["config"]["max_length"] == 64
    assert [s["records"] for s in manifest["shards"]] == [4, 3]
    assert manifest["shards"][0]["tokens"] == sum(len(r) for r in _records(4))
    assert manifest["shards"][0]["loss_tokens"] == sum(r.num_loss_tokens for r in _records(4))
    assert store.num_records == 7
    assert store.done_ids() == {f"r{i}" for i in range(7)}
    assert [r.id for r in store.iter_records()] == [f"r{i}" for i in range(7)]
    assert verify_store(tmp_path / "s") == []
    # Nothing but shards, the manifest, the claims and the lock: no temp file survives a write.
    names = sorted(p.name for p in (tmp_path / "s").iterdir())
    assert names == sorted([".lock", MANIFEST, "claims.json", first.name, second.name])
    # Reopening under the same config sees the same shards.
    assert RolloutStore(tmp_path / "s", dict(reversed(CONFIG.items()))).num_records == 7


def test_reading_verifies_checksums(tmp_path: Path) -> None:
    store = RolloutStore(tmp_path, CONFIG)
    info = store.write_shard(_records(3))
    path = tmp_path / info.name
    data = path.read_bytes()
    tampered = data.replace(b'"input_ids":[0,', b'"input_ids":[5,', 1)
    assert tampered != data and len(tampered) == len(data)
    path.write_bytes(tampered)
    with pytest.raises(StoreError, match="sha256"):
        list(store.iter_records())
    assert verify_store(tmp_path) == [f"{info.name} fails its sha256 check"]
    assert store.read_shard(info, verify=False)  # still parseable when asked not to verify


def test_a_store_refuses_another_config(tmp_path: Path) -> None:
    RolloutStore(tmp_path / "s", CONFIG).write_shard(_records(2))
    other = {**CONFIG, "max_length": 128}
    with pytest.raises(ConfigMismatchError) as info:
        RolloutStore(tmp_path / "s", other)
    message = str(info.value)
    assert "max_length" in message and str(tmp_path / "s") in message
    assert "Delete" in message and "another cache dir" in message


def test_unlisted_and_partial_shards_never_count(tmp_path: Path) -> None:
    """A kill between the shard rename and the manifest update leaves an unlisted shard; a kill
    mid-write leaves a temp file. Neither counts, and the next write replaces both."""
    store = RolloutStore(tmp_path, CONFIG)
    store.write_shard(_records(2))
    orphan = tmp_path / "shard-r000-000002.jsonl"
    orphan.write_bytes(encode_shard(_records(2, start=2), "jsonl"))
    partial = tmp_path / ".shard-r000-000003.jsonl.tmp-abc"
    partial.write_bytes(b'{"id": "r9", "input_')
    other_rank_partial = tmp_path / ".shard-r001-000001.jsonl.tmp-def"
    other_rank_partial.write_bytes(b"")
    assert store.done_ids() == {"r0", "r1"}
    info = store.write_shard(_records(1, start=5))
    assert info.name == orphan.name  # the unlisted file is overwritten by the listed one
    assert store.done_ids() == {"r0", "r1", "r5"}
    assert not partial.exists()
    assert other_rank_partial.exists()  # another rank may still be writing it


def test_completion_marks(tmp_path: Path) -> None:
    store = RolloutStore(tmp_path, CONFIG)
    assert store.completed() == {}
    store.mark_complete("first:10", failed=0)
    assert RolloutStore(tmp_path, CONFIG).completed()["first:10"]["failed"] == 0


def test_ranks_share_one_manifest(tmp_path: Path) -> None:
    """Concurrent writers (one per rank) never lose each other's manifest entries."""
    stores = [RolloutStore(tmp_path, CONFIG) for _ in range(3)]

    def write(rank: int) -> None:
        for shard in range(4):
            stores[rank].write_shard(_records(2, start=100 * rank + 10 * shard), rank=rank)

    threads = [threading.Thread(target=write, args=(rank,)) for rank in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    shards = stores[0].shards()
    assert len(shards) == 12 and len({s.name for s in shards}) == 12
    assert stores[0].num_records == 24 and verify_store(tmp_path) == []


def test_bad_arguments(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="shard format"):
        RolloutStore(tmp_path, CONFIG, shard_format="csv")
    store = RolloutStore(tmp_path, CONFIG)
    with pytest.raises(ValueError, match="empty"):
        store.write_shard([])
    with pytest.raises(ValueError, match="source"):
        store.write_shard(_records(1, source="elsewhere"))


def test_feature_cache_respects_its_cap(tmp_path: Path) -> None:
    store = RolloutStore(tmp_path, CONFIG)
    infos = [store.write_shard(_records(2, start=2 * k)) for k in range(3)]
    feature_config = {"target": "tiny", "layers": [1, 2]}
    width, length = 64, 5  # equal sizes per shard; the data dwarfs the safetensors header
    per_shard = {
        info.name: {r.id: torch.randn(length, width) for r in store.read_shard(info)}
        for info in infos
    }
    one_shard_bytes = 2 * length * width * 2
    cap = int(2.5 * (one_shard_bytes + 300))  # room for two shards (plus headers), not three
    written = [
        store.write_features(name, feats, feature_config=feature_config, cap_bytes=cap)
        for name, feats in per_shard.items()
    ]
    assert written == [True, True, False]
    assert store.feature_cache_full(feature_config)
    cached = store.read_features(infos[0].name, feature_config=feature_config)
    assert set(cached) == set(per_shard[infos[0].name])
    for rid, feats in cached.items():
        assert feats.dtype == torch.float16
        torch.testing.assert_close(
            feats.float(), per_shard[infos[0].name][rid], atol=2e-3, rtol=1e-3
        )
    assert store.read_features(infos[2].name, feature_config=feature_config) == {}
    assert (
        store.read_features(infos[0].name, feature_config=feature_config, key="last_hidden") == {}
    )
    total = store.manifest()["features"]["bytes"]
    assert total <= cap
    assert verify_store(tmp_path) == []
    # Features are derived data: another configuration reads as empty, and its first write
    # replaces the old cache (files deleted, token shards kept).
    other = {"target": "other"}
    assert store.feature_shards(other) == {} and not store.feature_cache_full(other)
    old_file = store.directory / store.feature_shards(feature_config)[infos[0].name]["name"]
    assert old_file.is_file()
    rows = {r.id: torch.randn(len(r), 4) for r in store.read_shard(infos[1])}
    assert store.write_features(infos[1].name, rows, feature_config=other, cap_bytes=cap)
    assert set(store.feature_shards(other)) == {infos[1].name}
    assert store.feature_shards(feature_config) == {}
    assert not old_file.exists()  # the old configuration's shard-0 features are gone
    assert store.num_records == sum(i.records for i in infos)
    assert verify_store(tmp_path) == []


def test_cached_last_hidden_must_match_the_features(tmp_path: Path) -> None:
    store = RolloutStore(tmp_path, CONFIG)
    info = store.write_shard(_records(1))
    config = {"target": "tiny"}
    features = {"r0": torch.randn(3, 4)}
    with pytest.raises(ValueError, match="same tokens"):
        store.write_features(
            info.name,
            features,
            feature_config=config,
            cap_bytes=10**6,
            last_hidden={"r0": torch.randn(2, 5)},
        )
    hidden = {"r0": torch.randn(3, 5)}
    assert store.write_features(
        info.name, features, feature_config=config, cap_bytes=10**6, last_hidden=hidden
    )
    back = store.read_features(info.name, feature_config=config, key="last_hidden")
    torch.testing.assert_close(back["r0"].float(), hidden["r0"], atol=2e-3, rtol=1e-3)


def test_features_past_fp16_range_round_trip_with_a_row_scale(tmp_path: Path) -> None:
    """A target whose hidden states pass fp16's range (some families reach 1e5) is cached with
    a per-row scale: values come back within fp16's relative precision, never inf; rows in range
    are stored as plain fp16 (no scale tensor); non-finite values are refused, located."""
    from safetensors.torch import load_file

    store = RolloutStore(tmp_path, CONFIG)
    info = store.write_shard(_records(2))
    config = {"target": "tiny"}
    large = torch.randn(3, 4)
    large[1, 2] = 1.2e5
    large[1, 0] = 0.25  # a small value in the same row as the outlier
    plain = torch.randn(2, 4)
    assert store.write_features(
        info.name, {"r0": large, "r1": plain}, feature_config=config, cap_bytes=10**6
    )
    back = store.read_features(info.name, feature_config=config)
    assert torch.isfinite(back["r0"]).all()
    torch.testing.assert_close(back["r0"], large, rtol=1e-3, atol=1e-3)
    torch.testing.assert_close(back["r1"].float(), plain, rtol=1e-3, atol=1e-3)
    shard = store.feature_shards(config)[info.name]["name"]
    stored = load_file(str(tmp_path / shard))
    assert stored["features"].dtype == torch.float16 and stored["features_scale"].shape == (5,)
    assert stored["features_scale"][[0, 2, 3, 4]].eq(1).all()  # only the outlier row is scaled

    in_range = RolloutStore(tmp_path / "b", CONFIG)
    shard_b = in_range.write_shard(_records(1)).name
    assert in_range.write_features(shard_b, {"r0": plain}, feature_config=config, cap_bytes=10**6)
    name = in_range.feature_shards(config)[shard_b]["name"]
    assert "features_scale" not in load_file(str(tmp_path / "b" / name))

    nan = torch.randn(3, 4)
    nan[2, 1] = float("nan")
    other = RolloutStore(tmp_path / "c", CONFIG)
    shard_c = other.write_shard(_records(1)).name
    with pytest.raises(ValueError, match="non-finite.*token 2, column 1.*largest finite"):
        other.write_features(shard_c, {"r0": nan}, feature_config=config, cap_bytes=10**6)
    assert other.feature_shards(config) == {}  # nothing was written


def test_non_finite_features_name_the_target_layer_and_the_magnitude(tmp_path: Path) -> None:
    """The refusal says which target layer overflowed and how large its finite values grew, so
    an fp16 overflow reads differently from a target that computes NaN at unit scale."""
    store = RolloutStore(tmp_path, CONFIG)
    shard = store.write_shard(_records(1)).name
    config = {"target": "tiny", "feature_layers": [2, 4, 5]}  # three 4-wide blocks
    overflow = torch.randn(3, 12)
    overflow[1, 3] = 6.0e4
    overflow[1, 9] = float("inf")
    with pytest.raises(ValueError, match=r"hidden unit 1 of target layer 5.*6e\+04.*float32"):
        store.write_features(shard, {"r0": overflow}, feature_config=config, cap_bytes=10**6)
    broken = torch.randn(3, 12)
    broken[0, 0] = float("nan")
    with pytest.raises(ValueError, match=r"target layer 2.*check its weights"):
        store.write_features(shard, {"r0": broken}, feature_config=config, cap_bytes=10**6)
