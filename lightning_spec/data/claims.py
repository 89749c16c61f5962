"""Work claims: several processes filling one store without doing (or writing) a record twice.

The default store folder is a hash of the data configuration, so a sweep launched at once
(several `fit` runs, or DDP ranks) shares it. Before producing records (rendering, regenerating,
caching features) a writer claims their ids in ``claims.json`` under the store's lock; ids
another live writer claimed are left to it, and ids written by anyone are marked done in the
same locked update that lists their shard (`RolloutStore.write_shard`), so a second writer
neither recomputes them nor lists them again. A claim whose holder died (same host, its pid
gone) or that is older than `CLAIM_TTL_SECONDS` (another host) is taken over, so a killed job
never blocks the next one. A writer that finds everything left claimed by others waits for them
(`wait_for_others`): the store is complete when its `prepare` returns, whichever process did
the work.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any, TypeVar

from lightning_spec.io import atomic_write_json, remove_stale

T = TypeVar("T")

log = logging.getLogger(__name__)

__all__ = ["CLAIMS", "CLAIM_TTL_SECONDS", "WorkClaims", "claimed_batches"]

CLAIMS = "claims.json"
CLAIM_TTL_SECONDS = 6 * 3600.0
"""A claim of a writer on another host counts as abandoned after this long (its pid cannot be
checked from here); same-host claims are checked by pid and freed at once when it died."""


def _alive(entry: dict[str, Any], now: float) -> bool:
    if entry.get("host") == socket.gethostname():
        try:
            os.kill(int(entry["pid"]), 0)
        except ProcessLookupError:
            return False
        except (PermissionError, OSError, ValueError):
            return True
        return True
    return now - float(entry.get("at", 0.0)) < CLAIM_TTL_SECONDS


class WorkClaims:
    """Claims on the ids of one store folder (see the module docstring)."""

    def __init__(self, directory: Path, locked: Callable[[], AbstractContextManager[None]]) -> None:
        self.path = Path(directory) / CLAIMS
        self._locked = locked
        self.owner = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"

    # ------------------------------------------------------------------ reading (lock held)
    def read(self) -> dict[str, dict[str, Any]]:
        """The claims on disk (call under the store lock for a consistent view)."""
        if not self.path.is_file():
            return {}
        try:
            data = json.loads(self.path.read_text(encoding="utf-8"))
        except (OSError, ValueError):  # written atomically: unreadable means damaged
            log.warning("%s is unreadable: claims start afresh", self.path)
            return {}
        return data if isinstance(data, dict) else {}

    def write(self, claims: dict[str, dict[str, Any]]) -> None:
        """Replace the claims file (lock held). Every writer writes under the store lock, so a
        temporary of this file already there was left by a writer killed mid-write: removed."""
        remove_stale(self.path.parent, contains=f".{self.path.name}.tmp-")
        atomic_write_json(self.path, claims)

    def _entry(self, now: float) -> dict[str, Any]:
        return {"by": self.owner, "host": socket.gethostname(), "pid": os.getpid(), "at": now}

    # ------------------------------------------------------------------ the protocol
    def claim(self, ids: Iterable[str], *, limit: int | None = None) -> list[str]:
        """Reserve up to `limit` of `ids` (in order): those not done and not held by another
        live writer. Returns the ids granted (this writer's from now on)."""
        granted: list[str] = []
        with self._locked():
            claims = self.read()
            now = time.time()
            for item in ids:
                entry = claims.get(item)
                if entry is not None and (
                    entry.get("done") or (entry.get("by") != self.owner and _alive(entry, now))
                ):
                    continue
                claims[item] = self._entry(now)
                granted.append(item)
                if limit is not None and len(granted) >= limit:
                    break
            if granted:
                self.write(claims)
        return granted

    def mark_done(self, claims: dict[str, dict[str, Any]], ids: Iterable[str]) -> None:
        """Mark `ids` written in `claims` (the caller holds the lock and writes them back)."""
        now = time.time()
        for item in ids:
            claims[item] = {**self._entry(now), "done": True}

    def done(self) -> set[str]:
        """Ids some writer has written (and listed) through a claim."""
        with self._locked():
            return {k for k, v in self.read().items() if v.get("done")}

    def held_elsewhere(self, ids: Iterable[str]) -> dict[str, dict[str, Any]]:
        """The not-done claims of other live writers among `ids` (id -> claim)."""
        with self._locked():
            claims = self.read()
        now = time.time()
        wanted = set(ids)
        return {
            k: v
            for k, v in claims.items()
            if k in wanted and not v.get("done") and v.get("by") != self.owner and _alive(v, now)
        }

    def finish(self, ids: Iterable[str]) -> None:
        """Mark `ids` done without a record (a conversation that cannot be rendered, a feature
        shard cached): nobody waits for them or makes them again."""
        with self._locked():
            claims = self.read()
            self.mark_done(claims, ids)
            self.write(claims)

    def release(self, ids: Iterable[str] | None = None) -> None:
        """Drop this writer's unfinished claims (its work is written or abandoned), or only
        those among `ids` (work given up, not done: a later writer may do it)."""
        wanted = None if ids is None else set(ids)
        with self._locked():
            claims = self.read()
            mine = [k for k, v in claims.items() if v.get("by") == self.owner and not v.get("done")
                    and (wanted is None or k in wanted)]  # fmt: skip
            for item in mine:
                del claims[item]
            if mine:
                self.write(claims)

    def wait_for_others(self, ids: Iterable[str], *, what: str, poll: float = 2.0) -> None:
        """Block while other live writers hold claims among `ids` (their records are being
        made); returns when they are done or their claims lapsed (then `claim` grants them)."""
        ids = list(ids)
        said = False
        while True:
            held = self.held_elsewhere(ids)
            if not held:
                return
            if not said:
                holders = sorted({f"pid {v.get('pid')} on {v.get('host')}" for v in held.values()})
                log.info(
                    "%s: %d records are being prepared by another process (%s); waiting for it",
                    what,
                    len(held),
                    ", ".join(holders),
                )
                said = True
            time.sleep(poll)


def claimed_batches(
    claims: WorkClaims,
    items: Sequence[T],
    key: Callable[[T], str],
    *,
    size: int,
    what: str,
    before_wait: Callable[[], None] | None = None,
) -> Iterator[list[T]]:
    """Batches of up to `size` of `items` (in their order) that this writer claimed.

    Items another live writer holds are skipped, then waited for once nothing else is free
    (`before_wait` runs first: flush what you hold, or two writers would wait on each other);
    items whose holder died come back as claims of this writer. The caller writes each batch's
    records (`RolloutStore.write_shard` marks them done) or `finish`es their ids. Ends when
    every item is done, whoever did it.
    """
    pending = list(items)
    while pending:
        done = claims.done()
        pending = [item for item in pending if key(item) not in done]
        if not pending:
            return
        granted = set(claims.claim([key(item) for item in pending], limit=size))
        if not granted:
            if before_wait is not None:
                before_wait()
            claims.wait_for_others([key(item) for item in pending], what=what)
            continue
        yield [item for item in pending if key(item) in granted]
        pending = [item for item in pending if key(item) not in granted]
