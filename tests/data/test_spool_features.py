"""Regenerated records' features from a serving engine's spool (`data.spool_features`), with a
tiny target standing in for the engine: its own forward pass gives each capture as the vLLM
plugin hands it over (the rows of every token but the last committed one), written by the real
`SpoolWriter`. The cached rows equal what the target-pass caching writes for the same records;
a record cut inside its capture gets every row computed; records without their capture (none,
or one of other tokens) are counted and left to the target pass, which then caches them beside
the spool's rows; a spool of another width and a missing folder are clear errors; and the data
module takes the features from the spool before its caching pass."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import Tensor

from lightning_spec.data.records import RolloutRecord
from lightning_spec.data.regenerate import cache_features, feature_config
from lightning_spec.data.rollouts import RolloutStore
from lightning_spec.data.spool_features import NO_TOKEN, SpoolFeaturesReport, features_from_spool
from lightning_spec.data.store_features import CACHED_FIELDS
from lightning_spec.models.target import TargetModel
from lightning_spec.models.tiny import tiny_config
from lightning_spec.online.capture import CapturedRequest
from lightning_spec.online.spool import SpoolWriter

CONFIG = {"kind": "regenerated", "target": "tiny", "max_length": 64}
CAP = 10**9
Text = tuple[list[int], list[int]]


@pytest.fixture(scope="module")
def target() -> TargetModel:
    return TargetModel.from_config(tiny_config("llama", num_layers=2), seed=1)


def _texts(count: int, seed: int) -> list[Text]:
    """(prompt, answer) token lists: 3..8 prompt tokens, 4..9 answer tokens, ids 3..127."""
    generator = torch.Generator().manual_seed(seed)

    def draw(low: int, high: int) -> list[int]:
        length = int(torch.randint(low, high, (1,), generator=generator))
        return torch.randint(3, 128, (length,), generator=generator).tolist()

    return [(draw(3, 9), draw(4, 10)) for _ in range(count)]


def _record(rid: str, text: Text) -> RolloutRecord:
    """A record as the regeneration writes it: the prompt, then the answer under the loss."""
    prompt, answer = text
    return RolloutRecord(rid, prompt + answer, [0] * len(prompt) + [1] * len(answer),
                         "regenerated", {"prompt_tokens": len(prompt)})  # fmt: skip


def _capture(target: TargetModel, text: Text, request_id: str) -> CapturedRequest:
    """What the vLLM plugin spools for this request: aux and final hidden rows of every token
    but the last committed one (nothing was computed after it)."""
    prompt, answer = text
    ids = prompt + answer
    with torch.no_grad():
        output = target(torch.tensor([ids]), use_cache=False)
    return CapturedRequest(request_id=request_id, prompt_len=len(prompt), token_ids=ids,
                           aux=output.features[0, :-1].clone(),
                           last=output.last_hidden[0, :-1].clone())  # fmt: skip


def _spool(folder: Path, captures: list[CapturedRequest]) -> Path:
    writer = SpoolWriter(folder)
    assert all(writer.put(capture) for capture in captures)
    return folder


def _store(folder: Path, records: list[RolloutRecord]) -> RolloutStore:
    """`records` in shards of two."""
    store = RolloutStore(folder, CONFIG)
    for lo in range(0, len(records), 2):
        store.write_shard(records[lo : lo + 2])
    return store


def _cached(store: RolloutStore, config: dict[str, Any]) -> dict[str, dict[str, Tensor]]:
    """``{record id: {field: tensor}}`` of the whole feature cache."""
    out: dict[str, dict[str, Tensor]] = {}
    for info in store.shards():
        fields = store.read_cached(info.name, feature_config=config)
        for rid in fields["features"]:
            out[rid] = {key: fields[key][rid] for key in CACHED_FIELDS}
    return out


def _counts(report: SpoolFeaturesReport) -> tuple[int, int, int, int]:
    return report.matched, report.written, report.unmatched, report.unused_captures


def _close(got: Tensor, want: Tensor) -> None:
    """Equal to fp16 storage (both sides went through it)."""
    torch.testing.assert_close(got.float(), want.float(), atol=5e-3, rtol=5e-3)


def test_spool_rows_equal_what_the_target_pass_caches(tmp_path: Path, target: TargetModel) -> None:
    texts = _texts(5, seed=0)
    records = [_record(f"r{i}", text) for i, text in enumerate(texts)]
    captures = [_capture(target, text, f"req-{i}") for i, text in enumerate(texts)]
    spool = _spool(tmp_path / "spool", captures)
    config = feature_config(target)
    store = _store(tmp_path / "spooled", records)
    report = features_from_spool(store, spool, target, feature_config=config, cap_bytes=CAP)
    assert _counts(report) == (5, 5, 0, 0)
    assert report.rows == sum(len(r) for r in records) and report.placeholder_rows == 5
    assert report.unusable == 0 and not report.cache_full
    reference = _store(tmp_path / "reference", records)
    cache_features(target, reference, cap_bytes=CAP, batch_size=4)
    got, want = _cached(store, config), _cached(reference, config)
    assert set(got) == set(want) == {r.id for r in records}
    for rid, fields in got.items():
        for key in CACHED_FIELDS:  # the same form: dtypes and [T, F], [T, H], [T]
            assert fields[key].shape == want[rid][key].shape
            assert fields[key].dtype == want[rid][key].dtype
        # every row the engine computed is the target pass's
        _close(fields["features"][:-1], want[rid]["features"][:-1])
        _close(fields["last_hidden"][:-1], want[rid]["last_hidden"][:-1])
        assert torch.equal(fields["target_argmax"][:-1], want[rid]["target_argmax"][:-1])
        # the final token's row, which the engine never computes and no loss reads: placeholders
        assert not fields["features"][-1].any() and not fields["last_hidden"][-1].any()
        assert int(fields["target_argmax"][-1]) == NO_TOKEN
    again = features_from_spool(store, spool, target, feature_config=config, cap_bytes=CAP)
    assert (again.already_cached, again.matched, again.written) == (5, 0, 0)


def test_a_record_cut_inside_its_capture_gets_every_row_computed(
    tmp_path: Path, target: TargetModel
) -> None:
    texts = [([5, 6, 7, 8], [9, 10, 11, 12, 13, 14, 15, 16]), ([20, 21, 22], [23, 24, 25, 26, 27])]
    records = [_record(f"r{i}", text) for i, text in enumerate(texts)]
    captures = [_capture(target, text, f"req-{i}") for i, text in enumerate(texts)]
    spool = _spool(tmp_path / "spool", captures)
    config = feature_config(target)
    store = _store(tmp_path / "spooled", records)
    cut = 6  # both records end at least two tokens before their captures: every row computed
    report = features_from_spool(store, spool, target, feature_config=config, cap_bytes=CAP,
                                 max_length=cut)  # fmt: skip
    assert (report.written, report.rows, report.placeholder_rows) == (2, 2 * cut, 0)
    reference = _store(tmp_path / "reference", records)
    cache_features(target, reference, cap_bytes=CAP, max_length=cut)
    got, want = _cached(store, config), _cached(reference, config)
    assert set(got) == set(want) == {"r0", "r1"}
    for rid in want:
        assert got[rid]["features"].shape == (cut, target.feature_size)
        _close(got[rid]["features"], want[rid]["features"])
        _close(got[rid]["last_hidden"], want[rid]["last_hidden"])
        assert torch.equal(got[rid]["target_argmax"], want[rid]["target_argmax"])


def test_records_without_their_capture_are_counted_and_left_to_the_target_pass(
    tmp_path: Path, target: TargetModel
) -> None:
    texts = _texts(4, seed=2)
    records = [_record(f"r{i}", text) for i, text in enumerate(texts)]
    prompt, answer = texts[1]
    other = answer[:1] + [3 + (answer[1] - 3 + 1) % 125] + answer[2:]  # one answer token differs
    captures = [
        _capture(target, texts[0], "req-0"),
        _capture(target, (prompt, other), "req-1-other-answer"),  # r1's prompt, other tokens
        _capture(target, texts[3], "req-3"),
        _capture(target, ([5, 6, 7], [8]), "probe"),  # no record holds these tokens
    ]  # r2 has no capture at all
    spool = _spool(tmp_path / "spool", captures)
    config = feature_config(target)
    store = _store(tmp_path / "store", records)
    report = features_from_spool(store, spool, target, feature_config=config, cap_bytes=CAP)
    assert _counts(report) == (2, 2, 2, 2)
    spooled = _cached(store, config)
    assert set(spooled) == {"r0", "r3"}  # r1 and r2 are left uncached
    # the target pass caches the rest beside the spool's rows, which it keeps as they are
    assert cache_features(target, store, cap_bytes=CAP) > 0
    after = _cached(store, config)
    assert set(after) == {"r0", "r1", "r2", "r3"}
    for rid in ("r0", "r3"):
        assert all(torch.equal(after[rid][key], spooled[rid][key]) for key in CACHED_FIELDS)
    for rid, record in (("r1", records[1]), ("r2", records[2])):
        alone = target(torch.tensor([record.input_ids]), use_cache=False)
        _close(after[rid]["features"], alone.features[0])  # r1's rows are its own tokens'
        assert int(after[rid]["target_argmax"][-1]) != NO_TOKEN


def test_a_spool_of_another_width_or_no_spool_is_a_clear_error(
    tmp_path: Path, target: TargetModel
) -> None:
    from lightning_spec.cli.prepare import engine_overrides

    text = _texts(1, seed=4)[0]
    store = _store(tmp_path / "store", [_record("r0", text)])
    config = feature_config(target)
    missing = tmp_path / "no-such-spool"
    with pytest.raises(FileNotFoundError, match="no spool folder"):
        features_from_spool(store, missing, target, feature_config=config, cap_bytes=CAP)
    with pytest.raises(ValueError, match="--features-from-spool: no folder"):
        engine_overrides(["--config", "a.yaml", "--features-from-spool", str(missing)])
    capture = _capture(target, text, "req")
    capture.aux = capture.aux[:, : target.hidden_size].contiguous()  # one layer, not three
    spool = _spool(tmp_path / "spool", [capture])
    with pytest.raises(ValueError, match="another target"):
        features_from_spool(store, spool, target, feature_config=config, cap_bytes=CAP)
    assert engine_overrides(["--config", "a.yaml", "--features-from-spool", str(spool)]) == [
        "--config", "a.yaml", f"--data.init_args.features_from_spool={spool.resolve()}",
    ]  # fmt: skip


def test_the_data_module_takes_regenerated_features_from_the_spool(
    tmp_path: Path, chats: Any, chat_tokenizer: Any, tiny_target: Any
) -> None:
    from lightning_spec.data.datamodule import RolloutDataModule

    with pytest.raises(ValueError, match="feature_cache_bytes"):
        RolloutDataModule(mode="regenerated", features_from_spool=str(tmp_path))
    data = chats(6, seed=5)
    options = {"dataset": str(data), "cache_dir": str(tmp_path / "cache"), "mode": "regenerated",
               "max_length": 64, "val_fraction": 0.0, "batch_size": 2,
               "regenerate_max_new_tokens": 6, "prompts_for_eval": str(data),
               "progress": False}  # fmt: skip
    first = RolloutDataModule.from_objects(tokenizer=chat_tokenizer, target_model=tiny_target,
                                           **options)  # fmt: skip
    first.prepare_data()  # the regeneration (the batched loop stands in for the server here)
    records = list(first.store("regenerated").iter_records())
    left_out = records[0].id
    texts = {
        r.id: (r.input_ids[: r.meta["prompt_tokens"]], r.input_ids[r.meta["prompt_tokens"] :])
        for r in records
    }
    captures = [_capture(tiny_target, texts[r.id], r.id) for r in records if r.id != left_out]
    spool = _spool(tmp_path / "spool", captures)
    module = RolloutDataModule.from_objects(
        tokenizer=chat_tokenizer, target_model=tiny_target, feature_cache_bytes=10**8,
        features_from_spool=str(spool), **options,
    )  # fmt: skip
    module.prepare_data()
    module.setup("fit")
    entries = module.stores.read_entries("regenerated")
    assert left_out in {record.id for record, *_ in entries} and len(entries) > 1
    for record, features, hidden, argmax in entries:
        assert features is not None and hidden is not None and argmax is not None
        from_spool = record.id != left_out
        # the spool's records end in the placeholder row; the target pass computed the other
        assert bool(features[-1].any()) != from_spool
        assert (int(argmax[-1]) == NO_TOKEN) == from_spool
    assert "features" in next(iter(module.train_dataloader()))
