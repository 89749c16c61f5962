"""lightning_spec.io: content appears only complete, crashes leave the old file and no litter,
the folder swap recovers from a kill between its renames, the file lock excludes a process."""

from __future__ import annotations

import json
import multiprocessing
import os
import stat
import time
from pathlib import Path

import pytest

from lightning_spec import io

# Forked children reuse this process's imports (a spawned one would re-import torch via the
# test session on a busy 2-core machine) and their monkeypatches stay in the child.
needs_fork = pytest.mark.skipif(
    "fork" not in multiprocessing.get_all_start_methods(), reason="needs the fork start method"
)


def _names(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


# ------------------------------------------------------------------------------------- files
def test_content_appears_only_complete(tmp_path: Path) -> None:
    target = tmp_path / "sub" / "data.bin"
    io.atomic_write_bytes(target, b"old")
    with io.atomic_write(target) as handle:
        handle.write(b"new ")
        handle.flush()
        assert target.read_bytes() == b"old"  # a reader mid-write still sees the old file
        handle.write(b"content")
    assert target.read_bytes() == b"new content"
    assert _names(target.parent) == ["data.bin"]


def test_crash_inside_the_write_leaves_the_previous_file_and_no_litter(tmp_path: Path) -> None:
    target = tmp_path / "manifest.json"
    io.atomic_write_json(target, {"version": 1})
    for writer in (io.atomic_write(target, "w"), io.atomic_path(target)):
        with pytest.raises(RuntimeError, match="crash"):
            with writer as handle_or_path:
                if isinstance(handle_or_path, Path):
                    handle_or_path.write_text('{"version": ')
                else:
                    handle_or_path.write('{"version": ')
                raise RuntimeError("crash")
        assert json.loads(target.read_text()) == {"version": 1}
        assert _names(tmp_path) == ["manifest.json"]


def test_text_json_and_path_writers(tmp_path: Path) -> None:
    io.atomic_write_text(tmp_path / "a.txt", "héllo")
    assert (tmp_path / "a.txt").read_text(encoding="utf-8") == "héllo"
    io.atomic_write_json(tmp_path / "b.json", {"b": 1, "a": [1, 2]})
    assert (tmp_path / "b.json").read_text() == '{\n  "a": [\n    1,\n    2\n  ],\n  "b": 1\n}\n'
    io.atomic_write_json(
        tmp_path / "c.json", {"b": Path("x"), "a": 1}, sort_keys=False, default=str
    )
    assert json.loads((tmp_path / "c.json").read_text()) == {"b": "x", "a": 1}
    with io.atomic_path(tmp_path / "model.onnx") as tmp:
        assert tmp.parent == tmp_path and tmp.name.startswith(".model.onnx.tmp-")
        assert tmp.suffix == ".onnx"  # libraries that infer the format from the suffix
        tmp.write_bytes(b"graph")
    assert (tmp_path / "model.onnx").read_bytes() == b"graph"
    assert _names(tmp_path) == ["a.txt", "b.json", "c.json", "model.onnx"]
    with pytest.raises(ValueError, match="mode"):
        with io.atomic_write(tmp_path / "x", "ab"):
            pass


def test_written_files_get_the_permissions_of_a_plain_write(tmp_path: Path) -> None:
    plain = tmp_path / "plain"
    plain.write_bytes(b"x")
    io.atomic_write_bytes(tmp_path / "atomic", b"x")
    mode = stat.S_IMODE((tmp_path / "atomic").stat().st_mode)
    assert mode == stat.S_IMODE(plain.stat().st_mode)


def test_sha256_file_and_remove_stale(tmp_path: Path) -> None:
    import hashlib

    data = os.urandom(3 * io.CHUNK + 17)  # several chunks and a partial one
    (tmp_path / "blob").write_bytes(data)
    assert io.sha256_file(tmp_path / "blob") == hashlib.sha256(data).hexdigest()
    (tmp_path / ".blob.tmp-dead").write_bytes(b"half")
    (tmp_path / ".shard-r001-000001.bin.tmp-dead").write_bytes(b"half")
    (tmp_path / ".tmp-folder-1234").mkdir()
    (tmp_path / ".hidden").write_bytes(b"not ours")
    io.remove_stale(tmp_path, contains="-r001-")
    assert ".shard-r001-000001.bin.tmp-dead" not in _names(tmp_path)
    assert ".blob.tmp-dead" in _names(tmp_path)  # another writer's: spared
    io.remove_stale(tmp_path)
    assert _names(tmp_path) == [".hidden", "blob"]


# ------------------------------------------------------------------------------------ folders
def _fill(folder: Path, version: str) -> None:
    (folder / "weights.bin").write_text(f"weights {version}")
    (folder / "config.json").write_text(f'{{"version": "{version}"}}')


def test_folder_swap_and_crash_inside(tmp_path: Path) -> None:
    final = tmp_path / "best"
    with io.atomic_folder(final) as staging:
        assert staging.parent == tmp_path and not final.exists()
        _fill(staging, "1")
    assert (final / "weights.bin").read_text() == "weights 1"
    with io.atomic_folder(final) as staging:
        _fill(staging, "2")
        assert (final / "weights.bin").read_text() == "weights 1"  # still the old one
    assert (final / "weights.bin").read_text() == "weights 2"
    with pytest.raises(RuntimeError, match="crash"):
        with io.atomic_folder(final) as staging:
            (staging / "weights.bin").write_text("half")
            raise RuntimeError("crash")
    assert (final / "weights.bin").read_text() == "weights 2"
    assert _names(tmp_path) == ["best"]


def _swap_then_die(final: str) -> None:
    """Child process: replace `final`, and die (SIGKILL-like, no cleanup) between the renames."""
    real_replace = os.replace
    calls = []

    def replace(src: str, dst: str) -> None:
        calls.append((src, dst))
        real_replace(src, dst)
        if len(calls) == 1:  # `final` -> its old name is done; the new folder is not in place
            os._exit(9)

    os.replace = replace  # the forked child only
    with io.atomic_folder(final) as staging:
        _fill(staging, "new")


@needs_fork
def test_folder_swap_recovers_after_a_kill_between_its_renames(tmp_path: Path) -> None:
    final = tmp_path / "last"
    with io.atomic_folder(final) as staging:
        _fill(staging, "old")
    process = multiprocessing.get_context("fork").Process(target=_swap_then_die, args=(final,))
    process.start()
    process.join(60)
    assert process.exitcode == 9
    assert not final.exists()  # the kill came between the two renames
    leftovers = _names(tmp_path)
    assert any(n.startswith(".tmp-last-old-") for n in leftovers), leftovers
    assert any(n.startswith(".tmp-last-") and "-old-" not in n for n in leftovers), leftovers

    assert io.recover_folder(final) is True
    assert (final / "weights.bin").read_text() == "weights old"
    assert _names(tmp_path) == ["last"]  # staging and old copies removed
    assert io.recover_folder(final) is False  # nothing to do the second time

    # the next write recovers by itself too
    process = multiprocessing.get_context("fork").Process(target=_swap_then_die, args=(final,))
    process.start()
    process.join(60)
    assert process.exitcode == 9 and not final.exists()
    with io.atomic_folder(final) as staging:
        _fill(staging, "newer")
    assert (final / "weights.bin").read_text() == "weights newer"
    assert _names(tmp_path) == ["last"]


def test_recovery_ignores_other_names(tmp_path: Path) -> None:
    (tmp_path / ".tmp-best-old-1234").mkdir()
    (tmp_path / ".tmp-best-extra-old-1234").mkdir()  # a folder named "best-extra"
    assert io.recover_folder(tmp_path / "best") is True
    assert _names(tmp_path) == [".tmp-best-extra-old-1234", "best"]


# --------------------------------------------------------------------------------------- lock
def _hold_lock(path: str, started: multiprocessing.Event, seconds: float) -> None:
    with io.file_lock(path):
        started.set()
        time.sleep(seconds)


def _try_lock(path: str, out: str) -> None:
    with io.file_lock(path):
        Path(out).write_text(repr(time.monotonic()))


@needs_fork
def test_file_lock_excludes_a_second_process(tmp_path: Path) -> None:
    lock = tmp_path / "locks" / "asset.lock"
    context = multiprocessing.get_context("fork")
    started = context.Event()
    holder = context.Process(target=_hold_lock, args=(str(lock), started, 2.0))
    holder.start()
    assert started.wait(60), "the holder never took the lock"
    taken_by_holder = time.monotonic()
    out = tmp_path / "second.txt"
    waiter = context.Process(target=_try_lock, args=(str(lock), str(out)))
    waiter.start()
    time.sleep(0.5)
    assert not out.exists(), "a second process entered the lock while it was held"
    holder.join(60)
    released = time.monotonic()
    waiter.join(60)
    assert holder.exitcode == 0 and waiter.exitcode == 0
    entered = float(out.read_text())
    assert taken_by_holder + 1.0 < entered  # CLOCK_MONOTONIC is system-wide on Linux
    assert entered <= released + 60
    with io.file_lock(lock):  # free again for this process
        pass


def test_a_lock_wait_that_times_out_names_the_holder(tmp_path: Path) -> None:
    """A process holding a lock writes who it is; a waiter that gives up says so (pid, host,
    command), and the lock is free again once the holder is gone."""
    import subprocess
    import sys

    from lightning_spec.io import LockTimeout, file_lock

    lock = tmp_path / "store" / ".lock"
    script = (
        "import sys, time\n"
        "from lightning_spec.io import file_lock\n"
        f"with file_lock({str(lock)!r}):\n"
        "    print('held', flush=True)\n"
        "    time.sleep(60)\n"
    )
    holder = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(LockTimeout, match=rf"after 0.3 s by pid {holder.pid} on "):
            with file_lock(lock, timeout=0.3):
                pass
    finally:
        holder.kill()
        holder.wait()
    with file_lock(lock, timeout=5):  # released with its holder
        pass
