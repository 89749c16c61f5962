"""Work claims: two real processes preparing one store split the work, duplicate nothing."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import time
from pathlib import Path

from lightning_spec.data.claims import CLAIMS, WorkClaims, claimed_batches
from lightning_spec.data.records import RolloutRecord
from lightning_spec.data.rollouts import RolloutStore, verify_store
from lightning_spec.io import file_lock

CONFIG = {"target": "tiny", "tokenizer": {"name": "t", "size": 10}, "max_length": 64}


def _claims(tmp_path: Path) -> WorkClaims:
    return WorkClaims(tmp_path, lambda: file_lock(tmp_path / ".lock"))


def test_claims_are_exclusive_until_done_or_released(tmp_path: Path) -> None:
    first, second = _claims(tmp_path), _claims(tmp_path)
    assert first.claim(["a", "b", "c"], limit=2) == ["a", "b"]
    assert second.claim(["a", "b", "c"]) == ["c"]  # a, b are held by a live writer
    assert set(second.held_elsewhere(["a", "b", "c"])) == {"a", "b"}
    first.finish(["a"])
    assert first.done() == {"a"}
    first.release()  # b was never written: free again
    assert second.claim(["a", "b"]) == ["b"]
    assert first.claim(["a", "b"]) == []  # a is done, b is second's


def test_a_claims_temporary_left_by_a_killed_writer_goes_with_the_next_write(
    tmp_path: Path,
) -> None:
    """A writer killed inside the atomic write leaves `.claims.json.tmp-*`; the next write
    (under the same lock) removes it, and spares other files' temporaries."""
    stale = tmp_path / f".{CLAIMS}.tmp-0123abcd.json"
    stale.write_text("{")
    other = tmp_path / ".shard-r000-000001.jsonl.tmp-89abcdef.jsonl"
    other.write_text("")
    claims = _claims(tmp_path)
    assert claims.claim(["a"]) == ["a"]
    assert not stale.exists() and other.exists()
    assert json.loads((tmp_path / CLAIMS).read_text())["a"]["by"] == claims.owner


def test_claims_of_a_dead_process_are_taken_over(tmp_path: Path) -> None:
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)  # fmt: skip
    claims = _claims(tmp_path)
    stale = {"by": "gone", "host": __import__("socket").gethostname(),
             "pid": int(dead.stdout), "at": time.time()}  # fmt: skip
    (tmp_path / CLAIMS).write_text(json.dumps({"x": stale}))
    assert claims.held_elsewhere(["x"]) == {}
    assert claims.claim(["x"]) == ["x"]


def test_write_shard_drops_records_another_writer_listed(tmp_path: Path) -> None:
    a, b = RolloutStore(tmp_path, CONFIG), RolloutStore(tmp_path, CONFIG)
    record = RolloutRecord("r0", [1, 2, 3], [0, 1, 1], "dataset", {})
    assert a.claims.claim(["r0"]) == ["r0"]
    assert a.write_shard([record]) is not None
    assert b.write_shard([record]) is None  # listed by a: not written twice
    assert a.num_records == 1 and verify_store(tmp_path) == []


def test_claimed_batches_wait_for_others_then_end(tmp_path: Path) -> None:
    first, second = _claims(tmp_path), _claims(tmp_path)
    first.claim(["b"])
    flushed = []

    def finish_b() -> None:  # the other writer completes while this one waits
        flushed.append(True)
        first.finish(["b"])

    batches = list(claimed_batches(second, ["a", "b", "c"], str, size=2, what="t",
                                   before_wait=finish_b))  # fmt: skip
    assert batches == [["a", "c"]] and flushed == [True]


SCRIPT = textwrap.dedent(
    """
    import os, sys, time
    from pathlib import Path
    import lightning_spec.data.chat as chat
    from lightning_spec.data.datamodule import RolloutDataModule

    model, chats, cache, go = sys.argv[1:5]
    real = chat.render_conversation
    meet = Path(go).parent / "meet"
    met = []

    def slow(*args, **kwargs):
        # The first render of each process waits until the other holds a claim too, so the
        # two overlap however the scheduler orders their start-up (a fixed sleep did not:
        # on a busy 2-core machine one process sometimes rendered everything first).
        if not met:
            meet.mkdir(exist_ok=True)
            (meet / str(os.getpid())).write_text("claimed")
            deadline = time.monotonic() + 120
            while len(list(meet.iterdir())) < 2 and time.monotonic() < deadline:
                time.sleep(0.01)
            met.append(True)
        time.sleep(0.02)
        return real(*args, **kwargs)

    chat.render_conversation = slow
    module = RolloutDataModule(
        target=model, dataset=chats, cache_dir=cache, mode="dataset", max_length=64,
        records_per_shard=4, feature_cache_bytes=10**8, progress=False, regenerate_batch_size=4,
    )
    while not Path(go).exists():
        time.sleep(0.01)
    module.prepare_data()
    store = module.store("dataset")
    print(len(store.shards()))
    """
)


def test_two_processes_prepare_one_store_without_duplicates(
    tiny_cli_assets: dict[str, str], tmp_path: Path
) -> None:
    """Two real processes start `prepare_data` on the same store at the same moment: every
    conversation is rendered once, shard names never collide, features are cached for every
    record, and both return with the store complete."""
    script = tmp_path / "prepare.py"
    script.write_text(SCRIPT)
    cache, go = tmp_path / "cache", tmp_path / "go"
    args = [sys.executable, str(script), tiny_cli_assets["model"], tiny_cli_assets["chats"],
            str(cache), str(go)]  # fmt: skip
    workers = [subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
               for _ in range(2)]  # fmt: skip
    time.sleep(1.0)
    go.write_text("go")
    outputs = [w.communicate(timeout=300) for w in workers]
    for worker, (_, err) in zip(workers, outputs, strict=True):
        assert worker.returncode == 0, err[-2000:]
    from lightning_spec.data.datamodule import RolloutDataModule

    module = RolloutDataModule(target=tiny_cli_assets["model"], dataset=tiny_cli_assets["chats"],
                               cache_dir=str(cache), mode="dataset", max_length=64,
                               records_per_shard=4, feature_cache_bytes=10**8,
                               progress=False)  # fmt: skip
    store = module.store("dataset")
    ids = [record.id for record in store.iter_records()]
    assert len(ids) == len(set(ids)) == 40
    names = [shard.name for shard in store.shards()]
    assert len(names) == len(set(names))
    assert verify_store(store.directory) == []
    claims = json.loads((store.directory / CLAIMS).read_text())
    writers = {v["pid"] for k, v in claims.items() if not k.startswith("features:")}
    assert len(writers) == 2, "both processes rendered part of the store"
    shards = [int(out.strip().splitlines()[-1]) for out, _ in outputs]
    assert shards == [len(names)] * 2  # each saw the complete store when it returned
    from lightning_spec.data.regenerate import feature_config

    config = feature_config(module.target_model, module.stores.feature_target_id)
    cached = store.feature_shards(config)
    assert set(cached) == set(names)
    assert sum(entry["records"] for entry in cached.values()) == 40


def test_a_killed_writer_leaves_nothing_to_wait_for(tmp_path: Path) -> None:
    """A writer killed while holding claims: the next one takes them over at once (same
    host, dead pid) and finishes the work."""
    script = tmp_path / "hold.py"
    script.write_text(textwrap.dedent(
        f"""
        import os, time
        from lightning_spec.data.rollouts import RolloutStore
        store = RolloutStore({str(tmp_path / 's')!r}, {CONFIG!r})
        store.claims.claim(["r0", "r1"])
        print("held", flush=True)
        time.sleep(60)
        """
    ))  # fmt: skip
    holder = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "held"
    holder.kill()
    holder.wait()
    store = RolloutStore(tmp_path / "s", CONFIG)
    batches = list(claimed_batches(store.claims, ["r0", "r1"], str, size=5, what="t"))
    assert batches == [["r0", "r1"]]
