"""The hand-off between a serving engine and its learner: a folder of finished requests.

The engine side (`SpoolWriter`, inside the server's worker) writes one file per finished
request, atomically (a temporary name, fsynced, renamed), named so that names sort in the order
the requests finished. The learner (`SpoolReader`) takes the complete files in that order and
moves each to ``done/`` once what it learned from them is checkpointed, so a learner killed at
any point takes the same requests again and none twice.

Serving never waits for the learner and never stops because of it: a write that fails (a full
disk, a folder removed) is counted and dropped, and after `max_failures` failures in a row the
writer opens its circuit and stops writing for `cooldown` seconds; a spool over `max_pending`
files (a learner that lags or is gone) drops new captures, counted, instead of filling the disk.
A file the reader cannot load (cut by a crash of something else than our rename) is moved to
``bad/`` and counted, never retried forever.

Files hold `CapturedRequest` as a dict of plain types and tensors (``torch.save``), so this module
imports only the standard library, torch and `online.capture`: it runs in vLLM's interpreter.
"""

from __future__ import annotations

import logging
import os
import time
from collections import Counter
from dataclasses import asdict
from pathlib import Path

import torch

from lightning_spec.online.capture import CapturedRequest

log = logging.getLogger(__name__)

__all__ = ["SpoolReader", "SpoolWriter", "SpoolEntry"]

SUFFIX = ".req.pt"


class SpoolWriter:
    """Writes finished requests into `folder`; never raises into the engine."""

    def __init__(
        self,
        folder: str | Path,
        *,
        max_pending: int = 10_000,
        max_failures: int = 3,
        cooldown: float = 60.0,
    ) -> None:
        self.folder = Path(folder)
        self.max_pending, self.max_failures, self.cooldown = max_pending, max_failures, cooldown
        self.counts: Counter[str] = Counter()
        self._failures_in_row = 0
        self._open_until = 0.0
        self._serial = 0
        self._pending = 0
        self._pending_checked = 0.0

    def put(self, request: CapturedRequest) -> bool:
        """Write `request`; False (counted by reason) when it was dropped instead."""
        now = time.monotonic()
        if now < self._open_until:
            self.counts["dropped_circuit_open"] += 1
            return False
        if self._too_full(now):
            self.counts["dropped_learner_lags"] += 1
            return False
        self._serial += 1
        name = f"{time.time_ns():020d}-{os.getpid()}-{self._serial:08d}{SUFFIX}"
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            tmp = self.folder / f".{name}.tmp"
            with open(tmp, "wb") as handle:
                torch.save(asdict(request), handle)
                handle.flush()
                os.fsync(handle.fileno())
            os.replace(tmp, self.folder / name)
        except Exception as error:  # noqa: BLE001 - serving must go on whatever the disk does
            self._failures_in_row += 1
            self.counts["dropped_write_failed"] += 1
            if self._failures_in_row >= self.max_failures:
                self._open_until = now + self.cooldown
                log.warning("spool %s: %d writes failed in a row (%r); capture paused %.0f s",
                            self.folder, self._failures_in_row, error, self.cooldown)  # fmt: skip
                self._failures_in_row = 0
            return False
        self._failures_in_row = 0
        self._pending += 1
        self.counts["written"] += 1
        return True

    def _too_full(self, now: float) -> bool:
        if now - self._pending_checked > 5.0 or self._pending >= self.max_pending:
            self._pending = (
                sum(1 for _ in self.folder.glob(f"*{SUFFIX}")) if self.folder.is_dir() else 0
            )
            self._pending_checked = now
        return self._pending >= self.max_pending


class SpoolEntry:
    """A complete spool file and the request it holds."""

    def __init__(self, path: Path, request: CapturedRequest) -> None:
        self.path, self.request = path, request


class SpoolReader:
    """Takes finished requests from `folder` in the order they finished."""

    def __init__(self, folder: str | Path) -> None:
        self.folder = Path(folder)
        self.counts: Counter[str] = Counter()

    def pending(self) -> list[Path]:
        """Complete files not taken yet, oldest first."""
        if not self.folder.is_dir():
            return []
        return sorted(self.folder.glob(f"*{SUFFIX}"))

    def take(self, limit: int | None = None) -> list[SpoolEntry]:
        """Up to `limit` requests, oldest first; unreadable files go to ``bad/``, counted."""
        entries = []
        for path in self.pending():
            if limit is not None and len(entries) >= limit:
                break
            try:
                # mapped, not read: a round the schedule skips needs only the counts, and a
                # round's 40 files of features are ~250 MB (the mapping outlives a move)
                data = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
                entries.append(SpoolEntry(path, CapturedRequest(**data)))
            except Exception as error:  # noqa: BLE001 - a bad file is set aside, not fatal
                log.warning("spool %s: %s is unreadable (%r); moved to bad/", self.folder,
                            path.name, error)  # fmt: skip
                self._move(path, "bad")
                self.counts["bad"] += 1
        return entries

    def done(self, entries: list[SpoolEntry], *, keep: bool = True) -> None:
        """Mark `entries` learned from: moved to ``done/`` (or deleted with ``keep=False``)."""
        for entry in entries:
            if keep:
                self._move(entry.path, "done")
            else:
                entry.path.unlink(missing_ok=True)
            self.counts["done"] += 1

    def _move(self, path: Path, where: str) -> None:
        (self.folder / where).mkdir(exist_ok=True)
        if path.exists():
            os.replace(path, self.folder / where / path.name)
