"""The run mirror: an append-only JSONL of everything a logger sent (or meant to send) to MLflow.

The logger writes each call here before it calls MLflow, so a tracking store that goes away, a
full disk or a killed process loses nothing that was logged; `lightning-spec relog` replays the
mirror into the store later (docs/tracking.md).
"""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path
from typing import Any

from lightning_spec.io import is_disk_full

__all__ = ["MIRROR_NAME", "RunMirror", "read_mirror"]

log = logging.getLogger("lightning_spec.tracking")

MIRROR_NAME = "mlflow_mirror.jsonl"


def _json_default(value: Any) -> Any:
    if hasattr(value, "item"):  # numpy / torch scalars
        try:
            return value.item()
        except (TypeError, ValueError):
            pass
    return str(value)


class RunMirror:
    """Append-only JSONL file holding everything a logger sent (or meant to send) to MLflow.

    One JSON object per line, each with `seq` (increasing across the file), `type` and `time`
    (seconds since the epoch). Types: `start` (a logger session: tracking URI, experiment, run
    name, tags), `run` (the MLflow run it got), `params`, `metrics` (`step`, `timestamp` in ms,
    `metrics`), `artifact` (`local_path`, `artifact_path`, `dir`), `offline` (the store became
    unreachable; `first_unsent_seq`), `end` (`status`), `killed_run` (an earlier session's run
    this one found RUNNING with its process gone and marked KILLED), and `relog` (written by `lightning-spec
    relog`: which records went to which run). Each line is written and flushed (no fsync)
    before MLflow is called; the file is opened per write, so the logger stays picklable.
    """

    #: Records held in memory while the disk is full, at most (the oldest are dropped beyond).
    MAX_PENDING = 200_000

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._next_seq: int | None = None
        self._pending: list[str] = []  # lines not yet on disk (the disk was full)
        self.dropped = 0  # lines lost past MAX_PENDING while the disk stayed full
        self._disk_full = False  # inside a full-disk episode (warned once per episode)

    def _prepare(self) -> int:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if not self.path.is_file():
            return 0
        last = -1
        with self.path.open("rb") as handle:
            data = handle.read()
        for line in data.splitlines():
            try:
                last = max(last, int(json.loads(line)["seq"]))
            except (ValueError, KeyError, TypeError):
                continue  # a line cut short by a crash
        if data and not data.endswith(b"\n"):
            self._pending.append("\n")  # never glue a record onto a torn line
        return last + 1

    def write(self, kind: str, **fields: Any) -> int:
        """Append one record; returns its `seq`."""
        if self._next_seq is None:
            self._next_seq = self._prepare()
        seq = self._next_seq
        record = {"seq": seq, "type": kind, "time": round(time.time(), 3), **fields}
        self._pending.append(json.dumps(record, default=_json_default, allow_nan=True) + "\n")
        self._next_seq = seq + 1
        self.flush()
        return seq

    @property
    def pending(self) -> int:
        """Records written to memory only, waiting for disk space."""
        return len(self._pending)

    def flush(self) -> bool:
        """Append the pending lines; on a full disk (ENOSPC, EDQUOT) keep them in memory, warn
        once per episode, and try again at the next write: a full disk must cost neither the
        training run nor, once space returns, the mirror's records. True when all are on disk."""
        if not self._pending:
            return True
        data = "".join(self._pending)
        try:
            with self.path.open("a", encoding="utf-8") as handle:
                handle.write(data)
        except OSError as error:
            if not is_disk_full(error):
                raise
            self._truncate_partial()
            if len(self._pending) > self.MAX_PENDING:
                excess = len(self._pending) - self.MAX_PENDING
                del self._pending[:excess]
                self.dropped += excess
            if not self._disk_full:
                self._disk_full = True
                log.error(
                    "the disk holding %s is full (%s): training continues, %d tracking "
                    "record(s) wait in memory and are written when space returns (free space; "
                    "MLflow still gets every call while it is reachable)",
                    self.path, os.strerror(error.errno), len(self._pending),
                )  # fmt: skip
            return False
        if self._disk_full:
            self._disk_full = False
            log.warning(
                "disk space is back: %d held tracking record(s) written", len(self._pending)
            )
        self._pending.clear()
        return True

    def _truncate_partial(self) -> None:
        """After a failed append, cut a torn last line (readers skip one, but a retry would
        append after it and make two records unreadable)."""
        if not self.path.is_file():
            return
        try:
            with self.path.open("rb+") as handle:
                data = handle.read()
                if data and not data.endswith(b"\n"):
                    handle.truncate(data.rfind(b"\n") + 1)
        except OSError:
            pass


def read_mirror(path: str | Path) -> tuple[list[dict[str, Any]], int]:
    """All records of a mirror file (a run folder or the file itself), and how many lines
    could not be parsed (a torn last line after a crash)."""
    path = Path(path)
    if path.is_dir():
        path = path / MIRROR_NAME
    records, bad = [], 0
    with path.open("r", encoding="utf-8") as handle:
        for line in handle:
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except ValueError:
                bad += 1
                continue
            if isinstance(record, dict) and "seq" in record and "type" in record:
                records.append(record)
            else:
                bad += 1
    return records, bad
