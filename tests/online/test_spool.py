"""online/spool.py: finished requests handed from the engine to the learner, in order, none lost
or taken twice, and a failing disk or a lagging learner never raised into serving."""

from __future__ import annotations

from pathlib import Path

import torch

from lightning_spec.online.capture import CapturedRequest
from lightning_spec.online.spool import SUFFIX, SpoolReader, SpoolWriter


def _request(i: int) -> CapturedRequest:
    return CapturedRequest(
        request_id=f"r{i}", prompt_len=3, token_ids=[1, 2, 3, 4 + i, 5], aux=torch.full((4, 6), float(i)),
        last=torch.zeros(4, 2), accepted=[1], drafted=[3],
    )  # fmt: skip


def test_requests_come_out_in_the_order_they_went_in_and_done_ones_stay_out(tmp_path: Path) -> None:
    writer, reader = SpoolWriter(tmp_path), SpoolReader(tmp_path)
    for i in range(5):
        assert writer.put(_request(i))
    first = reader.take(limit=3)
    assert [e.request.request_id for e in first] == ["r0", "r1", "r2"]
    assert torch.equal(first[1].request.aux, torch.full((4, 6), 1.0))
    assert first[1].request.token_ids == [1, 2, 3, 5, 5] and first[1].request.accepted == [1]
    assert [e.request.request_id for e in reader.take(limit=3)] == ["r0", "r1", "r2"]  # not acked
    reader.done(first)
    assert [e.request.request_id for e in reader.take()] == ["r3", "r4"]
    assert len(list((tmp_path / "done").glob(f"*{SUFFIX}"))) == 3
    assert writer.counts["written"] == 5 and reader.counts["done"] == 3


def test_a_half_written_file_is_never_taken_and_a_bad_one_is_set_aside(tmp_path: Path) -> None:
    writer, reader = SpoolWriter(tmp_path), SpoolReader(tmp_path)
    writer.put(_request(0))
    (tmp_path / ".00000000000000000001-1-00000001.req.pt.tmp").write_bytes(
        b"cut"
    )  # a kill mid-write
    (tmp_path / f"00000000000000000002-1-00000001{SUFFIX}").write_bytes(b"not a torch file")
    taken = reader.take()
    assert [e.request.request_id for e in taken] == ["r0"]
    assert reader.counts["bad"] == 1 and len(list((tmp_path / "bad").iterdir())) == 1
    assert [e.request.request_id for e in reader.take()] == ["r0"]  # the bad file is not retried


def test_writes_that_fail_open_the_circuit_and_never_raise(tmp_path: Path) -> None:
    blocked = tmp_path / "spool"
    blocked.write_text("a file where the folder should be")
    writer = SpoolWriter(blocked, max_failures=2, cooldown=3600)
    assert [writer.put(_request(i)) for i in range(4)] == [False] * 4
    assert writer.counts["dropped_write_failed"] == 2
    assert writer.counts["dropped_circuit_open"] == 2


def test_a_lagging_learner_makes_the_writer_drop_not_fill_the_disk(tmp_path: Path) -> None:
    writer = SpoolWriter(tmp_path, max_pending=3)
    assert [writer.put(_request(i)) for i in range(5)] == [True, True, True, False, False]
    assert writer.counts["dropped_learner_lags"] == 2
    reader = SpoolReader(tmp_path)
    reader.done(reader.take(), keep=False)
    writer._pending_checked = -1e9  # the writer re-counts the folder at its next check
    assert writer.put(_request(9))
