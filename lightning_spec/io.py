"""Atomic writes, checksums and inter-process file locks: the one implementation.

Everything the project writes for another process or a later run to read goes through here:
the asset cache, rollout shards and their manifests, drafter folders and checkpoints, exported
graphs and engines. A job can be killed at any instruction, so a reader must find either the
old content or the new one, never a half.

Files (:func:`atomic_write`, :func:`atomic_path` and the ``atomic_write_*`` helpers): write to
a temporary name in the destination directory (``.<name>.tmp-<hex><suffix>``, so the rename
stays on one filesystem and a library that infers the format from the suffix still sees it),
flush and fsync, ``os.replace`` it over the destination, fsync the directory. An exception
leaves the destination untouched and removes the temporary; a SIGKILL leaves at most the
temporary, which :func:`remove_stale` deletes later.

Folders (:func:`atomic_folder`): build under ``.tmp-<name>-<hex>``, fsync it, then two renames,
``<name>`` -> ``.tmp-<name>-old-<hex>`` and the new folder -> ``<name>``, then delete the old
one. A kill between the two renames leaves no ``<name>``; :func:`recover_folder` (which every
:func:`atomic_folder` runs first) renames the old folder back and removes the leftovers.
Writers of one folder must not run concurrently (hold a :func:`file_lock`, or write from one
rank only): recovery removes any staging folder of that name.

Temporaries are created with mode 0o666 minus the umask, as a plain ``open`` would, so an
atomically written file has the permissions a direct write would have given it.

This module imports nothing of ours: models, data, callbacks and export all sit above it.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import logging
import os
import re
import secrets
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

log = logging.getLogger(__name__)

__all__ = [
    "atomic_folder",
    "atomic_path",
    "atomic_write",
    "atomic_write_bytes",
    "atomic_write_json",
    "atomic_write_text",
    "file_lock",
    "fsync_dir",
    "fsync_tree",
    "is_disk_full",
    "recover_folder",
    "remove_stale",
    "sha256_file",
]

CHUNK = 1 << 20
_ATTEMPTS = 100


# --------------------------------------------------------------------------------- durability
def is_disk_full(error: BaseException) -> bool:
    """An out-of-space or out-of-quota write (ENOSPC, EDQUOT): the faults a long run should
    survive where what failed to be written is derived or can wait (the tracking mirror, the
    feature cache), unlike a checkpoint or a shard of answers."""
    return isinstance(error, OSError) and error.errno in (errno.ENOSPC, errno.EDQUOT)


def fsync_dir(path: str | Path) -> None:
    """Persist a rename: fsync the directory entry (a no-op where directories cannot be opened)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(directory: str | Path) -> None:
    """fsync every file under ``directory``, then the directory itself."""
    directory = Path(directory)
    for path in directory.rglob("*"):
        if path.is_file() and not path.is_symlink():
            _fsync_file(path)
    fsync_dir(directory)


# --------------------------------------------------------------------------------------- files
def _create_temp(path: Path) -> tuple[int, Path]:
    """Create ``.<name>.tmp-<hex><suffix>`` next to ``path`` exclusively; (fd, its path)."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0)
    for _ in range(_ATTEMPTS):
        tmp = path.with_name(f".{path.name}.tmp-{secrets.token_hex(4)}{path.suffix}")
        try:
            return os.open(tmp, flags, 0o666), tmp
        except FileExistsError:
            continue
    raise FileExistsError(f"could not create a temporary file next to {path}")


def _discard(tmp: Path) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(tmp)


@contextlib.contextmanager
def atomic_write(path: str | Path, mode: str = "wb") -> Iterator[IO[Any]]:
    """Open a temporary file next to ``path`` (mode ``"wb"`` or ``"w"``, text as UTF-8); on a
    clean exit fsync it and ``os.replace`` it over ``path``. On an exception ``path`` is
    untouched and the temporary removed."""
    if mode not in ("w", "wb", "wt"):
        raise ValueError(f"atomic_write writes whole files: mode 'w' or 'wb', got {mode!r}")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = _create_temp(path)
    try:
        encoding = None if "b" in mode else "utf-8"
        with os.fdopen(fd, mode, encoding=encoding) as handle:
            yield handle
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        _discard(tmp)
        raise
    fsync_dir(path.parent)


@contextlib.contextmanager
def atomic_path(path: str | Path) -> Iterator[Path]:
    """A temporary path next to ``path`` for writers that want a file name (``onnx.save``,
    ``safetensors.torch.save_file``, ``shutil.copy2``); on a clean exit the file is fsynced and
    moved over ``path``. On an exception ``path`` is untouched and the temporary removed."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = _create_temp(path)
    os.close(fd)
    try:
        yield tmp
        _fsync_file(tmp)
        os.replace(tmp, path)
    except BaseException:
        _discard(tmp)
        raise
    fsync_dir(path.parent)


def atomic_write_bytes(path: str | Path, data: bytes) -> None:
    """Write ``data`` to ``path`` atomically."""
    with atomic_write(path, "wb") as handle:
        handle.write(data)


def atomic_write_text(path: str | Path, text: str) -> None:
    """Write ``text`` (UTF-8) to ``path`` atomically."""
    atomic_write_bytes(path, text.encode("utf-8"))


def atomic_write_json(
    path: str | Path, obj: Any, *, indent: int = 2, sort_keys: bool = True, default: Any = None
) -> None:
    """Write ``obj`` as JSON (``json.dumps`` arguments as given, plus a final newline)."""
    text = json.dumps(obj, indent=indent, sort_keys=sort_keys, default=default)
    atomic_write_text(path, text + "\n")


def remove_stale(directory: str | Path, *, contains: str = "") -> None:
    """Remove the temporaries killed writers left in ``directory``: entries named ``.*`` with
    ``.tmp-`` or ``.old-`` in the name (and ``contains``, to spare other writers' files).

    Do not call it on a folder that :func:`recover_folder` may still need to restore (its old
    copy is a ``.tmp-<name>-old-*`` entry): recover first.
    """
    directory = Path(directory)
    if not directory.is_dir():
        return
    for entry in directory.iterdir():
        name = entry.name
        if name.startswith(".") and (".tmp-" in name or ".old-" in name) and contains in name:
            log.debug("removing stale %s", entry)
            _remove(entry)


def _remove(entry: Path) -> None:
    if entry.is_dir() and not entry.is_symlink():
        shutil.rmtree(entry, ignore_errors=True)
    else:
        with contextlib.suppress(FileNotFoundError):
            entry.unlink()


# ------------------------------------------------------------------------------------- folders
def _folder_pattern(name: str, *, old: bool) -> re.Pattern[str]:
    return re.compile(rf"\.tmp-{re.escape(name)}-{'old-' if old else ''}[0-9a-f]+")


def _leftovers(final: Path, *, old: bool) -> list[Path]:
    pattern = _folder_pattern(final.name, old=old)
    return [p for p in final.parent.iterdir() if pattern.fullmatch(p.name)]


def recover_folder(final: str | Path) -> bool:
    """Undo a kill inside :func:`atomic_folder`'s swap and remove its leftovers.

    When ``final`` is missing and a ``.tmp-<name>-old-*`` copy exists (the kill came between the
    two renames), the newest copy is renamed back to ``final``. Staging folders and other old
    copies of that name are then deleted. Returns whether a folder was restored.
    """
    final = Path(final)
    if not final.parent.is_dir():
        return False
    olds = sorted(_leftovers(final, old=True), key=lambda p: (p.stat().st_mtime, p.name))
    restored = False
    if olds and not final.exists():
        newest = olds.pop()
        os.replace(newest, final)
        fsync_dir(final.parent)
        log.info("restored %s from %s (a write was interrupted between its renames)", final, newest)
        restored = True
    for stale in olds + _leftovers(final, old=False):
        log.debug("removing stale %s", stale)
        _remove(stale)
    return restored


def _make_folder(final: Path, *, old: bool = False) -> Path:
    """A fresh, empty ``.tmp-<name>-[old-]<hex>`` folder next to ``final`` (mode as mkdir)."""
    for _ in range(_ATTEMPTS):
        tmp = final.with_name(f".tmp-{final.name}-{'old-' if old else ''}{secrets.token_hex(4)}")
        try:
            os.mkdir(tmp)
        except FileExistsError:
            continue
        return tmp
    raise FileExistsError(f"could not create a temporary folder next to {final}")


def _old_name(final: Path) -> Path:
    for _ in range(_ATTEMPTS):
        old = final.with_name(f".tmp-{final.name}-old-{secrets.token_hex(4)}")
        if not os.path.lexists(old):
            return old
    raise FileExistsError(f"could not name a temporary folder next to {final}")


@contextlib.contextmanager
def atomic_folder(final: str | Path, *, fsync: bool = True) -> Iterator[Path]:
    """Build a folder under a temporary name and swap it in place of ``final`` on a clean exit.

    Yields the empty staging folder. An exception removes it and leaves ``final`` as it was;
    a kill at any point leaves either the old ``final`` or the new one, after
    :func:`recover_folder` (run here first, so the next write repairs the last one).
    ``fsync`` syncs every file of the new folder before the swap.
    """
    final = Path(final)
    parent = final.parent
    parent.mkdir(parents=True, exist_ok=True)
    recover_folder(final)
    tmp = _make_folder(final)
    try:
        yield tmp
        if fsync:
            fsync_tree(tmp)
        if os.path.lexists(final):
            old = _old_name(final)
            os.replace(final, old)
            fsync_dir(parent)
            try:
                os.replace(tmp, final)
            except BaseException:
                os.replace(old, final)
                raise
            fsync_dir(parent)
            _remove(old)
        else:
            os.replace(tmp, final)
            fsync_dir(parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


# ----------------------------------------------------------------------------- checksums, locks
def sha256_file(path: str | Path) -> str:
    """Hex sha256 of a file, read in 1 MiB chunks (about 1 s per 250 MB on a laptop core)."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


class LockTimeout(TimeoutError):
    """A `file_lock` could not be taken in time; the message names the holder."""


@contextlib.contextmanager
def file_lock(path: str | Path, *, timeout: float | None = None) -> Iterator[None]:
    """Exclusive inter-process lock on the file ``path`` (created with its parent folders).

    ``fcntl.flock``: released when the holder exits or dies, so a killed job never leaves a
    stale lock. The holder writes its pid, host, command and start time into the file, so a
    waiter that gives up after `timeout` seconds (None: wait forever) raises `LockTimeout`
    naming who holds it (a hung job, another user's run). Not re-entrant (a second
    ``file_lock`` on the same path in the same process waits for the first). Best effort (no
    lock) where ``fcntl`` does not exist.
    """
    import socket
    import sys
    import time

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        import fcntl
    except ImportError:  # pragma: no cover - non-POSIX
        yield
        return
    with open(path, "a+") as handle:
        if timeout is None:
            fcntl.flock(handle.fileno(), fcntl.LOCK_EX)
        else:
            start = time.monotonic()
            while True:
                try:
                    fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if time.monotonic() - start >= timeout:
                        raise LockTimeout(
                            f"{path} is still locked after {timeout:g} s by {_lock_holder(path)}; "
                            "if that process is hung, stop it (the lock goes with it)"
                        ) from None
                    time.sleep(0.05)
        try:
            handle.seek(0)
            handle.truncate()
            holder = {"pid": os.getpid(), "host": socket.gethostname(),
                      "since": time.strftime("%Y-%m-%d %H:%M:%S"), "command": " ".join(sys.argv)[:200]}  # fmt: skip
            handle.write(json.dumps(holder))
            handle.flush()
        except OSError:  # the holder note is a courtesy; the lock is what matters
            pass
        try:
            yield
        finally:
            fcntl.flock(handle.fileno(), fcntl.LOCK_UN)


def _lock_holder(path: Path) -> str:
    """Who holds the lock at `path`, from the note its holder wrote."""
    try:
        note = json.loads(path.read_text() or "{}")
    except (OSError, ValueError):
        note = {}
    if not note:
        return "an unknown process"
    return f"pid {note.get('pid')} on {note.get('host')} since {note.get('since')} ({note.get('command')})"
